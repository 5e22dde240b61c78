// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {Float32} from "./Float32.sol";
import {NormRule} from "./NormRule.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title ProverNorms
/// @notice AggregationProver's norm proof: whether a version-3 round's committed clip scales are not the norm
/// rule of its committed squared norms, or a contribution's sum tree is wrong at a chunk (docs/FRAUD_PROOF.md).
/// Linked into AggregationProver and run in its context (DELEGATECALL); proveWrongNorm and isWrongNorm call it.
library ProverNorms {
    uint8 private constant _NORMED = 3; // RunParams.commitments of a run whose factors carry the norm commitment

    /// @notice Whether AggregationProver.proveWrongNorm(proof) would succeed against `ledger`'s records (the
    /// round's committed scales or squared norms are wrong); reverts with the prover's errors on a malformed proof.
    function normDiffers(TrainingLedger ledger, AggregationProver.NormProof calldata proof)
        external
        view
        returns (bool)
    {
        TrainingLedger.Record calldata record = proof.record;
        ProverCommon.requireCommitted(ledger, record);
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        if (proof.stage >= run.numStages) revert AggregationProver.ProverBadStage(proof.stage, run.numStages);
        (AggregationProver.StageLeaf memory leaf, bool leafOk) = ProverCommon.openStageLeaf(
            proof.stageLeaf, proof.stagePath, record.weightsRoot, record.round, proof.stage, run.numStages
        );
        if (!leafOk) return true; // a stage leaf no honest committer writes
        bytes calldata factors = proof.factors;
        if (sha256(factors) != leaf.factorsHash) revert AggregationProver.ProverBadFactors(record.round, proof.stage);
        // The factors' version (3: twelve fields, the first list at byte 384) must be the run's (RunParams.commitments):
        // version-2 factors in a normed run would escape this proof, version-3 ones in another run are no honest
        // node's either. Either way the round is wrong, whatever the proof's contribution.
        bool normed = ProverCommon.isNormed(factors);
        if (normed != (run.commitments == _NORMED)) return true;
        if (!normed) revert AggregationProver.ProverNotNormed(record.round, proof.stage);
        (AggregationProver.Norms memory norms, bool wellFormed) = ProverCommon.normCommitment(factors);
        if (!wellFormed) return true; // a norm commitment an honest round never makes
        TrainingLedger.RunValues memory values = ledger.valuesOf(record.runId);
        if (_valuesDiffer(proof.factors, norms, values, run.innerSteps)) return true;
        if (proof.contribution == ProverCommon.SCALES) return _scalesDiffer(factors, norms);
        if (proof.contribution >= norms.count) revert AggregationProver.ProverBadTarget(proof.contribution);
        if (proof.chunk >= leaf.numChunks) revert AggregationProver.ProverBadChunk(proof.chunk, leaf.numChunks);
        norms.maxRank = values.maxRank;
        return _sumDiffers(proof, leaf, norms);
    }

    /// @dev Whether the norm commitment breaks the run's values (issue 62): more contributions than
    /// maxContributions, a declared step count above innerSteps (H, the most a round may train), or another norm
    /// clip than the run's (where the run binds its values: scheduleRounds > 0).
    function _valuesDiffer(
        bytes calldata factors,
        AggregationProver.Norms memory norms,
        TrainingLedger.RunValues memory values,
        uint32 innerSteps
    ) private pure returns (bool) {
        if (norms.count > values.maxContributions) return true;
        if (values.scheduleRounds != 0 && norms.clip != values.normClipBits) return true;
        for (uint256 j = 0; j < norms.steps; ++j) {
            if (ProverCommon.word(factors, norms.stepsAt + 32 * j) > innerSteps) return true;
        }
        return false;
    }

    /// @dev The committed scales against the norm rule of the committed sums.
    function _scalesDiffer(bytes calldata factors, AggregationProver.Norms memory norms) private pure returns (bool) {
        uint256[] memory sums = new uint256[](3 * norms.count);
        for (uint256 i = 0; i < sums.length; ++i) {
            sums[i] = ProverCommon.word(factors, norms.sumsAt + 32 * i);
        }
        uint256[] memory steps = new uint256[](norms.steps);
        for (uint256 j = 0; j < steps.length; ++j) {
            steps[j] = ProverCommon.word(factors, norms.stepsAt + 32 * j);
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
    function _sumDiffers(
        AggregationProver.NormProof calldata proof,
        AggregationProver.StageLeaf memory leaf,
        AggregationProver.Norms memory norms
    )
        private
        pure
        returns (bool)
    {
        uint256 j = proof.contribution;
        uint256 chunk = proof.chunk;
        if (!ProverCommon.verifyLeaf(proof.weights.leaf, chunk, leaf.numChunks, proof.weights.path, leaf.weightsRoot)) {
            revert AggregationProver.ProverBadPath(2);
        }
        AggregationProver.Layout memory place = ProverCommon.chunkLayout(proof.weights.leaf, proof.weights.leaf);
        (,,,, bytes32[] memory payloadRoots,) =
            abi.decode(proof.factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        if (!ProverCommon.verifyLeaf(proof.piece.leaf, chunk, leaf.numChunks, proof.piece.path, payloadRoots[j])) {
            revert AggregationProver.ProverBadPath(4 + j);
        }
        // The committed leaf and the total its path gives, under the committed root.
        (bytes32 root, uint256[3] memory total, bool overflow) =
            ProverCommon.openSum(proof.sumLeaf, chunk, leaf.numChunks, proof.sumPath, j);
        if (root != bytes32(ProverCommon.word(proof.factors, norms.rootsAt + 32 * j))) {
            revert AggregationProver.ProverBadSumPath(j);
        }
        if (overflow) return true; // an honest tree's sums are far below 2^768
        uint256 sumAt = norms.sumsAt + 96 * j;
        if (total[0] != ProverCommon.word(proof.factors, sumAt)) return true;
        if (total[1] != ProverCommon.word(proof.factors, sumAt + 32)) return true;
        if (total[2] != ProverCommon.word(proof.factors, sumAt + 64)) return true;
        if (!ProverCommon.wellFormedPiece(proof.piece.leaf, place, norms.maxRank)) return true;
        uint256[3] memory squares;
        for (uint256 k = 0; k < place.count; ++k) {
            uint32 value = ProverCommon.decodeElement(proof.piece.leaf, place, k);
            if (!Float32.isFinite32(value)) return true; // an accepted contribution is finite
            (squares[0], squares[1], squares[2],) = NormRule.addSquare(squares[0], squares[1], squares[2], value);
        }
        bytes calldata sum = proof.sumLeaf; // 96 bytes: checked by _openSum
        return squares[0] != ProverCommon.word(sum, 0) || squares[1] != ProverCommon.word(sum, 32)
            || squares[2] != ProverCommon.word(sum, 64);
    }
}
