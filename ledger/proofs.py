"""The fraud proof's calls: :class:`ProofCalls` is a mixin of :class:`ledger.client.LedgerClient` (as
:class:`ledger.disputes.DisputeCalls` is) for the TrainingLedger's AggregationProver (docs/FRAUD_PROOF.md).

Anyone may prove (no stake): a read-only client can check a proof (:meth:`ProofCalls.proof_holds`) but only
an account can send it.
"""

from __future__ import annotations

from functools import cached_property

from eth_abi import encode
from eth_utils import keccak, to_checksum_address

import contracts
from ledger.chunkproof import AggregationProof
from ledger.errors import LedgerInputError
from ledger.normproof import SCALES, NormProof


def challenge_id(run_id: int, outer_round: int, stage: int, which: int, chunk: int, challenger: str) -> bytes:
    """An availability challenge's id as ``ProverAvailability.challengeAvailability`` makes it: its challenger
    is part of it (issue 79), so nobody's challenge blocks another's."""
    return keccak(encode(["uint256", "uint64", "uint32", "uint256", "uint64", "address"],
                         [run_id, outer_round, stage, which, chunk, to_checksum_address(challenger)]))


class ProofCalls:
    """The AggregationProver calls of :class:`ledger.client.LedgerClient`."""

    @cached_property
    def prover_address(self) -> str:
        """The AggregationProver the ledger deployed and takes fraud proofs from."""
        return to_checksum_address(self.sender.call(self.ledger_contract, "prover"))

    @cached_property
    def _prover(self):
        return self.w3.eth.contract(address=self.prover_address,
                                    abi=contracts.artifact("AggregationProver")["abi"])

    def _proof_args(self, proof: AggregationProof, attesters) -> tuple:
        if not isinstance(proof, AggregationProof):
            raise LedgerInputError(f"a fraud proof must be an AggregationProof, got {type(proof).__name__}")
        if attesters is None:
            commit = self.commit_record(proof.record[0], proof.record[1])
            if commit is None:  # let the contract name it: ProverNotCommitted
                attesters = ()
            else:
                attesters = commit.attesters
        (args,) = proof.args()
        return ((*args, [to_checksum_address(a) for a in attesters]),)

    def proof_holds(self, proof: AggregationProof, attesters=None) -> bool:
        """Whether the proof would succeed now (the chunk differs); raises the contract's error if malformed
        (ProverBadPath, ProverBadFactors, ...)."""
        return self.sender.call(self._prover, "isWrong", self._proof_args(proof, attesters), "isWrong")

    def prove_wrong_aggregation(self, proof: AggregationProof, attesters=None, *,
                                commit: bool = True) -> dict:
        """Send the proof; return the receipt. ``attesters``: the round's, as RoundCommitted gave them (None
        reads them from the event). ``commit``: first commit to it (:meth:`commit_proof`, mined before the
        proof is sent) unless committed already, so that its reward is paid at once and a copy sent by a
        front-runner pays it nothing (issue 62); False sends it bare (its reward is then held for the claim
        window, :meth:`claim_reward`).

        Raises:
            ProverRoundCorrect (the chunk is right), ProverBadRecords, ProverNotCommitted, ProverBadStage,
            ProverBadStagePath, ProverBadStageLeaf, ProverBadFactors, ProverBadChunk, ProverBadPath,
            ProverBadLeaf, LedgerRunHalted (the round is already invalid), LedgerNotAttesters,
            ProverParentOpen (the parent round can still be overturned: retry later), ProverProofWindowClosed.
        """
        what = (
            f"proveWrongAggregation(run {proof.record[0]}, round {proof.record[1]}, stage {proof.stage}, "
            f"chunk {proof.chunk})"
        )
        args = self._proof_args(proof, attesters)
        if commit:
            self._commit_once(proof, args[0][-1])
        return self.sender.transact(self._prover, "proveWrongAggregation", args, what)

    def _norm_args(self, proof: NormProof, attesters) -> tuple:
        if not isinstance(proof, NormProof):
            raise LedgerInputError(f"a norm proof must be a NormProof, got {type(proof).__name__}")
        if attesters is None:
            commit = self.commit_record(proof.record[0], proof.record[1])
            attesters = commit.attesters if commit is not None else ()  # else the contract names it
        return proof.args([to_checksum_address(a) for a in attesters])

    def norm_proof_holds(self, proof: NormProof, attesters=None) -> bool:
        """Whether the norm proof would succeed now; raises the contract's error if malformed
        (ProverNotNormed, ProverBadSumPath, ProverBadPath, ...)."""
        return self.sender.call(self._prover, "isWrongNorm", self._norm_args(proof, attesters), "isWrongNorm")

    def prove_wrong_norm(self, proof: NormProof, attesters=None, *, commit: bool = True) -> dict:
        """Send a proof of a wrong clip scale or squared norm (ledger/normproof.py); return the receipt.
        ``commit``: as :meth:`prove_wrong_aggregation`'s.

        Raises:
            ProverNormCorrect (the round's scales and the opened chunk are right), ProverNotNormed (a
            version-2 round), ProverNotCommitted, ProverBadStage, ProverBadStagePath, ProverBadStageLeaf,
            ProverBadFactors, ProverBadTarget, ProverBadChunk, ProverBadPath, ProverBadLeaf, ProverBadSumPath,
            LedgerRunHalted, LedgerNotAttesters, ProverParentOpen, ProverProofWindowClosed.
        """
        which = "scales" if proof.contribution == SCALES \
            else f"contribution {proof.contribution} chunk {proof.chunk}"
        what = f"proveWrongNorm(run {proof.record[0]}, round {proof.record[1]}, stage {proof.stage}, {which})"
        args = self._norm_args(proof, attesters)
        if commit:
            self._commit_once(proof, args[0][-1])
        return self.sender.transact(self._prover, "proveWrongNorm", args, what)

    def challenge_availability(self, target: tuple, *, bond: int | None = None) -> bytes:
        """Challenge the committers to publish one committed leaf
        (``ledger.availability.availability_target``), paying the run's bond; return the challenge's id.

        Raises:
            ProverNotCommitted, ProverBadStage, ProverBadStagePath, ProverBadChunk, ProverBadFactors,
            ProverBadTarget, ProverBondMismatch, ProverChallengeExists, ProverChallengeTooLate (the round's
            dispute window closed and this account's game on the stage has no fresh window),
            ProverGameTooLong.
        """
        record, stage, _leaf, _path, _factors, which, chunk = target
        if bond is None:
            bond = self.run_struct(record[0])["bond"]
        self.sender.transact(self._prover, "challengeAvailability", (target,),
                              f"challengeAvailability(run {record[0]}, round {record[1]}, stage {stage})",
                             bond)
        return challenge_id(record[0], record[1], stage, which, chunk, self.address)

    def answer_challenge(self, challenge_id: bytes, leaf: bytes, path: list[bytes]) -> dict:
        """Publish the challenged leaf with its path (``ledger.availability.availability_answer``; a sum
        tree's leaf: its 96-byte sum and its sum path).

        Raises: ProverNoChallenge, ProverChallengeSettled, ProverChallengeDue, ProverBadPath, ProverBadSumPath
        (a sum tree's leaf of another width or a path of another length).
        """
        return self.sender.transact(self._prover, "answerChallenge", (challenge_id, leaf, path),
                                    "answerChallenge")

    def expire_challenge(self, challenge_id: bytes, attesters=None) -> dict:
        """Settle an unanswered challenge past its deadline: its round is overturned (``attesters``: the
        round's, None reads them from RoundCommitted), the challenger paid half of the slash and its bond
        returned.

        Raises: ProverNoChallenge, ProverChallengeSettled, ProverChallengeNotDue, LedgerNotAttesters,
        ProverProofWindowClosed (the expiry window after the deadline passed).
        """
        if attesters is None:
            state = self.challenge_of(challenge_id)
            commit = self.commit_record(state["runId"], state["round"])
            attesters = commit.attesters if commit is not None else ()
        return self.sender.transact(self._prover, "expireChallenge",
                                     (challenge_id, [to_checksum_address(a) for a in attesters]),
                                    "expireChallenge")

    def availability_challenges(self, run_id: int, from_block: int | None = None) -> list[dict]:
        """The availability challenges of ``run_id`` opened from ``from_block`` on (default: the client's
        ``from_block``), in chain order: ``AvailabilityChallenged``'s fields by name (what a member
        answers)."""
        from ledger.events import EventDecoder, scan_logs, topic_uint

        decoder = EventDecoder(contracts.artifact("AggregationProver")["abi"])
        logs = scan_logs(self.w3, self.prover_address, [decoder.topic("AvailabilityChallenged"), None,
                                                        topic_uint(run_id)],
                         self.from_block if from_block is None else from_block, self.head_block(),
                         self.log_page_blocks, self.sender.rpc)
        found = []
        for log in logs:
            event = decoder.decode(log)
            if event is not None:
                found.append({**event.args, "block": event.block_number})
        return found

    def availability_answer(self, challenge_id: bytes, from_block: int | None = None
                            ) -> tuple[bytes, list[bytes]] | None:
        """``(leaf, path)`` a challenge was answered with, or None if it was not answered (from ``from_block``
        on; default: the client's ``from_block``): both from ``AvailabilityAnswered``'s log, so an answer sent
        through another contract (a relay) reads the same as a direct one (issue 62)."""
        from ledger.events import EventDecoder, scan_logs

        decoder = EventDecoder(contracts.artifact("AggregationProver")["abi"])
        logs = scan_logs(self.w3, self.prover_address, [decoder.topic("AvailabilityAnswered"),
                                                        "0x" + bytes(challenge_id).hex()],
                         self.from_block if from_block is None else from_block, self.head_block(),
                         self.log_page_blocks, self.sender.rpc)
        for log in logs:
            event = decoder.decode(log)
            if event is not None:
                return bytes(event.args["leaf"]), [bytes(sibling) for sibling in event.args["path"]]
        return None

    def challenge_of(self, challenge_id: bytes) -> dict:
        """A challenge's state by field name (a zero challenger: none)."""
        names = ("challenger", "deadline", "numChunks", "settled", "sums", "round", "chunk", "root", "runId",
                 "bond", "stage")
        return dict(zip(names, self.sender.call(self._prover, "challengeOf", (challenge_id,)), strict=True))

    def invalid_from(self, run_id: int) -> int | None:
        """The first invalid round of ``run_id`` (overturned by a verdict or a fraud proof), or None."""
        value = self.run_struct(run_id)["invalidFrom"]
        return value - 1 if value else None

    # The clock and the reward (issue 62) ------------------------------------------------------------------
    def proof_calldata(self, proof: AggregationProof | NormProof, attesters=None) -> bytes:
        """The calldata of the call that sends ``proof`` (proveWrongAggregation or proveWrongNorm)."""
        if isinstance(proof, NormProof):
            name, args = "proveWrongNorm", self._norm_args(proof, attesters)
        else:
            name, args = "proveWrongAggregation", self._proof_args(proof, attesters)
        return bytes.fromhex(self._prover.encode_abi(name, args=args)[2:])

    def proof_commitment(self, proof: AggregationProof | NormProof, attesters=None) -> bytes:
        """``keccak256(abi.encode(this account, keccak256(calldata)))``: what :meth:`commit_proof` commits."""
        calldata_hash = keccak(self.proof_calldata(proof, attesters))
        return keccak(encode(["address", "bytes32"], [self.address, calldata_hash]))

    def commit_proof(self, proof: AggregationProof | NormProof, attesters=None) -> bytes:
        """Commit to ``proof`` (AggregationProver.commitProof) before sending it: sent a block or more later,
        its reward is paid to this account at once, and a copy of it sent by another (a front-runner) leaves
        the reward to this account's :meth:`claim_reward`. Returns the commitment. ``attesters`` must be those
        the proof will be sent with (None: RoundCommitted's, as when sending)."""
        commitment = self.proof_commitment(proof, attesters)
        self.sender.transact(self._prover, "commitProof", (commitment,), "commitProof")
        return commitment

    def _commit_once(self, proof, attesters) -> None:
        """Commit to ``proof`` unless this account did already; return once the commitment is mined. The
        proof is not tried first (on py-evm its execution costs seconds): a refused one wastes the
        commitment's gas only."""
        if self.proof_committed_at(self.proof_commitment(proof, attesters)) is None:
            self.commit_proof(proof, attesters)

    def proof_committed_at(self, commitment: bytes) -> int | None:
        """The block ``commitment`` was first committed in, or None."""
        block = self.sender.call(self._prover, "proofCommittedAt", (commitment,))
        return block or None

    def claim_of(self, run_id: int, round: int) -> dict:
        """The reward held for round ``round`` (AggregationProver.claimOf) by field name; reward 0: none."""
        names = ("prover", "provenAt", "deadline", "reward", "proofHash")
        return dict(zip(names, self.sender.call(self._prover, "claimOf", (run_id, round)), strict=True))

    def claim_reward(self, run_id: int, round: int) -> dict:
        """Take the reward held for round ``round``: as an earlier committer of the proof that overturned it
        (within its claim window), or as its sender (after).

        Raises: ProverNoClaim, ProverNotClaimant.
        """
        return self.sender.transact(self._prover, "claimReward", (run_id, round),
                                    f"claimReward(run {run_id}, round {round})")

    def reclaim_bonds(self, run_id: int, round: int, stage: int) -> dict:
        """Take back the escrowed bonds of this account's answered challenges on ``stage`` of an overturned
        round.

        Raises: ProverRoundStands (the round was not overturned).
        """
        return self.sender.transact(self._prover, "reclaimBonds", (run_id, round, stage),
                                    f"reclaimBonds(run {run_id}, round {round}, stage {stage})")

    def game_of(self, run_id: int, round: int, stage: int, challenger: str | None = None) -> dict:
        """``challenger``'s (default: this account's) availability game on ``stage`` of ``round``: steps,
        continueBy (first block no further step may open after the dispute window), escrow."""
        who = to_checksum_address(challenger or self.address)
        steps, continue_by, escrow = self.sender.call(self._prover, "gameOf", (run_id, round, stage, who))
        return {"steps": steps, "continueBy": continue_by, "escrow": escrow}

    def proof_window_of(self, run_id: int, round: int) -> tuple[int, int]:
        """``(opens_at, closes_at)``: the blocks [opens_at, closes_at) in which a proof of ``round`` is taken
        (TrainingLedger.proofWindowOf: once its parent can no longer be overturned, until its own dispute
        window and games are over)."""
        opens_at, closes_at = self.sender.call(self.ledger_contract, "proofWindowOf", (run_id, round))
        return opens_at, closes_at
