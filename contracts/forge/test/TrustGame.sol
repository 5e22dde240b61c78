// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "../src/AggregationProver.sol";
import {TrainingLedger} from "../src/TrainingLedger.sol";
import {AnswerRelay} from "../src/test/AnswerRelay.sol";
import {TrustBase} from "./TrustBase.sol";
import {Vm} from "./Vm.sol";

/// @notice The fraud-proof game of docs/TRUST.md's G7 (issue 62) as forge handler moves, in runs of the coalition's
/// own (its two founders: it is the quorum there), the base of TrustHandler. The coalition commits right rounds
/// (version-3 factors of no contribution) and wrong ones (one contribution's clip scale 0.5 where the rule, clip
/// off, gives 1.0) and withholds their state; one honest prover (the outsider, staked nowhere, live: it acts in
/// every block) plays the availability game on the first wrong round of each run: the stage leaf, the factors, a
/// weights chunk and a momentum chunk, `GAME_STEPS` steps, each built from what the earlier answers published,
/// which it reads from `AvailabilityAnswered` (whoever sent the answer: the coalition answers directly or through
/// an AnswerRelay). The coalition answers each step in the last block of its window, after junk the contract must
/// refuse, or not at all (the prover expires the step: the round falls); the prover then commits its norm proof
/// and sends it a block later, and a coalition copier may send a copy first (a front-runner with a higher tip);
/// the coalition may leave its run at once and withdraw whenever it can. Ghost state (`caseOf`) records each wrong
/// round's case: the bonds the prover sent, what came back to it, the stake the overturn slashed, what a copier
/// gained; TrustInvariants.t.sol checks it: every wrong round overturned within its proof window by the one
/// prover, at no net cost (bonds back, reward exactly half the slash), every attester slashed, copiers paid
/// nothing.
abstract contract TrustGame is TrustBase {
    uint256 internal constant PROVER = OUTSIDER;
    uint256 internal constant COPIER = COALITION_JOINER; // the coalition's front-runner
    uint256 internal constant ANSWERER = 6;
    uint64 internal constant HALF = 0x3FE0000000000000; // binary64 0.5
    uint256 internal constant FACTORS = type(uint256).max - 1; // Target.which of the factors
    uint256 internal constant STAGE_LEAF = type(uint256).max; // and of the stage leaf

    TrainingLedger public immutable ledger;
    AggregationProver internal immutable _prover;
    AnswerRelay internal immutable _relay;

    string[] public violations;
    uint256 public calls;

    /// @dev One wrong round's game and what it cost and paid (the ghost state of the "no net cost" invariant).
    struct Case {
        uint256 run;
        uint64 round;
        uint16 steps; // challenges opened
        bytes32 open; // the step in flight (0: none)
        uint64 committedAt; // the proof's commitment (0: not yet)
        bool ended;
        bool copierArmed; // a coalition copier watches the mempool for the proof
        uint256 spent; // bonds the prover sent
        uint256 got; // what came back to it: bonds and reward
        uint256 slashed; // stake the overturn slashed
        uint256 copierGain; // what a copy of its proof paid the copier
        uint256 fundBefore; // the run's proof fund as its deposits left it when the round fell (ghost)
        uint256 burned; // what the overturn added to the ledger's slashedTotal (burned whole: issue 79)
        bool squat; // a coalition squatter opens each of the prover's steps in its own game first (issue 79)
        bytes32 squatOpen; // its copy of the step in flight, which the coalition answers with the step
        bool selfProof; // the coalition commits the proof of its own round at once and reveals it first
        uint64 selfCommittedAt;
        bool selfProved; // its own proof overturned the round
        uint256 selfGain; // what its proof paid the coalition
        bytes stageLeaf; // as the answers published them (read from AvailabilityAnswered)
        bytes factors;
    }

    Case[] internal _cases;
    uint256 public gameRun;
    uint256[] internal _gameRuns;
    // The game runs where a seat may still be bonded: the current one, and each past one until none of its seats
    // (4-6) is (nobody joins a past run again, so a seat there never bonds again): what G6 and the leaving
    // coalition read, instead of every game run ever opened (`_pruneGameRuns`).
    uint256[] internal _bondedRuns;
    mapping(uint256 run => mapping(uint64 round => TrainingLedger.Record)) internal _gameRecords;
    mapping(uint256 run => mapping(uint64 round => bool)) internal _gameWrong;
    mapping(uint256 run => address[]) internal _gameAttesters; // both founders sign every round
    mapping(uint256 run => bool) internal _hasCase;
    mapping(uint256 run => uint256) public funded; // every deposit into the run's proof fund (ghost)
    uint256 internal constant SELF_PROVER = 6; // the coalition's attester that proves its own round
    uint256 internal constant CONTRIBUTOR = 4; // contributes to a game run's right rounds, then leaves (issue 79)
    uint64 internal constant ONE = 0x3FF0000000000000; // binary64 1.0
    bytes32 internal constant CONTRIBUTION_TYPEHASH = keccak256(
        "Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)"
    );
    TrainingLedger.Record internal _listedRecord; // the last right round listing the contributor's contribution
    bytes internal _listedFactors;
    uint256 public listedRounds;

    constructor(TrainingLedger ledger_) {
        ledger = ledger_;
        _prover = ledger_.prover();
        _relay = new AnswerRelay();
        _castAddresses();
    }

    // ------------------------------------------------------------------------------------------- views

    function violationCount() external view returns (uint256) {
        return violations.length;
    }

    function gameRuns() external view returns (uint256[] memory) {
        return _gameRuns;
    }

    function bondedGameRuns() external view returns (uint256[] memory) {
        return _bondedRuns;
    }

    function caseCount() external view returns (uint256) {
        return _cases.length;
    }

    /// @notice Case `i`'s run, round, whether it ended, and its ghost accounts.
    function caseOf(uint256 i)
        external
        view
        returns (uint256 run, uint64 round, bool ended, uint256 spent, uint256 got, uint256 slashed, uint256 copierGain)
    {
        Case storage c = _cases[i];
        return (c.run, c.round, c.ended, c.spent, c.got, c.slashed, c.copierGain);
    }

    /// @notice Case `i`'s proof-fund accounts (issue 79): the fund when the round fell, what the overturn burned,
    /// whether the coalition's own proof overturned it and what that proof paid the coalition.
    function caseFunds(uint256 i)
        external
        view
        returns (uint256 fundBefore, uint256 burned, bool selfProved, uint256 selfGain)
    {
        Case storage c = _cases[i];
        return (c.fundBefore, c.burned, c.selfProved, c.selfGain);
    }

    /// @dev A case as GameCheck reads it: caseOf's and caseFunds' fields and what its run's fund was given.
    struct CaseView {
        uint256 run;
        uint64 round;
        bool ended;
        uint256 spent;
        uint256 got;
        uint256 slashed;
        uint256 copierGain;
        uint256 fundBefore;
        uint256 burned;
        bool selfProved;
        uint256 selfGain;
        uint256 funded;
    }

    /// @notice Every case (one call for GameCheck's check of them all after every call).
    function caseViews() external view returns (CaseView[] memory out) {
        out = new CaseView[](_cases.length);
        for (uint256 i = 0; i < out.length; ++i) {
            Case storage c = _cases[i];
            out[i] = CaseView(
                c.run, c.round, c.ended, c.spent, c.got, c.slashed, c.copierGain, c.fundBefore, c.burned,
                c.selfProved, c.selfGain, funded[c.run]
            );
        }
    }

    function gameAttesters(uint256 run) external view returns (address[] memory) {
        return _gameAttesters[run];
    }

    // ------------------------------------------------------------------------------------------- helpers

    function _violation(string memory what) internal {
        violations.push(what);
    }

    function _isBonded(TrainingLedger.MemberStatus s) internal pure returns (bool) {
        return s == TrainingLedger.MemberStatus.Active || s == TrainingLedger.MemberStatus.Unbonding;
    }

    /// @dev Let `blocks` blocks pass one at a time; the live prover acts in each.
    function _roll(uint256 blocks) internal {
        for (uint256 i = 0; i < blocks; ++i) {
            vm.roll(block.number + 1);
            _tick();
        }
    }

    function _leafHash(bytes memory leaf) internal pure returns (bytes32) {
        return sha256(abi.encodePacked(bytes1(0x00), leaf));
    }

    /// @dev Chunk `c` (of two) of tree `which` (0 weights, 1 momentum) of a game round: any bytes.
    function _chunk(uint256 which, uint64 round, uint64 c) internal pure returns (bytes memory) {
        return abi.encode("chunk", which, round, c);
    }

    function _chunkRoot(uint256 which, uint64 round) internal pure returns (bytes32) {
        return sha256(abi.encodePacked(bytes1(0x01), _leafHash(_chunk(which, round, 0)), _leafHash(_chunk(which, round, 1))));
    }

    /// @dev Version-3 factors: no contribution (a right round), or one whose scale is 0.5 where the norm rule of its
    /// committed sum (zero, clip off) gives 1.0 (a wrong round, shown by a norm proof of the scales).
    function _factors(bool wrong) internal pure returns (bytes memory) {
        uint256 n = wrong ? 1 : 0;
        bytes32[] memory roots = new bytes32[](n);
        uint64[] memory scales = new uint64[](n);
        if (wrong) scales[0] = HALF;
        return abi.encode(
            uint32(0), uint32(0), false, roots, roots, scales, uint64(0), new uint32[](0), roots,
            new uint256[](3 * n), new address[](n), new bytes32[](2 * n)
        );
    }

    function _stageLeaf(uint64 round, bytes memory factors) internal pure returns (bytes memory) {
        return abi.encode(uint32(0), uint32(2), _chunkRoot(0, round), _chunkRoot(1, round), sha256(factors));
    }

    /// @dev What step `step` of a game on `round` challenges.
    function _stepTarget(uint16 step, uint64 round) internal pure returns (uint256 which, uint64 chunk) {
        if (step == 0) return (STAGE_LEAF, 0);
        if (step == 1) return (FACTORS, 0);
        return (step - 2, round % 2);
    }

    /// @dev The truthful answer to a challenge of (`which`, `chunk`) of a game round: what the coalition withholds.
    function _answerOf(uint256 run, uint64 round, uint256 which, uint64 chunk)
        internal
        view
        returns (bytes memory leaf, bytes32[] memory path)
    {
        bytes memory factors = _factors(_gameWrong[run][round]);
        if (which == STAGE_LEAF) return (_stageLeaf(round, factors), new bytes32[](0));
        if (which == FACTORS) return (factors, new bytes32[](0));
        path = new bytes32[](1);
        path[0] = _leafHash(_chunk(which, round, 1 - chunk));
        leaf = _chunk(which, round, chunk);
    }

    /// @dev A norm proof of the scales of `record` from `stageLeaf` and `factors` (one stage: no stage path).
    function _normProof(
        TrainingLedger.Record memory record,
        bytes memory stageLeaf,
        bytes memory factors,
        address[] memory attesters
    ) internal pure returns (AggregationProver.NormProof memory proof) {
        proof.record = record;
        proof.stageLeaf = stageLeaf;
        proof.factors = factors;
        proof.contribution = type(uint256).max; // SCALES
        proof.attesters = attesters;
    }

    function _stands(uint256 run, uint64 round) internal view returns (bool) {
        uint64 invalidFrom = ledger.runOf(run).invalidFrom;
        return invalidFrom == 0 || invalidFrom > round + 1;
    }

    function _slashable(uint256 run) internal view returns (uint256 total) {
        address[] storage attesters = _gameAttesters[run];
        for (uint256 i = 0; i < attesters.length; ++i) {
            TrainingLedger.Member memory seat = ledger.memberOf(run, attesters[i]);
            if (_isBonded(seat.status)) total += seat.stake;
        }
    }

    // ------------------------------------------------------------------------------------------- the coalition

    /// @notice The coalition commits a round of its run (opening a run first if it has none it can commit in):
    /// right or wrong; the prover starts its game on the run's first wrong round at once.
    function gameCommits(uint256 seed) external {
        ++calls;
        uint256 run = gameRun;
        if (run == 0 || ledger.runOf(run).memberCount < 2 || ledger.runOf(run).invalidFrom != 0) {
            if (_cases.length != 0 && !_cases[_cases.length - 1].ended) return; // one game at a time
            run = _openGameRun(seed);
        }
        uint64 round = ledger.commitCount(run);
        bool wrong = seed % 2 == 0;
        bytes memory leaf = _stageLeaf(round, _factors(wrong));
        TrainingLedger.Record memory record = TrainingLedger.Record(
            run, round, ledger.headOf(run), _leafHash(leaf), keccak256("c"), 1, 1, 1, 1, 0
        );
        vm.prank(who(5));
        try ledger.commitRound(record, signAll(_pair(5, 6), recordDigest(ledger, record))) {} catch {
            return;
        }
        _gameRecords[run][round] = record;
        _gameWrong[run][round] = wrong;
        if (wrong && !_hasCase[run]) {
            _hasCase[run] = true;
            Case storage c = _cases.push();
            c.run = run;
            c.round = round;
            c.copierArmed = (seed >> 1) % 4 != 0; // most often: its proof is the game's last move
            c.squat = (seed >> 6) % 2 == 1; // (seeds below 64: none, nor a self-proof below 256)
            if ((seed >> 7) % 3 == 2) _commitOwnProof(c);
            if ((seed >> 3) % 2 == 0) _leave(run); // the coalition leaves at once (and withdraws when it can)
            _tick();
        }
    }

    function _openGameRun(uint256 seed) internal returns (uint256 run) {
        // The creator's proof fund (issue 79): enough for the reward, none, or less than half the slash.
        uint256 fund = [GAME_FUND, 0, STAKE / 2][(seed >> 4) % 3];
        vm.prank(who(5));
        run = ledger.createRun{value: fund}(runParams(keccak256(abi.encode("game", calls))), "game");
        funded[run] = fund;
        for (uint256 key = 5; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.joinRun{value: STAKE * (key - 3)}(run, bytes32("cpu"));
        }
        _pruneGameRuns();
        gameRun = run;
        _gameRuns.push(run);
        _bondedRuns.push(run);
        _gameAttesters[run] = _addresses(_pair(5, 6));
    }

    /// @notice Anyone tops up a game run's proof fund (fundProofs), or the honest run's, by 0-1 STAKE.
    function anyoneFundsProofs(uint256 seed) external {
        ++calls;
        uint256 run = seed % 2 == 0 && gameRun != 0 ? gameRun : _fundedRun();
        if (run == 0) return;
        uint256 amount = ((seed >> 1) % 3) * (STAKE / 2);
        vm.prank(who(OUTSIDER));
        ledger.fundProofs{value: amount}(run);
        funded[run] += amount;
    }

    /// @dev The run anyoneFundsProofs tops up when it is not the game run (TrustHandler: the honest run).
    function _fundedRun() internal view virtual returns (uint256) {
        return gameRun;
    }

    /// @dev The coalition's proof of its own wrong round (the self-proof of issue 79): it holds the truth.
    function _ownProof(Case storage c) internal view returns (AggregationProver.NormProof memory) {
        bytes memory factors = _factors(true);
        return _normProof(_gameRecords[c.run][c.round], _stageLeaf(c.round, factors), factors, _gameAttesters[c.run]);
    }

    function _commitOwnProof(Case storage c) internal {
        bytes32 proofHash = keccak256(abi.encodeCall(AggregationProver.proveWrongNorm, (_ownProof(c))));
        vm.prank(who(SELF_PROVER));
        _prover.commitProof(keccak256(abi.encode(who(SELF_PROVER), proofHash)));
        c.selfProof = true;
        c.selfCommittedAt = uint64(block.number);
    }

    /// @dev The coalition reveals its own proof in the proof window's first block, before the prover moves.
    function _selfProve(Case storage c) internal {
        (uint64 opensAt,) = ledger.proofWindowOf(c.run, c.round);
        if (block.number <= c.selfCommittedAt || block.number < opensAt || !_stands(c.run, c.round)) return;
        c.selfProof = false; // one try
        uint256 slashable = _slashable(c.run);
        uint256 burnedBefore = ledger.slashedTotal();
        AggregationProver.NormProof memory proof = _ownProof(c); // (sha256, a call: before the prank)
        uint256 before = who(SELF_PROVER).balance;
        vm.prank(who(SELF_PROVER));
        try _prover.proveWrongNorm(proof) {} catch {
            return;
        }
        c.selfProved = true;
        c.selfGain = who(SELF_PROVER).balance - before;
        c.slashed = slashable;
        c.burned = ledger.slashedTotal() - burnedBefore;
        c.fundBefore = funded[c.run];
    }

    /// @dev The round fell to another's proof (the coalition's own): the prover's open step expires (its bonds
    /// back, no reward), or it takes its escrowed bonds back, and its case ends.
    function _afterAnothersProof(Case storage c) internal {
        if (c.open != 0) {
            AggregationProver.Challenge memory challenge = _prover.challengeOf(c.open);
            if (!challenge.settled) {
                if (block.number >= challenge.deadline) _expire(c);
                return;
            }
            c.open = 0;
        }
        uint256 before = who(PROVER).balance;
        vm.prank(who(PROVER));
        try _prover.reclaimBonds(c.run, c.round, 0) {} catch {
            _violation("G7: the prover could not take its bonds back from a round another proved");
        }
        _end(c, 0, before);
    }

    /// @notice Issue 79 point 1, leave racing the commit: a member of the coalition's run contributes to its next
    /// round and leaves before the commit (`seed % 4`: 0, 1 in the commit's block ahead of it, by a higher tip, having
    /// joined a block before or in that block; 2 at once, the round staying open until it withdrew; 3 as 2, then it
    /// rejoins after the commit). The round lists its signed contribution at the right scale (1.0) and is right, so
    /// the outsider's proof of it (the scales' proof, whose binding reads the contributor's seat) must be refused,
    /// now and later (`outsiderProvesAListedRound`).
    function gameContributorLeavesBeforeTheCommit(uint256 seed) external {
        ++calls;
        uint256 run = gameRun;
        if (run == 0 || ledger.runOf(run).invalidFrom != 0 || ledger.commitCount(run) == 0) return;
        if (ledger.memberOf(run, who(CONTRIBUTOR)).status != TrainingLedger.MemberStatus.None) return;
        uint256 how = seed % 4;
        vm.prank(who(CONTRIBUTOR));
        ledger.joinRun{value: STAKE}(run, bytes32("cpu"));
        if (how == 0) _roll(1); // it joined a block before
        uint64 round = ledger.commitCount(run);
        bytes memory factors = _listedFactorsOf(run, round);
        vm.prank(who(CONTRIBUTOR));
        ledger.leaveRun(run);
        if (how >= 2) { // the round stays open until the leaver's stake is out
            _roll(ledger.memberOf(run, who(CONTRIBUTOR)).unbondingEnd - block.number);
            vm.prank(who(CONTRIBUTOR));
            ledger.withdrawStake(run);
        }
        bytes memory leaf = _stageLeaf(round, factors);
        TrainingLedger.Record memory record = TrainingLedger.Record(
            run, round, ledger.headOf(run), _leafHash(leaf), keccak256("c"), 1, 1, 1, 1, 0
        );
        bytes memory signatures = signAll(_pair(5, 6), recordDigest(ledger, record));
        vm.prank(who(5));
        try ledger.commitRound(record, signatures) {} catch {
            return;
        }
        _gameRecords[run][round] = record;
        _listedRecord = record;
        _listedFactors = factors;
        ++listedRounds;
        _proveListed();
        if (how == 3) { // a rejoined seat keeps the withdrawn seat's rounds
            vm.prank(who(CONTRIBUTOR));
            ledger.joinRun{value: STAKE}(run, bytes32("cpu"));
            _proveListed();
        }
    }

    /// @notice The contributor of the last listed round withdraws once due, and the outsider tries its proof again.
    function outsiderProvesAListedRound() external {
        ++calls;
        if (listedRounds == 0) return;
        uint256 run = _listedRecord.runId;
        TrainingLedger.Member memory seat = ledger.memberOf(run, who(CONTRIBUTOR));
        if (seat.status == TrainingLedger.MemberStatus.Unbonding && block.number >= seat.unbondingEnd) {
            vm.prank(who(CONTRIBUTOR));
            try ledger.withdrawStake(run) {} catch {}
        }
        _proveListed();
    }

    function _proveListed() internal {
        TrainingLedger.Record memory record = _listedRecord;
        if (!_stands(record.runId, record.round)) return; // (the run fell at an earlier wrong round)
        (, uint64 closesAt) = ledger.proofWindowOf(record.runId, record.round);
        if (block.number >= closesAt) return;
        AggregationProver.NormProof memory proof = _normProof(
            record, _stageLeaf(record.round, _listedFactors), _listedFactors, _gameAttesters[record.runId]
        );
        try _prover.isWrongNorm(proof) returns (bool wrong) {
            if (wrong) _violation("G7: a right round whose contributor left before its commit would be proven wrong");
        } catch {}
        vm.prank(who(OUTSIDER));
        try _prover.proveWrongNorm(proof) {
            _violation("G7: a right round whose contributor left before its commit was proven wrong");
        } catch {}
    }

    /// @dev Version-3 factors listing CONTRIBUTOR's signed contribution to `round` of `run` at scale 1.0, what the
    /// norm rule of its committed sum (zero, clip off) gives: a right round.
    function _listedFactorsOf(uint256 run, uint64 round) internal view returns (bytes memory) {
        bytes32[] memory roots = new bytes32[](1);
        uint64[] memory scales = new uint64[](1);
        scales[0] = ONE;
        address[] memory contributors = new address[](1);
        contributors[0] = who(CONTRIBUTOR);
        (uint8 v, bytes32 r, bytes32 s) = vm.sign(CONTRIBUTOR, _contributionDigest(run, round));
        bytes32[] memory signature = new bytes32[](2);
        signature[0] = r;
        signature[1] = bytes32(uint256(s) | (uint256(v - 27) << 255)); // EIP-2098
        return abi.encode(
            uint32(0), uint32(0), false, roots, roots, scales, uint64(0), new uint32[](0), roots, new uint256[](3),
            contributors, signature
        );
    }

    /// @dev The EIP-712 digest of CONTRIBUTOR's contribution to stage 0 of `round` (zero roots, steps 0).
    function _contributionDigest(uint256 run, uint64 round) internal view returns (bytes32) {
        return typed(
            ledger,
            keccak256(abi.encode(CONTRIBUTION_TYPEHASH, run, round, uint32(0), bytes32(0), bytes32(0), uint32(0)))
        );
    }

    function _pair(uint256 a, uint256 b) internal pure returns (uint256[] memory keys) {
        keys = new uint256[](2);
        keys[0] = a;
        keys[1] = b;
    }

    /// @notice The coalition meets the prover's game, step after step (two bits of `plan` each): 0 leaves the
    /// step unanswered (the prover expires it); 1 answers it in the last block of its window; 2 the same through a
    /// relay contract; 3 tries junk first (a flipped byte, a wrong path: the contract must refuse each), then
    /// answers in the last block. The live prover follows each answer.
    function gameCoalitionAnswers(uint256 plan) external {
        ++calls;
        for (uint256 i = 0; i <= GAME_STEPS; ++i) {
            if (_cases.length == 0) return;
            Case storage c = _cases[_cases.length - 1];
            if (c.ended || c.open == 0) return;
            uint256 how = plan & 3;
            plan >>= 2;
            if (how == 0) return;
            AggregationProver.Challenge memory challenge = _prover.challengeOf(c.open);
            if (challenge.settled || block.number >= challenge.deadline) return;
            _roll(challenge.deadline - 1 - block.number); // its last block
            (uint256 which, uint64 chunk) = _stepTarget(c.steps - 1, c.round);
            (bytes memory leaf, bytes32[] memory path) = _answerOf(c.run, c.round, which, chunk);
            if (how == 3) _junk(c.open, which, leaf, path);
            _answer(c, which, leaf, path, how == 2);
            if (c.squatOpen != 0) { // and the squatter's copy, keeping its game's clock going
                vm.prank(who(ANSWERER));
                try _prover.answerChallenge(c.squatOpen, leaf, path) {} catch {}
                c.squatOpen = 0;
            }
            _tryWithdraw(c.run, 5); // a coalition that left tries to withdraw at every turn
            _tryWithdraw(c.run, 6);
            _tick();
        }
    }

    function _junk(bytes32 id, uint256 which, bytes memory leaf, bytes32[] memory path) internal {
        bytes memory flipped = bytes.concat(leaf);
        flipped[flipped.length - 1] ^= 0x01;
        bytes32[] memory longer = new bytes32[](path.length + 1);
        vm.startPrank(who(ANSWERER));
        try _prover.answerChallenge(id, flipped, path) {
            _violation("G7: a junk answer (a leaf not committed) was accepted");
        } catch {}
        // (the factors have no path: their preimage alone answers)
        if (which != FACTORS) {
            try _prover.answerChallenge(id, leaf, longer) {
                _violation("G7: a junk answer (a wrong path) was accepted");
            } catch {}
        }
        vm.stopPrank();
    }

    /// @dev Answer the open step (directly or through the relay); the prover reads what it needs from the log.
    function _answer(Case storage c, uint256 which, bytes memory leaf, bytes32[] memory path, bool relayed) internal {
        vm.recordLogs();
        vm.prank(who(ANSWERER));
        if (relayed) {
            try _relay.relay(_prover, c.open, abi.encode(leaf, path)) {} catch {
                _violation("G7: a truthful relayed answer in time was refused");
            }
        } else {
            try _prover.answerChallenge(c.open, leaf, path) {} catch {
                _violation("G7: a truthful answer in time was refused");
            }
        }
        Vm.Log[] memory logs = vm.getRecordedLogs();
        for (uint256 i = 0; i < logs.length; ++i) {
            if (logs[i].emitter != address(_prover) || logs[i].topics.length < 2) continue;
            if (logs[i].topics[0] != AggregationProver.AvailabilityAnswered.selector || logs[i].topics[1] != c.open) {
                continue;
            }
            (bytes memory published,,) = abi.decode(logs[i].data, (bytes, bytes32[], address));
            if (which == STAGE_LEAF) c.stageLeaf = published;
            if (which == FACTORS) c.factors = published;
        }
    }

    /// @notice A coalition founder leaves its game run (once it committed), or withdraws from any it left: a stake
    /// of an attester of a wrong round must never leave before the round falls (unbonding >= the proof window).
    function gameCoalitionLeavesOrWithdraws(uint256 seed) external {
        ++calls;
        uint256 key = 5 + seed % 2;
        for (uint256 g = 0; g < _bondedRuns.length; ++g) { // (the other game runs hold no seat of its)
            uint256 run = _bondedRuns[g];
            TrainingLedger.MemberStatus s = ledger.memberOf(run, who(key)).status;
            if (s == TrainingLedger.MemberStatus.Active && run == gameRun && ledger.commitCount(run) > 0) {
                vm.prank(who(key));
                try ledger.leaveRun(run) {} catch {} // (a halted run)
            } else if (s == TrainingLedger.MemberStatus.Unbonding) {
                _tryWithdraw(run, key);
            }
        }
        _pruneGameRuns();
    }

    /// @dev Drop from `_bondedRuns` each past game run none of whose seats (4-6) is bonded any more.
    function _pruneGameRuns() internal {
        for (uint256 g = _bondedRuns.length; g > 0; --g) {
            uint256 run = _bondedRuns[g - 1];
            if (run == gameRun) continue;
            bool bonded = false;
            for (uint256 key = 4; key <= 6 && !bonded; ++key) bonded = _isBonded(ledger.memberOf(run, who(key)).status);
            if (bonded) continue;
            _bondedRuns[g - 1] = _bondedRuns[_bondedRuns.length - 1];
            _bondedRuns.pop();
        }
    }

    function _leave(uint256 run) internal {
        for (uint256 key = 5; key <= 6; ++key) {
            vm.prank(who(key));
            ledger.leaveRun(run);
        }
    }

    /// @dev `key` tries to take its stake out of `run`: never while the run's first wrong round stands.
    function _tryWithdraw(uint256 run, uint256 key) internal {
        if (ledger.memberOf(run, who(key)).status != TrainingLedger.MemberStatus.Unbonding) return;
        vm.prank(who(key));
        try ledger.withdrawStake(run) {
            if (_hasCase[run] && _firstWrongStands(run)) {
                _violation("G7: an attester of a wrong round withdrew before it was proven");
            }
        } catch {}
    }

    function _firstWrongStands(uint256 run) internal view returns (bool) {
        for (uint256 i = _cases.length; i > 0; --i) {
            if (_cases[i - 1].run == run) return _stands(run, _cases[i - 1].round);
        }
        return false;
    }

    // ------------------------------------------------------------------------------------------- the prover

    /// @dev The live prover's move in this block: follow its game on the case in flight (the next step, an
    /// unanswered step expired), then commit its proof and send it a block later.
    function _tick() internal {
        if (_cases.length == 0) return;
        Case storage c = _cases[_cases.length - 1];
        if (c.ended) return;
        if (c.selfProof) _selfProve(c);
        if (c.selfProved) return _afterAnothersProof(c);
        if (c.open != 0) {
            AggregationProver.Challenge memory challenge = _prover.challengeOf(c.open);
            if (!challenge.settled) {
                if (block.number >= challenge.deadline) _expire(c);
                return;
            }
            c.open = 0;
        }
        if (c.steps < GAME_STEPS) return _challenge(c);
        AggregationProver.NormProof memory proof =
            _normProof(_gameRecords[c.run][c.round], c.stageLeaf, c.factors, _gameAttesters[c.run]);
        if (c.committedAt == 0) {
            bytes32 proofHash = keccak256(abi.encodeCall(AggregationProver.proveWrongNorm, (proof)));
            vm.prank(who(PROVER));
            _prover.commitProof(keccak256(abi.encode(who(PROVER), proofHash)));
            c.committedAt = uint64(block.number);
            return;
        }
        (uint64 opensAt,) = ledger.proofWindowOf(c.run, c.round);
        if (block.number > c.committedAt && block.number >= opensAt) _reveal(c, proof);
    }

    function _challenge(Case storage c) internal {
        AggregationProver.Target memory target;
        target.record = _gameRecords[c.run][c.round];
        target.stageLeaf = c.stageLeaf;
        target.factors = c.factors;
        (target.which, target.chunk) = _stepTarget(c.steps, c.round);
        if (c.squat) { // seen in the mempool, the squatter's copy of the step is mined first, in its own game
            vm.prank(who(COPIER));
            try _prover.challengeAvailability{value: BOND}(target) returns (bytes32 id) {
                c.squatOpen = id;
            } catch {}
        }
        vm.prank(who(PROVER));
        try _prover.challengeAvailability{value: BOND}(target) returns (bytes32 id) {
            c.open = id;
            c.steps += 1;
            c.spent += BOND;
        } catch {
            _violation("G7: the live prover could not open its game's next step");
            c.ended = true;
        }
    }

    function _expire(Case storage c) internal {
        uint256 slashable = _slashable(c.run);
        uint256 before = who(PROVER).balance;
        uint256 burnedBefore = ledger.slashedTotal();
        vm.prank(who(PROVER));
        try _prover.expireChallenge(c.open, _gameAttesters[c.run]) {} catch {
            _violation("G7: the live prover could not expire an unanswered step");
        }
        if (!c.selfProved) c.burned = ledger.slashedTotal() - burnedBefore;
        c.open = 0;
        _end(c, slashable, before);
    }

    function _reveal(Case storage c, AggregationProver.NormProof memory proof) internal {
        uint256 slashable = _slashable(c.run);
        uint256 before = who(PROVER).balance;
        uint256 copierBefore = who(COPIER).balance;
        uint256 burnedBefore = ledger.slashedTotal();
        if (c.copierArmed) { // the copy, with a higher tip, is mined first
            vm.prank(who(COPIER));
            try _prover.proveWrongNorm(proof) {} catch {}
        }
        vm.prank(who(PROVER));
        try _prover.proveWrongNorm(proof) {} catch {
            // Overturned by the copy: its reward is held for the earlier committer (none where every attester
            // was slashed before, by its equivocation: the overturn slashed nothing).
            if (_prover.claimOf(c.run, c.round).reward != 0) {
                vm.prank(who(PROVER));
                try _prover.claimReward(c.run, c.round) {} catch {
                    _violation("G7: the prover could not claim the reward a copy of its proof left held");
                }
            }
        }
        if (c.copierArmed) {
            vm.prank(who(COPIER));
            try _prover.claimReward(c.run, c.round) {} catch {}
            c.copierGain = who(COPIER).balance - copierBefore;
        }
        c.burned = ledger.slashedTotal() - burnedBefore;
        vm.prank(who(PROVER));
        try _prover.reclaimBonds(c.run, c.round, 0) {} catch {}
        _end(c, slashable, before);
    }

    function _end(Case storage c, uint256 slashable, uint256 before) internal {
        c.ended = true;
        c.got += who(PROVER).balance - before;
        if (!c.selfProved && !_stands(c.run, c.round)) {
            c.slashed = slashable;
            c.fundBefore = funded[c.run];
        }
        if (gameRun == c.run) gameRun = 0;
    }
}

