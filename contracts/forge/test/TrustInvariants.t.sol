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
        _deploy(false);
    }

    /// @param seated The handler fills the seat cap's run at once (the invariant campaign: see TrustHandler).
    function _deploy(bool seated) internal {
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
        handler = new TrustHandler(ledger, registry, runId, seated);
    }
}

contract TrustInvariantsTest is TrustSetup, GameCheck, InvariantTargets {
    function setUp() public {
        _deploy(true);
        targetContract(address(handler));
    }

    /// @dev What several guarantees read, read once per check (the seats of the cast in the run: keys 1-8; the
    /// run; the honest keys and their addresses): every check still reads the chain after every call.
    struct Seen {
        uint64 count;
        TrainingLedger.Run run;
        TrainingLedger.Member[] seats; // by key, 1 .. COALITION_JOINER (0 unused)
        uint256[] honest;
        address[] honestAt;
    }

    /// @notice Every guarantee after every call, in one campaign (forge runs a campaign per invariant_ function:
    /// one function makes each call count for all of them). A failure names the guarantee it broke. The checks
    /// read each piece of state once (a round's dispute case serves G5 and G6, a seat G1, G2, G3 and G6) and call
    /// the assertion cheatcodes only on a failure: the same checks as reading it per guarantee, at a fraction
    /// of the EVM work (bench/fuzz_forge.py's rate).
    function invariant_trust_model() public view {
        Seen memory seen = _see();
        check_G1_every_committed_record_is_honest(seen);
        check_G1_who_counts(seen);
        check_G2_live_honest_never_behind(seen);
        check_G3_no_honest_harm(seen);
        uint256 openBonds = check_G5_finality(seen);
        check_G6_solvency(seen, openBonds);
        check_G7_every_wrong_round_overturned();
        check_no_violation_seen();
    }

    function _see() internal view returns (Seen memory seen) {
        seen.count = ledger.commitCount(runId);
        seen.run = ledger.runOf(runId);
        seen.seats = new TrainingLedger.Member[](COALITION_JOINER + 1);
        for (uint256 key = 1; key <= COALITION_JOINER; ++key) seen.seats[key] = ledger.memberOf(runId, who(key));
        seen.honest = handler.honestKeys();
        seen.honestAt = new address[](seen.honest.length);
        for (uint256 i = 0; i < seen.honest.length; ++i) seen.honestAt[i] = who(seen.honest[i]);
    }

    /// @dev A failed check reported through the cheatcode (its message), a passing one without a call.
    function _require(bool ok, string memory what) internal pure {
        if (!ok) vm.assertTrue(false, what);
    }

    // ------------------------------------------------------------------------------------------- G1 safety

    /// @notice G1: every committed record is the honest record of its round: the run never changes hands.
    function check_G1_every_committed_record_is_honest(Seen memory seen) internal view {
        bytes32[] memory honest = handler.honestHashes(seen.count);
        for (uint64 round = 0; round < seen.count; ++round) {
            _require(ledger.recordHashOf(runId, round) == honest[round], "G1: a record not honest");
        }
    }

    /// @notice G1's mechanism, who counts: a founder from its join, a joiner once credited with a round at least
    /// tenureRounds after it joined; the run's counters match the seats.
    function check_G1_who_counts(Seen memory seen) internal pure {
        uint256 active = 0;
        uint256 counted = 0;
        for (uint256 key = 1; key < OUTSIDER; ++key) {
            TrainingLedger.Member memory seat = seen.seats[key];
            if (seat.status != TrainingLedger.MemberStatus.Active) continue;
            ++active;
            if (seat.countedBlock == 0) continue;
            ++counted;
            if (seat.joinRound > 0 && seat.activeRound < uint256(seat.joinRound) + TENURE + 1) {
                vm.assertGe(seat.activeRound, uint256(seat.joinRound) + TENURE + 1, "G1: counted before its tenure");
            }
        }
        if (seen.run.memberCount != active) {
            vm.assertEq(seen.run.memberCount, active, "G1: memberCount is not the active seats");
        }
        if (seen.run.countedCount != counted) {
            vm.assertEq(seen.run.countedCount, counted, "G1: countedCount is not the counted seats");
        }
    }

    // ------------------------------------------------------------------------------------------- G2, G3

    /// @notice G2: a live honest member is never ejectable (never inactivityRounds behind).
    function check_G2_live_honest_never_behind(Seen memory seen) internal pure {
        for (uint256 i = 0; i < seen.honest.length; ++i) {
            TrainingLedger.Member memory seat = seen.seats[seen.honest[i]];
            if (seat.status != TrainingLedger.MemberStatus.Active) continue;
            if (seen.count - seat.activeRound > INACTIVITY - 1) {
                vm.assertLe(seen.count - seat.activeRound, INACTIVITY - 1, "G2: a live honest member is ejectable");
            }
        }
    }

    /// @notice G3: no honest member is slashed, no honest round overturned.
    function check_G3_no_honest_harm(Seen memory seen) internal pure {
        for (uint256 i = 0; i < seen.honest.length; ++i) {
            _require(
                seen.seats[seen.honest[i]].status != TrainingLedger.MemberStatus.Slashed,
                "G3: an honest member was slashed"
            );
        }
        if (seen.run.invalidFrom != 0) vm.assertEq(seen.run.invalidFrom, 0, "G3: an honest round was overturned");
    }

    // ------------------------------------------------------------------------------------------- G5 finality

    /// @notice G5: a final round is out of its dispute window and has no dispute open before its deadline; the
    /// disputers of a round are only those whose own transaction filed (no honest member disputes an honest round).
    /// A round out of its window with no dispute open passes whether it is final or not, so `isFinal` (a walk back
    /// over the proof windows) is asked only of the others. Returns the bonds of the open disputes (G6).
    function check_G5_finality(Seen memory seen) internal view returns (uint256 openBonds) {
        for (uint64 round = 0; round < seen.count; ++round) {
            TrainingLedger.DisputeCase memory case_ = ledger.disputeCaseOf(runId, round);
            bool open = case_.status == TrainingLedger.DisputeStatus.Open;
            if (open) openBonds += uint256(case_.disputers) * BOND;
            bool outOfWindow = block.number >= ledger.commitBlockOf(runId, round) + WINDOW;
            bool noneOpen = !open || block.number >= case_.deadline;
            if (!(outOfWindow && noneOpen) && ledger.isFinal(runId, round)) {
                _require(outOfWindow, "G5: final inside its window");
                _require(noneOpen, "G5: final with a dispute open");
            }
            if (case_.disputers == 0) { // (the list's length alone: nothing to compare)
                uint256 listed = ledger.disputeCount(runId, round);
                if (listed != 0) vm.assertEq(listed, 0, "G5: disputers miscounted");
                continue;
            }
            address[] memory disputers = ledger.disputersOf(runId, round);
            if (disputers.length != case_.disputers) {
                vm.assertEq(disputers.length, case_.disputers, "G5: disputers miscounted");
            }
            for (uint256 d = 0; d < disputers.length; ++d) {
                for (uint256 i = 0; i < seen.honestAt.length; ++i) {
                    _require(disputers[d] != seen.honestAt[i], "G5: a dispute filed with another's signature");
                }
            }
        }
    }

    // ------------------------------------------------------------------------------------------- G6 solvency

    /// @notice G6, exactly: the ledger holds every bonded stake, every open bond, what it slashed or forfeited
    /// (burned whole: issue 79), the runs' proof funds (less what they paid provers) and the stakes of the seat cap's
    /// and the hashed run's seats (issue 79), to the wei. `openBonds`: the open disputes' bonds (check_G5_finality
    /// read every round's case).
    function check_G6_solvency(Seen memory seen, uint256 openBonds) internal view {
        uint256 owed = ledger.slashedTotal() + ledger.forfeitedTotal() + ledger.proofFundTotal() + handler.sideStakes()
            + openBonds;
        for (uint256 key = 1; key <= COALITION_JOINER; ++key) {
            if (_isBonded(seen.seats[key].status)) owed += seen.seats[key].stake;
        }
        // The game runs seat the coalition's founders and, for a while, the contributor (4); a past game run none
        // of whose seats is bonded any more (the handler drops it: nobody joins it again) holds no stake.
        uint256[] memory games = handler.bondedGameRuns();
        for (uint256 g = 0; g < games.length; ++g) {
            for (uint256 key = 4; key <= 6; ++key) {
                TrainingLedger.Member memory seat = ledger.memberOf(games[g], who(key));
                if (_isBonded(seat.status)) owed += seat.stake;
            }
        }
        (address[] memory accused, bytes32[] memory evidence) = handler.accusations();
        for (uint256 i = 0; i < accused.length; ++i) {
            TrainingLedger.Accusation memory a = ledger.accusationOf(runId, accused[i], evidence[i]);
            if (a.status == TrainingLedger.AccusationStatus.Open) owed += a.bond;
        }
        if (address(ledger).balance != owed) {
            vm.assertEq(address(ledger).balance, owed, "G6: the ledger's balance is not what it owes and burned");
        }
    }

    function _isBonded(TrainingLedger.MemberStatus s) internal pure returns (bool) {
        return s == TrainingLedger.MemberStatus.Active || s == TrainingLedger.MemberStatus.Unbonding;
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
        if (n != 0) vm.assertEq(n, 0, handler.violations(0));
    }
}
