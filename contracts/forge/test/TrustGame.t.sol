// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustSetup} from "./TrustInvariants.t.sol";

/// @notice TrustGame's moves (issue 62) step by step, each a named case of the invariant campaign's G7 game: the
/// coalition's last-block, relayed and junk answers, its silence, a copier of the proof, a coalition that leaves at
/// once; a right round stands. Issue 79's moves: the coalition's self-proof, a short proof fund, a squatter, a
/// contributor leaving before the commit, the seat cap, a hashed run. tests/test_forge_invariants.py runs them.
contract TrustGameTest is TrustSetup {
    uint256 internal constant DIRECT = 1;
    uint256 internal constant RELAYED = 2;
    uint256 internal constant JUNK_FIRST = 3;

    function setUp() public {
        _deploy();
    }

    /// @dev The coalition's plan for the steps (two bits each, TrustGame.gameCoalitionAnswers).
    function _plan(uint256 a, uint256 b, uint256 c, uint256 d) internal pure returns (uint256) {
        return a | (b << 2) | (c << 4) | (d << 6);
    }

    /// @dev The last case ended overturned, every attester slashed, the prover's bonds back with its reward:
    /// min(the run's proof fund, half the slash), here half the slash (the fund holds 3 stakes).
    function _assertOverturnedAtNoCost(uint256 expectedSpent) internal view returns (uint256 run, uint64 round) {
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
        (uint256 run_, uint64 round_, bool ended, uint256 spent, uint256 got, uint256 slashed, uint256 copierGain) =
            handler.caseOf(handler.caseCount() - 1);
        vm.assertTrue(ended, "the game did not end");
        vm.assertEq(ledger.runOf(run_).invalidFrom, round_ + 1, "the wrong round stands");
        vm.assertEq(slashed, 5 * STAKE, "the attesters' stakes (2 and 3 STAKE) were not slashed");
        for (uint256 key = 5; key <= 6; ++key) {
            vm.assertTrue(
                ledger.memberOf(run_, who(key)).status == TrainingLedger.MemberStatus.Slashed, "an attester kept its stake"
            );
        }
        vm.assertEq(spent, expectedSpent, "bonds sent");
        vm.assertEq(got, spent + slashed / 2, "bonds back and half the slash");
        vm.assertEq(ledger.proofFundOf(run_), GAME_FUND - slashed / 2, "the reward not paid from the proof fund");
        vm.assertGe(ledger.slashedTotal(), slashed, "the slash not burned whole");
        vm.assertEq(copierGain, 0, "the copier was paid");
        return (run_, round_);
    }

    function test_last_block_answers_direct_relayed_and_after_junk_still_end_in_a_proof() public {
        handler.gameCommits(8); // wrong, no copier, the coalition stays
        handler.gameCoalitionAnswers(_plan(DIRECT, RELAYED, JUNK_FIRST, RELAYED));
        handler.blocksPass(0); // the proof, a block after its commitment
        (uint256 run, uint64 round) = _assertOverturnedAtNoCost(4 * BOND);
        // the clock: four last-block answers took the game well past the round's dispute window
        vm.assertGe(block.number, ledger.commitBlockOf(run, round) + 3 * WINDOW, "the game ended inside the window");
    }

    function test_a_copier_of_the_pending_proof_gains_nothing() public {
        handler.gameCommits(10); // wrong, a copier watches, the coalition stays
        handler.gameCoalitionAnswers(_plan(DIRECT, DIRECT, DIRECT, DIRECT));
        uint256 before = who(COALITION_JOINER).balance;
        handler.blocksPass(0);
        (uint256 run, uint64 round) = _assertOverturnedAtNoCost(4 * BOND);
        vm.assertEq(who(COALITION_JOINER).balance, before, "the copier's balance changed");
        // the copy was mined first: the reward was held (for the walker's earlier commitment), not paid to it
        vm.assertTrue(ledger.prover().claimOf(run, round).prover == who(COALITION_JOINER), "no copy went first");
    }

    function test_an_unanswered_step_is_expired_and_pays_the_prover() public {
        handler.gameCommits(8);
        handler.gameCoalitionAnswers(_plan(DIRECT, 0, 0, 0)); // answers the stage leaf, withholds the factors
        handler.blocksPass(WINDOW); // past the factors' deadline: the live prover expires the step
        _assertOverturnedAtNoCost(2 * BOND);
    }

    function test_a_coalition_that_leaves_at_once_is_still_slashed() public {
        handler.gameCommits(6); // a copier too; the coalition leaves at once
        for (uint256 key = 5; key <= 6; ++key) {
            vm.assertTrue(
                ledger.memberOf(handler.gameRun(), who(key)).status == TrainingLedger.MemberStatus.Unbonding, "it stayed"
            );
        }
        for (uint256 step = 0; step < 4; ++step) {
            handler.gameCoalitionAnswers(JUNK_FIRST); // one step, in its last block
            handler.gameCoalitionLeavesOrWithdraws(step); // it tries to withdraw at every turn
        }
        handler.blocksPass(0);
        _assertOverturnedAtNoCost(4 * BOND);
    }

    function test_right_rounds_stand_and_start_no_game() public {
        handler.gameCommits(1); // right
        handler.gameCommits(3); // right
        for (uint256 seed = 1; seed < 6; seed += 2) handler.outsiderOpensAWrongLeaf(seed); // under the right roots
        handler.outsiderOpensAWrongLeaf(0); // under the honest run's (none committed: nothing to try)
        vm.assertEq(handler.caseCount(), 0, "a game on a right round");
        vm.assertEq(ledger.runOf(handler.gameRun()).invalidFrom, 0, "a right round overturned");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
    }

    // ------------------------------------------------------------------------------------------- issue 79

    /// @dev Blocks pass (the live prover and the coalition's self-prover act in each) until the last case ends.
    function _untilTheCaseEnds() internal {
        for (uint256 i = 0; i < 20; ++i) {
            (,, bool ended,,,,) = handler.caseOf(handler.caseCount() - 1);
            if (ended) return;
            handler.blocksPass(0);
        }
    }

    function test_a_coalition_proving_its_own_round_loses_its_whole_stake() public {
        uint256 before = who(5).balance + who(6).balance;
        handler.gameCommits(296); // wrong, its fund 3 stakes, the coalition commits its own proof at once
        _untilTheCaseEnds();
        (uint256 run,,, uint256 spent, uint256 got, uint256 slashed,) = handler.caseOf(0);
        (uint256 fundBefore, uint256 burned, bool selfProved, uint256 selfGain) = handler.caseFunds(0);
        vm.assertTrue(selfProved, "the coalition's own proof did not go first");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
        vm.assertEq(slashed, 5 * STAKE, "the attesters' stakes");
        vm.assertEq(burned, slashed, "the slash not burned whole");
        vm.assertEq(fundBefore, GAME_FUND, "the fund");
        vm.assertEq(selfGain, slashed / 2, "the self-prover's reward: min(fund, half the slash)");
        vm.assertEq(ledger.proofFundOf(run), GAME_FUND - slashed / 2, "the reward not paid from the fund");
        vm.assertEq(got, spent, "the prover's bonds back");
        // its stakes and its own fund in, half the slash back out of that fund: it lost more than its whole stake
        vm.assertEq(who(5).balance + who(6).balance, before - slashed - GAME_FUND + slashed / 2, "the coalition's net");
    }

    function test_a_short_proof_fund_pays_what_it_holds() public {
        handler.gameCommits(40); // wrong, its fund half a stake
        handler.gameCoalitionAnswers(_plan(DIRECT, 0, 0, 0)); // withholds the factors
        handler.blocksPass(WINDOW);
        (uint256 run,,, uint256 spent, uint256 got, uint256 slashed,) = handler.caseOf(0);
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
        vm.assertEq(slashed, 5 * STAKE, "the attesters' stakes");
        vm.assertEq(got, spent + STAKE / 2, "bonds back and the whole fund");
        vm.assertEq(ledger.proofFundOf(run), 0, "the fund");
    }

    function test_a_squatter_opening_every_step_first_blocks_none() public {
        uint256 before = who(COALITION_JOINER).balance;
        handler.gameCommits(104); // wrong, a squatter opens each of the prover's steps first
        handler.gameCoalitionAnswers(_plan(DIRECT, DIRECT, DIRECT, DIRECT));
        handler.blocksPass(0);
        _assertOverturnedAtNoCost(4 * BOND);
        vm.assertEq(before - who(COALITION_JOINER).balance, 4 * BOND, "the squatter did not open the four steps");
    }

    function test_a_contributor_leaving_in_the_commits_block_leaves_the_round_right() public {
        handler.gameCommits(1); // right: the run has a round
        handler.gameContributorLeavesBeforeTheCommit(0); // joined a block before, leaves ahead of the commit
        handler.blocksPass(WINDOW);
        handler.outsiderProvesAListedRound();
        vm.assertEq(handler.listedRounds(), 1, "no round listed the contribution");
        vm.assertEq(ledger.runOf(handler.gameRun()).invalidFrom, 0, "a right round overturned");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
    }

    function test_a_contributor_that_withdrew_or_rejoined_leaves_the_round_right() public {
        handler.gameCommits(1);
        handler.gameContributorLeavesBeforeTheCommit(2); // left, withdrew, then the round was committed
        handler.gameContributorLeavesBeforeTheCommit(3); // the same, and rejoined after the commit
        vm.assertEq(handler.listedRounds(), 2, "no round listed the contribution");
        vm.assertTrue(handler.status(handler.gameRun(), 4) == TrainingLedger.MemberStatus.Active, "not rejoined");
        vm.assertEq(ledger.runOf(handler.gameRun()).invalidFrom, 0, "a right round overturned");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
    }

    function test_a_run_fills_to_its_seat_cap_and_a_leave_frees_a_seat() public {
        handler.seatsFillAndTurn(7);
        vm.assertEq(ledger.runOf(handler.seatRun()).memberCount, ledger.maxSeats(), "not full");
        vm.assertEq(handler.seatKeys(), uint256(ledger.maxSeats()) + 2, "one refused, one after the leave");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
    }

    function test_a_hashed_run_takes_no_challenge() public {
        handler.outsiderChallengesAHashedRun(0);
        uint256 run = handler.hashedRun();
        vm.assertEq(ledger.commitCount(run), 1, "no round committed");
        vm.assertEq(ledger.runOf(run).invalidFrom, 0, "a right round overturned");
        vm.assertEq(handler.violationCount(), 0, handler.violationCount() == 0 ? "" : handler.violations(0));
    }
}
