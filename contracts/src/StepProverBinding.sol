// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {LedgerCore} from "./LedgerCore.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {StepProver} from "./StepProver.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title StepProverBinding
/// @notice What binds a run claim (StepProver.claimRun, issue 78) to the ledger's record, as the fraud proofs bind
/// a round's contributions (docs/FRAUD_PROOF.md "The binding"): the claim's `payloadRoot` is a contribution the
/// committed record of its round lists for its stage (its factors' `payloadRoots`, each signed by its member in a
/// normed run), and its `startWeights` is the weights root the round starts from for that stage (round - 1's
/// committed stage leaf, or the run's genesis for round 0). A linked library (DELEGATECALL), like StepProverMath.
/// @dev Reverts with AggregationProver's errors for the records' openings (the ones its proofs give), and with
/// StepProver's for a contribution not listed or a start not the round's.
library StepProverBinding {
    /// @dev What a later stage's contributor signs of its replica's data key (ledger/stepbinding.py
    /// `DATA_KEY_TYPE`; docs/FRAUD_PROOF.md "The replica's key").
    bytes32 internal constant DATA_KEY_TYPEHASH =
        keccak256("DataKey(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,address dataKey)");
    /// @dev What the replica's stage-0 member (the data key) counter-signs: `member` runs stage `stage` of its
    /// replica in round `round` (ledger/stepbinding.py `PARTNER_TYPE`; docs/FRAUD_PROOF.md "The replica's key").
    bytes32 internal constant PARTNER_TYPEHASH =
        keccak256("ReplicaPartner(uint256 runId,uint64 round,uint32 stage,address member)");

    /// @notice Reverts unless `run`'s subject is on `ledger`'s record, as `b` opens it.
    function check(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        public
        view
    {
        uint32 numStages = _listed(ledger, run, b);
        (uint64 startRound, bytes32 startRoot) = _startRoot(ledger, run, b);
        (AggregationProver.StageLeaf memory start, bool good) =
            ProverCommon.openStageLeaf(b.prevStageLeaf, b.prevStagePath, startRoot, startRound, run.stage, numStages);
        if (!good || start.weightsRoot != run.startWeights) {
            revert StepProver.ProverStepWrongStart(run.runId, run.round, run.stage, run.startWeights);
        }
    }

    /// @notice StepProver.claimRun: its checks (its bond sent, its shape, its round's proof window, the run's
    /// program and step count, the binding, an open case's deadline), its count, and the claim, stored.
    function register(
        TrainingLedger ledger,
        mapping(bytes32 => StepProver.Case) storage cases,
        mapping(uint256 => bytes32) storage programs,
        mapping(bytes32 => StepProver.Claim) storage claims,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(uint256 => StepProver.DataTerms) storage data,
        StepProver.RunClaim calldata run,
        StepProver.RunBinding calldata b,
        uint256 bond,
        uint64 clock
    ) external returns (bytes32 claimId) {
        uint64 closesAt;
        (bond, clock, closesAt) = _terms(ledger, run, bond, clock);
        if (run.steps == 0 || run.ops == 0 || run.depth > 32
            || uint256(run.stateLeaves) + run.ops > (uint256(1) << run.depth)) {
            revert StepProver.ProverStepBadOp();
        }
        if (block.number >= closesAt) revert StepProver.ProverStepWindowClosed(run.runId, run.round, closesAt);
        _program(programs, run);
        check(ledger, run, b);
        // The steps: the ones the contribution declares (a run bounded by time: its member signed them and the
        // factors list them), else the run's innerSteps H.
        uint32 steps = _declaredSteps(b.factors, b.index);
        if (steps == 0) steps = ledger.runOf(run.runId).innerSteps;
        if (run.steps != steps) revert StepProver.ProverStepWrongSteps(run.runId, steps, run.steps);
        // The data key: the replica's (its stage-0 member's), else none; checked where the run's data is bound
        // (without terms, fixed before the first commit only, no claim's batches are ever disputed).
        if (data[run.runId].root != bytes32(0)) {
            address key = _dataKey(ledger, run, b);
            if (run.dataKey != key) revert StepProver.ProverStepWrongDataKey(key, run.dataKey);
        }
        StepProver.Case storage k = cases[keccak256(abi.encode(run.runId, run.round, run.stage, run.payloadRoot))];
        if (k.opener != address(0) && block.number >= k.deadline) {
            revert StepProver.ProverStepClaimsClosed(
                keccak256(abi.encode(run.runId, run.round, run.stage, run.payloadRoot)), k.deadline
            );
        }
        ++k.claims;
        claimId = keccak256(abi.encode(run, msg.sender));
        if (claims[claimId].defender != address(0)) revert StepProver.ProverStepClaimClosed();
        claims[claimId] = StepProver.Claim(msg.sender, false, false, clock, bond);
        runs[claimId] = run;
        emit StepProver.RunClaimed(claimId, run.runId, run.round, run.stage, run.payloadRoot, msg.sender);
    }

    /// @notice StepProver.commitCase.
    function commit(mapping(bytes32 => uint64) storage commits, bytes32 commitment) external {
        if (commits[commitment] != 0) return;
        commits[commitment] = uint64(block.number);
        emit StepProver.CaseCommitted(commitment, msg.sender);
    }

    /// @notice StepProver.setProgram: `programHash` and `originRoot` become run `runId`'s, if the sender created the run, the run
    /// has no program yet and no round is committed (else `ProverStepProgramFixed`).
    function setProgram(
        TrainingLedger ledger,
        mapping(uint256 => bytes32) storage programs,
        mapping(uint256 => bytes32) storage origins,
        uint256 runId,
        bytes32 programHash,
        bytes32 originRoot
    ) external {
        TrainingLedger.Run memory r = ledger.runOf(runId);
        if (msg.sender != r.creator || r.commitCount != 0 || programs[runId] != bytes32(0) || programHash == 0) {
            revert StepProver.ProverStepProgramFixed(runId, msg.sender);
        }
        programs[runId] = programHash;
        origins[runId] = originRoot;
        emit StepProver.ProgramRegistered(runId, programHash, originRoot);
    }

    /// @notice StepProver.setEndRule: `rule` (1, the plain end) becomes run `runId`'s, under setProgram's terms
    /// (its creator, once, before its first commit; else `ProverStepProgramFixed`).
    function setEndRule(TrainingLedger ledger, mapping(uint256 => uint8) storage ends, uint256 runId, uint8 rule)
        external
    {
        TrainingLedger.Run memory r = ledger.runOf(runId);
        if (msg.sender != r.creator || r.commitCount != 0 || ends[runId] != 0 || rule != 1) {
            revert StepProver.ProverStepProgramFixed(runId, msg.sender);
        }
        ends[runId] = rule;
        emit StepProver.EndRuleFixed(runId, rule);
    }

    /// @notice StepProver.setData: `terms` become run `runId`'s data, under setProgram's terms (its creator, once,
    /// before its first commit; else `ProverStepProgramFixed`); terms whose root is zero, with no rows or no
    /// window start (`tokens <= window`) are refused (`ProverStepDataUnbound`).
    function setData(
        TrainingLedger ledger,
        mapping(uint256 => StepProver.DataTerms) storage data,
        uint256 runId,
        StepProver.DataTerms calldata terms
    ) external {
        TrainingLedger.Run memory r = ledger.runOf(runId);
        if (msg.sender != r.creator || r.commitCount != 0 || data[runId].root != bytes32(0)) {
            revert StepProver.ProverStepProgramFixed(runId, msg.sender);
        }
        if (terms.root == bytes32(0) || terms.rows == 0 || terms.tokens <= terms.window) {
            revert StepProver.ProverStepDataUnbound(runId);
        }
        data[runId] = terms;
        emit StepProver.DataFixed(runId, terms.root, terms.seed, terms.tokens, terms.rows, terms.window);
    }

    /// @notice StepProver.withdraw: the sender's balance, sent.
    function withdraw(mapping(address => uint256) storage balances) external {
        uint256 amount = balances[msg.sender];
        balances[msg.sender] = 0;
        (bool ok,) = msg.sender.call{value: amount}("");
        require(ok);
    }

    /// @notice StepProver.openCase.
    function openCase(
        TrainingLedger ledger,
        mapping(bytes32 => StepProver.Case) storage cases,
        mapping(bytes32 => uint64) storage commits,
        mapping(uint256 => bytes32) storage programs,
        StepProver.RunClaim calldata run,
        StepProver.RunBinding calldata b,
        bytes32 salt,
        uint256 bond,
        uint64 clock
    ) external returns (bytes32 key) {
        uint256 stake;
        uint64 closesAt;
        (stake, clock, closesAt) = _terms(ledger, run, bond, clock);
        // Without the run's program no claim could defend the contribution: a case would overturn any round.
        if (programs[run.runId] == bytes32(0)) revert StepProver.ProverStepNoProgram(run.runId);
        check(ledger, run, b);
        key = keccak256(abi.encode(run.runId, run.round, run.stage, run.payloadRoot));
        bytes32 commitment = keccak256(abi.encode(msg.sender, key, salt));
        uint64 committedAt = commits[commitment];
        if (committedAt == 0 || committedAt >= block.number) revert StepProver.ProverStepNotCommitted(commitment);
        StepProver.Case storage k = cases[key];
        if (k.opener != address(0)) revert StepProver.ProverStepCaseOpen(key);
        k.deadline = uint64(block.number) + clock;
        k.ends = k.deadline + 3 * clock + 1;
        if (k.ends >= closesAt) revert StepProver.ProverStepWindowClosed(run.runId, run.round, closesAt);
        k.opener = msg.sender;
        k.round = run.round;
        k.runId = run.runId;
        k.stake = stake;
        emit StepProver.CaseOpened(key, run.runId, run.round, run.stage, run.payloadRoot, msg.sender, k.deadline);
    }

    /// @notice StepProver.overturnContribution.
    function overturn(
        TrainingLedger ledger,
        mapping(bytes32 => StepProver.Case) storage cases,
        mapping(address => uint256) storage balances,
        bytes32 key,
        address[] calldata attesters
    ) external returns (uint256) {
        StepProver.Case storage k = cases[key];
        address opener = k.opener;
        if (opener == address(0)) revert StepProver.ProverStepNoCase(key);
        if (block.number < k.deadline) revert StepProver.ProverStepCaseRunning(key, k.deadline);
        if (k.refuted != k.claims) revert StepProver.ProverStepClaimStands(key, k.claims, k.refuted);
        k.opener = address(0);
        balances[opener] += k.stake;
        emit StepProver.ContributionOverturned(key, k.runId, k.round, opener);
        return ledger.prover().overturnByStep(k.runId, k.round, attesters, opener);
    }

    /// @notice StepProver.dismissCase.
    function dismiss(
        mapping(bytes32 => StepProver.Case) storage cases,
        mapping(bytes32 => StepProver.Claim) storage claims,
        mapping(bytes32 => StepProver.RunClaim) storage runs,
        mapping(address => uint256) storage balances,
        bytes32 key,
        bytes32 claimId
    ) external {
        StepProver.Case storage k = cases[key];
        if (k.opener == address(0)) revert StepProver.ProverStepNoCase(key);
        if (block.number < k.ends) revert StepProver.ProverStepCaseRunning(key, k.ends);
        StepProver.RunClaim storage run = runs[claimId];
        StepProver.Claim storage c = claims[claimId];
        if (c.wrong || run.steps == 0 || keccak256(abi.encode(run.runId, run.round, run.stage, run.payloadRoot)) != key) {
            revert StepProver.ProverStepClaimClosed();
        }
        k.opener = address(0);
        balances[c.defender] += k.stake;
        emit StepProver.CaseDismissed(key, claimId, c.defender);
    }

    /// @dev A run claim is about the run's program (`StepProver.setProgram`), run for the contribution's steps
    /// (`register`): a claim about any other computation is refused, so a claim that stands is one about the
    /// run's program.
    function _program(mapping(uint256 => bytes32) storage programs, StepProver.RunClaim calldata run)
        private
        view
    {
        bytes32 programHash = keccak256(abi.encode(run.programRoot, run.stateLeaves, run.ops, run.depth));
        bytes32 expected = programs[run.runId];
        if (expected == bytes32(0)) revert StepProver.ProverStepNoProgram(run.runId);
        if (programHash != expected) revert StepProver.ProverStepWrongProgram(run.runId, programHash);
    }

    /// @dev The inner steps contribution `index` of version-3 `factors` declares (its signed `Contribution.steps`,
    /// listed beside its payload root in a run bounded by time); zero where the factors list none (a fixed-H run,
    /// or version 2, whose first list starts at 192, not at version 3's 384).
    function _declaredSteps(bytes calldata factors, uint256 index) private pure returns (uint32) {
        if (factors.length < 128 || uint256(bytes32(factors[96:128])) != 384) return 0;
        (,,,,,,, uint32[] memory steps) =
            abi.decode(factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[], uint64, uint32[]));
        return index < steps.length ? steps[index] : 0;
    }

    /// @dev The member account version-3 `factors` list for contribution `index` (its EIP-712 signer, which the
    /// aggregation proof's binding checks); zero where the factors list none (version 2).
    function _contributor(bytes calldata factors, uint256 index) private pure returns (address) {
        if (factors.length < 128 || uint256(bytes32(factors[96:128])) != 384) return address(0);
        (,,,,,,,,,, address[] memory contributors) = abi.decode(
            factors,
            (uint32, uint32, bool, bytes32[], bytes32[], uint64[], uint64, uint32[], bytes32[], uint256[], address[])
        );
        return index < contributors.length ? contributors[index] : address(0);
    }

    /// @dev The replica's data key of a run claim's contribution (docs/FRAUD_PROOF.md "The replica's key"): for
    /// stage 0 the member the factors list for it (zero where they list none: version 2); for a later stage the
    /// member the same round's stage-0 factors list at `b.replica.index`, which the stage's own listed member
    /// signed as its replica's key (`DataKey`) and which counter-signed that member as its partner at the stage
    /// in the round (`ReplicaPartner`); else `ProverStepWrongReplica`. A stage leaf or factors that do not open
    /// revert with AggregationProver's errors.
    function _dataKey(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        private
        view
        returns (address key)
    {
        address member = _contributor(b.factors, b.index);
        if (run.stage == 0 || member == address(0)) return member;
        bytes calldata p = b.replica;
        if (p.length < 256) revert StepProver.ProverStepWrongReplica(member, address(0));
        _openStageZero(ledger, run, b);
        key = _contributor(_bytesAt(p, 64), ProverCommon.word(p, 96));
        bytes32 keyHash =
            keccak256(abi.encode(DATA_KEY_TYPEHASH, run.runId, run.round, run.stage, run.payloadRoot, key));
        bytes32 partnerHash = keccak256(abi.encode(PARTNER_TYPEHASH, run.runId, run.round, run.stage, member));
        if (
            key == address(0) || _signer(ledger, keyHash, p, 128) != member
                || _signer(ledger, partnerHash, p, 192) != key
        ) {
            revert StepProver.ProverStepWrongReplica(member, key);
        }
    }

    /// @dev Reverts unless `b.replica` opens the claim's round's stage-0 leaf under the record's weightsRoot and
    /// its factors.
    function _openStageZero(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        private
        view
    {
        (AggregationProver.StageLeaf memory leaf, bool ok) = ProverCommon.openStageLeaf(
            _bytesAt(b.replica, 0), _pathOf(b.replica), b.record.weightsRoot, run.round, 0,
            ledger.runOf(run.runId).numStages
        );
        if (!ok) revert AggregationProver.ProverBadStageLeaf(run.round, 0);
        if (sha256(_bytesAt(b.replica, 64)) != leaf.factorsHash) {
            revert AggregationProver.ProverBadFactors(run.round, 0);
        }
    }

    /// @dev The stage-0 leaf's path of replica binding `p` (its second field).
    function _pathOf(bytes calldata p) private pure returns (bytes32[] calldata path) {
        bytes calldata words = _bytesAt(p, 32);
        assembly ("memory-safe") {
            path.offset := words.offset
            path.length := shr(5, words.length)
        }
    }

    /// @dev The dynamic field whose offset is at `head` of ABI-encoded `data`: a byte string, or a bytes32 array's
    /// words (its length counts words); a field that overruns `data` reverts (the slice's bounds).
    function _bytesAt(bytes calldata data, uint256 head) private pure returns (bytes calldata) {
        uint256 offset = ProverCommon.word(data, head);
        uint256 length = ProverCommon.word(data, offset);
        if (head == 32) length *= 32;
        return data[offset + 32:offset + 32 + length];
    }

    /// @dev The account whose EIP-2098 signature (replica binding `p`'s words `r` at `head`, `vs` after it) signed
    /// the EIP-712 message `structHash` (domain: the ledger); zero for none or a malleable one (a high s).
    function _signer(TrainingLedger ledger, bytes32 structHash, bytes calldata p, uint256 head)
        private
        view
        returns (address)
    {
        uint256 vs = ProverCommon.word(p, head + 32);
        uint256 s = vs & (type(uint256).max >> 1);
        if (s > LedgerCore.MAX_S) return address(0);
        bytes32 digest = LedgerCore.typedDigest(LedgerCore.domainSeparator(address(ledger)), structHash);
        return ecrecover(digest, uint8(27 + (vs >> 255)), bytes32(ProverCommon.word(p, head)), bytes32(s));
    }

    /// @dev A run claim's or a case's stake and clock: StepProver's own (`bond`, `clock`) where set, else the
    /// run's (its `bond`, its `accusationBlocks`), and the end of its round's proof window (proofWindowOf); the
    /// value sent must be the stake.
    function _terms(TrainingLedger ledger, StepProver.RunClaim calldata run, uint256 bond, uint64 clock)
        private
        view
        returns (uint256, uint64, uint64 closesAt)
    {
        if (bond == 0 || clock == 0) {
            TrainingLedger.Run memory r = ledger.runOf(run.runId);
            if (bond == 0) bond = r.bond;
            if (clock == 0) clock = r.accusationBlocks;
        }
        if (msg.value != bond) revert StepProver.ProverStepBondMismatch(bond, msg.value);
        (, closesAt) = ledger.proofWindowOf(run.runId, run.round);
        return (bond, clock, closesAt);
    }

    /// @dev The run's stage count, once the claim's payload root is listed by its round's committed record.
    function _listed(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        private
        view
        returns (uint32 numStages)
    {
        TrainingLedger.Record calldata record = b.record;
        if (record.runId != run.runId || record.round != run.round) {
            revert AggregationProver.ProverBadRecords(run.runId, b.prevRecord.round, record.round);
        }
        ProverCommon.requireCommitted(ledger, record);
        numStages = ledger.runOf(run.runId).numStages;
        if (run.stage >= numStages) revert AggregationProver.ProverBadStage(run.stage, numStages);
        (AggregationProver.StageLeaf memory leaf, bool ok) =
            ProverCommon.openStageLeaf(b.stageLeaf, b.stagePath, record.weightsRoot, run.round, run.stage, numStages);
        if (!ok) revert AggregationProver.ProverBadStageLeaf(run.round, run.stage);
        if (sha256(b.factors) != leaf.factorsHash) revert AggregationProver.ProverBadFactors(run.round, run.stage);
        // The payload roots are the fifth field of version-2 and version-3 factors alike.
        (,,,, bytes32[] memory payloadRoots) = abi.decode(b.factors, (uint32, uint32, bool, bytes32[], bytes32[]));
        if (b.index >= payloadRoots.length || payloadRoots[b.index] != run.payloadRoot) {
            revert StepProver.ProverStepNotListed(run.runId, run.round, run.stage, run.payloadRoot);
        }
    }

    /// @dev The tree the round's start stage leaf is under: round - 1's committed weightsRoot, or the run's genesis.
    function _startRoot(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        private
        view
        returns (uint64 startRound, bytes32 startRoot)
    {
        if (run.round == 0) {
            startRoot = ledger.valuesOf(run.runId).genesisRoot;
            if (startRoot == bytes32(0)) revert AggregationProver.ProverNoGenesis(run.runId);
            return (0, startRoot);
        }
        startRound = run.round - 1;
        if (b.prevRecord.runId != run.runId || b.prevRecord.round != startRound) {
            revert AggregationProver.ProverBadRecords(run.runId, b.prevRecord.round, run.round);
        }
        ProverCommon.requireCommitted(ledger, b.prevRecord);
        startRoot = b.prevRecord.weightsRoot;
    }
}
