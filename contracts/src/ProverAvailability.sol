// SPDX-License-Identifier: Apache-2.0
pragma solidity 0.8.37;

import {AggregationProver} from "./AggregationProver.sol";
import {ProverCommon} from "./ProverCommon.sol";
import {TrainingLedger} from "./TrainingLedger.sol";

/// @title ProverAvailability
/// @notice AggregationProver's data-availability game: a challenge names one committed leaf of a committed
/// round; publishing it (with its path) answers, and one unanswered by its deadline overturns the round through
/// the ledger. Linked into AggregationProver and run in its context (DELEGATECALL, so its events and payments
/// are the prover's) on the prover's challenges; the prover's functions of the same names are its callers.
library ProverAvailability {
    /// @dev `Target.which` of a challenge of the factors (a stage leaf's preimage of factorsHash, no tree's leaf).
    uint256 private constant _FACTORS = type(uint256).max - 1;

    /// @notice Challenge the committers of a round to publish one committed leaf (a chunk of the new weights or
    /// momentum, or of an accepted contribution's payload, or a stage leaf itself: `STAGE_LEAF`) on chain within
    /// the run's `accusationBlocks`, depositing the run's bond; only within the round's dispute window
    /// (`disputeBlocks` after its commit). Answered (answerChallenge, by anyone): the bond is forfeited. Unanswered by
    /// the deadline (expireChallenge): the round and every later one are invalid, its attesters slashed, the
    /// challenger paid half of the slash and its bond returned.
    /// @return id The challenge's id, keccak256(runId, round, stage, which, chunk).
    function challengeAvailability(
        mapping(bytes32 => AggregationProver.Challenge) storage challenges,
        TrainingLedger ledger,
        AggregationProver.Target calldata target
    ) external returns (bytes32 id) {
        TrainingLedger.Record calldata record = target.record;
        ProverCommon.requireCommitted(ledger, record);
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        if (target.stage >= run.numStages) revert AggregationProver.ProverBadStage(target.stage, run.numStages);
        if (msg.value != run.bond) revert AggregationProver.ProverBondMismatch(run.bond, msg.value);
        // Only while the round can be disputed: members need not keep a round's leaves available for ever, and
        // an old right round must not fall to a challenge nobody is left to answer.
        uint256 closedAt = ledger.commitBlockOf(record.runId, record.round) + run.disputeBlocks;
        if (block.number >= closedAt) {
            revert AggregationProver.ProverChallengeTooLate(record.runId, record.round, uint64(closedAt));
        }
        (bytes32 root, uint32 numChunks, bool sums) = _targetTree(target, run.numStages);
        id = keccak256(abi.encode(record.runId, record.round, target.stage, target.which, target.chunk));
        AggregationProver.Challenge storage challenge = challenges[id];
        if (challenge.challenger != address(0)) revert AggregationProver.ProverChallengeExists(id);
        uint64 deadline = uint64(block.number) + run.accusationBlocks;
        challenges[id] = AggregationProver.Challenge(
            msg.sender, deadline, numChunks, false, sums, record.round, target.chunk, root, record.runId, msg.value
        );
        emit AggregationProver.AvailabilityChallenged(
            id, record.runId, record.round, target.stage, target.which, target.chunk, msg.sender, deadline
        );
    }

    /// @notice Publish the leaf a challenge names, with its Merkle path (anyone may; a sum tree's leaf: its 96-byte
    /// sum and a sum path, as NormProof's; the factors: their bytes, no path). The bond is forfeited.
    function answerChallenge(
        mapping(bytes32 => AggregationProver.Challenge) storage challenges,
        bytes32 id,
        bytes calldata leaf,
        bytes32[] calldata path
    ) external {
        AggregationProver.Challenge storage challenge = _openChallenge(challenges, id);
        if (block.number >= challenge.deadline) revert AggregationProver.ProverChallengeDue(id, challenge.deadline);
        bool opened;
        if (challenge.numChunks == 0) {
            opened = sha256(leaf) == challenge.root;
        } else if (challenge.sums) {
            (bytes32 root,,) = ProverCommon.openSum(leaf, challenge.chunk, challenge.numChunks, path, 0);
            opened = root == challenge.root;
        } else {
            opened = ProverCommon.verifyLeaf(leaf, challenge.chunk, challenge.numChunks, path, challenge.root);
        }
        if (!opened) revert AggregationProver.ProverBadPath(0);
        challenge.settled = true;
        emit AggregationProver.AvailabilityAnswered(id, leaf);
    }

    /// @notice Settle a challenge left unanswered past its deadline: the round is overturned through the ledger
    /// (invalidateByProof) and the challenger gets its bond back and half of the slash. If the round is already
    /// invalid, only the bond is returned.
    /// @param attesters The round's attesters as RoundCommitted gave them.
    function expireChallenge(
        mapping(bytes32 => AggregationProver.Challenge) storage challenges,
        TrainingLedger ledger,
        bytes32 id,
        address[] calldata attesters
    ) external returns (uint256 reward) {
        AggregationProver.Challenge storage challenge = _openChallenge(challenges, id);
        if (block.number < challenge.deadline) revert AggregationProver.ProverChallengeNotDue(id, challenge.deadline);
        challenge.settled = true;
        address challenger = challenge.challenger;
        uint256 bond = challenge.bond;
        uint64 invalidFrom = ledger.runOf(challenge.runId).invalidFrom;
        if (invalidFrom == 0 || invalidFrom > challenge.round + 1) {
            reward = ledger.invalidateByProof(challenge.runId, challenge.round, attesters, challenger);
        }
        emit AggregationProver.AvailabilityExpired(id, reward);
        // Last: every effect is done. A challenger that refuses its bond leaves it burned.
        (bool ok,) = payable(challenger).call{value: bond}("");
        ok;
    }

    function _openChallenge(mapping(bytes32 => AggregationProver.Challenge) storage challenges, bytes32 id)
        private
        view
        returns (AggregationProver.Challenge storage challenge) {
        challenge = challenges[id];
        if (challenge.challenger == address(0)) revert AggregationProver.ProverNoChallenge(id);
        if (challenge.settled) revert AggregationProver.ProverChallengeSettled(id);
    }

    /// @dev The tree a challenge's leaf must be opened in, its leaf count, and whether it is a sum tree.
    function _targetTree(AggregationProver.Target calldata target, uint32 numStages)
        private
        pure
        returns (bytes32, uint32, bool)
    {
        if (target.which == ProverCommon.STAGE_LEAF) {
            if (target.chunk != target.stage) revert AggregationProver.ProverBadChunk(target.chunk, numStages);
            return (target.record.weightsRoot, numStages, false);
        }
        (AggregationProver.StageLeaf memory leaf, bool leafOk) = ProverCommon.openStageLeaf(
            target.stageLeaf, target.stagePath, target.record.weightsRoot, target.record.round, target.stage, numStages
        );
        // A malformed stage leaf is proven (a chunk or norm proof), not opened.
        if (!leafOk) revert AggregationProver.ProverBadStageLeaf(target.record.round, target.stage);
        bool factors = target.which == _FACTORS;
        uint32 count = factors ? 1 : leaf.numChunks; // the factors are one "leaf", chunk 0
        if (target.chunk >= count) revert AggregationProver.ProverBadChunk(target.chunk, count);
        if (factors) return (leaf.factorsHash, 0, false);
        (bytes32 root, bool sums) = _targetRoot(target, leaf);
        return (root, leaf.numChunks, sums);
    }

    function _targetRoot(AggregationProver.Target calldata target, AggregationProver.StageLeaf memory leaf)
        private
        pure
        returns (bytes32, bool)
    {
        uint256 which = target.which;
        if (which == 0) return (leaf.weightsRoot, false);
        if (which == 1) return (leaf.momentumRoot, false);
        bytes calldata factors = target.factors;
        if (sha256(factors) != leaf.factorsHash) {
            revert AggregationProver.ProverBadFactors(target.record.round, target.stage);
        }
        // Malformed factors are proven (proveWrongAggregation), not opened: a named error, never abi.decode's.
        (,, bool wellFormed) = ProverCommon.factorsShape(factors);
        if (!wellFormed) revert AggregationProver.ProverBadFactors(target.record.round, target.stage);
        (,,,, bytes32[] memory roots,) = abi.decode(factors, (uint32, uint32, bool, bytes32[], bytes32[], uint64[]));
        uint256 j = which - 2;
        if (j < roots.length) return (roots[j], false);
        // 2 + M + j: contribution j's sum tree, in well-formed version-3 factors (others are proven, not opened).
        j -= roots.length;
        if (j >= roots.length || !ProverCommon.isNormed(factors)) {
            revert AggregationProver.ProverBadTarget(which);
        }
        (AggregationProver.Norms memory norms, bool ok) = ProverCommon.normCommitment(factors);
        if (!ok) revert AggregationProver.ProverBadTarget(which);
        return (bytes32(ProverCommon.word(factors, norms.rootsAt + 32 * j)), true);
    }
}
