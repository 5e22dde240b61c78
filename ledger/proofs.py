"""The fraud proof's calls: :class:`ProofCalls` is a mixin of :class:`ledger.client.LedgerClient` (as
:class:`ledger.disputes.DisputeCalls` is) for the TrainingLedger's AggregationProver (docs/FRAUD_PROOF.md).

Anyone may prove (no stake): a read-only client can check a proof (:meth:`ProofCalls.proof_holds`) but only
an account can send it.
"""

from __future__ import annotations

from functools import cached_property

from eth_utils import to_checksum_address

import contracts
from ledger.chunkproof import AggregationProof
from ledger.errors import LedgerInputError


class ProofCalls:
    """The AggregationProver calls of :class:`ledger.client.LedgerClient`."""

    @cached_property
    def prover_address(self) -> str:
        """The AggregationProver the ledger deployed and takes fraud proofs from."""
        return to_checksum_address(self._sender.call(self._ledger, "prover"))

    @cached_property
    def _prover(self):
        return self.w3.eth.contract(address=self.prover_address, abi=contracts.artifact("AggregationProver")["abi"])

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
        return self._sender.call(self._prover, "isWrong", self._proof_args(proof, attesters), "isWrong")

    def prove_wrong_aggregation(self, proof: AggregationProof, attesters=None) -> dict:
        """Send the proof; return the receipt. ``attesters``: the round's, as RoundCommitted gave them (None
        reads them from the event).

        Raises:
            ProverRoundCorrect (the chunk is right), ProverBadRecords, ProverNotCommitted, ProverBadStage,
            ProverBadStagePath, ProverBadStageLeaf, ProverBadFactors, ProverBadChunk, ProverBadPath,
            ProverBadLeaf, LedgerRunHalted (the round is already invalid), LedgerNotAttesters.
        """
        what = f"proveWrongAggregation(run {proof.record[0]}, round {proof.record[1]}, stage {proof.stage}, " \
               f"chunk {proof.chunk})"
        return self._sender.transact(self._prover, "proveWrongAggregation", self._proof_args(proof, attesters), what)

    def invalid_from(self, run_id: int) -> int | None:
        """The first invalid round of ``run_id`` (overturned by a verdict or a fraud proof), or None."""
        value = self._run_struct(run_id)["invalidFrom"]
        return value - 1 if value else None
