// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustBase} from "./TrustBase.sol";

/// @notice A coalition's verdicts at close quarters (issue 63): the handler of VerdictInvariants.t.sol. Blocks pass
/// only when the campaign calls `nextBlock`, so commits, joins, leaves, disputes and accusations share blocks as
/// transactions of one block do; the coalition (founders 5 and 6, joiner 8) disputes every round it can and accuses
/// honest members, and for every open case tries a verdict with every subset of its bonded seats: it wins wherever
/// any set of its signatures is accepted. Honest members (founders 1-4) commit every round, signed by all of them
/// and any of the coalition's seats, and leave while the model's assumption holds (the coalition's active seats
/// fewer than the honest counted ones). A verdict the coalition wins slashes an honest member: the invariants
/// (no honest member slashed, no round overturned) catch a verdict taken without the quorum its case was counted
/// with, or signed by a seat counted or gone within the block that quorum was counted in.
contract VerdictHandler is TrustBase {
    TrainingLedger public immutable ledger;
    uint256 public immutable runId;
    uint256 public calls;
    uint256 public commits;
    uint256 public disputes; // cases the coalition opened
    uint256 public accusationCount; // accusations the coalition filed
    uint256 public verdictTries; // verdicts the coalition sent (each subset of its seats is one)
    uint256 public wrongBondsAccepted; // disputes opened with a bond other than the run's (G5: never)

    uint256[] internal _honest = [uint256(1), 2, 3, 4];
    uint256[] internal _coalition = [uint256(5), 6, COALITION_JOINER];

    mapping(uint64 round => TrainingLedger.Record) internal _records;
    mapping(uint64 round => address[]) internal _attesters;
    address[] internal _accused;
    bytes32[] internal _evidence;

    constructor(TrainingLedger ledger_, uint256 runId_) {
        ledger = ledger_;
        runId = runId_;
        _castAddresses();
    }

    function honestKeys() external view returns (uint256[] memory) {
        return _honest;
    }

    // ------------------------------------------------------------------------------------------- helpers

    function _seat(uint256 key) internal view returns (TrainingLedger.Member memory) {
        return ledger.memberOf(runId, who(key));
    }

    function _isActive(uint256 key) internal view returns (bool) {
        return _seat(key).status == TrainingLedger.MemberStatus.Active;
    }

    function _isBonded(uint256 key) internal view returns (bool) {
        TrainingLedger.MemberStatus s = _seat(key).status;
        return s == TrainingLedger.MemberStatus.Active || s == TrainingLedger.MemberStatus.Unbonding;
    }

    /// @dev The keys of `group` that are active (`bondedToo`: or unbonding).
    function _select(uint256[] storage group, bool bondedToo) internal view returns (uint256[] memory out) {
        out = new uint256[](group.length);
        uint256 n = 0;
        for (uint256 i = 0; i < group.length; ++i) {
            if (bondedToo ? _isBonded(group[i]) : _isActive(group[i])) out[n++] = group[i];
        }
        assembly ("memory-safe") {
            mstore(out, n)
        }
    }

    function _subset(uint256[] memory keys, uint256 mask) internal pure returns (uint256[] memory out) {
        out = new uint256[](keys.length);
        uint256 n = 0;
        for (uint256 i = 0; i < keys.length; ++i) {
            if ((mask >> i) & 1 == 1) out[n++] = keys[i];
        }
        assembly ("memory-safe") {
            mstore(out, n)
        }
    }

    function _honestCounted(uint256 leaving) internal view returns (uint256 n) {
        for (uint256 i = 0; i < _honest.length; ++i) {
            TrainingLedger.Member memory seat = _seat(_honest[i]);
            if (_honest[i] != leaving && seat.status == TrainingLedger.MemberStatus.Active && seat.countedBlock != 0) {
                ++n;
            }
        }
    }

    function _record(string memory label) internal view returns (TrainingLedger.Record memory) {
        uint64 round = ledger.commitCount(runId);
        return TrainingLedger.Record({
            runId: runId,
            round: round,
            prevHead: ledger.headOf(runId),
            weightsRoot: keccak256(abi.encode(label, "weights", round)),
            contributionsRoot: keccak256(abi.encode(label, "contributions", round)),
            trainLossMicro: 3_000_000,
            evalLossMicro: 3_100_000,
            tokens: 4096,
            numContributors: 4,
            checkpointHash: bytes32(0)
        });
    }

    // ------------------------------------------------------------------------------------------- moves

    /// @notice Blocks pass only here: one at a time, so the dispute and accusation windows (8 blocks) stay open
    /// across several calls.
    function nextBlock() external {
        ++calls;
        vm.roll(block.number + 1);
    }

    /// @notice The honest record of the next round (`twice`: and of the one after, in the same block), signed by
    /// every active honest member and the coalition's active seats in `coalitionMask` (a signature credits its
    /// seat: a joiner past its tenure starts to count).
    function honestCommit(uint256 coalitionMask, bool twice) external {
        ++calls;
        _honestCommit(coalitionMask);
        if (twice) _honestCommit(coalitionMask >> 3);
    }

    function _honestCommit(uint256 coalitionMask) internal {
        uint256[] memory honest = _select(_honest, false);
        if (honest.length == 0) return;
        uint256[] memory extra = _subset(_select(_coalition, false), coalitionMask);
        uint256[] memory signers = new uint256[](honest.length + extra.length);
        for (uint256 i = 0; i < honest.length; ++i) signers[i] = honest[i];
        for (uint256 i = 0; i < extra.length; ++i) signers[honest.length + i] = extra[i];
        TrainingLedger.Record memory record = _record("honest");
        vm.prank(who(honest[0]));
        try ledger.commitRound(record, signAll(signers, recordDigest(ledger, record))) {
            ++commits;
            _records[record.round] = record;
            _attesters[record.round] = _addresses(signers);
        } catch {}
    }

    /// @notice The coalition's joiner joins once the run has a round (before, it would be a founder), while the
    /// assumption holds with its seat.
    function coalitionJoinerJoins() external {
        ++calls;
        if (_seat(COALITION_JOINER).status != TrainingLedger.MemberStatus.None) return;
        if (ledger.commitCount(runId) == 0) return;
        if (_select(_coalition, false).length + 1 >= _honestCounted(0)) return;
        vm.prank(who(COALITION_JOINER));
        ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
    }

    /// @notice A seat leaves (a third of the calls: the coalition has three seats and no way back): any of the
    /// coalition's, or an honest one while the assumption holds without it and two honest members stay to commit.
    function leaves(uint256 seed) external {
        ++calls;
        if (seed % 3 != 0) return;
        seed /= 3;
        uint256 key = seed % 2 == 0 ? _coalition[(seed >> 1) % 3] : _honest[(seed >> 1) % 4];
        if (!_isActive(key)) return;
        if (key <= 4) {
            uint256 stay = _honestCounted(key);
            if (stay < 2 || _select(_coalition, false).length >= stay) return;
        }
        vm.prank(who(key));
        ledger.leaveRun(runId);
    }

    /// @notice The coalition disputes every round still in its dispute window (up to six, the latest first) that
    /// a seat of it can (bonded and in the run at the round, with the run's bond and its own signature), and tries
    /// to overturn each. Each seat first tries a bond one wei short of the run's and one wei over: counted in
    /// `wrongBondsAccepted` if taken.
    function coalitionDisputes() external {
        ++calls;
        uint64 count = ledger.commitCount(runId);
        for (uint64 back = 0; back < 6 && back < count; ++back) {
            uint64 round = count - 1 - back;
            if (block.number >= ledger.commitBlockOf(runId, round) + WINDOW) break;
            if (ledger.disputeCaseOf(runId, round).status == TrainingLedger.DisputeStatus.None) _dispute(round);
            _tryOverturn(round);
        }
    }

    function _dispute(uint64 round) internal {
        TrainingLedger.Record memory committed = _records[round];
        TrainingLedger.Record memory disputed = abi.decode(abi.encode(committed), (TrainingLedger.Record));
        disputed.weightsRoot = keccak256(abi.encode("other", round));
        for (uint256 i = 0; i < _coalition.length; ++i) {
            uint256 key = _coalition[i];
            bytes memory signature = sign(key, recordDigest(ledger, disputed));
            // first a bond a wei short and a wei over the run's: each must be refused (LedgerBondMismatch);
            // one accepted opens the case (G5's price of a dispute, and G6's books, would be off)
            for (uint256 wrong = BOND - 1; wrong <= BOND + 1; wrong += 2) {
                vm.prank(who(key));
                try ledger.dispute{value: wrong}(committed, disputed, signature) {
                    ++wrongBondsAccepted;
                    return;
                } catch {}
            }
            vm.prank(who(key));
            try ledger.dispute{value: BOND}(committed, disputed, signature) {
                ++disputes;
                return;
            } catch {}
        }
    }

    /// @notice An active coalition seat accuses an honest member (active, or unbonding before its end) and the
    /// coalition tries to convict it.
    function coalitionAccuses(uint256 accuserSeed, uint256 targetSeed) external {
        ++calls;
        uint256[] memory accusers = _select(_coalition, false);
        if (accusers.length == 0) return;
        address target = who(_honest[targetSeed % 4]);
        bytes32 evidence = keccak256(abi.encode("made up", calls, target));
        vm.prank(who(accusers[accuserSeed % accusers.length]));
        try ledger.accuse{value: BOND}(runId, target, evidence) {
            ++accusationCount;
            _accused.push(target);
            _evidence.push(evidence);
            _tryConvict(target, evidence);
        } catch {}
    }

    /// @notice The coalition tries again on every open case: its seats may have changed since.
    function coalitionVotesAgain() external {
        ++calls;
        for (uint256 i = 0; i < _accused.length; ++i) _tryConvict(_accused[i], _evidence[i]);
        uint64 count = ledger.commitCount(runId);
        for (uint64 round = count > 6 ? count - 6 : 0; round < count; ++round) _tryOverturn(round);
    }

    /// @dev Every subset of the coalition's bonded seats signs the round's verdict "overturned" until one is taken.
    function _tryOverturn(uint64 round) internal {
        if (ledger.disputeCaseOf(runId, round).status != TrainingLedger.DisputeStatus.Open) return;
        TrainingLedger.Record memory committed = _records[round];
        bytes32 digest = roundVerdictDigest(ledger, committed, false);
        uint256[] memory seats = _select(_coalition, true);
        for (uint256 mask = 1; mask < 1 << seats.length; ++mask) {
            ++verdictTries;
            try ledger.resolveDispute(committed, false, signAll(_subset(seats, mask), digest), _attesters[round]) {
                return;
            } catch {}
        }
    }

    /// @dev Every subset of the coalition's bonded seats signs "guilty" on an open accusation until one is taken.
    function _tryConvict(address accused, bytes32 evidence) internal {
        if (ledger.accusationOf(runId, accused, evidence).status != TrainingLedger.AccusationStatus.Open) return;
        TrainingLedger.Verdict memory verdict = TrainingLedger.Verdict(runId, accused, evidence, true);
        bytes32 digest = verdictDigest(ledger, verdict);
        uint256[] memory seats = _select(_coalition, true);
        for (uint256 mask = 1; mask < 1 << seats.length; ++mask) {
            ++verdictTries;
            try ledger.resolveAccusation(verdict, signAll(_subset(seats, mask), digest)) {
                return;
            } catch {}
        }
    }
}
