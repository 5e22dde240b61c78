// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
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
    /// @notice Reverts unless `run`'s subject is on `ledger`'s record, as `b` opens it.
    function check(TrainingLedger ledger, StepProver.RunClaim calldata run, StepProver.RunBinding calldata b)
        external
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
