// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {ProverAvailability} from "./ProverAvailability.sol";
import {ProverBinding} from "./ProverBinding.sol";
import {ProverChunks} from "./ProverChunks.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {ProverNorms} from "./ProverNorms.sol";
import {StepProver} from "./StepProver.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title AggregationProver
/// @notice The on-chain fraud proof of a wrong aggregation (issue 43; docs/FRAUD_PROOF.md). Anyone, staked or
/// not, shows that one chunk of one stage of a committed round is not the outer step of its committed inputs;
/// the contract recomputes the chunk in IEEE-754 binary32 exactly as training/diloco.py does and, if any element
/// differs, has its TrainingLedger invalidate the round and every later one, slash every attester of the round
/// and pay the prover half of what was slashed.
/// @dev Deployed by its TrainingLedger's constructor (`TrainingLedger.prover()`), so the ledger trusts exactly
/// this code. Commitments (ledger/chunkproof.py, training/chunks.py): the record's weightsRoot is the Merkle
/// root over stage leaves abi.encode(uint32 stage, uint32 numChunks, bytes32 weightsRoot, bytes32 momentumRoot,
/// bytes32 factorsHash); every tree is ledger/merkle.py's (sha256, 0x00 leaf and 0x01 inner prefixes, odd nodes
/// promoted), a path's shape follows from the leaf's index and the tree's leaf count.
/// The work is in linked libraries run in this contract's context (DELEGATECALL): ProverChunks (the chunk proof),
/// ProverNorms (the norm proof) and ProverAvailability (the availability game); their events and errors are
/// declared here.
contract AggregationProver {
    /// @notice One leaf of a tree and the sibling hashes from it up.
    struct Opening {
        bytes leaf;
        bytes32[] path;
    }

    /// @notice Everything a proof opens (ledger/chunkproof.py, AggregationProof).
    struct Proof {
        TrainingLedger.Record prevRecord; // the committed record of round t - 1
        TrainingLedger.Record record; // the committed record of round t, the one proven wrong
        uint32 stage;
        uint64 chunk;
        bytes prevStageLeaf; // stage leaf of round t - 1, under prevRecord.weightsRoot
        bytes32[] prevStagePath;
        bytes stageLeaf; // stage leaf of round t, under record.weightsRoot
        bytes32[] stagePath;
        bytes factors; // preimage of the stage leaf's factorsHash
        Opening prevWeights; // chunk `chunk` of round t - 1's weights
        Opening prevMomentum;
        Opening newWeights; // chunk `chunk` of round t's committed weights
        Opening newMomentum;
        Opening[] pieces; // chunk `chunk` of each accepted contribution's payload, in the factors' order
        // issue 62: the run's schedule leaf of round t (RunParams.scheduleRoot; round min(t, scheduleRounds - 1)):
        // abi.encode(uint64 round, uint32 lrBits, uint32 muBits), and its path. Empty in a run without a schedule.
        bytes scheduleLeaf;
        bytes32[] schedulePath;
        address[] attesters; // round t's attesters as RoundCommitted gave them
    }

    /// @notice A proof that a version-3 round's committed clip scales are not the norm rule of its committed
    /// squared norms (`contribution == SCALES`), or that one chunk of contribution `contribution`'s sum tree is
    /// not the sum of squares of its committed piece or does not sum to the committed total (docs/FRAUD_PROOF.md).
    struct NormProof {
        TrainingLedger.Record record; // the committed record of round t
        uint32 stage;
        bytes stageLeaf; // under record.weightsRoot
        bytes32[] stagePath;
        bytes factors; // version 3: the preimage of the stage leaf's factorsHash
        uint256 contribution; // SCALES, or the index j of an accepted contribution
        uint64 chunk; // (a sum-tree proof) the chunk opened
        Opening weights; // chunk `chunk` of round t's weights: its header places the chunk
        Opening piece; // chunk `chunk` of contribution j's payload
        bytes sumLeaf; // the committed sum of squares of the chunk: 96 bytes, (hi, mid, lo)
        bytes32[] sumPath; // per level with a sibling: its hash, then its sum's hi, mid, lo
        address[] attesters; // round t's attesters as RoundCommitted gave them
    }

    /// @dev A version-3 factors' norm commitment, located in the factors' calldata (docs/FRAUD_PROOF.md).
    struct Norms {
        uint64 clip; // the run's norm_clip, binary64
        uint256 count; // the accepted contributions
        uint256 stepsAt; // where each list's first element is in the factors (0 steps: fixed H)
        uint256 steps;
        uint256 rootsAt;
        uint256 sumsAt;
        uint256 maxRank; // the run's (RunParams.maxRank): a piece of a higher rank does not decode
        uint256 payloadRootsAt;
        uint256 contributorsAt; // the binding (issue 62): each contribution's member account
        uint256 signaturesAt; // and its EIP-2098 signature (r, vs: two words) of the Contribution message
    }

    /// @notice What a data-availability challenge names: one committed leaf of one stage of a committed round.
    struct Target {
        TrainingLedger.Record record;
        uint32 stage;
        bytes stageLeaf; // under record.weightsRoot
        bytes32[] stagePath;
        bytes factors; // the stage leaf's factors
        // 0: the new weights, 1: the new momentum, 2 + j: accepted contribution j's payload, 2 + M + j (M accepted,
        // version-3 factors): contribution j's sum tree; 2^256 - 2: the factors themselves (the preimage of the
        // stage leaf's factorsHash; chunk 0, factors not read); STAGE_LEAF: the stage leaf (then stageLeaf,
        // stagePath and factors are not read, and chunk must be the stage)
        uint256 which;
        uint64 chunk;
    }

    /// @notice An open or settled data-availability challenge.
    struct Challenge {
        address challenger;
        uint64 deadline; // first block at which an unanswered challenge can be expired
        uint32 numChunks; // 0: the factors (answered by their preimage of root)
        bool settled; // answered, or expired
        bool sums; // the tree is a sum tree (ledger/normproof.py): its leaves open as a NormProof's sum leaf
        uint64 round;
        uint64 chunk; // the leaf's index in the tree
        bytes32 root; // the tree the leaf must be opened in
        uint256 runId;
        uint256 bond;
        uint32 stage; // issue 62: the game (round, stage, challenger) the challenge is a step of
    }

    /// @notice One challenger's availability game on one stage of one round (issue 62, the chess clock): its
    /// challenges are its steps; each answer gives the challenger `accusationBlocks` to open the next step, even
    /// after the round's dispute window; at most the run's `maxGameSteps` steps.
    struct Game {
        uint16 steps; // challenges opened
        uint64 continueBy; // first block at which no further step may be opened after the dispute window
        uint128 escrow; // bonds of its answered steps: back to the challenger if the round falls, else burned
    }

    /// @notice A fraud proof's reward held for its claim window (the proof came without a matured commitment).
    struct Claim {
        address prover; // who sent the proof: takes the reward once the claim window is over
        uint64 provenAt; // the proof's block: an earlier commitment of the same proof claims it first
        uint64 deadline; // first block at which `prover` may take it
        uint128 reward;
        bytes32 proofHash; // keccak256 of the proof's calldata
    }

    /// @notice The prover's state, one struct so that its libraries take it by reference.
    struct ProverState {
        mapping(bytes32 id => Challenge) challenges;
        mapping(bytes32 game => Game) games;
        // 1 + the last block at which a step of a game on the round can still be answered or continued, or an
        // unanswered step expired: the round's proofs and its finality wait for it (0: no game).
        mapping(uint256 runId => mapping(uint64 round => uint64)) liveUntil;
        mapping(bytes32 commitment => uint64 blockNumber) proofCommitments;
        mapping(uint256 runId => mapping(uint64 round => Claim)) claims;
    }

    /// @dev The decoded stage leaf.
    struct StageLeaf {
        uint32 stage;
        uint32 numChunks;
        bytes32 weightsRoot;
        bytes32 momentumRoot;
        bytes32 factorsHash;
    }

    /// @dev The round's factors of one stage (the arrays' lengths are equal; checked).
    struct Factors {
        uint32 lr;
        uint32 mu;
        bool nesterov;
        bytes32[] envelopes;
        bytes32[] payloadRoots;
        uint64[] scales;
    }

    /// @dev Where the chunk lies in its tensor (from round t - 1's weights leaf header).
    struct Layout {
        uint64 offset;
        uint64 cols;
        uint256 count;
    }

    /// @notice Round `round` of run `runId` was shown wrong at `stage`, chunk `chunk`; `prover` was paid `reward`.
    event AggregationDisproved(
        uint256 indexed runId, uint64 indexed round, uint32 stage, uint64 chunk, address indexed prover, uint256 reward
    );

    /// @notice Round `round` of run `runId` was shown to commit a wrong clip scale or squared norm at `stage`
    /// (`contribution`: SCALES, or the contribution whose sum tree was opened at `chunk`).
    event NormDisproved(
        uint256 indexed runId, uint64 indexed round, uint32 stage, uint256 contribution, uint64 chunk,
        address indexed prover, uint256 reward
    );

    /// @notice `challenger` asks the committers of round `round` to publish a leaf (challenge `id`) by `deadline`.
    event AvailabilityChallenged(
        bytes32 indexed id, uint256 indexed runId, uint64 indexed round, uint32 stage, uint256 which, uint64 chunk,
        address challenger, uint64 deadline
    );
    /// @notice The leaf of challenge `id` was published by `answerer`: it is `leaf`, opened by `path` (checked
    /// against the commitment), so anyone reads the answer from the log, whoever relayed it.
    event AvailabilityAnswered(bytes32 indexed id, bytes leaf, bytes32[] path, address answerer);
    /// @notice Challenge `id` went unanswered: its round was overturned and the challenger paid `reward`.
    event AvailabilityExpired(bytes32 indexed id, uint256 reward);

    /// @notice `prover` committed to a proof (`commitment` = keccak256(abi.encode(prover, keccak256(calldata)))).
    event ProofCommitted(bytes32 indexed commitment, address indexed prover);
    /// @notice A proof of round `round` came without a matured commitment: its `reward` is held until `deadline`
    /// for an earlier committer of the same proof, then `prover`'s.
    event RewardEscrowed(uint256 indexed runId, uint64 indexed round, address prover, uint256 reward, uint64 deadline);
    /// @notice The held reward of round `round` went to `recipient`.
    event RewardClaimed(uint256 indexed runId, uint64 indexed round, address indexed recipient, uint256 reward);
    /// @notice The escrowed bonds of `challenger`'s game on `stage` of round `round` came back to it.
    event BondsReclaimed(uint256 indexed runId, uint64 indexed round, uint32 stage, address challenger, uint256 amount);

    error ProverBadTarget(uint256 which);
    error ProverGameTooLong(bytes32 game, uint16 maxGameSteps);
    error ProverProofWindowClosed(uint256 runId, uint64 round, uint64 closedAt);
    error ProverParentOpen(uint256 runId, uint64 parent, uint64 closesAt);
    error ProverNoClaim(uint256 runId, uint64 round);
    error ProverNotClaimant(uint256 runId, uint64 round, address caller);
    error ProverRoundStands(uint256 runId, uint64 round);
    error ProverNotLedger(address caller);
    error ProverNotStepProver(address caller);
    error ProverBondMismatch(uint256 required, uint256 sent);
    error ProverChallengeExists(bytes32 id);
    error ProverNoAnswerer(uint256 runId);
    error ProverNoChallenge(bytes32 id);
    error ProverChallengeSettled(bytes32 id);
    error ProverChallengeDue(bytes32 id, uint64 deadline);
    error ProverChallengeNotDue(bytes32 id, uint64 deadline);
    error ProverChallengeTooLate(uint256 runId, uint64 round, uint64 closedAt);
    error ProverBadRecords(uint256 runId, uint64 prevRound, uint64 round);
    error ProverNotCommitted(uint256 runId, uint64 round);
    error ProverBadStage(uint32 stage, uint32 numStages);
    error ProverBadStagePath(uint64 round, uint32 stage);
    error ProverBadStageLeaf(uint64 round, uint32 stage);
    error ProverBadFactors(uint64 round, uint32 stage);
    error ProverBadChunk(uint64 chunk, uint32 numChunks);
    /// @dev `which`: 0 previous weights, 1 previous momentum, 2 new weights, 3 new momentum, 4 + j piece j.
    error ProverBadPath(uint256 which);
    error ProverBadLeaf(uint256 which);
    error ProverRoundCorrect(uint256 runId, uint64 round, uint32 stage, uint64 chunk);
    error ProverNotNormed(uint64 round, uint32 stage);
    error ProverBadSumPath(uint256 contribution);
    error ProverNormCorrect(uint256 runId, uint64 round, uint32 stage, uint256 contribution);
    error ProverNoGenesis(uint256 runId);
    error ProverBadSchedule(uint64 round, uint256 index);

    /// @notice `Target.which` of a challenge of the stage leaf itself (its index in the record's weightsRoot is
    /// the stage): a record whose root has no stage leaves behind it (a back door) cannot be answered.
    uint256 public constant STAGE_LEAF = ProverCommon.STAGE_LEAF;
    /// @notice `NormProof.contribution` of a proof of the clip scales themselves (from the committed sums).
    uint256 public constant SCALES = ProverCommon.SCALES;

    /// @notice The TrainingLedger that deployed this prover and takes its proofs.
    TrainingLedger public immutable ledger;
    /// @notice The ledger's contribution proof (issue 78): the StepProver this prover deployed, bonded and clocked
    /// by each run's own values, whose won contribution cases overturn rounds through `overturnByStep`.
    StepProver public immutable stepProver;

    ProverState private _p;

    constructor(TrainingLedger ledger_) {
        ledger = ledger_;
        stepProver = new StepProver(0, 0, ledger_);
    }

    /// @notice The StepProver's overturn of round `round` (a contribution it lists proven wrong: every claim on
    /// it refuted, or none made): within the round's proof window (as a fraud proof's), the ledger pays
    /// `recipient` (the case's opener) directly. A round already invalid is left as it is (reward 0).
    function overturnByStep(uint256 runId, uint64 round, address[] calldata attesters, address recipient)
        external
        returns (uint256 reward)
    {
        if (msg.sender != address(stepProver)) revert ProverNotStepProver(msg.sender);
        (uint64 opensAt, uint64 closesAt) = ledger.proofWindowOf(runId, round);
        if (block.number < opensAt) revert ProverParentOpen(runId, round - 1, opensAt);
        if (block.number >= closesAt) revert ProverProofWindowClosed(runId, round, closesAt);
        uint64 invalidFrom = ledger.runOf(runId).invalidFrom;
        if (invalidFrom == 0 || invalidFrom > round + 1) {
            reward = ledger.invalidateByProof(runId, round, attesters, recipient);
        }
    }

    /// @notice Only the ledger pays this contract: a proof's reward held for its claim window.
    receive() external payable {
        if (msg.sender != address(ledger)) revert ProverNotLedger(msg.sender);
    }

    // ------------------------------------------------------------------------------------------- commit-reveal

    /// @notice Commit to a proof before sending it, so that a copy of it sent by another (a front-runner) is not
    /// paid: `commitment` = keccak256(abi.encode(prover, keccak256(calldata of the proveWrong... call))). A proof
    /// whose sender committed it at least one block earlier is paid at once; any other proof still overturns the
    /// round, but its reward is held `accusationBlocks` for an earlier committer of the same proof (claimReward).
    /// The first commitment of a hash counts (a later one of the same hash changes nothing).
    function commitProof(bytes32 commitment) external {
        if (_p.proofCommitments[commitment] != 0) return;
        _p.proofCommitments[commitment] = uint64(block.number);
        emit ProofCommitted(commitment, msg.sender);
    }

    /// @notice The block at which `commitment` was first committed (0: never).
    function proofCommittedAt(bytes32 commitment) external view returns (uint64) {
        return _p.proofCommitments[commitment];
    }

    /// @notice Take the held reward of round `round`: an earlier committer of the proof that overturned it, within
    /// the claim window; after it, the proof's sender.
    function claimReward(uint256 runId, uint64 round) external returns (uint256 reward) {
        reward = ProverAvailability.claimReward(_p, runId, round);
    }

    /// @notice A round's held reward (zero reward: none, or claimed).
    function claimOf(uint256 runId, uint64 round) external view returns (Claim memory) {
        return _p.claims[runId][round];
    }

    /// @notice Prove that chunk `proof.chunk` of stage `proof.stage` in round `proof.record.round` is not the
    /// outer step of the previous round's committed weights and momentum with the round's committed factors and
    /// contributions. On success the round and every later one are invalid, the round's attesters slashed and
    /// the caller paid; a proof against a correct chunk reverts with ProverRoundCorrect.
    /// @return reward The wei paid to the caller (half of the stake slashed).
    function proveWrongAggregation(Proof calldata proof) external returns (uint256 reward) {
        if (!_chunkWrong(proof)) {
            revert ProverRoundCorrect(proof.record.runId, proof.record.round, proof.stage, proof.chunk);
        }
        reward = ProverAvailability.overturn(_p, ledger, proof.record.runId, proof.record.round,
            proof.attesters, keccak256(msg.data));
        emit AggregationDisproved(
            proof.record.runId, proof.record.round, proof.stage, proof.chunk, msg.sender, reward
        );
    }

    /// @notice Whether the proof would succeed (the chunk differs), without changing anything; reverts like
    /// proveWrongAggregation on a malformed proof.
    function isWrong(Proof calldata proof) external view returns (bool) {
        return _chunkWrong(proof);
    }

    /// @notice Prove that a version-3 round committed a wrong clip scale: the committed scales are not the norm
    /// rule of the committed sums of squares (`proof.contribution == SCALES`), or contribution `j`'s sum tree is
    /// wrong at chunk `proof.chunk` (the chunk's sum is not the exact sum of squares of its committed piece, or the
    /// tree does not sum to the committed total). On success as proveWrongAggregation; a proof against a right
    /// round reverts with ProverNormCorrect.
    /// @return reward The wei paid to the caller (half of the stake slashed).
    function proveWrongNorm(NormProof calldata proof) external returns (uint256 reward) {
        if (!_normWrong(proof)) {
            revert ProverNormCorrect(proof.record.runId, proof.record.round, proof.stage, proof.contribution);
        }
        reward = ProverAvailability.overturn(_p, ledger, proof.record.runId, proof.record.round,
            proof.attesters, keccak256(msg.data));
        emit NormDisproved(
            proof.record.runId, proof.record.round, proof.stage, proof.contribution, proof.chunk, msg.sender, reward
        );
    }

    /// @notice Whether the norm proof would succeed, without changing anything; reverts like proveWrongNorm on a
    /// malformed proof.
    function isWrongNorm(NormProof calldata proof) external view returns (bool) {
        return _normWrong(proof);
    }

    /// @dev The chunk differs, or (its factors checked by the chunk proof) the round lists a contribution bound to
    /// no member, or too many (ProverBinding).
    function _chunkWrong(Proof calldata proof) private view returns (bool) {
        return ProverChunks.differs(ledger, proof)
            || ProverBinding.unbound(ledger, proof.record, proof.stage, proof.factors, proof.pieces.length);
    }

    /// @dev The norm commitment is wrong, or (its factors checked and well-formed version 3) the binding is.
    function _normWrong(NormProof calldata proof) private view returns (bool) {
        return ProverNorms.normDiffers(ledger, proof)
            || ProverBinding.unbound(ledger, proof.record, proof.stage, proof.factors, 0);
    }

    // ------------------------------------------------------------------------------------------- availability

    /// @notice Challenge the committers of a round to publish one committed leaf (a chunk of the new weights or
    /// momentum, or of an accepted contribution's payload, or a stage leaf itself: `STAGE_LEAF`) on chain within the run's `accusationBlocks`,
    /// depositing the run's bond; only within the round's dispute window (`disputeBlocks` after its commit). Answered (answerChallenge, by anyone): the bond is forfeited. Unanswered by
    /// the deadline (expireChallenge): the round and every later one are invalid, its attesters slashed, the
    /// challenger paid half of the slash and its bond returned.
    /// @return id The challenge's id, keccak256(runId, round, stage, which, chunk).
    function challengeAvailability(Target calldata target) external payable returns (bytes32 id) {
        id = ProverAvailability.challengeAvailability(_p, ledger, target);
    }

    /// @notice Publish the leaf a challenge names, with its Merkle path (anyone may; a sum tree's leaf: its 96-byte
    /// sum and a sum path, as NormProof's; the factors: their bytes, no path). The bond is forfeited.
    function answerChallenge(bytes32 id, bytes calldata leaf, bytes32[] calldata path) external {
        ProverAvailability.answerChallenge(_p, ledger, id, leaf, path);
    }

    /// @notice Settle a challenge left unanswered past its deadline: the round is overturned through the ledger
    /// (invalidateByProof) and the challenger gets its bond back and half of the slash. If the round is already
    /// invalid, only the bond is returned.
    /// @param attesters The round's attesters as RoundCommitted gave them.
    function expireChallenge(bytes32 id, address[] calldata attesters) external returns (uint256 reward) {
        reward = ProverAvailability.expireChallenge(_p, ledger, id, attesters);
    }

    /// @notice A challenge's state (a zero challenger: none).
    function challengeOf(bytes32 id) external view returns (Challenge memory) {
        return _p.challenges[id];
    }

    /// @notice Take back the escrowed bonds of the caller's answered steps on `stage` of round `round`, once the
    /// round is overturned (by anyone). A game on a round that stands is lost: its escrow stays here (burned).
    function reclaimBonds(uint256 runId, uint64 round, uint32 stage) external returns (uint256 amount) {
        amount = ProverAvailability.reclaimBonds(_p, ledger, runId, round, stage);
    }

    /// @notice The game of `challenger` on `stage` of round `round` (zero steps: none).
    function gameOf(uint256 runId, uint64 round, uint32 stage, address challenger) external view returns (Game memory) {
        return _p.games[keccak256(abi.encode(runId, round, stage, challenger))];
    }

    /// @notice 1 + the last block at which a game on round `round` can still be answered, continued or expired
    /// (0: no game was played on it): the round's proof window and finality wait for it.
    function liveUntil(uint256 runId, uint64 round) external view returns (uint64) {
        return _p.liveUntil[runId][round];
    }
}
