"""Disputes, equivocation proofs and accusations: the TrainingLedger's calls that judge members.

:class:`DisputeCalls` is a mixin of :class:`ledger.client.LedgerClient` (as :class:`ledger.history.EventReads`
is): it uses the client's transaction sender, contract and ``transact_ledger``/``run_struct`` helpers. Reads
of the resulting events (disputes, slashes, accusations in a run's history) are
:class:`ledger.history.EventReads`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

from eth_utils import to_checksum_address

from ledger.attest import (
    order_signatures,
    pack_signatures,
    record_struct_hash,
    round_verdict_digest,
    sign_round_verdict,
    verdict_digest,
)
from ledger.errors import LedgerInputError
from ledger.records import (
    ACCUSATION_STATUSES,
    DISPUTE_STATUSES,
    UINT64_MAX,
    AccusationState,
    RoundRecord,
    RoundVerdict,
    Verdict,
    check_bytes32,
    check_uint,
)


class DisputeCalls:
    """The dispute, equivocation and accusation calls of :class:`ledger.client.LedgerClient`."""

    def dispute(
        self,
        record: RoundRecord,
        signature: bytes,
        *,
        committed: RoundRecord | None = None,
        bond: int | None = None,
    ) -> str:
        """Put on chain a member's own signed ``record`` for a committed round it differs from; return the tx.

        The disputer is this account, which must be the signer of ``signature``
        (``client.sign_record(record)``): a member in force at the round (joined before it was committed, not
        left before), still staked, within the run's ``dispute_blocks`` of the commit. The record must differ
        from the committed one in its weights root, contributions root or checkpoint hash. This account pays
        the run's bond: returned if a verdict overturns the round, forfeited if it is upheld or the case
        lapses. It cannot be withdrawn.

        Args:
            committed: The committed record of the round; None reads it from its RoundCommitted event.
            bond: Wei sent; None sends the run's bond (the contract takes exactly that).

        Raises:
            LedgerRoundNotCommitted, LedgerDisputeMatchesCommit, LedgerDisputeOnlyMetrics,
            LedgerDisputeWindowClosed, LedgerNotInForce, LedgerAlreadyDisputed, LedgerNotBonded,
            LedgerNotCommittedRecord, LedgerBondMismatch, LedgerDisputerNotSender, LedgerDisputeNotOpen.
        """
        if not isinstance(record, RoundRecord):
            raise LedgerInputError(f"dispute needs a RoundRecord, got {type(record).__name__}")
        if committed is None:
            committed = self.commit_of(record.run_id, record.round)
            if committed is None:  # let the contract name it: LedgerRoundNotCommitted
                committed = record
        args = (committed.fields(), record.fields(), pack_signatures([signature]))
        if bond is None:
            bond = self.run_struct(record.run_id)["bond"]
        return self.transact_ledger("dispute", args, f"dispute(run {record.run_id}, round {record.round})",
                                    bond)

    def dispute_count(self, run_id: int, round: int) -> int:
        """How many members disputed ``round`` of ``run_id``."""
        return self.sender.call(self.ledger_contract, "disputeCount", (run_id, round))

    def disputers_of(self, run_id: int, round: int) -> list[str]:
        """The members that disputed ``round`` of ``run_id``, in order (their records: :meth:`disputes`)."""
        check_uint("round", round, UINT64_MAX)
        return list(self.sender.call(self.ledger_contract, "disputersOf", (run_id, round)))

    def commit_block_of(self, run_id: int, round: int) -> int | None:
        """The block that committed ``round`` of ``run_id``, or None if it is not committed."""
        check_uint("round", round, UINT64_MAX)
        block = self.sender.call(self.ledger_contract, "commitBlockOf", (run_id, round))
        return block or None

    def dispute_window_end(self, run_id: int, round: int) -> int | None:
        """The first block at which ``round`` of ``run_id`` can no longer be disputed, or None if
        uncommitted."""
        block = self.commit_block_of(run_id, round)
        return None if block is None else block + self.run_struct(run_id)["disputeBlocks"]

    def dispute_case(self, run_id: int, round: int) -> tuple[str, int, int]:
        """(status, deadline, disputers) of the round's dispute case; status in ``DISPUTE_STATUSES``."""
        check_uint("round", round, UINT64_MAX)
        status, deadline, disputers = self.sender.call(self.ledger_contract, "disputeCaseOf", (run_id, round))
        return DISPUTE_STATUSES[status], deadline, disputers

    def is_final(self, run_id: int, round: int) -> bool:
        """Whether ``round`` is final now: committed, dispute window closed, disputes upheld, lapsed or past
        their deadline, and not overturned (earlier rounds are not looked at)."""
        check_uint("round", round, UINT64_MAX)
        return self.sender.call(self.ledger_contract, "isFinal", (run_id, round))

    def commit_quorum_of(self, run_id: int, round: int) -> int:
        """The counted signatures the round's commit needed (a verdict on its disputes needs as many)."""
        check_uint("round", round, UINT64_MAX)
        return self.sender.call(self.ledger_contract, "commitQuorumOf", (run_id, round))

    def sign_round_verdict(self, verdict: RoundVerdict) -> bytes:
        """This account's signature over ``verdict``."""
        return sign_round_verdict(self.account, verdict, self.chain_id, self.ledger_address)

    def sign_round_verdict_for(self, committed: RoundRecord, upheld: bool) -> bytes:
        """This account's signature over the RoundVerdict that ``upheld`` (or overturns) ``committed``."""
        verdict = RoundVerdict(committed.run_id, committed.round, record_struct_hash(committed), bool(upheld))
        return self.sign_round_verdict(verdict)

    def resolve_dispute(
        self, committed: RoundRecord, upheld: bool, signatures: Iterable[bytes], attesters: Iterable[str]
    ) -> str:
        """Settle the round's disputes with counted members' signatures over the RoundVerdict (any order);
        ``attesters`` as the round's RoundCommitted gave them. Return the tx hash.

        Raises:
            LedgerDisputeNotOpen, LedgerDisputeExpired, LedgerNotAttesters, LedgerQuorumNotMet,
            LedgerSignerNotMember, LedgerSignerNotInForce, LedgerSignersNotAscending,
            LedgerNotCommittedRecord.
        """
        if not isinstance(committed, RoundRecord):
            raise LedgerInputError(f"resolve_dispute needs a RoundRecord, got {type(committed).__name__}")
        verdict = RoundVerdict(committed.run_id, committed.round, record_struct_hash(committed), bool(upheld))
        digest = round_verdict_digest(verdict, self.chain_id, self.ledger_address)
        packed = pack_signatures(order_signatures(digest, [bytes(signature) for signature in signatures]))
        args = (committed.fields(), bool(upheld), packed, [to_checksum_address(a) for a in attesters])
        return self.transact_ledger("resolveDispute", args,
                                    f"resolveDispute(run {committed.run_id}, round {committed.round})")

    def expire_dispute(self, run_id: int, round: int) -> str:
        """Close a round's dispute case past its deadline: the record stands, the bonds are forfeited."""
        check_uint("round", round, UINT64_MAX)
        return self.transact_ledger("expireDispute", (run_id, round),
                                    f"expireDispute(run {run_id}, round {round})")

    def report_equivocation(
        self, record_a: RoundRecord, signature_a: bytes, record_b: RoundRecord, signature_b: bytes
    ) -> str:
        """Prove that one member signed two different records for a round: it is slashed; return the tx.

        Raises:
            LedgerNotEquivocation, LedgerDifferentSigners, LedgerNotBonded, LedgerInvalidSignature.
        """
        for record in (record_a, record_b):
            if not isinstance(record, RoundRecord):
                raise LedgerInputError(f"report_equivocation needs RoundRecords, got {type(record).__name__}")
        args = (
            record_a.fields(),
            pack_signatures([signature_a]),
            record_b.fields(),
            pack_signatures([signature_b]),
        )
        return self.transact_ledger("reportEquivocation", args, f"reportEquivocation(run {record_a.run_id})")

    def accuse(self, run_id: int, accused: str, evidence_hash: bytes, *, bond: int | None = None) -> str:
        """Open an accusation against staked member ``accused``, paying the run's bond; return the tx hash.

        The accused cannot withdraw until it is resolved or lapses (``accusation_blocks`` later). The bond
        comes back on a guilty verdict and is forfeited on a not-guilty one or when it lapses. ``bond``: wei
        sent; None sends the run's bond (the contract takes exactly that).

        Raises:
            LedgerNotMember (only an active member accuses), LedgerNotBonded, LedgerAccusationExists,
            LedgerZeroHash, LedgerBondMismatch.
        """
        args = (run_id, to_checksum_address(accused), check_bytes32("evidence_hash", evidence_hash))
        if bond is None:
            bond = self.run_struct(run_id)["bond"]
        return self.transact_ledger("accuse", args, f"accuse(run {run_id}, {accused})", bond)

    def resolve_accusation(self, verdict: Verdict, signatures: Iterable[bytes]) -> str:
        """Decide an open accusation with members' signatures over ``verdict`` (any order); return the tx
        hash.

        The signers must have been members in force when it was opened (unbonding ones included), at least
        its quorum (:meth:`accusation`), before its deadline. Guilty slashes the accused, removes it from the
        run and returns the accuser's bond; not guilty forfeits the bond. The accused's signature is not
        counted.

        Raises:
            LedgerAccusationNotOpen, LedgerAccusationExpired, LedgerQuorumNotMet, LedgerSignerNotMember,
            LedgerSignerNotInForce, LedgerSignersNotAscending.
        """
        if not isinstance(verdict, Verdict):
            raise LedgerInputError(f"resolve_accusation needs a Verdict, got {type(verdict).__name__}")
        digest = verdict_digest(verdict, self.chain_id, self.ledger_address)
        packed = pack_signatures(order_signatures(digest, [bytes(signature) for signature in signatures]))
        what = f"resolveAccusation(run {verdict.run_id}, {verdict.accused})"
        return self.transact_ledger("resolveAccusation", (verdict.fields(), packed), what)

    def expire_accusation(self, run_id: int, accused: str, evidence_hash: bytes) -> str:
        """Close an accusation whose deadline passed undecided: it lapses, the accused's stake is free of it
        and the accuser's bond is forfeited. Anyone may. Return the tx hash.

        Raises:
            LedgerAccusationNotExpired, LedgerAccusationNotOpen.
        """
        args = (run_id, to_checksum_address(accused), check_bytes32("evidence_hash", evidence_hash))
        return self.transact_ledger("expireAccusation", args, f"expireAccusation(run {run_id}, {accused})")

    def accusation(self, run_id: int, accused: str, evidence_hash: bytes) -> AccusationState | None:
        """The accusation as the contract holds it now, or None if it was never opened."""
        accused = to_checksum_address(accused)
        evidence_hash = check_bytes32("evidence_hash", evidence_hash)
        status, accuser, opened_block, deadline, quorum, bond = self.sender.call(
            self.ledger_contract, "accusationOf", (run_id, accused, evidence_hash)
        )
        if status == 0:
            return None
        return AccusationState(
            run_id, accused, evidence_hash, ACCUSATION_STATUSES[status], accuser, opened_block, deadline,
            quorum, bond
        )

    def accusation_status(self, run_id: int, accused: str, evidence_hash: bytes) -> str:
        """The accusation's state: one of ``ACCUSATION_STATUSES`` ("none", "open", "guilty", "cleared",
        "expired")."""
        state = self.accusation(run_id, accused, evidence_hash)
        return "none" if state is None else state.status

    def slashed_total(self) -> int:
        """Wei slashed so far over all runs (kept by the ledger for good)."""
        return self.sender.call(self.ledger_contract, "slashedTotal")

    def forfeited_total(self) -> int:
        """Wei of accusation bonds forfeited so far over all runs (kept by the ledger for good)."""
        return self.sender.call(self.ledger_contract, "forfeitedTotal")

    def fund_proofs(self, run_id: int, wei: int) -> str:
        """Add ``wei`` to run ``run_id``'s proof fund (issue 79: what a fraud proof's reward is paid from);
        return the tx hash."""
        return self.sender.transact(self.ledger_contract, "fundProofs", (run_id,), "fundProofs",
                                    wei)["transactionHash"].to_0x_hex()

    def proof_fund_of(self, run_id: int) -> int:
        """Run ``run_id``'s proof fund in wei (the next fraud proof's reward is at most this)."""
        return self.sender.call(self.ledger_contract, "proofFundOf", (run_id,))

    def proof_fund_total(self) -> int:
        """Wei held in proof funds over all runs."""
        return self.sender.call(self.ledger_contract, "proofFundTotal")
