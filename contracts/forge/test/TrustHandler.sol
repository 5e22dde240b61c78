// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "../src/AggregationProver.sol";
import {NodeRegistry} from "../src/NodeRegistry.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {TrustGame} from "./TrustGame.sol";

/// @notice The actors of docs/TRUST.md's model as one forge invariant handler (the twin of tests/trust_machine.py):
/// honest members (founders and a joiner) commit the honest record of each round, attest every commit that left
/// them out (they are live), leave while the assumption holds and withdraw when due; a coalition below the quorum
/// fraction commits with as few honest signatures as it likes, commits back doors, accuses, disputes and votes;
/// anyone ejects; an outsider sends fraud proofs against right rounds; and in runs of the coalition's own (where it
/// is the quorum) a prover overturns its rounds and a reporter proves its equivocations. What the handler sees
/// break is recorded in `violations`; the invariants (TrustInvariants.t.sol) read it and the chain.
contract TrustHandler is TrustGame {
    NodeRegistry public immutable registry;
    uint256 public immutable runId;

    uint256[] internal _honest = [uint256(1), 2, 3, 4, HONEST_JOINER];
    uint256[] internal _coalition = [uint256(5), 6, COALITION_JOINER];

    mapping(uint64 round => TrainingLedger.Record) internal _records;
    mapping(uint64 round => address[]) internal _attesters;
    mapping(uint64 round => bytes32) public honestHash;
    mapping(uint256 key => uint64) public dueAt; // an honest leaver's unbondingEnd + accusationBlocks
    mapping(uint256 key => bool) public withdrawn;
    bytes32[] internal _evidence; // accusations filed against honest members (evidence hashes)
    address[] internal _accused;
    uint256 public commits;
    uint256 public refusedProofs;
    // issue 79: the seat cap's run (fresh accounts fill it), the hashed run (honest founders 1 and 2), and the
    // stakes both hold (G6)
    uint256 public seatRun;
    uint256 public seatKeys; // accounts made so far: keys SEAT_KEY0 + 0 .. seatKeys - 1
    address[] internal _seated; // their accounts while seated
    uint256 public hashedRun;
    uint256 public sideStakes;
    uint256 internal constant SEAT_KEY0 = 1000;

    /// @param seated Fill the seat cap's run at once (TrustInvariants.t.sol's setUp: forge starts every sequence
    /// from that state, so the maxSeats joins are made once, not at each sequence's first seatsFillAndTurn).
    constructor(TrainingLedger ledger_, NodeRegistry registry_, uint256 runId_, bool seated) TrustGame(ledger_) {
        registry = registry_;
        runId = runId_;
        if (seated) _fillSeats();
    }

    // ------------------------------------------------------------------------------------------- views

    function honestKeys() external view returns (uint256[] memory) {
        return _honest;
    }

    /// @notice The honest records' hashes of rounds 0 .. count - 1 (one call for G1's check of every round).
    function honestHashes(uint64 count) external view returns (bytes32[] memory out) {
        out = new bytes32[](count);
        for (uint64 round = 0; round < count; ++round) out[round] = honestHash[round];
    }

    function coalitionKeys() external view returns (uint256[] memory) {
        return _coalition;
    }

    function accusations() external view returns (address[] memory, bytes32[] memory) {
        return (_accused, _evidence);
    }

    function _fundedRun() internal view override returns (uint256) {
        return runId;
    }

    function status(uint256 run, uint256 key) public view returns (TrainingLedger.MemberStatus) {
        return ledger.memberOf(run, who(key)).status;
    }

    // ------------------------------------------------------------------------------------------- helpers

    function _active(uint256[] storage group) internal view returns (uint256[] memory) {
        return _seats(group, false, false);
    }

    /// @dev The seats of `group` active (`bonded`: or unbonding) in the run, and counted where `counted`.
    function _seats(uint256[] storage group, bool bonded, bool counted) internal view returns (uint256[] memory out) {
        out = new uint256[](group.length);
        uint256 n = 0;
        for (uint256 i = 0; i < group.length; ++i) {
            TrainingLedger.Member memory seat = ledger.memberOf(runId, who(group[i]));
            bool inForce = bonded ? _isBonded(seat.status) : seat.status == TrainingLedger.MemberStatus.Active;
            if (inForce && (!counted || seat.countedBlock != 0)) out[n++] = group[i];
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

    function _concat(uint256[] memory a, uint256[] memory b) internal pure returns (uint256[] memory out) {
        out = new uint256[](a.length + b.length);
        for (uint256 i = 0; i < a.length; ++i) out[i] = a[i];
        for (uint256 i = 0; i < b.length; ++i) out[a.length + i] = b[i];
    }

    function _honestCounted(uint256 leaving) internal view returns (uint256 n) {
        for (uint256 i = 0; i < _honest.length; ++i) {
            TrainingLedger.Member memory seat = ledger.memberOf(runId, who(_honest[i]));
            if (_honest[i] != leaving && seat.status == TrainingLedger.MemberStatus.Active && seat.countedBlock != 0) {
                ++n;
            }
        }
    }

    /// @dev The model's assumption at one half: the coalition's active seats (counted or not) stay fewer than the
    /// honest counted ones.
    function _assumptionHolds(uint256 leaving, uint256 coalitionSeats) internal view returns (bool) {
        return coalitionSeats < _honestCounted(leaving);
    }

    function _honestRecord() internal view returns (TrainingLedger.Record memory r) {
        uint64 round = ledger.commitCount(runId);
        r = TrainingLedger.Record({
            runId: runId,
            round: round,
            prevHead: ledger.headOf(runId),
            weightsRoot: keccak256(abi.encode("honest weights", round)),
            contributionsRoot: keccak256(abi.encode("honest contributions", round)),
            trainLossMicro: 3_000_000,
            evalLossMicro: 3_100_000,
            tokens: 4096,
            numContributors: 4,
            checkpointHash: bytes32(0)
        });
    }

    /// @dev Commit `record` signed by `signers`, sent by `submitter`; on success remember it and let every live
    /// honest member the commit left out attest it (node/live/record/committer).
    function _commit(uint256 submitter, TrainingLedger.Record memory record, uint256[] memory signers)
        internal
        returns (bool)
    {
        bytes memory signatures = signAll(signers, recordDigest(ledger, record));
        vm.prank(who(submitter));
        try ledger.commitRound(record, signatures) {}
        catch {
            return false;
        }
        ++commits;
        _records[record.round] = record;
        _attesters[record.round] = _addresses(signers);
        for (uint256 i = 0; i < _honest.length; ++i) {
            uint256 key = _honest[i];
            TrainingLedger.Member memory seat = ledger.memberOf(runId, who(key));
            if (seat.status != TrainingLedger.MemberStatus.Active || seat.joinRound > record.round) continue;
            if (seat.activeRound > record.round) continue; // its signature is in the commit
            try ledger.attest(record, record, sign(key, recordDigest(ledger, record))) {}
            catch {
                _violation("G2: a live honest member could not attest a commit that left it out");
            }
        }
        return true;
    }

    /// @dev A fresh copy (assigning a memory struct copies the reference).
    function _copy(TrainingLedger.Record memory r) internal pure returns (TrainingLedger.Record memory) {
        return abi.decode(abi.encode(r), (TrainingLedger.Record));
    }

    /// @dev The coalition's seats that a verdict can count (bonded, counted): its strongest set of signatures.
    function _coalitionVoters() internal view returns (uint256[] memory) {
        return _seats(_coalition, true, true);
    }

    function _pick(uint256[] memory keys, uint256 seed) internal pure returns (uint256) {
        return keys[seed % keys.length];
    }

    // ------------------------------------------------------------------------------------------- honest members

    function honestCommit(uint256 submitterSeed, uint256 extraMask) external {
        ++calls;
        uint256[] memory honest = _active(_honest);
        if (honest.length == 0) return;
        TrainingLedger.Record memory record = _honestRecord();
        honestHash[record.round] = structHash(record);
        _commit(_pick(honest, submitterSeed), record, _concat(honest, _subset(_active(_coalition), extraMask)));
    }

    function honestLeaves(uint256 seed) external {
        ++calls;
        uint256[] memory honest = _active(_honest);
        if (honest.length < 2) return;
        uint256 key = _pick(honest, seed);
        if (!_assumptionHolds(key, _active(_coalition).length)) return;
        vm.prank(who(key));
        ledger.leaveRun(runId);
        dueAt[key] = ledger.memberOf(runId, who(key)).unbondingEnd + WINDOW;
    }

    function honestJoinerJoins() external {
        ++calls;
        if (status(runId, HONEST_JOINER) != TrainingLedger.MemberStatus.None || withdrawn[HONEST_JOINER]) return;
        vm.prank(who(HONEST_JOINER));
        ledger.joinRun{value: STAKE}(runId, bytes32("cpu"));
    }

    /// @notice G4: at unbondingEnd + accusationBlocks an honest leaver's whole stake comes back, whatever was filed.
    function honestWithdrawsWhenDue() external {
        ++calls;
        for (uint256 i = 0; i < _honest.length; ++i) {
            uint256 key = _honest[i];
            if (dueAt[key] != 0 && block.number >= dueAt[key]) _withdrawWhenDue(key);
        }
    }

    function _withdrawWhenDue(uint256 key) internal {
        address account = who(key);
        for (uint256 i = 0; i < _accused.length; ++i) {
            if (_accused[i] != account) continue;
            TrainingLedger.Accusation memory accusation = ledger.accusationOf(runId, account, _evidence[i]);
            if (accusation.status != TrainingLedger.AccusationStatus.Open) continue;
            if (accusation.deadline > dueAt[key]) {
                _violation("G4: an accusation against an honest leaver lapses only after its stake's due block");
            }
            vm.prank(account);
            try ledger.expireAccusation(runId, account, _evidence[i]) {}
            catch {
                _violation("G4: an accusation against an honest leaver outlived its stake's due block");
            }
        }
        uint256 before = account.balance;
        vm.prank(account);
        try ledger.withdrawStake(runId) {
            if (account.balance - before != STAKE) _violation("G4: a withdrawal returned other than the stake");
        } catch {
            _violation("G4: an honest leaver could not withdraw when due");
        }
        dueAt[key] = 0;
        withdrawn[key] = true;
    }

    /// @notice The honest members counted at a disputed round uphold it, or let it lapse past its deadline.
    function honestSettlesDispute(uint256 roundSeed) external {
        ++calls;
        uint64 count = ledger.commitCount(runId);
        if (count == 0) return;
        uint64 round = uint64(roundSeed % count);
        TrainingLedger.DisputeCase memory case_ = ledger.disputeCaseOf(runId, round);
        if (case_.status != TrainingLedger.DisputeStatus.Open) return;
        if (block.number >= case_.deadline) {
            ledger.expireDispute(runId, round);
            return;
        }
        uint256[] memory signers = _seats(_honest, true, false);
        TrainingLedger.Record memory committed = _records[round];
        bytes memory signatures = signAll(signers, roundVerdictDigest(ledger, committed, true));
        try ledger.resolveDispute(committed, true, signatures, _attesters[round]) {} catch {}
    }

    // ------------------------------------------------------------------------------------------- the coalition

    function coalitionCommitsLeavingHonestOut(uint256 submitterSeed, uint256 honestMask) external {
        ++calls;
        uint256[] memory coalition = _active(_coalition);
        if (coalition.length == 0) return;
        TrainingLedger.Record memory record = _honestRecord();
        honestHash[record.round] = structHash(record);
        _commit(_pick(coalition, submitterSeed), record, _concat(coalition, _subset(_active(_honest), honestMask)));
    }

    function coalitionCommitsABackDoor(uint256 submitterSeed, uint256 mask) external {
        ++calls;
        uint256[] memory coalition = _active(_coalition);
        if (coalition.length == 0) return;
        TrainingLedger.Record memory record = _honestRecord();
        record.weightsRoot = keccak256(abi.encode("back door", record.round));
        // Every seat it holds half the time (its strongest try), else any non-empty subset.
        uint256[] memory signers = mask % 2 == 0 ? coalition : _subset(coalition, (mask >> 1) | 1);
        if (_commit(_pick(coalition, submitterSeed), record, signers)) {
            _violation("G1: the coalition committed a back-doored record alone");
        }
    }

    function anyoneEjects(uint256 targetSeed, uint256 callerSeed) external {
        ++calls;
        uint256[] memory everyone = _concat(_honest, _coalition);
        uint256 target = _pick(everyone, targetSeed);
        vm.prank(who(_pick(everyone, callerSeed)));
        try ledger.ejectInactive(runId, who(target)) {
            for (uint256 i = 0; i < _honest.length; ++i) {
                if (_honest[i] == target) _violation("G2: a live honest member was ejected");
            }
        } catch {}
    }

    /// @notice Accuse an honest member (active or unbonding) and try a guilty verdict signed by the coalition's
    /// counted seats, or by any set of its seats.
    function coalitionAccusesAndConvicts(uint256 accuserSeed, uint256 targetSeed, uint256 voterMask) external {
        ++calls;
        uint256[] memory coalition = _active(_coalition);
        if (coalition.length == 0) return;
        address target = who(_pick(_honest, targetSeed));
        bytes32 evidence = keccak256(abi.encode("made up", calls, target));
        vm.prank(who(_pick(coalition, accuserSeed)));
        try ledger.accuse{value: BOND}(runId, target, evidence) {}
        catch {
            return;
        }
        _accused.push(target);
        _evidence.push(evidence);
        TrainingLedger.Verdict memory verdict = TrainingLedger.Verdict(runId, target, evidence, true);
        uint256[] memory seats = voterMask % 2 == 0 ? _coalitionVoters() : _subset(_coalition, voterMask >> 1);
        try ledger.resolveAccusation(verdict, signAll(seats, verdictDigest(ledger, verdict))) {} catch {}
    }

    /// @notice Dispute an honest round (with the sender's own signature or an honest member's signature over the
    /// disputed record), with a bond of any size, and try to overturn it by a coalition verdict.
    function coalitionDisputesAndOverturns(uint256 roundSeed, uint256 senderSeed, uint256 signerSeed, uint8 value)
        external
    {
        ++calls;
        uint64 count = ledger.commitCount(runId);
        if (count == 0) return;
        uint64 round = uint64(count - 1 - roundSeed % (count < 3 ? count : 3));
        TrainingLedger.Record memory committed = _records[round];
        TrainingLedger.Record memory disputed = _copy(committed);
        disputed.weightsRoot = keccak256(abi.encode("other", round));
        uint256 sender = _pick(_coalition, senderSeed);
        uint256 signer = signerSeed % 2 == 0 ? sender : _pick(_honest, signerSeed >> 1);
        uint256 bond = value % 4 == 0 ? BOND - 1 : (value % 4 == 1 ? BOND + 1 : BOND); // the run's half the time
        vm.prank(who(sender));
        try ledger.dispute{value: bond}(committed, disputed, sign(signer, recordDigest(ledger, disputed))) {}
        catch {}
        if (ledger.disputeCaseOf(runId, round).status != TrainingLedger.DisputeStatus.Open) return;
        uint256[] memory voters = value % 2 == 0 ? _coalitionVoters() : _subset(_coalition, signerSeed >> 8);
        bytes memory signatures = signAll(voters, roundVerdictDigest(ledger, committed, false));
        try ledger.resolveDispute(committed, false, signatures, _attesters[round]) {} catch {}
    }

    /// @notice A fresh coalition seat joins the running run (after its first commit: before, it would be a founder).
    function coalitionJoinerJoins() external {
        ++calls;
        if (status(runId, COALITION_JOINER) != TrainingLedger.MemberStatus.None) return;
        if (ledger.commitCount(runId) == 0) return;
        if (!_assumptionHolds(0, _active(_coalition).length + 1)) return;
        vm.prank(who(COALITION_JOINER));
        try ledger.joinRun{value: STAKE}(runId, bytes32("cpu")) {} catch {}
    }

    /// @notice A coalition seat leaves, or withdraws at any time: a stake leaves only once due and unaccused.
    function coalitionLeavesOrWithdraws(uint256 seed) external {
        ++calls;
        uint256 key = _pick(_coalition, seed);
        address account = who(key);
        TrainingLedger.Member memory seat = ledger.memberOf(runId, account);
        vm.prank(account);
        if (seat.status == TrainingLedger.MemberStatus.Active) {
            ledger.leaveRun(runId);
        } else if (seat.status == TrainingLedger.MemberStatus.Unbonding) {
            uint256 before = account.balance;
            try ledger.withdrawStake(runId) {
                if (block.number < seat.unbondingEnd || seat.openAccusations > 0) {
                    _violation("G4: a stake left before its unbonding ended or with an accusation open");
                }
                if (account.balance - before != seat.stake) _violation("G6: a withdrawal paid other than the stake");
            } catch {}
        }
    }

    /// @notice G4: the coalition lets an honest leaver's unbonding end (blocks pass) and accuses it before its
    /// withdrawal is due: refused, or the accusation would lock the stake past its due block.
    function coalitionAccusesALeaverLate(uint256 seed) external {
        ++calls;
        uint256[] memory coalition = _active(_coalition);
        if (coalition.length == 0) return;
        for (uint256 i = 0; i < _honest.length; ++i) {
            uint256 key = _honest[i];
            if (dueAt[key] == 0) continue;
            uint256 late = ledger.memberOf(runId, who(key)).unbondingEnd + seed % WINDOW;
            if (block.number < late) _roll(late - block.number);
            if (block.number >= dueAt[key]) continue;
            bytes32 evidence = keccak256(abi.encode("late", calls, key));
            vm.prank(who(_pick(coalition, seed)));
            try ledger.accuse{value: BOND}(runId, who(key), evidence) {
                _accused.push(who(key));
                _evidence.push(evidence);
                _violation("G4: an accusation after the accused's unbonding ended was accepted");
            } catch {}
            return;
        }
    }

    function blocksPass(uint256 blocks) external {
        ++calls;
        _roll(1 + blocks % (2 * WINDOW));
    }

    // ------------------------------------------------------------------------------------------- issue 79

    /// @notice The seat cap (issue 79 point 4): fresh accounts fill a run up to maxSeats (every join below it
    /// succeeds), the next join is refused (LedgerRunFull), a seat leaves and a fresh account takes its place.
    function seatsFillAndTurn(uint256 seed) external {
        ++calls;
        if (!_fillSeats()) return;
        if (_seatJoins()) _violation("G1: a run seated more than maxSeats");
        uint256 i = seed % _seated.length;
        vm.prank(_seated[i]);
        ledger.leaveRun(seatRun);
        _seated[i] = _seated[_seated.length - 1];
        _seated.pop();
        if (!_seatJoins()) _violation("G1: a seat that left was not freed");
    }

    /// @dev Open the seat run if there is none and fill it to maxSeats: every join below it must succeed.
    function _fillSeats() internal returns (bool) {
        uint32 most = ledger.maxSeats();
        if (seatRun == 0) {
            vm.prank(who(OUTSIDER));
            seatRun = ledger.createRun(runParams(keccak256("seats")), "seats");
        }
        while (ledger.runOf(seatRun).memberCount < most) {
            if (!_seatJoins()) {
                _violation("G1: a join below the seat cap was refused");
                return false;
            }
        }
        return true;
    }

    /// @dev A fresh account registers and joins the seat run; whether the join went through.
    function _seatJoins() internal returns (bool) {
        uint256 key = SEAT_KEY0 + seatKeys++;
        address account = vm.addr(key);
        vm.deal(account, 2 * STAKE);
        vm.prank(account);
        registry.register(keccak256(abi.encode("seat", key)), new bytes(64));
        vm.prank(account);
        try ledger.joinRun{value: STAKE}(seatRun, bytes32("cpu")) {
            _seated.push(account);
            sideStakes += STAKE;
            return true;
        } catch (bytes memory reason) {
            if (bytes4(reason) != TrainingLedger.LedgerRunFull.selector) {
                _violation("G1: a join refused for another reason than a full run");
            }
            return false;
        }
    }

    /// @notice Issue 79 point 5: an outsider challenges a right round of a hashed (version-1) run, whose nodes
    /// answer nothing, and lets the challenge run out: refused, or the honest attesters are slashed (G3).
    function outsiderChallengesAHashedRun(uint256 seed) external {
        ++calls;
        if (hashedRun == 0) _openHashedRun();
        TrainingLedger.Record memory record = TrainingLedger.Record(
            hashedRun, ledger.commitCount(hashedRun), ledger.headOf(hashedRun), keccak256("hashed"), keccak256("c"), 1,
            1, 1, 1, 0
        );
        vm.prank(who(1));
        try ledger.commitRound(record, signAll(_pair(1, 2), recordDigest(ledger, record))) {} catch {
            return;
        }
        AggregationProver.Target memory target;
        target.record = record;
        target.which = STAGE_LEAF; // what the issue's outsider challenged (~188k gas)
        target.stage = uint32(seed % 2); // (the run's one stage, or one past it: refused either way)
        vm.prank(who(OUTSIDER));
        try _prover.challengeAvailability{value: BOND}(target) returns (bytes32 id) {
            _roll(_prover.challengeOf(id).deadline - block.number); // nobody answers
            vm.prank(who(OUTSIDER));
            try _prover.expireChallenge(id, _addresses(_pair(1, 2))) {} catch {}
            for (uint256 key = 1; key <= 2; ++key) {
                if (status(hashedRun, key) == TrainingLedger.MemberStatus.Slashed) {
                    _violation("G3: an honest member was slashed (a challenge of a hashed run nobody answers)");
                    sideStakes -= STAKE;
                }
            }
        } catch {}
    }

    function _openHashedRun() internal {
        TrainingLedger.RunParams memory params = runParams(keccak256("hashed"));
        params.commitments = 1;
        params.maxContributions = 0;
        vm.prank(who(1));
        hashedRun = ledger.createRun(params, "hashed");
        for (uint256 key = 1; key <= 2; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE}(hashedRun, bytes32("cpu"));
        }
        sideStakes += 2 * STAKE;
    }

    // ------------------------------------------------------------------------------------------- fraud proofs

    /// @notice G7: an outsider's proof against a right round, built from the committed records and junk openings,
    /// never invalidates it.
    function outsiderProvesARightRound(uint256 roundSeed, uint32 stage, uint64 chunk, bytes calldata junk) external {
        ++calls;
        uint64 count = ledger.commitCount(runId);
        if (count < 2) return;
        uint64 round = uint64(1 + roundSeed % (count - 1));
        AggregationProver.Proof memory proof;
        proof.prevRecord = _records[round - 1];
        proof.record = _records[round];
        proof.stage = stage % 2;
        proof.chunk = chunk % 4;
        proof.prevStageLeaf = junk;
        proof.stageLeaf = junk;
        proof.factors = junk;
        proof.stagePath = new bytes32[](roundSeed % 3);
        proof.attesters = _attesters[round];
        vm.prank(who(OUTSIDER));
        try _prover.proveWrongAggregation(proof) {
            _violation("G7: a proof invalidated a right round");
        } catch {
            ++refusedProofs;
        }
    }

    /// @notice G7: an outsider opens a wrong round's stage leaf (a clip scale 0.5) under a right round's root, of the
    /// honest run or of the coalition's: the stage path must not open it (a proof or its view that succeeds is a
    /// violation; the Merkle-path mutants of scripts/forge_mutations.py).
    function outsiderOpensAWrongLeaf(uint256 seed) external {
        ++calls;
        uint256 run = seed % 2 == 0 ? runId : gameRun;
        uint64 count = run == 0 ? 0 : ledger.commitCount(run);
        if (count == 0) return;
        uint64 round = uint64(count - 1 - (seed >> 1) % (count < 3 ? count : 3));
        if (run != runId && _gameWrong[run][round]) return;
        TrainingLedger.Record memory record = run == runId ? _records[round] : _gameRecords[run][round];
        bytes memory factors = _factors(true);
        AggregationProver.NormProof memory proof = _normProof(
            record, _stageLeaf(round, factors), factors, run == runId ? _attesters[round] : _gameAttesters[run]
        );
        try _prover.isWrongNorm(proof) returns (bool wrong) {
            if (wrong) _violation("G7: a proof of a right round would succeed");
        } catch {}
        vm.prank(who(OUTSIDER));
        try _prover.proveWrongNorm(proof) {
            _violation("G7: a proof invalidated a right round");
        } catch {
            ++refusedProofs;
        }
    }

    /// @notice A coalition founder signs two records of one round of its run; anyone reports it.
    function gameEquivocates(uint256 seed) external {
        ++calls;
        uint256 run = gameRun;
        if (run == 0) return;
        uint256 key = 5 + seed % 2;
        if (status(run, key) == TrainingLedger.MemberStatus.Slashed) return;
        TrainingLedger.Record memory a = TrainingLedger.Record(
            run, ledger.commitCount(run), ledger.headOf(run), keccak256("a"), keccak256("c"), 1, 1, 1, 1, 0
        );
        TrainingLedger.Record memory b = _copy(a);
        b.weightsRoot = keccak256(abi.encode("b", seed));
        bytes memory signatureA = sign(key, recordDigest(ledger, a));
        bytes memory signatureB = sign(key, recordDigest(ledger, b));
        bool bonded = status(run, key) != TrainingLedger.MemberStatus.None;
        vm.prank(who(OUTSIDER));
        try ledger.reportEquivocation(a, signatureA, b, signatureB) {
            if (status(run, key) != TrainingLedger.MemberStatus.Slashed) _violation("equivocation left a stake");
        } catch (bytes memory reason) {
            if (bonded) _violation(string(abi.encodePacked("a proven equivocation was refused ", reason)));
        }
    }
}
