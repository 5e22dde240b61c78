"""Accusations and verdicts of the spot checker: evidence, ``accuse`` on chain, confirming another member's
accusation by rerunning the contribution it names, judging accusations seen only on chain, signing verdicts
and resolving them at quorum (docs/PROTOCOL.md, "Spot checks"; the verdicts are
node/live/checks/verdicts.py's).

:class:`Tribunal` is the half of :class:`node.live.checks.verifier.SpotChecker` that judges members; the other
half samples and reruns contributions. Its work runs on a thread of its own, the *court*
(a :class:`node.live.checks.jobqueue.JobQueue`), never behind a rerun: a charge against a member already found
wrong is opened while the spot checker reruns someone else. The one part that needs a rerun, confirming
another member's accusation, hands the rerun and the verdict after it to the spot checker's rerun thread,
ahead of its sampled checks (``_rerun_then_judge``, :meth:`Tribunal._judge_by_rerun`). It uses the spot
checker's state (``ctx``, the lock, the two queues, the accusation and verdict books) and its reruns
(``_check``, ``_envelopes_of``, ``_chain_holds``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable

from ledger.errors import LedgerError
from ledger.eventrecords import AccusationRecord
from node import protocol as msg
from node.errors import NodeError
from node.fsutil import keep_evidence, serve_when_space
from node.live.checks.spotcheck import SpotCheckResult
from node.live.checks.verdicts import COURT, Verdicts
from p2p.envelope import Envelope, decode_envelope
from p2p.errors import EnvelopeRejected, P2PError

logger = logging.getLogger(__name__)

#: How long a node waits for an accusation's evidence blob before judging the accuser unable to show it.
EVIDENCE_FETCH_TIMEOUT_S = 60.0
#: An accusation seen on chain is judged from the chain after this long without its gossip.
CHAIN_ACCUSATION_GRACE_S = 20.0


class Tribunal(Verdicts):
    """Accusing, confirming, judging and resolving (a part of
    :class:`node.live.checks.verifier.SpotChecker`)."""

    # -- accusing -----------------------------------------------------------------------
    def _accuse(self, outer_round: int, replica: int, result: SpotCheckResult,
                next_envs: list[Envelope] = ()) -> None:
        """Evidence, ``accuse`` on chain, gossip, our guilty verdict, against each signer of a stage whose
        claim fails (one member on a whole replica; on a split cluster the stage holders answer each for its
        own stage). ``next_envs``: a broken chain's round t+1 envelopes, which follow round t's in the
        evidence; their signers are the ones a broken chain accuses."""
        envs = self._envelopes_of(outer_round, replica)
        blamed = list(next_envs) or envs
        if len({e.sender_peer_id for e in blamed}) > 1 and not result.failed_stages:
            logger.warning(
                "round %d: replica %d failed its spot check (%s) in no single stage's claim: on a split "
                "cluster that names no member, nobody is accused", outer_round, replica, result.reason)
            return
        stages = result.failed_stages or range(len(blamed))
        for accused_peer in sorted({blamed[stage].sender_peer_id for stage in stages}):
            self._accuse_member(outer_round, replica, result, envs, list(next_envs), accused_peer)

    def _accuse_member(self, outer_round: int, replica: int, result: SpotCheckResult, envs: list[Envelope],
                       next_envs: list[Envelope], accused_peer: str) -> None:
        account = self._account_of(accused_peer)
        if account is None:
            logger.warning("round %d: replica %d (%s) failed its spot check but its account is unknown here",
                           outer_round, replica, accused_peer[-8:])
            return
        evidence = msg.Evidence(account, replica, [e.to_bytes() for e in [*envs, *next_envs]], result.verdict,
                                result.reason, [result.distances.get(e.stage, math.inf) for e in envs]
                                + [math.inf] * len(next_envs))
        self._open_accusation(outer_round, account, accused_peer, replica, evidence,
                              f"spotcheck-round-{outer_round:08d}-replica{replica}")

    def charge(self, outer_round: int, accused_peer: str, replica: int,
               build: Callable[[bytes], msg.Evidence]) -> None:
        """Accuse on chain with evidence built elsewhere (``ctx.charges``): sign it, keep and serve it,
        ``accuse``, gossip the accusation, sign our guilty verdict."""
        account = self._account_of(accused_peer)
        if account is None:
            logger.warning("round %d: %s not accused: its account is unknown here", outer_round,
                           accused_peer[-8:])
            return
        evidence = build(account)
        self._open_accusation(outer_round, account, accused_peer, replica, evidence,
                              f"{evidence.verdict}-round-{outer_round:08d}")

    def _open_accusation(self, outer_round: int, account: bytes, accused_peer: str, replica: int,
                         evidence: msg.Evidence, file_stem: str) -> None:
        """Sign ``evidence``, keep it under ``evidence/<file_stem>-<sha256>.envelope`` and serve it, open the
        accusation on chain, gossip it and sign our own guilty verdict."""
        data = self.ctx.sign_envelope(outer_round, msg.EVIDENCE, msg.encode_payload(evidence))
        evidence_hash = hashlib.sha256(data).digest()
        keep_evidence(self.ctx.evidence_dir / f"{file_stem}-{evidence_hash.hex()}.envelope", data)
        serve_when_space(self.ctx.host, data, what=f"round {outer_round}'s evidence", stop=self.ctx.stop)
        try:
            self.ctx.chain.accuse(self.ctx.run_id, "0x" + account.hex(), evidence_hash)
        except LedgerError as exc:  # e.g. already slashed, or this node is no longer a member
            logger.warning("round %d: accusation of %s not opened on chain: %s", outer_round,
                           accused_peer[-8:], exc)
            return
        logger.warning("round %d: accused replica %d (%s, 0x%s) on chain: %s; evidence %s", outer_round,
                       replica, accused_peer[-8:], account.hex(), evidence.reason, evidence_hash.hex()[:16])
        accusation = msg.Accusation(outer_round, account, accused_peer, replica, evidence_hash, len(data))
        with self._lock:
            self._accusations[evidence_hash] = (outer_round, accusation)
        if self.ctx.on_accused is not None:
            self.ctx.on_accused(outer_round, account, evidence_hash)
        self.ctx.gossip(self.ctx.current_round(), msg.ACCUSATION, accusation)
        self._sign_verdict(outer_round, account, evidence_hash, True, accused_peer)

    def _account_of(self, peer_id: str) -> bytes | None:
        info = self.ctx.membership.book.live_peers(float("inf")).get(peer_id)
        return None if info is None else info.hello.account

    # -- hearing accusations and verdicts (from the inbox thread) ------------------------
    def on_accusation(self, env: Envelope, accusation: msg.Accusation) -> None:
        """Another member accused someone: check the evidence and the contribution ourselves (on our
        thread)."""
        with self._lock:
            if accusation.evidence_hash in self._accusations or accusation.accused_peer == self.ctx.peer_id:
                if accusation.accused_peer == self.ctx.peer_id:
                    logger.warning("round %d: %s accuses this node (evidence %s)", accusation.outer_round,
                                   env.sender_peer_id[-8:], accusation.evidence_hash.hex()[:16])
                    self._accusations[accusation.evidence_hash] = (accusation.outer_round, accusation)
                return
            self._accusations[accusation.evidence_hash] = (accusation.outer_round, accusation)
        self._court.put(COURT, "confirm", accusation.outer_round, env.sender_peer_id, accusation)

    def _fetch_evidence(self, evidence_hash: bytes, providers: list[str] | None) -> bytes:
        """An accusation's evidence blob by its hash (hash-checked by the blob protocol; nothing kept on
        disk); raises P2PError or OSError if it is not served in time."""
        dest = self.ctx.work_dir / f"evidence-{evidence_hash.hex()}.part"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.ctx.host.fetch_blob(evidence_hash.hex(), dest, providers=providers,
                                     timeout=EVIDENCE_FETCH_TIMEOUT_S)
            return dest.read_bytes()
        finally:
            dest.unlink(missing_ok=True)

    def _confirm(self, outer_round: int, accuser: str, accusation: msg.Accusation) -> None:
        """Fetch the evidence, check that it names a sealed contribution of the accused, then queue its rerun
        (the verdict follows the rerun: :meth:`_judge_by_rerun`); self-contained evidence is judged here at
        once.

        Evidence not served in time, or malformed (not the accuser's evidence envelope of the round naming the
        accused), gets a not-guilty verdict: the accuser must show its case. Evidence this node cannot check
        (it did not seal the contributions named, or cannot rerun them) gets no verdict from it.
        """
        who = accusation.accused_peer
        try:
            data = self._fetch_evidence(accusation.evidence_hash, [accuser])
        except (P2PError, OSError) as exc:
            logger.warning("round %d: evidence %s of %s's accusation not served: %s; not guilty", outer_round,
                           accusation.evidence_hash.hex()[:16], accuser[-8:], exc)
            self._sign_verdict(outer_round, accusation.accused, accusation.evidence_hash, False, who)
            return
        try:
            env = decode_envelope(data, msg.MAX_EVIDENCE_PAYLOAD + 4096)
            evidence = msg.decode_payload(msg.EVIDENCE, env.payload)
        except (EnvelopeRejected, msg.ProtocolError) as exc:
            logger.warning("round %d: %s's accusation has malformed evidence: %s; not guilty", outer_round,
                           accuser[-8:], exc)
            self._sign_verdict(outer_round, accusation.accused, accusation.evidence_hash, False, who)
            return
        if (env.kind, env.sender_peer_id, env.round) != (msg.EVIDENCE, accuser, outer_round) or (
                evidence.accused, evidence.replica) != (accusation.accused, accusation.replica):
            logger.warning("round %d: %s's evidence is not its evidence of this accusation; not guilty",
                           outer_round, accuser[-8:])
            self._sign_verdict(outer_round, accusation.accused, accusation.evidence_hash, False, who)
            return
        judge = self.ctx.evidence_judges.get(evidence.verdict)
        if judge is not None:  # self-contained evidence another module judges (a wrong sliced partial)
            guilty, why = judge(evidence, who)
            logger.warning("round %d: %s's accusation of %s: %s", outer_round, accuser[-8:], who[-8:], why)
            if guilty is not None:
                serve_when_space(self.ctx.host, data, what=f"round {outer_round}'s evidence",
                                 stop=self.ctx.stop)
                self._sign_verdict(outer_round, accusation.accused, accusation.evidence_hash, guilty, who)
            return
        try:
            ours = [e.to_bytes() for e in self._envelopes_of(outer_round, accusation.replica)]
            # A broken chain's evidence goes on with the replica's envelopes of round t+1.
            next_envs = (self._envelopes_of(outer_round + 1, accusation.replica)
                         if len(evidence.contributions) > len(ours) else [])
        except NodeError as exc:
            logger.warning("round %d: %s's accusation cannot be checked here: %s", outer_round, accuser[-8:],
                           exc)
            return
        if evidence.contributions != ours + [e.to_bytes() for e in next_envs]:
            logger.warning("round %d: %s's evidence does not name the sealed contributions of replica %d",
                           outer_round, accuser[-8:], accusation.replica)
            return
        # Served onward: anyone may check it.
        serve_when_space(self.ctx.host, data, what=f"round {outer_round}'s evidence", stop=self.ctx.stop)
        self._rerun_then_judge(outer_round, accusation, ours, next_envs)

    def _judge_by_rerun(self, outer_round: int, accusation: msg.Accusation, ours: list[bytes],
                        next_envs: list[Envelope]) -> None:
        """On the rerun thread: rerun the accused contribution (and its chain into round t+1, if the evidence
        names one) and sign the verdict it gives; nothing if it cannot be told."""
        who = accusation.accused_peer
        result = self._check(outer_round, accusation.replica)
        if result is None or result.undecided:
            return  # could not rerun, or not on a platform that can tell: sign nothing either way
        envs = [decode_envelope(e, self.ctx.cfg.p2p.max_blob_bytes) for e in ours]
        # A forked member's round (built on another result of round t-1) is not a cheat either.
        guilty = False if result.honest or result.elsewhere else \
            self._blames(envs, result.failed_stages, accusation.accused)
        if next_envs and result.honest:
            if result.next_state_hashes is None:
                return  # not a bit-exact rerun here: the chain cannot be judged, sign nothing
            holds, _reason, _parts, broken = self._chain_holds(outer_round, accusation.replica, result,
                                                               next_envs)
            if holds is None:
                return
            guilty = False if holds else self._blames(next_envs, broken, accusation.accused)
        if guilty is None:
            # the failure names no single stage's signer here, or the chain did not answer: sign nothing
            return
        self._sign_verdict(outer_round, accusation.accused, accusation.evidence_hash, guilty, who)

    def _blames(self, envs: list[Envelope], failed_stages: tuple[int, ...], account: bytes) -> bool | None:
        """Whether ``account`` signed one of the failing stages' envelopes (its seat binds the envelope's
        key); None if that cannot be told (a split replica's failure in no single stage, or the chain unread).
        An accusation names one member: a failure in a partner's stage is not this member's."""
        if len({e.sender_peer_id for e in envs}) > 1 and not failed_stages:
            return None
        try:
            return any(self.ctx.chain.seat(self.ctx.run_id, account, envs[stage].sender, current=False)
                       is not None
                       for stage in failed_stages or range(len(envs)))
        except LedgerError as exc:
            logger.warning("seat of 0x%s not read from the chain: %s", account.hex(), exc)
            return None

    # -- accusations seen on chain ------------------------------------------------------
    def _watch_chain(self) -> None:
        """Read the run's accusations from the chain; queue the open ones no gossip brought once their grace
        is over (this node's own, and those against it, excepted)."""
        self._watched_at = time.monotonic()
        try:
            opened = self.ctx.chain.accusations(self.ctx.run_id, self._watched_block)
        except LedgerError as exc:
            logger.debug("accusations not read from the chain: %s", exc)
            return
        own = "0x" + self.ctx.chain.account_bytes.hex()
        now = time.monotonic()
        waiting = []  # opening blocks of accusations still in their grace: read again from the oldest
        for record in opened:
            if not record.open or own in (record.accused.lower(), record.accuser.lower()):
                continue
            with self._lock:
                if record.evidence_hash in self._accusations:
                    continue  # gossip brought it (or it was judged): the gossip path judges it
                first_seen = self._on_chain.setdefault(record.evidence_hash, now)
                if now - first_seen < CHAIN_ACCUSATION_GRACE_S:
                    waiting.append(record.opened_block)
                    continue
                # Judged once: mark it known, as a gossiped one would be.
                self._accusations[record.evidence_hash] = (-1, None)
            self._court.put(COURT, "chain", record)
        newest = max([record.opened_block for record in opened] + [self._watched_block or 0])
        self._watched_block = min(waiting) if waiting else newest

    def _judge_chain_accusation(self, record: AccusationRecord) -> None:
        """An accusation known only from the chain: fetch its evidence by hash (from the accuser's node if
        known, else any provider); not served in time or malformed: not guilty; else confirm it like a
        gossiped one."""
        accused = bytes.fromhex(record.accused[2:])
        accuser_peer = self._peer_of(bytes.fromhex(record.accuser[2:]))
        try:
            data = self._fetch_evidence(record.evidence_hash, [accuser_peer] if accuser_peer else None)
        except (P2PError, OSError) as exc:
            logger.warning("accusation of %s by %s on chain: evidence %s not served: %s; not guilty",
                           record.accused, record.accuser, record.evidence_hash.hex()[:16], exc)
            self._sign_verdict(None, accused, record.evidence_hash, False, record.accused)
            return
        try:
            env = decode_envelope(data, msg.MAX_EVIDENCE_PAYLOAD + 4096)
            evidence = msg.decode_payload(msg.EVIDENCE, env.payload)
            if evidence.verdict in self.ctx.evidence_judges:
                # Self-contained evidence judged elsewhere (a wrong sliced partial): its first item is the
                # accused's signed envelope, the others are packs of inputs, not envelopes.
                envs = [decode_envelope(evidence.contributions[0], self.ctx.cfg.p2p.max_blob_bytes)]
            else:
                envs = [decode_envelope(c, self.ctx.cfg.p2p.max_blob_bytes) for c in evidence.contributions]
            accused_peer = self._signer_among(envs, accused)
        except (EnvelopeRejected, msg.ProtocolError, IndexError) as exc:
            logger.warning("accusation of %s on chain: malformed evidence: %s; not guilty", record.accused,
                           exc)
            self._sign_verdict(None, accused, record.evidence_hash, False, record.accused)
            return
        if env.kind != msg.EVIDENCE or evidence.accused != accused or (
                accuser_peer is not None and env.sender_peer_id != accuser_peer):
            logger.warning(
                "accusation of %s on chain: its evidence is not the accuser's evidence against it; "
                "not guilty", record.accused)
            self._sign_verdict(None, accused, record.evidence_hash, False, record.accused)
            return
        accusation = msg.Accusation(env.round, accused, accused_peer, evidence.replica, record.evidence_hash,
                                    len(data))
        with self._lock:
            self._accusations[record.evidence_hash] = (env.round, accusation)
        self._confirm(env.round, env.sender_peer_id, accusation)

    def _signer_among(self, envs: list[Envelope], account: bytes) -> str:
        """The peer id of the envelope signer whose seat is ``account``'s (a split replica's envelopes have
        several signers); the first envelope's signer if none is known to be (or the chain does not
        answer)."""
        for env in envs:
            try:
                if self.ctx.chain.seat(self.ctx.run_id, account, env.sender, current=False) is not None:
                    return env.sender_peer_id
            except LedgerError as exc:
                logger.debug("seat of 0x%s not read from the chain: %s", account.hex(), exc)
                break
        return envs[0].sender_peer_id

    def _peer_of(self, account: bytes) -> str | None:
        """The peer id of the live member whose hello names ``account``, if any."""
        for peer_id, info in self.ctx.membership.book.live_peers(float("inf")).items():
            if info.hello.account == account:
                return peer_id
        return None
