// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";
import {TrustGame} from "./TrustGame.sol";
import {InvariantTargets} from "./Vm.sol";

/// @notice TrustGame's moves alone (issue 63): the coalition's runs, its answers (in the last block, relayed, after
/// junk, or none), its leaving and withdrawing, and blocks passing, with the live prover and the copier acting as
/// in TrustHandler, which mixes them among twenty other moves; here most sequences play a game to its proof.
contract GameHandler is TrustGame {
    constructor(TrainingLedger ledger_) TrustGame(ledger_) {}

    function blocksPass(uint256 blocks) external {
        ++calls;
        _roll(1 + blocks % (2 * WINDOW));
    }
}

/// @notice G7 over GameHandler's games, in the quick campaign beside TrustInvariants.t.sol (whose check it
/// repeats): every wrong round overturned by the one prover within its proof window, its bonds back and exactly
/// half the slash, every attester slashed, a copier of its proof paid nothing.
contract GameInvariantsTest is TrustBase, InvariantTargets {
    GameHandler internal handler;

    function setUp() public {
        _castAddresses();
        NodeRegistry registry = new NodeRegistry(0);
        TrainingLedger ledger_ = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        handler = new GameHandler(ledger_);
        targetContract(address(handler));
    }

    function invariant_every_wrong_round_overturned() public view {
        TrainingLedger ledger_ = handler.ledger();
        uint256 cases = handler.caseCount();
        for (uint256 i = 0; i < cases; ++i) {
            (uint256 run, uint64 round, bool ended, uint256 spent, uint256 got, uint256 slashed, uint256 copierGain) =
                handler.caseOf(i);
            if (!ended) {
                (, uint64 closesAt) = ledger_.proofWindowOf(run, round);
                vm.assertTrue(block.number < closesAt, "G7: a wrong round outlived its proof window");
                continue;
            }
            uint64 invalidFrom = ledger_.runOf(run).invalidFrom;
            vm.assertTrue(invalidFrom != 0 && invalidFrom <= round + 1, "G7: a wrong round stands after its game");
            address[] memory attesters = handler.gameAttesters(run);
            for (uint256 a = 0; a < attesters.length; ++a) {
                vm.assertTrue(
                    ledger_.memberOf(run, attesters[a]).status == TrainingLedger.MemberStatus.Slashed,
                    "G7: an attester of a wrong round kept its stake"
                );
            }
            vm.assertEq(got, spent + slashed / 2, "G7: the prover did not get its bonds back and half the slash");
            vm.assertEq(
                ledger_.proofFundOf(run), GAME_FUND - slashed / 2, "G7: the reward was not paid from the proof fund"
            );
            vm.assertEq(copierGain, 0, "G7: a copier of the proof was paid");
        }
        uint256 n = handler.violationCount();
        vm.assertEq(n, 0, n == 0 ? "" : handler.violations(0));
    }
}
