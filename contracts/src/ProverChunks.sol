// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {Float32} from "./Float32.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title ProverChunks
/// @notice AggregationProver's chunk proof: whether one chunk of one stage of a committed round is not the outer
/// step of its committed inputs, recomputed in IEEE-754 binary32 exactly as training/diloco.py does. Linked into
/// AggregationProver and run in its context (DELEGATECALL); proveWrongAggregation and isWrong call it.
library ProverChunks {
    using Float32 for uint32;

    uint64 private constant _SCALE_ONE = 0x3FF0000000000000; // float64 1.0
    uint8 private constant _NORMED = 3; // RunParams.commitments of a run whose factors carry the norm commitment

    /// @notice Whether AggregationProver.proveWrongAggregation(proof) would succeed against `ledger`'s records
    /// (the chunk differs, or the round's committed values are not the run's); reverts with the prover's errors on
    /// a malformed proof.
    function differs(TrainingLedger ledger, AggregationProver.Proof calldata proof) external view returns (bool) {
        uint256 runId = proof.record.runId;
        TrainingLedger.Run memory run = ledger.runOf(runId);
        TrainingLedger.RunValues memory values = ledger.valuesOf(runId);
        (AggregationProver.StageLeaf memory prev, AggregationProver.StageLeaf memory next, bool wellFormed) =
            _stageLeaves(ledger, proof, run.numStages, values.genesisRoot);
        if (!wellFormed) return true; // round t's stage leaf is no honest committer's
        return _differs(proof, prev, next, run, values);
    }

    /// @dev Both records committed and consecutive (round 0: its start is the run's genesisRoot); both stage
    /// leaves under their roots. `wellFormed` false: round t's committed stage leaf is malformed.
    function _stageLeaves(TrainingLedger ledger, AggregationProver.Proof calldata proof, uint32 numStages,
        bytes32 genesisRoot)
        private
        view
        returns (AggregationProver.StageLeaf memory prev, AggregationProver.StageLeaf memory next, bool wellFormed)
    {
        (uint64 prevRound, bytes32 prevRoot) = _start(ledger, proof, genesisRoot);
        if (proof.stage >= numStages) revert AggregationProver.ProverBadStage(proof.stage, numStages);
        (prev, wellFormed) = ProverCommon.openStageLeaf(
            proof.prevStageLeaf, proof.prevStagePath, prevRoot, prevRound, proof.stage, numStages
        );
        // A malformed leaf of round t - 1 is round t - 1's fault: prove that round instead.
        if (!wellFormed) revert AggregationProver.ProverBadStageLeaf(prevRound, proof.stage);
        (next, wellFormed) = ProverCommon.openStageLeaf(
            proof.stageLeaf, proof.stagePath, proof.record.weightsRoot, proof.record.round, proof.stage, numStages
        );
    }

    /// @dev The round before round t and the root its stage leaves are under: the committed record of t - 1, or
    /// for round 0 the run's genesis commitment (RunParams.genesisRoot; round 0 has no record before it).
    function _start(TrainingLedger ledger, AggregationProver.Proof calldata proof, bytes32 genesisRoot)
        private
        view
        returns (uint64 prevRound, bytes32 prevRoot)
    {
        TrainingLedger.Record calldata record = proof.record;
        uint256 runId = record.runId;
        prevRound = proof.prevRecord.round;
        if (proof.prevRecord.runId != runId || (record.round != 0 && uint256(prevRound) + 1 != record.round)) {
            revert AggregationProver.ProverBadRecords(runId, prevRound, record.round);
        }
        ProverCommon.requireCommitted(ledger, record);
        if (record.round == 0) {
            if (genesisRoot == bytes32(0)) revert AggregationProver.ProverNoGenesis(runId);
            return (0, genesisRoot);
        }
        ProverCommon.requireCommitted(ledger, proof.prevRecord);
        prevRoot = proof.prevRecord.weightsRoot;
    }

    /// @dev Whether the committed chunk of round t differs from the outer step of its committed inputs, or its
    /// committed factors are not what the run allows (issue 62: its version, its bounds, its per-round values).
    function _differs(
        AggregationProver.Proof calldata proof,
        AggregationProver.StageLeaf memory prev,
        AggregationProver.StageLeaf memory next,
        TrainingLedger.Run memory run,
        TrainingLedger.RunValues memory values
    )
        private
        pure
        returns (bool)
    {
        // A different chunk count is wrong on its face: the step keeps every tensor's shape.
        if (next.numChunks != prev.numChunks) return true;
        if (proof.chunk >= prev.numChunks) revert AggregationProver.ProverBadChunk(proof.chunk, prev.numChunks);
        if (sha256(proof.factors) != next.factorsHash) {
            revert AggregationProver.ProverBadFactors(proof.record.round, proof.stage);
        }
        (uint256 accepted, bool normed, bool wellFormed) = ProverCommon.factorsShape(proof.factors);
        if (!wellFormed) return true; // committed factors an honest round never has
        if (normed != (run.commitments == _NORMED)) return true; // factors of another version than the run's
        if (accepted > values.maxContributions) return true; // more contributions than the run allows
        AggregationProver.Factors memory factors = _factors(proof);
        if (_valuesDiffer(proof, factors, values)) return true;
        if (proof.pieces.length != accepted) revert AggregationProver.ProverBadFactors(proof.record.round, proof.stage);
        _openChunk(proof, prev, next);
        AggregationProver.Layout memory place =
            ProverCommon.chunkLayout(proof.prevWeights.leaf, proof.prevMomentum.leaf);
        if (!_piecesDecode(proof, factors, place, prev.numChunks, values.maxRank)) return true;
        return _compare(proof, factors, place);
    }

    /// @dev Every piece under its contribution's payload root at the chunk; false if one does not decode (or is
    /// past the run's rank): the round aggregated something no accepted contribution holds.
    function _piecesDecode(
        AggregationProver.Proof calldata proof,
        AggregationProver.Factors memory factors,
        AggregationProver.Layout memory place,
        uint32 numChunks,
        uint256 maxRank
    ) private pure returns (bool) {
        for (uint256 j = 0; j < proof.pieces.length; ++j) {
            AggregationProver.Opening calldata piece = proof.pieces[j];
            if (!ProverCommon.verifyLeaf(piece.leaf, proof.chunk, numChunks, piece.path, factors.payloadRoots[j])) {
                revert AggregationProver.ProverBadPath(4 + j);
            }
            if (!ProverCommon.wellFormedPiece(piece.leaf, place, maxRank)) return false;
        }
        return true;
    }

    /// @dev Whether the factors' lr, mu or Nesterov flag are not the run's for the round (its schedule leaf, opened
    /// under RunParams.scheduleRoot; a round past the schedule's end takes its last leaf). A run whose values are
    /// unbound (scheduleRounds 0: created without them, only a hand-made one) is not checked.
    function _valuesDiffer(
        AggregationProver.Proof calldata proof,
        AggregationProver.Factors memory factors,
        TrainingLedger.RunValues memory values
    ) private pure returns (bool) {
        if (values.scheduleRounds == 0) return false;
        uint256 last = values.scheduleRounds - 1;
        uint256 index = proof.record.round < last ? proof.record.round : last;
        bytes calldata leaf = proof.scheduleLeaf;
        if (
            leaf.length != 96 || ProverCommon.word(leaf, 0) != index
                || !ProverCommon.verifyLeaf(leaf, index, values.scheduleRounds, proof.schedulePath, values.scheduleRoot)
        ) revert AggregationProver.ProverBadSchedule(proof.record.round, index);
        return ProverCommon.word(leaf, 32) != factors.lr || ProverCommon.word(leaf, 64) != factors.mu
            || factors.nesterov != values.nesterov;
    }

    /// @dev The four tensor leaves of the chunk are under their roots.
    function _openChunk(
        AggregationProver.Proof calldata proof,
        AggregationProver.StageLeaf memory prev,
        AggregationProver.StageLeaf memory next
    ) private pure {
        uint256 chunk = proof.chunk;
        uint256 count = prev.numChunks;
        if (!ProverCommon.verifyLeaf(proof.prevWeights.leaf, chunk, count, proof.prevWeights.path, prev.weightsRoot)) {
            revert AggregationProver.ProverBadPath(0);
        }
        AggregationProver.Opening calldata prevMomentum = proof.prevMomentum;
        if (!ProverCommon.verifyLeaf(prevMomentum.leaf, chunk, count, prevMomentum.path, prev.momentumRoot)) {
            revert AggregationProver.ProverBadPath(1);
        }
        if (!ProverCommon.verifyLeaf(proof.newWeights.leaf, chunk, count, proof.newWeights.path, next.weightsRoot)) {
            revert AggregationProver.ProverBadPath(2);
        }
        if (!ProverCommon.verifyLeaf(proof.newMomentum.leaf, chunk, count, proof.newMomentum.path, next.momentumRoot)) {
            revert AggregationProver.ProverBadPath(3);
        }
    }

    /// @dev Whether a committed new leaf differs from the recomputation (its header must be the previous one).
    function _compare(
        AggregationProver.Proof calldata proof,
        AggregationProver.Factors memory factors,
        AggregationProver.Layout memory place
    ) private pure returns (bool) {
        bytes calldata newWeights = proof.newWeights.leaf;
        bytes calldata newMomentum = proof.newMomentum.leaf;
        uint256 size = ProverCommon.LEAF_HEADER + 4 * place.count;
        if (newWeights.length != size || newMomentum.length != size) return true;
        bytes32 header = keccak256(proof.prevWeights.leaf[:ProverCommon.LEAF_HEADER]);
        if (
            keccak256(newWeights[:ProverCommon.LEAF_HEADER]) != header
                || keccak256(newMomentum[:ProverCommon.LEAF_HEADER]) != header
        ) {
            return true;
        }
        for (uint256 k = 0; k < place.count; ++k) {
            (uint32 weight, uint32 momentum) = _element(proof, factors, place, k);
            if (!Float32.same32(weight, ProverCommon.u32(newWeights, ProverCommon.LEAF_HEADER + 4 * k))) return true;
            if (!Float32.same32(momentum, ProverCommon.u32(newMomentum, ProverCommon.LEAF_HEADER + 4 * k))) return true;
        }
        return false;
    }

    /// @dev The committed factors' first six fields (version 2's; a version-3 factors' too), canonical (checked).
    function _factors(AggregationProver.Proof calldata proof)
        private
        pure
        returns (AggregationProver.Factors memory factors)
    {
        (factors.lr, factors.mu, factors.nesterov, factors.envelopes, factors.payloadRoots, factors.scales) =
            abi.decode(proof.factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
    }

    /// @dev One element's new weight and momentum: decode, clip, the in-order sum, / M, the (Nesterov) step.
    function _element(
        AggregationProver.Proof calldata proof,
        AggregationProver.Factors memory factors,
        AggregationProver.Layout memory place,
        uint256 k
    )
        private
        pure
        returns (uint32 weight, uint32 momentum)
    {
        uint256 p = ProverCommon.LEAF_HEADER + 4 * k;
        weight = ProverCommon.u32(proof.prevWeights.leaf, p);
        momentum = ProverCommon.u32(proof.prevMomentum.leaf, p);
        uint256 accepted = proof.pieces.length;
        if (accepted == 0) return (weight, momentum); // every contribution left out: a no-op round
        uint32 delta = _scaled(ProverCommon.decodeElement(proof.pieces[0].leaf, place, k), factors.scales[0]);
        for (uint256 j = 1; j < accepted; ++j) {
            delta = delta.add(_scaled(ProverCommon.decodeElement(proof.pieces[j].leaf, place, k), factors.scales[j]));
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
}
