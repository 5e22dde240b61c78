// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";
import {VerdictHandler} from "./VerdictHandler.sol";
import {InvariantTargets} from "./Vm.sol";

/// @notice G3 against a coalition's verdicts at close quarters (issue 63): VerdictHandler's commits, joins, leaves,
/// disputes and accusations share blocks, and the coalition tries every set of its seats on every open case. No
/// honest member is ever slashed and no round overturned: a verdict needs the quorum its case was counted with
/// (a round's at its commit, an accusation's at its opening), from seats counted before that block and not gone
/// within it (LedgerCore.requireCountedAt). The quick run of the mutation check (scripts/forge_mutations.py) runs
/// this campaign beside TrustInvariants.t.sol's; it catches `verdict-no-quorum`, `same-block-counted` and
/// `same-block-leaver` within it.
contract VerdictInvariantsTest is TrustBase, InvariantTargets {
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    VerdictHandler internal handler;
    uint256 internal runId;

    function setUp() public {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        vm.prank(who(1));
        runId = ledger.createRun(runParams(keccak256("verdicts")), "verdicts");
        for (uint256 key = 1; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
        }
        vm.roll(block.number + 1); // the founders count from their join's block: before round 0's
        handler = new VerdictHandler(ledger, runId);
        targetContract(address(handler));
    }

    /// @notice G3 after every call: no honest member slashed, no (honest) round overturned, no accusation of an
    /// honest member found guilty; and G5's price of a dispute: no case opened with a bond other than the run's
    /// (the handler tries one wei short and one wei over before each dispute).
    function invariant_verdicts_need_the_quorum_in_force() public view {
        uint256[] memory honest = handler.honestKeys();
        for (uint256 i = 0; i < honest.length; ++i) {
            vm.assertTrue(
                ledger.memberOf(runId, who(honest[i])).status != TrainingLedger.MemberStatus.Slashed,
                "G3: an honest member was slashed by a coalition verdict"
            );
        }
        vm.assertEq(ledger.runOf(runId).invalidFrom, 0, "G3: a coalition verdict overturned an honest round");
        vm.assertEq(handler.wrongBondsAccepted(), 0, "G5: a dispute with a bond other than the run's was accepted");
    }
}
