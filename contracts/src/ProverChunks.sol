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

    /// @notice Whether AggregationProver.proveWrongAggregation(proof) would succeed against `ledger`'s records
    /// (the chunk differs); reverts with the prover's errors on a malformed proof.
    function differs(TrainingLedger ledger, AggregationProver.Proof calldata proof) external view returns (bool) {
        (AggregationProver.StageLeaf memory prev, AggregationProver.StageLeaf memory next) =
            _stageLeaves(ledger, proof);
        return _differs(proof, prev, next);
    }

    /// @dev Both records committed and consecutive; both stage leaves under their records' weights roots.
    function _stageLeaves(TrainingLedger ledger, AggregationProver.Proof calldata proof)
        private
        view
        returns (AggregationProver.StageLeaf memory prev, AggregationProver.StageLeaf memory next)
    {
        TrainingLedger.Record calldata record = proof.record;
        uint256 runId = record.runId;
        if (proof.prevRecord.runId != runId || uint256(proof.prevRecord.round) + 1 != record.round) {
            revert AggregationProver.ProverBadRecords(runId, proof.prevRecord.round, record.round);
        }
        ProverCommon.requireCommitted(ledger, proof.prevRecord);
        ProverCommon.requireCommitted(ledger, record);
        uint32 numStages = ledger.runOf(runId).numStages;
        if (proof.stage >= numStages) revert AggregationProver.ProverBadStage(proof.stage, numStages);
        prev = ProverCommon.openStageLeaf(
            proof.prevStageLeaf, proof.prevStagePath, proof.prevRecord, proof.stage, numStages
        );
        next = ProverCommon.openStageLeaf(proof.stageLeaf, proof.stagePath, record, proof.stage, numStages);
    }

    /// @dev Whether the committed chunk of round t differs from the outer step of its committed inputs.
    function _differs(
        AggregationProver.Proof calldata proof,
        AggregationProver.StageLeaf memory prev,
        AggregationProver.StageLeaf memory next
    )
        private
        pure
        returns (bool)
    {
        // A different chunk count is wrong on its face: the step keeps every tensor's shape.
        if (next.numChunks != prev.numChunks) return true;
        if (proof.chunk >= prev.numChunks) revert AggregationProver.ProverBadChunk(proof.chunk, prev.numChunks);
        (AggregationProver.Factors memory factors, bool wellFormed) = _factors(proof, next.factorsHash);
        if (!wellFormed) return true; // committed factors an honest round never has
        _openChunk(proof, prev, next);
        AggregationProver.Layout memory place =
            ProverCommon.chunkLayout(proof.prevWeights.leaf, proof.prevMomentum.leaf);
        for (uint256 j = 0; j < proof.pieces.length; ++j) {
            AggregationProver.Opening calldata piece = proof.pieces[j];
            bytes32 root = factors.payloadRoots[j];
            if (!ProverCommon.verifyLeaf(piece.leaf, proof.chunk, prev.numChunks, piece.path, root)) {
                revert AggregationProver.ProverBadPath(4 + j);
            }
            // A committed piece that does not decode: the round aggregated something no contribution holds.
            if (!ProverCommon.wellFormedPiece(proof.pieces[j].leaf, place)) return true;
        }
        return _compare(proof, factors, place);
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

    /// @dev The committed factors; `wellFormed` false when their lists differ in length (a wrong round).
    function _factors(AggregationProver.Proof calldata proof, bytes32 factorsHash)
        private
        pure
        returns (AggregationProver.Factors memory factors, bool wellFormed)
    {
        if (sha256(proof.factors) != factorsHash) {
            revert AggregationProver.ProverBadFactors(proof.record.round, proof.stage);
        }
        (factors.lr, factors.mu, factors.nesterov, factors.envelopes, factors.payloadRoots, factors.scales) =
            abi.decode(proof.factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        uint256 accepted = factors.payloadRoots.length;
        if (proof.pieces.length != accepted) revert AggregationProver.ProverBadFactors(proof.record.round, proof.stage);
        wellFormed = factors.envelopes.length == accepted && factors.scales.length == accepted;
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
