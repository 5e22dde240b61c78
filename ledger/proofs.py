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
from ledger.abidecode import ABI_DECODE_ERRORS
from ledger.chunkproof import AggregationProof
from ledger.errors import LedgerInputError
from ledger.normproof import SCALES, NormProof


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

    def prove_wrong_aggregation(self, proof: AggregationProof, attesters=None) -> dict:
        """Send the proof; return the receipt. ``attesters``: the round's, as RoundCommitted gave them (None
        reads them from the event).

        Raises:
            ProverRoundCorrect (the chunk is right), ProverBadRecords, ProverNotCommitted, ProverBadStage,
            ProverBadStagePath, ProverBadStageLeaf, ProverBadFactors, ProverBadChunk, ProverBadPath,
            ProverBadLeaf, LedgerRunHalted (the round is already invalid), LedgerNotAttesters.
        """
        what = (
            f"proveWrongAggregation(run {proof.record[0]}, round {proof.record[1]}, stage {proof.stage}, "
            f"chunk {proof.chunk})"
        )
        return self.sender.transact(self._prover, "proveWrongAggregation", self._proof_args(proof, attesters),
                                    what)

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

    def prove_wrong_norm(self, proof: NormProof, attesters=None) -> dict:
        """Send a proof of a wrong clip scale or squared norm (ledger/normproof.py); return the receipt.

        Raises:
            ProverNormCorrect (the round's scales and the opened chunk are right), ProverNotNormed (a
            version-2 round), ProverNotCommitted, ProverBadStage, ProverBadStagePath, ProverBadStageLeaf,
            ProverBadFactors, ProverBadTarget, ProverBadChunk, ProverBadPath, ProverBadLeaf, ProverBadSumPath,
            LedgerRunHalted, LedgerNotAttesters.
        """
        which = "scales" if proof.contribution == SCALES \
            else f"contribution {proof.contribution} chunk {proof.chunk}"
        what = f"proveWrongNorm(run {proof.record[0]}, round {proof.record[1]}, stage {proof.stage}, {which})"
        return self.sender.transact(self._prover, "proveWrongNorm", self._norm_args(proof, attesters), what)

    def challenge_availability(self, target: tuple, *, bond: int | None = None) -> bytes:
        """Challenge the committers to publish one committed leaf
        (``ledger.availability.availability_target``), paying the run's bond; return the challenge's id.

        Raises:
            ProverNotCommitted, ProverBadStage, ProverBadStagePath, ProverBadChunk, ProverBadFactors,
            ProverBadTarget, ProverBondMismatch, ProverChallengeExists, ProverChallengeTooLate (the round's
            dispute window closed).
        """
        record, stage, _leaf, _path, _factors, which, chunk = target
        if bond is None:
            bond = self.run_struct(record[0])["bond"]
        self.sender.transact(self._prover, "challengeAvailability", (target,),
                              f"challengeAvailability(run {record[0]}, round {record[1]}, stage {stage})",
                             bond)
        return keccak(encode(["uint256", "uint64", "uint32", "uint256", "uint64"],
                             [record[0], record[1], stage, which, chunk]))

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

        Raises: ProverNoChallenge, ProverChallengeSettled, ProverChallengeNotDue, LedgerNotAttesters.
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
                            ) -> tuple[bytes, list[bytes] | None] | None:
        """``(leaf, path)`` a challenge was answered with, or None if it was not answered (from ``from_block``
        on; default: the client's ``from_block``). The leaf is ``AvailabilityAnswered``'s; the path is read
        from the answering transaction's calldata (None if that transaction is not a direct
        ``answerChallenge`` call of this challenge and leaf, e.g. one made through another contract)."""
        from ledger.events import EventDecoder, scan_logs

        decoder = EventDecoder(contracts.artifact("AggregationProver")["abi"])
        logs = scan_logs(self.w3, self.prover_address, [decoder.topic("AvailabilityAnswered"),
                                                        "0x" + bytes(challenge_id).hex()],
                         self.from_block if from_block is None else from_block, self.head_block(),
                         self.log_page_blocks, self.sender.rpc)
        for log in logs:
            event = decoder.decode(log)
            if event is None:
                continue
            leaf = bytes(event.args["leaf"])
            # Read like every other call: retried through an outage, then ChainUnavailable.
            sent = self.sender.rpc(lambda tx_hash=event.tx_hash: self.w3.eth.get_transaction(tx_hash),
                                   "eth_getTransactionByHash")
            try:
                function, args = self._prover.decode_function_input(sent["input"])
            except ABI_DECODE_ERRORS:  # calldata of a call through another contract, or malformed: no path
                return leaf, None
            if (function.fn_name != "answerChallenge" or bytes(args["id"]) != bytes(challenge_id)
                    or bytes(args["leaf"]) != leaf):
                return leaf, None
            return leaf, [bytes(sibling) for sibling in args["path"]]
        return None

    def challenge_of(self, challenge_id: bytes) -> dict:
        """A challenge's state by field name (a zero challenger: none)."""
        names = ("challenger", "deadline", "numChunks", "settled", "sums", "round", "chunk", "root", "runId",
                 "bond")
        return dict(zip(names, self.sender.call(self._prover, "challengeOf", (challenge_id,)), strict=True))

    def invalid_from(self, run_id: int) -> int | None:
        """The first invalid round of ``run_id`` (overturned by a verdict or a fraud proof), or None."""
        value = self.run_struct(run_id)["invalidFrom"]
        return value - 1 if value else None
