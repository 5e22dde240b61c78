// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";
import {GameCheck} from "./TrustGame.sol";
import {TrustHandler} from "./TrustHandler.sol";
import {InvariantTargets} from "./Vm.sol";

/// @notice docs/TRUST.md's guarantees G1-G7 (plus solvency and the fraud-proof game's) as forge invariants over the
/// real contracts, checked after every call of TrustHandler's actors: `forge test --root contracts/forge`
/// (tests/test_forge_invariants.py; the long campaign: bench/forge_invariants.py).
/// @notice The deployment every suite over TrustHandler starts from: the registry, the ledger, the honest run with
/// the six founders staked, and the handler.
abstract contract TrustSetup is TrustBase {
    NodeRegistry internal registry;
    TrainingLedger internal ledger;
    TrustHandler internal handler;
    uint256 internal runId;

    function _deploy() internal {
        _castAddresses();
        registry = new NodeRegistry(0);
        ledger = new TrainingLedger(registry);
        for (uint256 key = 1; key <= OUTSIDER; ++key) register(registry, key);
        vm.prank(who(1));
        runId = ledger.createRun(runParams(keccak256("trust")), "trust");
        for (uint256 key = 1; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
        }
        handler = new TrustHandler(ledger, registry, runId);
    }
}

contract TrustInvariantsTest is TrustSetup, GameCheck, InvariantTargets {
    function setUp() public {
        _deploy();
        targetContract(address(handler));
    }

    /// @notice Every guarantee after every call, in one campaign (forge runs a campaign per invariant_ function:
    /// one function makes each call count for all of them). A failure names the guarantee it broke.
    function invariant_trust_model() public view {
        check_G1_every_committed_record_is_honest();
        check_G1_who_counts();
        check_G2_live_honest_never_behind();
        check_G3_no_honest_harm();
        check_G5_finality();
        check_G6_solvency();
        check_G7_every_wrong_round_overturned();
        check_no_violation_seen();
    }

    // ------------------------------------------------------------------------------------------- G1 safety

    /// @notice G1: every committed record is the honest record of its round: the run never changes hands.
    function check_G1_every_committed_record_is_honest() internal view {
        uint64 count = ledger.commitCount(runId);
        for (uint64 round = 0; round < count; ++round) {
            vm.assertTrue(ledger.recordHashOf(runId, round) == handler.honestHash(round), "G1: a record not honest");
        }
    }

    /// @notice G1's mechanism, who counts: a founder from its join, a joiner once credited with a round at least
    /// tenureRounds after it joined; the run's counters match the seats.
    function check_G1_who_counts() internal view {
        TrainingLedger.Run memory run = ledger.runOf(runId);
        uint256 active = 0;
        uint256 counted = 0;
        for (uint256 key = 1; key < OUTSIDER; ++key) {
            TrainingLedger.Member memory seat = ledger.memberOf(runId, who(key));
            if (seat.status != TrainingLedger.MemberStatus.Active) continue;
            ++active;
            if (seat.countedBlock == 0) continue;
            ++counted;
            if (seat.joinRound > 0) {
                vm.assertGe(seat.activeRound, uint256(seat.joinRound) + TENURE + 1, "G1: counted before its tenure");
            }
        }
        vm.assertEq(run.memberCount, active, "G1: memberCount is not the active seats");
        vm.assertEq(run.countedCount, counted, "G1: countedCount is not the counted seats");
    }

    // ------------------------------------------------------------------------------------------- G2, G3

    /// @notice G2: a live honest member is never ejectable (never inactivityRounds behind).
    function check_G2_live_honest_never_behind() internal view {
        uint64 count = ledger.commitCount(runId);
        uint256[] memory honest = handler.honestKeys();
        for (uint256 i = 0; i < honest.length; ++i) {
            TrainingLedger.Member memory seat = ledger.memberOf(runId, who(honest[i]));
            if (seat.status != TrainingLedger.MemberStatus.Active) continue;
            vm.assertLe(count - seat.activeRound, INACTIVITY - 1, "G2: a live honest member is ejectable");
        }
    }

    /// @notice G3: no honest member is slashed, no honest round overturned.
    function check_G3_no_honest_harm() internal view {
        uint256[] memory honest = handler.honestKeys();
        for (uint256 i = 0; i < honest.length; ++i) {
            vm.assertTrue(
                ledger.memberOf(runId, who(honest[i])).status != TrainingLedger.MemberStatus.Slashed,
                "G3: an honest member was slashed"
            );
        }
        vm.assertEq(ledger.runOf(runId).invalidFrom, 0, "G3: an honest round was overturned");
    }

    // ------------------------------------------------------------------------------------------- G5 finality

    /// @notice G5: a final round is out of its dispute window and has no dispute open before its deadline; the
    /// disputers of a round are only those whose own transaction filed (no honest member disputes an honest round).
    function check_G5_finality() internal view {
        uint64 count = ledger.commitCount(runId);
        uint256[] memory honest = handler.honestKeys();
        for (uint64 round = 0; round < count; ++round) {
            TrainingLedger.DisputeCase memory case_ = ledger.disputeCaseOf(runId, round);
            if (ledger.isFinal(runId, round)) {
                vm.assertGe(block.number, ledger.commitBlockOf(runId, round) + WINDOW, "G5: final inside its window");
                vm.assertTrue(
                    case_.status != TrainingLedger.DisputeStatus.Open || block.number >= case_.deadline,
                    "G5: final with a dispute open"
                );
            }
            address[] memory disputers = ledger.disputersOf(runId, round);
            vm.assertEq(disputers.length, case_.disputers, "G5: disputers miscounted");
            for (uint256 d = 0; d < disputers.length; ++d) {
                for (uint256 i = 0; i < honest.length; ++i) {
                    vm.assertTrue(disputers[d] != who(honest[i]), "G5: a dispute filed with another's signature");
                }
            }
        }
    }

    // ------------------------------------------------------------------------------------------- G6 solvency

    /// @notice G6, exactly: the ledger holds every bonded stake, every open bond, what it slashed or forfeited
    /// (burned whole: issue 79), the runs' proof funds (less what they paid provers) and the stakes of the seat cap's
    /// and the hashed run's seats (issue 79), to the wei.
    function check_G6_solvency() internal view {
        uint256 owed = ledger.slashedTotal() + ledger.forfeitedTotal() + ledger.proofFundTotal() + handler.sideStakes();
        uint256[] memory games = handler.gameRuns();
        for (uint256 g = 0; g <= games.length; ++g) {
            uint256 run = g == games.length ? runId : games[g];
            // The game runs seat the coalition's founders and, for a while, the contributor (4).
            for (uint256 key = run == runId ? 1 : 4; key <= (run == runId ? COALITION_JOINER : 6); ++key) {
                TrainingLedger.Member memory seat = ledger.memberOf(run, who(key));
                if (
                    seat.status == TrainingLedger.MemberStatus.Active
                        || seat.status == TrainingLedger.MemberStatus.Unbonding
                ) owed += seat.stake;
            }
        }
        uint64 count = ledger.commitCount(runId);
        for (uint64 round = 0; round < count; ++round) {
            TrainingLedger.DisputeCase memory case_ = ledger.disputeCaseOf(runId, round);
            if (case_.status == TrainingLedger.DisputeStatus.Open) owed += uint256(case_.disputers) * BOND;
        }
        (address[] memory accused, bytes32[] memory evidence) = handler.accusations();
        for (uint256 i = 0; i < accused.length; ++i) {
            TrainingLedger.Accusation memory a = ledger.accusationOf(runId, accused[i], evidence[i]);
            if (a.status == TrainingLedger.AccusationStatus.Open) owed += a.bond;
        }
        vm.assertEq(address(ledger).balance, owed, "G6: the ledger's balance is not what it owes and burned");
    }

    // ------------------------------------------------------------------------------------------- G7 and the rest

    /// @notice G7, the game (issue 62, issue 79): GameCheck over the handler's cases.
    function check_G7_every_wrong_round_overturned() internal view {
        checkGameCases(handler, ledger);
    }

    /// @notice Whatever a handler saw break (a back door committed, an honest member ejected or unable to attest or
    /// withdraw when due, a stake leaving early, a right round proven wrong, a prover paid other than half).
    function check_no_violation_seen() internal view {
        uint256 n = handler.violationCount();
        vm.assertEq(n, 0, n == 0 ? "" : handler.violations(0));
    }
}
