// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

/// @notice The few forge cheatcodes the invariant suite uses (forge-std is a GitHub library, not a registry
/// package: this is its Vm interface cut down to them). The cheatcode contract lives at VM_ADDRESS in every test.
interface Vm {
    struct Log {
        bytes32[] topics;
        bytes data;
        address emitter;
    }

    function prank(address sender) external;
    function startPrank(address sender) external;
    function stopPrank() external;
    function deal(address account, uint256 balance) external;
    function roll(uint256 blockNumber) external;
    function assume(bool condition) external pure;
    function addr(uint256 privateKey) external pure returns (address);
    function sign(uint256 privateKey, bytes32 digest) external pure returns (uint8 v, bytes32 r, bytes32 s);
    function label(address account, string calldata name) external;
    function recordLogs() external;
    function getRecordedLogs() external returns (Log[] memory logs);
    function expectRevert() external;
    function expectRevert(bytes4 selector) external;
    function expectRevert(bytes calldata revertData) external;
    function assertTrue(bool condition, string calldata message) external pure;
    function assertFalse(bool condition, string calldata message) external pure;
    function assertEq(uint256 left, uint256 right, string calldata message) external pure;
    function assertLe(uint256 left, uint256 right, string calldata message) external pure;
    function assertGe(uint256 left, uint256 right, string calldata message) external pure;
}

/// @notice The address forge serves cheatcodes at: address(uint160(uint256(keccak256("hevm cheat code")))).
abstract contract WithVm {
    Vm internal constant vm = Vm(0x7109709ECfa91a80626fF3989D68f67F5b1DD12D);
}

/// @notice forge's invariant-target hooks (forge-std StdInvariant's names and types): a test contract lists the
/// contracts and selectors the campaign calls.
abstract contract InvariantTargets {
    struct FuzzSelector {
        address addr;
        bytes4[] selectors;
    }

    address[] private _targetContracts;
    FuzzSelector[] private _targetSelectors;
    address[] private _targetSenders;

    function targetContract(address target) internal {
        _targetContracts.push(target);
    }

    function targetSelector(FuzzSelector memory selector) internal {
        _targetSelectors.push(selector);
    }

    function targetSender(address sender) internal {
        _targetSenders.push(sender);
    }

    function targetContracts() public view returns (address[] memory) {
        return _targetContracts;
    }

    function targetSelectors() public view returns (FuzzSelector[] memory) {
        return _targetSelectors;
    }

    function targetSenders() public view returns (address[] memory) {
        return _targetSenders;
    }
}
