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
    /// the run's `accusationBlocks`, depositing the run's bond. The challenges of one challenger on one stage of
    /// one round are the steps of its game (issue 62, the chess clock): a game starts within the round's dispute
    /// window (`disputeBlocks` after its commit); each answered step gives its challenger `accusationBlocks`
    /// more to open the next, even after the window; at most the run's `maxGameSteps` steps. Answered
    /// (answerChallenge, by anyone): the bond goes to the game's escrow. Unanswered by the deadline
    /// (expireChallenge): the round and every later one are invalid, its attesters slashed, the challenger paid
    /// half of the slash, its bond and its game's escrow.
    /// @return id The challenge's id, keccak256(runId, round, stage, which, chunk, challenger): one challenger's
    /// challenge never blocks another's (issue 79), so a squatter that opens an honest walker's next target first
    /// (or copies it from the mempool) spends only its own game's clock.
    function challengeAvailability(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        AggregationProver.Target calldata target
    ) external returns (bytes32 id) {
        TrainingLedger.Record calldata record = target.record;
        ProverCommon.requireCommitted(ledger, record);
        TrainingLedger.Run memory run = ledger.runOf(record.runId);
        // issue 79: no node of a hashed run answers a challenge (node/live/fraud/answerer.py serves chunked runs):
        // one there would only let an outsider slash a right round's attesters by waiting.
        if (run.commitments < 2) revert AggregationProver.ProverNoAnswerer(record.runId);
        if (target.stage >= run.numStages) revert AggregationProver.ProverBadStage(target.stage, run.numStages);
        if (msg.value != run.bond) revert AggregationProver.ProverBondMismatch(run.bond, msg.value);
        uint64 deadline = _step(p, ledger, run, record.runId, record.round, target.stage); // the clock first
        (bytes32 root, uint32 numChunks, bool sums) = _targetTree(target, run.numStages);
        id = keccak256(abi.encode(record.runId, record.round, target.stage, target.which, target.chunk, msg.sender));
        if (p.challenges[id].challenger != address(0)) revert AggregationProver.ProverChallengeExists(id);
        p.challenges[id] = AggregationProver.Challenge(
            msg.sender, deadline, numChunks, false, sums, record.round, target.chunk, root, record.runId, msg.value,
            target.stage
        );
        emit AggregationProver.AvailabilityChallenged(
            id, record.runId, record.round, target.stage, target.which, target.chunk, msg.sender, deadline
        );
    }

    /// @dev Open the next step of the caller's game on `stage` of the round; its challenge's deadline.
    function _step(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        TrainingLedger.Run memory run,
        uint256 runId,
        uint64 round,
        uint32 stage
    ) private returns (uint64 deadline) {
        bytes32 gameKey = keccak256(abi.encode(runId, round, stage, msg.sender));
        AggregationProver.Game storage game = p.games[gameKey];
        if (game.steps >= run.maxGameSteps) revert AggregationProver.ProverGameTooLong(gameKey, run.maxGameSteps);
        // A game starts only while the round can be disputed (members need not keep a round's leaves for ever);
        // after that only an answered step's fresh window continues it, so a last-block answer costs the
        // challenger nothing and the clock never runs out on it.
        uint256 closedAt = ledger.commitBlockOf(runId, round) + run.disputeBlocks;
        if (block.number >= closedAt && block.number >= game.continueBy) {
            revert AggregationProver.ProverChallengeTooLate(
                runId, round, uint64(closedAt > game.continueBy ? closedAt : game.continueBy)
            );
        }
        game.steps += 1;
        deadline = uint64(block.number) + run.accusationBlocks;
        // Answered by `deadline`, the next step may come `accusationBlocks` after the answer; unanswered, the
        // challenger expires it within `accusationBlocks` after the deadline: the round stays live until then.
        uint64 live = deadline + run.accusationBlocks;
        if (p.liveUntil[runId][round] < live) p.liveUntil[runId][round] = live;
    }

    /// @notice Publish the leaf a challenge names, with its Merkle path (anyone may, a relay contract too; a sum
    /// tree's leaf: its 96-byte sum and a sum path, as NormProof's; the factors: their bytes, no path). The bond
    /// goes to the game's escrow and its challenger gets `accusationBlocks` to open its next step.
    function answerChallenge(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        bytes32 id,
        bytes calldata leaf,
        bytes32[] calldata path
    ) external {
        AggregationProver.Challenge storage challenge = _openChallenge(p, id);
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
        AggregationProver.Game storage game =
            p.games[keccak256(abi.encode(challenge.runId, challenge.round, challenge.stage, challenge.challenger))];
        game.escrow += uint128(challenge.bond);
        game.continueBy = uint64(block.number) + ledger.runOf(challenge.runId).accusationBlocks;
        emit AggregationProver.AvailabilityAnswered(id, leaf, path, msg.sender);
    }

    /// @notice Settle a challenge left unanswered past its deadline, within `accusationBlocks` after it: the round
    /// is overturned through the ledger (invalidateByProof) and the game's challenger (whoever calls) gets its
    /// bond, its game's escrow and half of the slash. If the round is already invalid, bond and escrow only.
    /// @param attesters The round's attesters as RoundCommitted gave them.
    function expireChallenge(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        bytes32 id,
        address[] calldata attesters
    ) external returns (uint256 reward) {
        AggregationProver.Challenge storage challenge = _openChallenge(p, id);
        if (block.number < challenge.deadline) revert AggregationProver.ProverChallengeNotDue(id, challenge.deadline);
        uint256 runId = challenge.runId;
        uint64 round = challenge.round;
        uint64 live = p.liveUntil[runId][round];
        if (block.number >= live) revert AggregationProver.ProverProofWindowClosed(runId, round, live);
        challenge.settled = true;
        address challenger = challenge.challenger;
        AggregationProver.Game storage game = p.games[keccak256(abi.encode(runId, round, challenge.stage, challenger))];
        uint256 payment = challenge.bond + game.escrow;
        game.escrow = 0;
        uint64 invalidFrom = ledger.runOf(runId).invalidFrom;
        if (invalidFrom == 0 || invalidFrom > round + 1) {
            reward = ledger.invalidateByProof(runId, round, attesters, challenger);
        }
        emit AggregationProver.AvailabilityExpired(id, reward);
        // Last: every effect is done. A challenger that refuses its bond leaves it burned.
        (bool ok,) = payable(challenger).call{value: payment}("");
        ok;
    }

    /// @notice AggregationProver's overturn of round `round` on a proof whose calldata hashes to `proofHash`:
    /// only within the round's proof window (TrainingLedger.proofWindowOf: once its parent can no longer be
    /// overturned, until its own games and window are over); the reward is paid to the sender if it committed
    /// the proof at least one block before (commitProof), else held for the claim window.
    function overturn(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        uint256 runId,
        uint64 round,
        address[] calldata attesters,
        bytes32 proofHash
    ) external returns (uint256 reward) {
        (uint64 opensAt, uint64 closesAt) = ledger.proofWindowOf(runId, round);
        if (block.number < opensAt) revert AggregationProver.ProverParentOpen(runId, round - 1, opensAt);
        if (block.number >= closesAt) revert AggregationProver.ProverProofWindowClosed(runId, round, closesAt);
        reward = ledger.invalidateByProof(runId, round, attesters, address(this));
        uint64 committedAt = p.proofCommitments[keccak256(abi.encode(msg.sender, proofHash))];
        if (committedAt != 0 && committedAt < block.number) {
            _pay(runId, round, msg.sender, reward);
            return reward;
        }
        uint64 deadline = uint64(block.number) + ledger.runOf(runId).accusationBlocks;
        p.claims[runId][round] =
            AggregationProver.Claim(msg.sender, uint64(block.number), deadline, uint128(reward), proofHash);
        emit AggregationProver.RewardEscrowed(runId, round, msg.sender, reward, deadline);
        reward = 0;
    }

    /// @notice AggregationProver.claimReward.
    function claimReward(AggregationProver.ProverState storage p, uint256 runId, uint64 round)
        external
        returns (uint256 reward)
    {
        AggregationProver.Claim storage claim = p.claims[runId][round];
        reward = claim.reward;
        if (reward == 0) revert AggregationProver.ProverNoClaim(runId, round);
        uint64 committedAt = p.proofCommitments[keccak256(abi.encode(msg.sender, claim.proofHash))];
        bool earlier = committedAt != 0 && committedAt < claim.provenAt && block.number < claim.deadline;
        bool late = msg.sender == claim.prover && block.number >= claim.deadline;
        if (!earlier && !late) revert AggregationProver.ProverNotClaimant(runId, round, msg.sender);
        claim.reward = 0;
        _pay(runId, round, msg.sender, reward);
    }

    /// @notice AggregationProver.reclaimBonds.
    function reclaimBonds(
        AggregationProver.ProverState storage p,
        TrainingLedger ledger,
        uint256 runId,
        uint64 round,
        uint32 stage
    ) external returns (uint256 amount) {
        uint64 invalidFrom = ledger.runOf(runId).invalidFrom;
        if (invalidFrom == 0 || invalidFrom > round + 1) revert AggregationProver.ProverRoundStands(runId, round);
        AggregationProver.Game storage game = p.games[keccak256(abi.encode(runId, round, stage, msg.sender))];
        amount = game.escrow;
        game.escrow = 0;
        emit AggregationProver.BondsReclaimed(runId, round, stage, msg.sender, amount);
        (bool ok,) = payable(msg.sender).call{value: amount}("");
        ok;
    }

    function _pay(uint256 runId, uint64 round, address recipient, uint256 reward) private {
        emit AggregationProver.RewardClaimed(runId, round, recipient, reward);
        // Last: every effect is done. A recipient that refuses the payment leaves it burned.
        (bool ok,) = payable(recipient).call{value: reward}("");
        ok;
    }

    function _openChallenge(AggregationProver.ProverState storage p, bytes32 id)
        private
        view
        returns (AggregationProver.Challenge storage challenge) {
        challenge = p.challenges[id];
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
