// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title QuirkyToken
/// @notice Test only (issue 77): an ERC-20 for RewardPool's token pools that can behave as the tokens a pool must
/// survive: a plain one (returns true), one that returns nothing (old USDT), one that returns false and moves
/// nothing instead of reverting, one that keeps a fee of each transfer (the recipient gets less), one that takes
/// an extra fee from the sender (the sender loses more than it sent), and a re-entrant one that, once armed,
/// calls a target with armed calldata in the middle of a transfer and records how that call ended.
contract QuirkyToken {
    /// @notice How transfers behave; set by anyone (a test contract).
    enum Mode {
        Plain,
        ReturnsNothing,
        ReturnsFalse,
        FeeOnTransfer,
        SenderFee
    }

    /// @notice The token's name.
    string public constant name = "Quirky";
    /// @notice The token's symbol.
    string public constant symbol = "QRK";
    /// @notice The token's decimals.
    uint8 public constant decimals = 18;
    /// @notice Everything minted, less the fees burned.
    uint256 public totalSupply;
    /// @notice What `account` holds.
    mapping(address account => uint256) public balanceOf;
    /// @notice What `spender` may move of `owner`'s.
    mapping(address owner => mapping(address spender => uint256)) public allowance;
    /// @notice How transfers behave now.
    Mode public mode;
    /// @notice The fee of the fee modes, basis points.
    uint16 public feeBps;

    address private _target;
    bytes private _data;
    bool private _armed;
    bool private _reentered;
    bool private _reenteredOk;
    bytes private _reenteredReturn;

    /// @notice `amount` moved from `from` to `to` (ERC-20's Transfer, named in the past tense as every event of
    /// this project's contracts: the pool reads balances, never a token's events).
    event Transferred(address indexed from, address indexed to, uint256 amount);
    /// @notice `owner` allowed `spender` `amount` (ERC-20's Approval).
    event Approved(address indexed owner, address indexed spender, uint256 amount);

    /// @notice Create `amount` for `to`.
    function mint(address to, uint256 amount) external {
        totalSupply += amount;
        balanceOf[to] += amount;
        emit Transferred(address(0), to, amount);
    }

    /// @notice Behave as `mode_`, with a fee of `feeBps_` basis points where the mode takes one.
    function setMode(Mode mode_, uint16 feeBps_) external {
        mode = mode_;
        feeBps = feeBps_;
    }

    /// @notice On the next transfer, call `target` with `data` (before moving anything).
    function arm(address target, bytes calldata data) external {
        _target = target;
        _data = data;
        _armed = true;
    }

    /// @notice Whether it is armed, whether it re-entered, whether that call succeeded and what it returned.
    function outcome() external view returns (bool armed, bool reentered, bool ok, bytes memory returned) {
        return (_armed, _reentered, _reenteredOk, _reenteredReturn);
    }

    /// @notice Allow `spender` `amount` of the caller's.
    function approve(address spender, uint256 amount) external returns (bool) {
        allowance[msg.sender][spender] = amount;
        emit Approved(msg.sender, spender, amount);
        return true;
    }

    /// @notice Move `amount` of the caller's to `to` (as the mode says).
    function transfer(address to, uint256 amount) external returns (bool) {
        return _transfer(msg.sender, to, amount);
    }

    /// @notice Move `amount` of `from`'s to `to` within the caller's allowance (as the mode says).
    function transferFrom(address from, address to, uint256 amount) external returns (bool) {
        uint256 allowed = allowance[from][msg.sender];
        if (allowed < amount) {
            if (mode == Mode.ReturnsFalse) return false;
            revert("allowance");
        }
        allowance[from][msg.sender] = allowed - amount;
        return _transfer(from, to, amount);
    }

    function _transfer(address from, address to, uint256 amount) private returns (bool) {
        if (_armed) {
            _armed = false;
            (bool ok, bytes memory ret) = _target.call(_data);
            _reentered = true;
            _reenteredOk = ok;
            _reenteredReturn = ret;
        }
        Mode m = mode;
        if (m == Mode.ReturnsFalse) return false; // moves nothing, says so only by its return
        uint256 fee = m == Mode.FeeOnTransfer || m == Mode.SenderFee ? amount * feeBps / 10_000 : 0;
        uint256 debit = m == Mode.SenderFee ? amount + fee : amount;
        uint256 credit = m == Mode.FeeOnTransfer ? amount - fee : amount;
        require(balanceOf[from] >= debit, "balance");
        balanceOf[from] -= debit;
        balanceOf[to] += credit;
        totalSupply -= debit - credit;
        emit Transferred(from, to, credit);
        if (m == Mode.ReturnsNothing) {
            assembly ("memory-safe") {
                return(0, 0)
            }
        }
        return true;
    }
}
