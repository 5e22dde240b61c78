// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {Float32} from "./Float32.sol";
import {NormRule} from "./NormRule.sol";
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
contract AggregationProver {
    using Float32 for uint32;

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
    /// @notice The leaf of challenge `id` was published: it is `leaf` (its path checked against the commitment).
    event AvailabilityAnswered(bytes32 indexed id, bytes leaf);
    /// @notice Challenge `id` went unanswered: its round was overturned and the challenger paid `reward`.
    event AvailabilityExpired(bytes32 indexed id, uint256 reward);

    error ProverBadTarget(uint256 which);
    error ProverBondMismatch(uint256 required, uint256 sent);
    error ProverChallengeExists(bytes32 id);
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

    bytes32 private constant _RECORD_TYPEHASH = keccak256(
        "Record(uint256 runId,uint64 round,bytes32 prevHead,bytes32 weightsRoot,bytes32 contributionsRoot,"
        "uint64 trainLossMicro,uint64 evalLossMicro,uint64 tokens,uint32 numContributors,bytes32 checkpointHash)"
    );
    uint64 private constant _SCALE_ONE = 0x3FF0000000000000; // float64 1.0
    /// @dev `Target.which` of a challenge of the factors (a stage leaf's preimage of factorsHash, no tree's leaf).
    uint256 private constant _FACTORS = type(uint256).max - 1;
    uint8 private constant _NORMED = 3; // RunParams.commitments of a run whose factors carry the norm commitment
    uint256 private constant _LEAF_HEADER = 24; // u32 tensor, u64 offset, u64 cols, u32 count
    uint256 private constant _PIECE_HEADER = 5; // u8 codec, u32 count
    uint256 private constant _WEIGHTS_AT = 10; // a lowrank piece's w, after its header, rank and S
    uint256 private constant _MAX_RANK = 64; // training/codec_wire.py MAX_RANK
    /// @notice `Target.which` of a challenge of the stage leaf itself (its index in the record's weightsRoot is
    /// the stage): a record whose root has no stage leaves behind it (a back door) cannot be answered.
    uint256 public constant STAGE_LEAF = type(uint256).max;
    /// @notice `NormProof.contribution` of a proof of the clip scales themselves (from the committed sums).
    uint256 public constant SCALES = type(uint256).max;

    /// @notice The TrainingLedger that deployed this prover and takes its proofs.
    TrainingLedger public immutable ledger;

    mapping(bytes32 id => Challenge) private _challenges;

    constructor(TrainingLedger ledger_) {
        ledger = ledger_;
    }

    /// @notice Prove that chunk `proof.chunk` of stage `proof.stage` in round `proof.record.round` is not the
    /// outer step of the previous round's committed weights and momentum with the round's committed factors and
    /// contributions. On success the round and every later one are invalid, the round's attesters slashed and
    /// the caller paid; a proof against a correct chunk reverts with ProverRoundCorrect.
    /// @return reward The wei paid to the caller (half of the stake slashed).
    function proveWrongAggregation(Proof calldata proof) external returns (uint256 reward) {
        (StageLeaf memory prev, StageLeaf memory next) = _stageLeaves(proof);
        if (!_differs(proof, prev, next)) {
            revert ProverRoundCorrect(proof.record.runId, proof.record.round, proof.stage, proof.chunk);
        }
        reward = ledger.invalidateByProof(proof.record.runId, proof.record.round, proof.attesters, msg.sender);
        emit AggregationDisproved(
            proof.record.runId, proof.record.round, proof.stage, proof.chunk, msg.sender, reward
        );
    }

    /// @notice Whether the proof would succeed (the chunk differs), without changing anything; reverts like
    /// proveWrongAggregation on a malformed proof.
    function isWrong(Proof calldata proof) external view returns (bool) {
        (StageLeaf memory prev, StageLeaf memory next) = _stageLeaves(proof);
        return _differs(proof, prev, next);
    }

    /// @notice Prove that a version-3 round committed a wrong clip scale: the committed scales are not the norm
    /// rule of the committed sums of squares (`proof.contribution == SCALES`), or contribution `j`'s sum tree is
    /// wrong at chunk `proof.chunk` (the chunk's sum is not the exact sum of squares of its committed piece, or the
    /// tree does not sum to the committed total). On success as proveWrongAggregation; a proof against a right
    /// round reverts with ProverNormCorrect.
    /// @return reward The wei paid to the caller (half of the stake slashed).
    function proveWrongNorm(NormProof calldata proof) external returns (uint256 reward) {
        if (!_normDiffers(proof)) {
            revert ProverNormCorrect(proof.record.runId, proof.record.round, proof.stage, proof.contribution);
        }
        reward = ledger.invalidateByProof(proof.record.runId, proof.record.round, proof.attesters, msg.sender);
        emit NormDisproved(
            proof.record.runId, proof.record.round, proof.stage, proof.contribution, proof.chunk, msg.sender, reward
        );
    }

    /// @notice Whether the norm proof would succeed, without changing anything; reverts like proveWrongNorm on a
    /// malformed proof.
    function isWrongNorm(NormProof calldata proof) external view returns (bool) {
        return _normDiffers(proof);
    }

    // ------------------------------------------------------------------------------------------- availability

    /// @notice Challenge the committers of a round to publish one committed leaf (a chunk of the new weights or
    /// momentum, or of an accepted contribution's payload, or a stage leaf itself: `STAGE_LEAF`) on chain within the run's `accusationBlocks`,
    /// depositing the run's bond; only within the round's dispute window (`disputeBlocks` after its commit). Answered (answerChallenge, by anyone): the bond is forfeited. Unanswered by
    /// the deadline (expireChallenge): the round and every later one are invalid, its attesters slashed, the
    /// challenger paid half of the slash and its bond returned.
    /// @return id The challenge's id, keccak256(runId, round, stage, which, chunk).
    function challengeAvailability(Target calldata target) external payable returns (bytes32 id) {
        TrainingLedger.Record calldata record = target.record;
        _requireCommitted(record);
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        if (target.stage >= run.numStages) revert ProverBadStage(target.stage, run.numStages);
        if (msg.value != run.bond) revert ProverBondMismatch(run.bond, msg.value);
        // Only while the round can be disputed: members need not keep a round's leaves available for ever, and
        // an old right round must not fall to a challenge nobody is left to answer.
        uint256 closedAt = ledger.commitBlockOf(record.runId, record.round) + run.disputeBlocks;
        if (block.number >= closedAt) revert ProverChallengeTooLate(record.runId, record.round, uint64(closedAt));
        (bytes32 root, uint32 numChunks, bool sums) = _targetTree(target, run.numStages);
        id = keccak256(abi.encode(record.runId, record.round, target.stage, target.which, target.chunk));
        Challenge storage challenge = _challenges[id];
        if (challenge.challenger != address(0)) revert ProverChallengeExists(id);
        uint64 deadline = uint64(block.number) + run.accusationBlocks;
        _challenges[id] = Challenge(
            msg.sender, deadline, numChunks, false, sums, record.round, target.chunk, root, record.runId, msg.value
        );
        emit AvailabilityChallenged(
            id, record.runId, record.round, target.stage, target.which, target.chunk, msg.sender, deadline
        );
    }

    /// @notice Publish the leaf a challenge names, with its Merkle path (anyone may; a sum tree's leaf: its 96-byte
    /// sum and a sum path, as NormProof's; the factors: their bytes, no path). The bond is forfeited.
    function answerChallenge(bytes32 id, bytes calldata leaf, bytes32[] calldata path) external {
        Challenge storage challenge = _openChallenge(id);
        if (block.number >= challenge.deadline) revert ProverChallengeDue(id, challenge.deadline);
        bool opened;
        if (challenge.numChunks == 0) {
            opened = sha256(leaf) == challenge.root;
        } else if (challenge.sums) {
            (bytes32 root,,) = _openSum(leaf, challenge.chunk, challenge.numChunks, path, 0);
            opened = root == challenge.root;
        } else {
            opened = _verify(leaf, challenge.chunk, challenge.numChunks, path, challenge.root);
        }
        if (!opened) revert ProverBadPath(0);
        challenge.settled = true;
        emit AvailabilityAnswered(id, leaf);
    }

    /// @notice Settle a challenge left unanswered past its deadline: the round is overturned through the ledger
    /// (invalidateByProof) and the challenger gets its bond back and half of the slash. If the round is already
    /// invalid, only the bond is returned.
    /// @param attesters The round's attesters as RoundCommitted gave them.
    function expireChallenge(bytes32 id, address[] calldata attesters) external returns (uint256 reward) {
        Challenge storage challenge = _openChallenge(id);
        if (block.number < challenge.deadline) revert ProverChallengeNotDue(id, challenge.deadline);
        challenge.settled = true;
        address challenger = challenge.challenger;
        uint256 bond = challenge.bond;
        uint64 invalidFrom = ledger.runOf(challenge.runId).invalidFrom;
        if (invalidFrom == 0 || invalidFrom > challenge.round + 1) {
            reward = ledger.invalidateByProof(challenge.runId, challenge.round, attesters, challenger);
        }
        emit AvailabilityExpired(id, reward);
        // Last: every effect is done. A challenger that refuses its bond leaves it burned.
        (bool ok,) = payable(challenger).call{value: bond}("");
        ok;
    }

    /// @notice A challenge's state (a zero challenger: none).
    function challengeOf(bytes32 id) external view returns (Challenge memory) {
        return _challenges[id];
    }

    function _openChallenge(bytes32 id) private view returns (Challenge storage challenge) {
        challenge = _challenges[id];
        if (challenge.challenger == address(0)) revert ProverNoChallenge(id);
        if (challenge.settled) revert ProverChallengeSettled(id);
    }

    /// @dev The tree a challenge's leaf must be opened in, its leaf count, and whether it is a sum tree.
    function _targetTree(Target calldata target, uint32 numStages) private pure returns (bytes32, uint32, bool) {
        if (target.which == STAGE_LEAF) {
            if (target.chunk != target.stage) revert ProverBadChunk(target.chunk, numStages);
            return (target.record.weightsRoot, numStages, false);
        }
        StageLeaf memory leaf = _stageLeaf(target.stageLeaf, target.stagePath, target.record, target.stage, numStages);
        bool factors = target.which == _FACTORS;
        uint32 count = factors ? 1 : leaf.numChunks; // the factors are one "leaf", chunk 0
        if (target.chunk >= count) revert ProverBadChunk(target.chunk, count);
        if (factors) return (leaf.factorsHash, 0, false);
        (bytes32 root, bool sums) = _targetRoot(target, leaf);
        return (root, leaf.numChunks, sums);
    }

    function _targetRoot(Target calldata target, StageLeaf memory leaf) private pure returns (bytes32, bool) {
        uint256 which = target.which;
        if (which == 0) return (leaf.weightsRoot, false);
        if (which == 1) return (leaf.momentumRoot, false);
        bytes calldata factors = target.factors;
        if (sha256(factors) != leaf.factorsHash) revert ProverBadFactors(target.record.round, target.stage);
        (,,,, bytes32[] memory roots,) = abi.decode(factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        uint256 j = which - 2;
        if (j < roots.length) return (roots[j], false);
        // 2 + M + j: contribution j's sum tree, in well-formed version-3 factors (others are proven, not opened).
        j -= roots.length;
        if (j >= roots.length || factors.length < 352 || _word(factors, 96) != 320) revert ProverBadTarget(which);
        (Norms memory norms, bool ok) = _norms(factors);
        if (!ok) revert ProverBadTarget(which);
        return (bytes32(_word(factors, norms.rootsAt + 32 * j)), true);
    }

    // ------------------------------------------------------------------------------------------- openings

    /// @dev Both records committed and consecutive; both stage leaves under their records' weights roots.
    function _stageLeaves(Proof calldata proof) private view returns (StageLeaf memory prev, StageLeaf memory next) {
        TrainingLedger.Record calldata record = proof.record;
        uint256 runId = record.runId;
        if (proof.prevRecord.runId != runId || uint256(proof.prevRecord.round) + 1 != record.round) {
            revert ProverBadRecords(runId, proof.prevRecord.round, record.round);
        }
        _requireCommitted(proof.prevRecord);
        _requireCommitted(record);
        uint32 numStages = ledger.runOf(runId).numStages;
        if (proof.stage >= numStages) revert ProverBadStage(proof.stage, numStages);
        prev = _stageLeaf(proof.prevStageLeaf, proof.prevStagePath, proof.prevRecord, proof.stage, numStages);
        next = _stageLeaf(proof.stageLeaf, proof.stagePath, record, proof.stage, numStages);
    }

    function _requireCommitted(TrainingLedger.Record calldata record) private view {
        bytes32 structHash = keccak256(abi.encode(_RECORD_TYPEHASH, record));
        if (ledger.recordHashOf(record.runId, record.round) != structHash) {
            revert ProverNotCommitted(record.runId, record.round);
        }
    }

    function _stageLeaf(
        bytes calldata leaf,
        bytes32[] calldata path,
        TrainingLedger.Record calldata record,
        uint32 stage,
        uint32 numStages
    ) private pure returns (StageLeaf memory decoded) {
        if (!_verify(leaf, stage, numStages, path, record.weightsRoot)) revert ProverBadStagePath(record.round, stage);
        if (leaf.length != 160) revert ProverBadStageLeaf(record.round, stage);
        decoded = abi.decode(leaf, (StageLeaf));
        if (decoded.stage != stage) revert ProverBadStageLeaf(record.round, stage);
    }

    /// @dev Whether `leaf` is at position `index` of a ledger/merkle.py tree of `count` leaves with root `root`.
    function _verify(bytes calldata leaf, uint256 index, uint256 count, bytes32[] calldata path, bytes32 root)
        private
        pure
        returns (bool)
    {
        if (index >= count) return false;
        bytes32 node = sha256(abi.encodePacked(bytes1(0x00), leaf));
        uint256 used = 0;
        for (uint256 size = count; size > 1; size = (size + 1) / 2) {
            uint256 sibling = index ^ 1;
            if (sibling < size) {
                if (used == path.length) return false;
                node = sibling < index
                    ? sha256(abi.encodePacked(bytes1(0x01), path[used], node))
                    : sha256(abi.encodePacked(bytes1(0x01), node, path[used]));
                ++used;
            }
            index >>= 1;
        }
        return used == path.length && node == root;
    }

    // ------------------------------------------------------------------------------------------- the step

    /// @dev Whether the committed chunk of round t differs from the outer step of its committed inputs.
    function _differs(Proof calldata proof, StageLeaf memory prev, StageLeaf memory next)
        private
        pure
        returns (bool)
    {
        // A different chunk count is wrong on its face: the step keeps every tensor's shape.
        if (next.numChunks != prev.numChunks) return true;
        if (proof.chunk >= prev.numChunks) revert ProverBadChunk(proof.chunk, prev.numChunks);
        (Factors memory factors, bool wellFormed) = _factors(proof, next.factorsHash);
        if (!wellFormed) return true; // committed factors an honest round never has
        _openChunk(proof, prev, next);
        Layout memory place = _layout(proof.prevWeights.leaf, proof.prevMomentum.leaf);
        for (uint256 j = 0; j < proof.pieces.length; ++j) {
            if (!_verify(proof.pieces[j].leaf, proof.chunk, prev.numChunks, proof.pieces[j].path, factors.payloadRoots[j]))
            {
                revert ProverBadPath(4 + j);
            }
            // A committed piece that does not decode: the round aggregated something no contribution holds.
            if (!_wellFormed(proof.pieces[j].leaf, place)) return true;
        }
        return _compare(proof, factors, place);
    }

    /// @dev The four tensor leaves of the chunk are under their roots.
    function _openChunk(Proof calldata proof, StageLeaf memory prev, StageLeaf memory next) private pure {
        uint256 chunk = proof.chunk;
        uint256 count = prev.numChunks;
        if (!_verify(proof.prevWeights.leaf, chunk, count, proof.prevWeights.path, prev.weightsRoot)) {
            revert ProverBadPath(0);
        }
        if (!_verify(proof.prevMomentum.leaf, chunk, count, proof.prevMomentum.path, prev.momentumRoot)) {
            revert ProverBadPath(1);
        }
        if (!_verify(proof.newWeights.leaf, chunk, count, proof.newWeights.path, next.weightsRoot)) {
            revert ProverBadPath(2);
        }
        if (!_verify(proof.newMomentum.leaf, chunk, count, proof.newMomentum.path, next.momentumRoot)) {
            revert ProverBadPath(3);
        }
    }

    /// @dev Whether a committed new leaf differs from the recomputation (its header must be the previous one).
    function _compare(Proof calldata proof, Factors memory factors, Layout memory place) private pure returns (bool) {
        bytes calldata newWeights = proof.newWeights.leaf;
        bytes calldata newMomentum = proof.newMomentum.leaf;
        uint256 size = _LEAF_HEADER + 4 * place.count;
        if (newWeights.length != size || newMomentum.length != size) return true;
        bytes32 header = keccak256(proof.prevWeights.leaf[:_LEAF_HEADER]);
        if (keccak256(newWeights[:_LEAF_HEADER]) != header || keccak256(newMomentum[:_LEAF_HEADER]) != header) {
            return true;
        }
        for (uint256 k = 0; k < place.count; ++k) {
            (uint32 weight, uint32 momentum) = _element(proof, factors, place, k);
            if (!Float32.same32(weight, _u32(newWeights, _LEAF_HEADER + 4 * k))) return true;
            if (!Float32.same32(momentum, _u32(newMomentum, _LEAF_HEADER + 4 * k))) return true;
        }
        return false;
    }

    /// @dev The committed factors; `wellFormed` false when their lists differ in length (a wrong round).
    function _factors(Proof calldata proof, bytes32 factorsHash)
        private
        pure
        returns (Factors memory factors, bool wellFormed)
    {
        if (sha256(proof.factors) != factorsHash) revert ProverBadFactors(proof.record.round, proof.stage);
        (factors.lr, factors.mu, factors.nesterov, factors.envelopes, factors.payloadRoots, factors.scales) =
            abi.decode(proof.factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        uint256 accepted = factors.payloadRoots.length;
        if (proof.pieces.length != accepted) revert ProverBadFactors(proof.record.round, proof.stage);
        wellFormed = factors.envelopes.length == accepted && factors.scales.length == accepted;
    }

    /// @dev The chunk's place, from round t - 1's weights leaf; its momentum leaf must have the same header.
    function _layout(bytes calldata weights, bytes calldata momentum) private pure returns (Layout memory place) {
        if (weights.length < _LEAF_HEADER) revert ProverBadLeaf(0);
        place.count = _u32(weights, 20);
        place.offset = uint64(bytes8(weights[4:12]));
        place.cols = uint64(bytes8(weights[12:20]));
        if (place.count == 0 || place.cols == 0 || weights.length != _LEAF_HEADER + 4 * place.count) {
            revert ProverBadLeaf(0);
        }
        if (momentum.length != weights.length || keccak256(momentum[:_LEAF_HEADER]) != keccak256(weights[:_LEAF_HEADER]))
        {
            revert ProverBadLeaf(1);
        }
    }

    /// @dev One element's new weight and momentum: decode, clip, the in-order sum, / M, the (Nesterov) step.
    function _element(Proof calldata proof, Factors memory factors, Layout memory place, uint256 k)
        private
        pure
        returns (uint32 weight, uint32 momentum)
    {
        uint256 p = _LEAF_HEADER + 4 * k;
        weight = _u32(proof.prevWeights.leaf, p);
        momentum = _u32(proof.prevMomentum.leaf, p);
        uint256 accepted = proof.pieces.length;
        if (accepted == 0) return (weight, momentum); // every contribution left out: a no-op round
        uint32 delta = _scaled(_decode(proof.pieces[0].leaf, place, k), factors.scales[0]);
        for (uint256 j = 1; j < accepted; ++j) {
            delta = delta.add(_scaled(_decode(proof.pieces[j].leaf, place, k), factors.scales[j]));
        }
        delta = delta.div(Float32.fromInt32(int256(accepted)));
        momentum = momentum.mul(factors.mu).add(delta);
        uint32 step = factors.nesterov ? delta.add(momentum.mul(factors.mu)).mul(factors.lr) : momentum.mul(factors.lr);
        weight = weight.sub(step);
    }

    /// @dev ``float32(float64(d) * scale)``, or ``d`` untouched when the scale is 1.0 (training/robust.py).
    function _scaled(uint32 value, uint64 scale) private pure returns (uint32) {
        if (scale == _SCALE_ONE) return value;
        return Float32.toFloat32(Float32.mul64(Float32.toFloat64(value), scale));
    }

    // ------------------------------------------------------------------------------------------- the norm rule

    /// @dev Whether the round's committed scales or squared norms are wrong (NormProof).
    function _normDiffers(NormProof calldata proof) private view returns (bool) {
        TrainingLedger.Record calldata record = proof.record;
        _requireCommitted(record);
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        if (proof.stage >= run.numStages) revert ProverBadStage(proof.stage, run.numStages);
        StageLeaf memory leaf = _stageLeaf(proof.stageLeaf, proof.stagePath, record, proof.stage, run.numStages);
        bytes calldata factors = proof.factors;
        if (sha256(factors) != leaf.factorsHash) revert ProverBadFactors(record.round, proof.stage);
        // The factors' version (3: ten fields, the first list at byte 320) must be the run's (RunParams.commitments):
        // version-2 factors in a normed run would escape this proof, version-3 ones in another run are no honest
        // node's either. Either way the round is wrong, whatever the proof's contribution.
        bool normed = factors.length >= 352 && _word(factors, 96) == 320;
        if (normed != (run.commitments == _NORMED)) return true;
        if (!normed) revert ProverNotNormed(record.round, proof.stage);
        (Norms memory norms, bool wellFormed) = _norms(factors);
        if (!wellFormed) return true; // a norm commitment an honest round never makes
        if (proof.contribution == SCALES) return _scalesDiffer(factors, norms);
        if (proof.contribution >= norms.count) revert ProverBadTarget(proof.contribution);
        if (proof.chunk >= leaf.numChunks) revert ProverBadChunk(proof.chunk, leaf.numChunks);
        return _sumDiffers(proof, leaf, norms);
    }

    /// @dev The committed scales against the norm rule of the committed sums.
    function _scalesDiffer(bytes calldata factors, Norms memory norms) private pure returns (bool) {
        uint256[] memory sums = new uint256[](3 * norms.count);
        for (uint256 i = 0; i < sums.length; ++i) {
            sums[i] = _word(factors, norms.sumsAt + 32 * i);
        }
        uint256[] memory steps = new uint256[](norms.steps);
        for (uint256 j = 0; j < steps.length; ++j) {
            steps[j] = _word(factors, norms.stepsAt + 32 * j);
        }
        uint64[] memory expected = NormRule.scales(sums, steps, norms.clip);
        (,,,,, uint64[] memory committed) =
            abi.decode(factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        for (uint256 j = 0; j < norms.count; ++j) {
            if (committed[j] != expected[j]) return true;
        }
        return false;
    }

    /// @dev Contribution j's sum tree at the chunk: its leaf against the piece's squares, its total against the
    /// committed one.
    function _sumDiffers(NormProof calldata proof, StageLeaf memory leaf, Norms memory norms)
        private
        pure
        returns (bool)
    {
        uint256 j = proof.contribution;
        uint256 chunk = proof.chunk;
        if (!_verify(proof.weights.leaf, chunk, leaf.numChunks, proof.weights.path, leaf.weightsRoot)) {
            revert ProverBadPath(2);
        }
        Layout memory place = _layout(proof.weights.leaf, proof.weights.leaf);
        (,,,, bytes32[] memory payloadRoots,) =
            abi.decode(proof.factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        if (!_verify(proof.piece.leaf, chunk, leaf.numChunks, proof.piece.path, payloadRoots[j])) {
            revert ProverBadPath(4 + j);
        }
        // The committed leaf and the total its path gives, under the committed root.
        (bytes32 root, uint256[3] memory total, bool overflow) = _openSum(proof.sumLeaf, chunk, leaf.numChunks,
            proof.sumPath, j);
        if (root != bytes32(_word(proof.factors, norms.rootsAt + 32 * j))) revert ProverBadSumPath(j);
        if (overflow) return true; // an honest tree's sums are far below 2^768
        uint256 sumAt = norms.sumsAt + 96 * j;
        if (total[0] != _word(proof.factors, sumAt) || total[1] != _word(proof.factors, sumAt + 32)) return true;
        if (total[2] != _word(proof.factors, sumAt + 64)) return true;
        if (!_wellFormed(proof.piece.leaf, place)) return true;
        uint256[3] memory squares;
        for (uint256 k = 0; k < place.count; ++k) {
            uint32 value = _decode(proof.piece.leaf, place, k);
            if (!Float32.isFinite32(value)) return true; // an accepted contribution is finite
            (squares[0], squares[1], squares[2],) = NormRule.addSquare(squares[0], squares[1], squares[2], value);
        }
        bytes calldata sum = proof.sumLeaf; // 96 bytes: checked by _openSum
        return squares[0] != _word(sum, 0) || squares[1] != _word(sum, 32) || squares[2] != _word(sum, 64);
    }

    /// @dev The root and the total of a sum tree (ledger/normproof.py) from one leaf (96 bytes: hi, mid, lo) at
    /// `index` of `count` and its path (per level with a sibling: its hash and sum, four words). A leaf hashes
    /// as sha256(0x00 || sum), an inner node as sha256(0x01 || left hash || left sum || right hash || right sum)
    /// and sums its children; an odd node is promoted. `overflow`: a sum past 2^768 on the way.
    function _openSum(bytes calldata leaf, uint256 index, uint256 count, bytes32[] calldata path, uint256 j)
        private
        pure
        returns (bytes32 node, uint256[3] memory sum, bool overflow)
    {
        if (leaf.length != 96) revert ProverBadSumPath(j);
        node = sha256(abi.encodePacked(bytes1(0x00), leaf));
        sum = [_word(leaf, 0), _word(leaf, 32), _word(leaf, 64)];
        uint256 used = 0;
        for (uint256 size = count; size > 1; size = (size + 1) / 2) {
            uint256 sibling = index ^ 1;
            if (sibling < size) {
                if (used + 4 > path.length) revert ProverBadSumPath(j);
                uint256[3] memory other = [uint256(path[used + 1]), uint256(path[used + 2]), uint256(path[used + 3])];
                node = sibling < index
                    ? sha256(abi.encodePacked(bytes1(0x01), path[used], other, node, sum))
                    : sha256(abi.encodePacked(bytes1(0x01), node, sum, path[used], other));
                bool carry;
                (sum[0], sum[1], sum[2], carry) = NormRule.add(sum[0], sum[1], sum[2], other[0], other[1], other[2]);
                overflow = overflow || carry;
                used += 4;
            }
            index >>= 1;
        }
        if (used != path.length) revert ProverBadSumPath(j);
    }

    /// @dev Where a version-3 factors' norm commitment lies, and whether it is well formed: the canonical
    /// encoding of abi.encode(uint32 lr, uint32 mu, bool nesterov, bytes32[] envelopes, bytes32[] payloadRoots,
    /// uint64[] scales, uint64 normClip, uint32[] steps, bytes32[] normRoots, uint256[] normSums) with every list
    /// of the accepted count (steps: that count, or none), sums three words each, every value in its type's range,
    /// normClip 0 or in [1, inf) and every step at least 1. The caller checked that it is version 3 (at least 352
    /// bytes, its first list at byte 320).
    function _norms(bytes calldata factors) private pure returns (Norms memory norms, bool ok) {
        uint256 count = _word(factors, 320);
        if (count > type(uint32).max) return (norms, false);
        uint256 list = 32 * (1 + count);
        uint256 stepsAt = 320 + 3 * list; // after envelopes, payloadRoots and scales
        if (_word(factors, 128) != 320 + list || _word(factors, 160) != 320 + 2 * list) return (norms, false);
        if (_word(factors, 224) != stepsAt || factors.length < stepsAt + 32) return (norms, false);
        norms.count = count;
        norms.steps = _word(factors, stepsAt);
        if (norms.steps != 0 && norms.steps != count) return (norms, false);
        norms.stepsAt = stepsAt + 32;
        norms.rootsAt = norms.stepsAt + 32 * norms.steps;
        norms.sumsAt = norms.rootsAt + list;
        if (_word(factors, 256) != norms.rootsAt || _word(factors, 288) != norms.sumsAt) return (norms, false);
        if (factors.length != norms.sumsAt + 32 * (1 + 3 * count)) return (norms, false);
        if (_word(factors, 320 + list) != count || _word(factors, 320 + 2 * list) != count) return (norms, false);
        if (_word(factors, norms.rootsAt) != count || _word(factors, norms.sumsAt) != 3 * count) return (norms, false);
        norms.rootsAt += 32;
        norms.sumsAt += 32;
        uint256 clip = _word(factors, 192);
        if (clip != 0 && (clip < NormRule.ONE || clip >= NormRule.INF)) return (norms, false);
        norms.clip = uint64(clip);
        ok = _normValuesOk(factors, norms, 320 + 2 * list + 32);
    }

    /// @dev Every value of the factors in its type's range (what abi.decode would revert on), every step >= 1.
    function _normValuesOk(bytes calldata factors, Norms memory norms, uint256 scalesAt) private pure returns (bool) {
        if (_word(factors, 0) > type(uint32).max || _word(factors, 32) > type(uint32).max) return false;
        if (_word(factors, 64) > 1) return false;
        for (uint256 j = 0; j < norms.count; ++j) {
            if (_word(factors, scalesAt + 32 * j) > type(uint64).max) return false;
            if (j < norms.steps) {
                uint256 step = _word(factors, norms.stepsAt + 32 * j);
                if (step == 0 || step > type(uint32).max) return false;
            }
        }
        return true;
    }

    function _word(bytes calldata data, uint256 position) private pure returns (uint256 value) {
        assembly ("memory-safe") {
            value := calldataload(add(data.offset, position))
        }
    }

    // ------------------------------------------------------------------------------------------- pieces

    /// @dev Whether a piece has its codec's size for the chunk's layout (training/chunks.py).
    function _wellFormed(bytes calldata piece, Layout memory place) private pure returns (bool) {
        if (piece.length < _PIECE_HEADER || _u32(piece, 1) != place.count) return false;
        uint8 codec = uint8(piece[0]);
        if (codec == 0) return piece.length == _PIECE_HEADER + 4 * place.count;
        if (codec == 1) return piece.length == _PIECE_HEADER + 6 * place.count;
        if (codec != 2 || piece.length < _WEIGHTS_AT) return false;
        uint256 rank = uint8(piece[_PIECE_HEADER]);
        uint256 head = _WEIGHTS_AT + 2 * rank;
        if (rank == 0 || rank > _MAX_RANK || piece.length < head + 4) return false;
        uint256 rows = _u32(piece, head);
        uint256 first = place.offset / place.cols;
        uint256 last = (uint256(place.offset) + place.count - 1) / place.cols;
        return rows == last - first + 1 && piece.length == head + 4 + 2 * rank * (rows + place.count);
    }

    /// @dev Element `k` of a checked piece, decoded exactly as training/codec_wire.py.
    function _decode(bytes calldata piece, Layout memory place, uint256 k) private pure returns (uint32) {
        uint8 codec = uint8(piece[0]);
        if (codec == 0) return _u32(piece, _PIECE_HEADER + 4 * k);
        if (codec == 1) {
            int256 q = _i16(piece, _PIECE_HEADER + 2 * k);
            uint32 scale = _u32(piece, _PIECE_HEADER + 2 * place.count + 4 * k);
            return Float32.fromInt32(q).mul(scale); // float32(q) is exact: |q| < 2^15
        }
        return _lowrank(piece, place, k);
    }

    /// @dev ``float32(float64(sum_r P[i,r] w[r] Q[j,r]) * float64(S))``: the integer sum is exact (< 2^53).
    function _lowrank(bytes calldata piece, Layout memory place, uint256 k) private pure returns (uint32) {
        uint256 rank = uint8(piece[_PIECE_HEADER]);
        uint256 rowsAt = _WEIGHTS_AT + 2 * rank + 4;
        uint256 pAt = rowsAt + 2 * rank * ((uint256(place.offset) + k) / place.cols - place.offset / place.cols);
        uint256 qAt = rowsAt + 2 * rank * (_u32(piece, _WEIGHTS_AT + 2 * rank) + k);
        int256 sum = _lowrankSum(piece, rank, pAt, qAt);
        return Float32.toFloat32(Float32.mul64(Float32.fromInt(sum), Float32.toFloat64(_u32(piece, _PIECE_HEADER + 1))));
    }

    /// @dev ``sum_r P[i,r] w[r] Q[j,r]`` over a checked piece: |P|, |Q| <= 2^15, w < 2^16 and r <= 64 bound every
    /// partial sum by 2^52, so the int256 arithmetic never wraps.
    function _lowrankSum(bytes calldata piece, uint256 rank, uint256 pAt, uint256 qAt) private pure returns (int256 sum) {
        assembly ("memory-safe") {
            let base := piece.offset
            for { let r := 0 } lt(r, rank) { r := add(r, 1) } {
                let at := mul(2, r)
                let w := shr(240, calldataload(add(base, add(_WEIGHTS_AT, at))))
                let p := signextend(1, shr(240, calldataload(add(base, add(pAt, at)))))
                let q := signextend(1, shr(240, calldataload(add(base, add(qAt, at)))))
                sum := add(sum, mul(mul(p, w), q))
            }
        }
    }

    function _u32(bytes calldata data, uint256 position) private pure returns (uint32 value) {
        assembly ("memory-safe") {
            value := shr(224, calldataload(add(data.offset, position)))
        }
    }

    function _i16(bytes calldata data, uint256 position) private pure returns (int256) {
        uint16 raw;
        assembly ("memory-safe") {
            raw := shr(240, calldataload(add(data.offset, position)))
        }
        return int256(int16(raw));
    }
}
