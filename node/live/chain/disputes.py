"""Disputes on chain: record disputes, equivocation reports, fraud proofs, availability
challenges and accusations (NodeChain's)."""

from __future__ import annotations

from ledger.attest import recover_verdict_signer
from ledger.eventrecords import AccusationRecord
from ledger.records import AccusationState, RoundRecord, Verdict


class ChainDisputes:
    """The chain's dispute calls (see the module docstring)."""

    def dispute(self, record: RoundRecord, signature: bytes) -> str:
        with self._lock:
            return self.client.dispute(record, signature)

    def report_equivocation(self, record_a: RoundRecord, signature_a: bytes, record_b: RoundRecord,
                            signature_b: bytes) -> str:
        with self._lock:
            return self.client.report_equivocation(record_a, signature_a, record_b, signature_b)

    # -- fraud proofs (docs/FRAUD_PROOF.md; node/live/fraud/prover.py) -------------------------
    def prove_wrong_aggregation(self, proof, attesters=None) -> dict:
        with self._lock:
            return self.client.prove_wrong_aggregation(proof, attesters)

    def prove_wrong_norm(self, proof, attesters=None) -> dict:
        with self._lock:
            return self.client.prove_wrong_norm(proof, attesters)

    def norm_proof_holds(self, proof, attesters=None) -> bool:
        """Whether the norm proof would succeed now (the contract's view ``isWrongNorm``)."""
        with self._lock:
            return self.client.norm_proof_holds(proof, attesters)

    def claim_held_reward(self, run_id: int, round: int) -> dict | None:
        """Claim the reward held for ``round`` (a proof of it sent by another first, issue 62) if this
        account's earlier commitment is of that proof; the receipt, or None if there is nothing to claim."""
        from ledger.errors import ProverNoClaim, ProverNotClaimant

        with self._lock:
            try:
                return self.client.claim_reward(run_id, round)
            except (ProverNoClaim, ProverNotClaimant):
                return None

    def reclaim_game_bonds(self, run_id: int, round: int, stage: int) -> int:
        """Take back this account's escrowed bonds of its game on ``stage`` of an overturned ``round`` (issue
        62); the wei taken (0: none escrowed)."""
        with self._lock:
            escrow = self.client.game_of(run_id, round, stage)["escrow"]
            if escrow:
                self.client.reclaim_bonds(run_id, round, stage)
            return escrow

    def proof_window_of(self, run_id: int, round: int) -> tuple[int, int]:
        """(opens_at, closes_at) of the proofs of ``round`` (TrainingLedger.proofWindowOf)."""
        with self._lock:
            return self.client.proof_window_of(run_id, round)

    def challenge_availability(self, target: tuple) -> bytes:
        """Open an availability challenge; the head before it was sent is kept as where its answer is looked
        for (:meth:`availability_answer`): an answer cannot be mined before its challenge."""
        with self._lock:
            opened_after = self.client.head_block()
            challenge_id = self.client.challenge_availability(target)
            self._challenge_opened[challenge_id] = opened_after
            return challenge_id

    def expire_challenge(self, challenge_id: bytes, attesters=None) -> dict:
        with self._lock:
            return self.client.expire_challenge(challenge_id, attesters)

    def challenge_of(self, challenge_id: bytes) -> dict:
        with self._lock:
            return self.client.challenge_of(challenge_id)

    def availability_answer(self, challenge_id: bytes) -> tuple[bytes, list[bytes]] | None:
        """The answer to a challenge, read from the block before this node opened it (a challenge an earlier
        life opened: from the client's start block). Read from the start block every time, each answer's
        look-up cost grew with the run (issue 79)."""
        with self._lock:
            return self.client.availability_answer(challenge_id, self._challenge_opened.get(challenge_id))

    def availability_challenges(self, run_id: int, from_block: int) -> tuple[list[dict], int]:
        """(the availability challenges of ``run_id`` opened in [from_block, head], head)."""
        with self._lock:
            head = self.client.head_block()
            return self.client.availability_challenges(run_id, from_block) if from_block <= head else [], head

    def contribution_cases(self, run_id: int, from_block: int) -> tuple[list[dict], int]:
        """(the contribution cases of ``run_id`` opened in [from_block, head] on the ledger's StepProver, its
        ``CaseOpened`` fields by name and ``block``; head): what a node's case defender reads (issue 78)."""
        from ledger.stepcase import ledger_step_prover
        from ledger.stepdefense import cases_opened

        with self._lock:
            head = self.client.head_block()
            if from_block > head:
                return [], head
            prover = ledger_step_prover(self.client.w3, self.client.ledger_address)
            start = max(from_block, self.client.from_block)
            return cases_opened(self.client, prover, run_id, start, head), head

    def answer_challenge(self, challenge_id: bytes, leaf: bytes, path: list[bytes]) -> dict:
        with self._lock:
            return self.client.answer_challenge(challenge_id, leaf, path)

    def invalid_from(self, run_id: int) -> int | None:
        """The first round of ``run_id`` a verdict or a fraud proof overturned, or None."""
        with self._lock:
            return self.client.invalid_from(run_id)

    # -- accusations (re-execution spot checks, docs/PROTOCOL.md "Spot checks") -----------
    def sign_verdict(self, verdict: Verdict) -> bytes:
        return self.client.sign_verdict(verdict)

    def verdict_signer(self, verdict: Verdict, signature: bytes) -> str:
        """The account whose EIP-712 signature over ``verdict`` this is (raises LedgerError if malformed)."""
        return recover_verdict_signer(verdict, signature, self.client.chain_id, self.client.ledger_address)

    def accuse(self, run_id: int, accused: str, evidence_hash: bytes) -> str:
        with self._lock:
            return self.client.accuse(run_id, accused, evidence_hash)

    def resolve_accusation(self, verdict: Verdict, signatures: list[bytes]) -> str:
        with self._lock:
            return self.client.resolve_accusation(verdict, signatures)

    def accusation_status(self, run_id: int, accused: str, evidence_hash: bytes) -> str:
        with self._lock:
            return self.client.accusation_status(run_id, accused, evidence_hash)

    def accusation(self, run_id: int, accused: str, evidence_hash: bytes) -> AccusationState | None:
        with self._lock:
            return self.client.accusation(run_id, accused, evidence_hash)

    def accusations(self, run_id: int, from_block: int | None = None) -> list[AccusationRecord]:
        """The run's accusations opened from ``from_block`` on (AccusationOpened events), with their
        outcome."""
        with self._lock:
            return self.client.accusations(run_id, from_block)