/// @notice G7 over TrustGame's cases (TrustInvariants.t.sol and GameInvariants.t.sol): every wrong round overturned
/// within its proof window, every attester slashed and the slash burned whole; whoever proved it (the prover, or the
/// coalition itself: the self-proof of issue 79) paid min(the run's proof fund, half the slash) from the fund; the
/// prover at no net cost (every bond back); a copier of its proof paid nothing.
abstract contract GameCheck is TrustBase {
    /// @dev (Every case read in one call; the assertion cheatcodes called only on a failure: the same checks.)
    function checkGameCases(TrustGame game, TrainingLedger ledger_) internal view {
        TrustGame.CaseView[] memory cases = game.caseViews();
        for (uint256 i = 0; i < cases.length; ++i) {
            TrustGame.CaseView memory c = cases[i];
            if (!c.ended) {
                (, uint64 closesAt) = ledger_.proofWindowOf(c.run, c.round);
                if (block.number >= closesAt) vm.assertTrue(false, "G7: a wrong round outlived its proof window");
                continue;
            }
            uint64 invalidFrom = ledger_.runOf(c.run).invalidFrom;
            if (invalidFrom == 0 || invalidFrom > c.round + 1) {
                vm.assertTrue(false, "G7: a wrong round stands after its game");
            }
            address[] memory attesters = game.gameAttesters(c.run);
            for (uint256 a = 0; a < attesters.length; ++a) {
                if (ledger_.memberOf(c.run, attesters[a]).status != TrainingLedger.MemberStatus.Slashed) {
                    vm.assertTrue(false, "G7: an attester of a wrong round kept its stake");
                }
            }
            _checkPaid(ledger_, c);
            if (c.copierGain != 0) vm.assertEq(c.copierGain, 0, "G7: a copier of the proof was paid");
        }
    }

    /// @dev Case `c`'s money: the slash burned whole, the reward min(fund, half the slash) from the fund.
    function _checkPaid(TrainingLedger ledger_, TrustGame.CaseView memory c) private view {
        uint256 reward = c.slashed / 2 < c.fundBefore ? c.slashed / 2 : c.fundBefore;
        if (c.burned != c.slashed) vm.assertEq(c.burned, c.slashed, "G7: the slash was not burned whole");
        uint256 owed = c.spent + (c.selfProved ? 0 : reward);
        if (c.got != owed) vm.assertEq(c.got, owed, "G7: the prover did not get its bonds back and its reward");
        uint256 gain = c.selfProved ? reward : 0;
        if (c.selfGain != gain) {
            vm.assertEq(c.selfGain, gain, "G7: a self-proof paid other than min(fund, half the slash)");
        }
        uint256 fund = ledger_.proofFundOf(c.run);
        if (fund != c.funded - reward) {
            vm.assertEq(fund, c.funded - reward, "G7: the reward was not paid from the proof fund");
        }
    }
}
