// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice The properties that move money, for all inputs (halmos: `check_` functions, symbolic arguments;
/// tests/test_halmos.py). Plain addresses, no signatures: halmos treats keccak and ecrecover as uninterpreted.
contract MoneySymbolicTest is TrustBase {
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    uint256 internal runId;
    address internal constant A = address(0xA11CE);
    address internal constant B = address(0xB0B);

    function setUp() public {
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        runId = ledger.createRun(runParams(keccak256("symbolic")), "");
        _register(A);
        _register(B);
    }

    function _register(address account) internal {
        vm.prank(account);
        registry.register(bytes32(uint256(uint160(account))), new bytes(64));
    }

    /// @notice A member's withdrawal returns exactly its stake, whatever it staked and whenever it withdraws
    /// (from its unbonding's end on; before, it reverts and pays nothing).
    function check_withdrawal_returns_exactly_the_stake(uint128 stake, uint32 wait) public {
        vm.assume(stake >= STAKE && stake <= 10 ** 30);
        vm.deal(A, stake);
        vm.prank(A);
        ledger.joinRun{value: stake}(runId, bytes32(0));
        vm.prank(A);
        ledger.leaveRun(runId);
        uint64 end = ledger.memberOf(runId, A).unbondingEnd;
        vm.roll(uint256(end) + wait);
        uint256 before = A.balance;
        uint256 held = address(ledger).balance;
        vm.prank(A);
        ledger.withdrawStake(runId);
        assert(A.balance == before + stake);
        assert(address(ledger).balance == held - stake);
    }

    /// @notice Before its unbonding ends a leaver's stake stays in the ledger.
    function check_no_withdrawal_before_the_unbonding_ends(uint128 stake, uint64 early) public {
        vm.assume(stake >= STAKE && stake <= 10 ** 30);
        vm.deal(A, stake);
        vm.prank(A);
        ledger.joinRun{value: stake}(runId, bytes32(0));
        vm.prank(A);
        ledger.leaveRun(runId);
        uint64 end = ledger.memberOf(runId, A).unbondingEnd;
        vm.assume(early < end && early >= block.number);
        vm.roll(early);
        vm.prank(A);
        (bool ok,) = address(ledger).call(abi.encodeCall(TrainingLedger.withdrawStake, (runId)));
        assert(!ok);
        assert(address(ledger).balance == stake);
    }

    /// @notice A slash moves money only through a proof of a committed round: the prover's call over a round never
    /// committed refuses and leaves every stake where it was, for any two stakes. (The reward of a proven round,
    /// exactly half the slash, needs a commit, hence signatures: halmos did not finish that search in 15 minutes
    /// here, so the forge campaign checks it instead, G7 and G6 in TrustInvariants.t.sol.)
    function check_no_slash_without_a_committed_round(uint128 stakeA, uint128 stakeB) public {
        vm.assume(stakeA >= STAKE && stakeA <= 10 ** 30 && stakeB >= STAKE && stakeB <= 10 ** 30);
        vm.deal(A, stakeA);
        vm.deal(B, stakeB);
        vm.prank(A);
        ledger.joinRun{value: stakeA}(runId, bytes32(0));
        vm.prank(B);
        ledger.joinRun{value: stakeB}(runId, bytes32(0));
        address[] memory attesters = new address[](2);
        attesters[0] = A;
        attesters[1] = B;
        vm.prank(address(ledger.prover()));
        (bool ok,) = address(ledger).call(
            abi.encodeCall(TrainingLedger.invalidateByProof, (runId, 0, attesters, address(0xCAFE)))
        );
        assert(!ok);
        assert(address(ledger).balance == uint256(stakeA) + stakeB);
        assert(ledger.slashedTotal() == 0);
    }
}
