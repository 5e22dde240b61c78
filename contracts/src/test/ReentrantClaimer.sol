// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @title ReentrantClaimer
/// @notice Test only (issue 77): the code a member's account delegates to (EIP-7702), so that the payment of a
/// RewardPool claim runs it: once armed, on receiving wei it calls the pool again with the armed calldata (the
/// same claim) and records whether that call succeeded and what it returned, without reverting the outer claim.
contract ReentrantClaimer {
    address private _target;
    bytes private _data;
    bool private _armed;
    bool private _reentered;
    bool private _reenteredOk;
    bytes private _reenteredReturn;

    /// @notice Re-enter `target` with `data` on the next payment received.
    function arm(address target, bytes calldata data) external {
        _target = target;
        _data = data;
        _armed = true;
    }

    /// @notice Whether it is armed, whether it re-entered, whether that call succeeded and what it returned.
    function outcome() external view returns (bool armed, bool reentered, bool ok, bytes memory returned) {
        return (_armed, _reentered, _reenteredOk, _reenteredReturn);
    }

    receive() external payable {
        if (!_armed) return;
        _armed = false;
        (bool ok, bytes memory ret) = _target.call(_data);
        _reentered = true;
        _reenteredOk = ok;
        _reenteredReturn = ret;
    }
}
