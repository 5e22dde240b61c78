"""Verdicts of the spot checker's tribunal: signing a verdict on an accusation, hearing other members'
signatures and resolving the accusation on chain at its quorum (docs/PROTOCOL.md, "Spot checks").

:class:`Verdicts` is the part of :class:`node.live.checks.tribunal.Tribunal` (and so of
:class:`node.live.checks.verifier.SpotChecker`) that decides; it uses the spot checker's state (``ctx``, the
lock, the court's queue, the accusation and verdict books).
"""

from __future__ import annotations

import logging

from ledger.errors import LedgerError
from ledger.records import Verdict
from node import protocol as msg
from p2p.envelope import Envelope

logger = logging.getLogger(__name__)

#: The court's one job priority: its jobs run in the order they came.
COURT = 0


class Verdicts:
    """Signing, hearing and resolving verdicts (a part of :class:`node.live.checks.tribunal.Tribunal`)."""

    def _sign_verdict(self, outer_round: int | None, accused: bytes, evidence_hash: bytes, guilty: bool,
                      who: str) -> None:
        verdict = Verdict(self.ctx.run_id, "0x" + accused.hex(), evidence_hash, guilty)
        signature = self.ctx.chain.sign_verdict(verdict)
        own = self.ctx.chain.account_bytes
        self.add_verdict(verdict, "0x" + own.hex(), signature)
        self.ctx.gossip(self.ctx.current_round(), msg.VERDICT,
                        msg.VerdictSignature(accused, evidence_hash, guilty, own, signature))
        logger.info("%s: signed verdict %s on %s", "chain" if outer_round is None else f"round {outer_round}",
                    "guilty" if guilty else "not guilty", who[-8:])

    def on_verdict(self, env: Envelope, signed: msg.VerdictSignature) -> None:
        """A member's verdict signature: recovered, checked against its seat, filed; resolve at quorum."""
        verdict = Verdict(self.ctx.run_id, "0x" + signed.accused.hex(), signed.evidence_hash, signed.guilty)
        try:
            signer = self.ctx.chain.verdict_signer(verdict, signed.signature)
        except LedgerError as exc:
            raise msg.ProtocolError(f"verdict signature does not verify: {exc}") from None
        if signer.lower() != "0x" + signed.account.hex() or signer.lower() == verdict.accused.lower():
            raise msg.ProtocolError(
                f"verdict signed by {signer}, not by the account it names or by the accused")
        # A member that left since the accusation opened may still decide it (the contract checks who was
        # in force then): any seat of the run, current or ended, is heard.
        if not self.ctx.chain.held_seat(self.ctx.run_id, signer):
            raise msg.ProtocolError(f"verdict signed by {signer}, not a member of run {self.ctx.run_id}")
        self.add_verdict(verdict, signer, signed.signature)

    def add_verdict(self, verdict: Verdict, signer: str, signature: bytes) -> None:
        if signer.lower() == verdict.accused.lower():
            return  # the contract does not count the accused's own signature
        quorum = self._verdict_quorum(verdict)
        with self._lock:
            signers = self._verdicts.setdefault((verdict.evidence_hash, verdict.guilty), {})
            signers[signer.lower()] = signature
            ready = len(signers) >= quorum
            if ready and verdict.evidence_hash not in self._resolved:
                self._court.put(COURT, "resolve", verdict, dict(signers))

    def _verdict_quorum(self, verdict: Verdict) -> int:
        """The signatures the accusation's verdict needs, fixed on chain when it was opened (the run's k until
        the chain answers)."""
        quorum = self._verdict_quorums.get(verdict.evidence_hash)
        if quorum is None:
            try:
                state = self.ctx.chain.accusation(self.ctx.run_id, verdict.accused, verdict.evidence_hash)
            except LedgerError as exc:
                logger.debug("accusation's quorum not read: %s", exc)
                state = None
            if state is None:
                return self.ctx.chain.run_info(self.ctx.run_id).quorum
            quorum = self._verdict_quorums[verdict.evidence_hash] = state.quorum
        return quorum

    def _resolve(self, verdict: Verdict, signatures: dict[str, bytes]) -> None:
        chain = self.ctx.chain
        if verdict.evidence_hash in self._resolved:
            return
        status = chain.accusation_status(self.ctx.run_id, verdict.accused, verdict.evidence_hash)
        if status == "open":
            try:
                chain.resolve_accusation(verdict, list(signatures.values()))
                logger.warning("accusation %s against %s resolved on chain: %s",
                               verdict.evidence_hash.hex()[:16], verdict.accused, "guilty" if verdict.guilty
                               else "not guilty")
            except LedgerError as exc:  # another member was first, or a signer left meanwhile
                logger.info("resolveAccusation not sent: %s", exc)
            status = chain.accusation_status(self.ctx.run_id, verdict.accused, verdict.evidence_hash)
        if status in ("guilty", "cleared", "expired"):
            self._resolved.add(verdict.evidence_hash)
        if status == "guilty":
            with self._lock:
                entry = self._accusations.get(verdict.evidence_hash)
            chain.forget_seats(self.ctx.run_id)
            if entry is not None and entry[1] is not None:
                self.ctx.on_ejected(entry[1].accused_peer, entry[1].accused)
