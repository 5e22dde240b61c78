"""The gossip inbox: every message of the run topic is parsed, checked, then handled by its kind.

Runs on its own thread. Parse, then use: an envelope is decoded and validated
(signature, run, size, replay, equivocation), its payload decoded into a typed
message, and a round message is checked against its sender's placement,
before a handler from the table files it in the :class:`RoundBook`. A bad
message costs only itself: it is dropped and the reason logged; the consumer
never dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from queue import Empty, Queue

from ledger.errors import LedgerError
from ledger.records import RoundRecord
from node import protocol as msg
from node.live.exchange.pool import ContributionPool
from node.live.peers.membership import Membership
from node.live.state.roundbook import Announced, RoundBook
from p2p.envelope import Envelope, EnvelopeValidator, decode_envelope
from p2p.errors import EnvelopeRejected

logger = logging.getLogger(__name__)

#: A hello older (or newer) than this by its signed timestamp is refused: a replayed old hello
#: must not make a departed peer look present, nor carry a stale declaration.
HELLO_MAX_AGE_S = 60.0
#: Of another peer's hellos, at most one this often is kept to re-serve over /dlx/sync (well inside
#: HELLO_MAX_AGE_S, so a peer whose gossip misses a sender's hellos still places it from any peer).
HELLO_SYNC_EVERY_S = 30.0
#: A round message from a peer not placed yet (its hello or seat still on the way) is kept and tried
#: again for this long: the host delivers each message once, so a dropped one would never return.
DEFER_S = 120.0
DEFER_MAX = 2048  # messages kept in all
DEFER_MAX_PER_SENDER = 256
RETRY_DEFERRED_S = 1.0


class GossipInbox:
    """Consumes the run topic's queue and dispatches by message kind (see module docstring).

    ``held_stages()`` returns the stages this node holds (empty while joining), so
    that an announce for one of them starts the contribution's fetch at once.
    ``spot_checks`` (a :class:`~node.live.checks.verifier.SpotChecker`) hears accusations and
    verdicts; ``handlers``: kind -> handler of the rooms wired in by configuration (the
    sliced exchange's partial announces).
    """

    def __init__(self, run_id: int, validator: EnvelopeValidator, book: RoundBook, membership: Membership,
                 contributions: ContributionPool, held_stages: Callable[[], tuple[int, ...]],
                 record_signer: Callable[[RoundRecord, bytes, bytes], str] | None = None,
                 spot_checks=None, handlers: dict[str, Callable[[Envelope, object, bytes], None]]
                 | None = None) -> None:
        self.run_id = run_id
        self.validator = validator
        self.book = book
        self.membership = membership
        self.contributions = contributions
        self.held_stages = held_stages
        self.record_signer = record_signer
        # sender key -> when one of its hellos was last kept for sync
        self._hello_kept: dict[bytes, float] = {}
        self._handlers: dict[str, Callable[[Envelope, object, bytes], None]] = {
            msg.ANNOUNCE: self._on_announce,
            msg.CLOSE: self._on_close,
            msg.TAKEOVER: lambda env, _m, _d: self.book.add_takeover(env.round, env.stage,
                                                                     env.sender_peer_id),
            msg.YIELD: lambda env, _m, _d: self.book.add_yield(env.round, env.stage, env.sender_peer_id),
            msg.ATTESTATION: self._on_attestation,
            msg.RECORD: self._on_record,
            msg.ACCUSATION: self._on_accusation,
            msg.VERDICT: self._on_verdict,
            **(handlers or {}),
        }
        self.spot_checks = spot_checks
        self._deferred: list[tuple[float, str, bytes]] = []  # (deadline, sender peer id, message)

    # -- the topic validator (runs on the host's thread, before relaying) -------------------
    def relay_ok(self, data: bytes, _from: str = "") -> bool:
        """Only well-formed, signed envelopes of this run are relayed."""
        try:
            env = decode_envelope(data, self.validator.max_size, self.validator.versions)
        except EnvelopeRejected:
            return False
        return env.run_id == self.run_id and env.kind in msg.KINDS

    def keep_for_sync(self, data: bytes, own_peer_id: str) -> bool:
        """Whether the host keeps ``data`` to re-serve over /dlx/sync: every run message, our own
        hellos, and of another sender's once-a-second hellos one per HELLO_SYNC_EVERY_S. Every peer
        re-serves what it keeps to every peer that pulls, so keeping all hellos cost each node peers x
        senders hellos per pull (measured at 8 nodes: sync was 87% of what a node received, most of it
        hellos; docs/PROTOCOL.md). Runs on the network thread."""
        try:
            env = decode_envelope(data, self.validator.max_size, self.validator.versions)
        except EnvelopeRejected:
            return False
        if env.kind != msg.HELLO or env.sender_peer_id == own_peer_id:
            return True
        now = time.monotonic()
        if now - self._hello_kept.get(env.sender, -HELLO_SYNC_EVERY_S) < HELLO_SYNC_EVERY_S:
            return False
        if len(self._hello_kept) > 4096:  # senders are signers; forget the oldest of a flood
            for key in sorted(self._hello_kept, key=self._hello_kept.get)[:2048]:
                del self._hello_kept[key]
        self._hello_kept[env.sender] = now
        return True

    # -- the consumer thread ------------------------------------------------------------
    def run(self, queue: Queue, stop: threading.Event) -> None:
        last_retry = time.monotonic()
        while not stop.is_set():
            if self._deferred and time.monotonic() - last_retry > RETRY_DEFERRED_S:
                last_retry = time.monotonic()
                self._retry_deferred()
            try:
                data, _from = queue.get(timeout=0.5)
            except Empty:
                continue
            self._handle_logged(data)

    def _handle_logged(self, data: bytes) -> None:
        try:
            self.handle(data)
        except (EnvelopeRejected, msg.ProtocolError) as exc:
            if getattr(exc, "reason", "") != "replayed":
                logger.debug("dropped message: %s", exc)
        except Exception:  # thread boundary: a bad message must never kill the gossip consumer
            logger.exception("error while handling a gossip message; dropped")

    def _defer(self, sender: str, data: bytes) -> None:
        """Keep a round message of a sender not placed yet (bounded in count, per sender and in time)."""
        if len(self._deferred) >= DEFER_MAX or \
                sum(1 for _d, s, _m in self._deferred if s == sender) >= DEFER_MAX_PER_SENDER:
            return
        self._deferred.append((time.monotonic() + DEFER_S, sender, data))

    def _retry_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        now = time.monotonic()
        for deadline, sender, data in pending:
            if now > deadline:
                logger.debug("dropped a message of %s: its sender was never placed", sender[-8:])
                continue
            if sender not in self.membership.refresh():
                self._deferred.append((deadline, sender, data))
                continue
            self._handle_logged(data)

    def handle(self, data: bytes) -> None:
        """Parse, check and file one message; raises EnvelopeRejected / ProtocolError for a bad one."""
        env = decode_envelope(data, self.validator.max_size, self.validator.versions)
        if env.kind == msg.HELLO:
            # Hellos repeat every second with the same header: exempt from replay checks, but
            # only fresh ones count. Membership places a sender only once the registry binds
            # its account to the signing key.
            if env.run_id != self.run_id:
                raise msg.ProtocolError(f"hello of run {env.run_id}")
            age = abs(time.time() - env.timestamp_ms / 1000)
            if age > HELLO_MAX_AGE_S:
                raise msg.ProtocolError(f"hello of {env.sender_peer_id[-8:]} is {age:.0f}s off the clock")
            self.book.add_hello(env.sender_peer_id, env.sender, msg.decode_payload(msg.HELLO, env.payload))
            return
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise msg.ProtocolError(f"{env.kind} messages are not sent on the run topic")
        # Placement first, before the validator files the envelope as seen: a message of a peer
        # not placed yet (its seat or hello still on the way) is kept and tried again once it is
        # placed (the host delivers each message once; a resync does not bring it back), instead
        # of being refused later as a replay. (A record signature's authority is its EIP-712
        # signer's seat, checked by its handler.)
        if env.kind in (msg.ACCUSATION, msg.VERDICT):
            # Not round messages of a stage: an accuser must be a placed member (its authority on
            # chain is its seat); a verdict's authority is its EIP-712 signer's seat (its handler).
            if env.kind == msg.ACCUSATION and (self.membership.ejected(env.sender_peer_id) or
                                               env.sender_peer_id not in self.membership.refresh()):
                raise msg.ProtocolError(f"accusation from {env.sender_peer_id[-8:]}, not a placed member")
        elif env.kind != msg.RECORD:
            if env.sender_peer_id not in self.membership.placements and \
                    env.sender_peer_id not in self.membership.refresh():
                # Not placed yet (its hello or its seat is still on the way): try again later,
                # before the validator files it as seen.
                self._defer(env.sender_peer_id, data)
                raise msg.ProtocolError(
                    f"{env.kind} from {env.sender_peer_id[-8:]}, not placed yet: deferred")
            self.membership.check_sender(env)
        try:
            env = self.validator.check(data)
        except EnvelopeRejected as exc:
            if exc.reason == "equivocation":
                self._on_equivocation(data)
            raise
        payload = msg.decode_payload(env.kind, env.payload)
        self.book.heard_from(env.sender_peer_id)
        handler(env, payload, data)

    def _on_equivocation(self, data: bytes) -> None:
        """A coordinator that signed two different closes of one (round, stage) is skipped for it.

        The validator keeps both envelopes as evidence; which one a node saw first depends on
        timing, so neither may decide the round (docs/PROTOCOL.md, "Closing a round"). A second,
        different announce is filed as one a close may name, for the same reason.
        """
        env = decode_envelope(data, self.validator.max_size, self.validator.versions)
        if env.kind == msg.RECORD:
            self._on_record(env, msg.decode_payload(msg.RECORD, env.payload), data)  # files it as evidence
        # a close of the sliced exchange may name either (RoundCoordinator.judge)
        if env.kind == msg.ANNOUNCE:
            announce = msg.decode_payload(msg.ANNOUNCE, env.payload)
            self.book.add_announce(env.round, env.stage, Announced(env.sender_peer_id, env.replica,
                                                                   announce.envelope_hash, announce.size),
                                   first=False)
        if env.kind == msg.CLOSE:
            logger.warning("round %d stage %d: %s signed two different closes; both are ignored", env.round,
                           env.stage, env.sender_peer_id[-8:])
            self.book.add_close_equivocation(env.round, env.stage, env.sender_peer_id)

    def _on_announce(self, env: Envelope, announce: msg.Announce, _data: bytes) -> None:
        self.book.add_announce(env.round, env.stage,
                               Announced(env.sender_peer_id, env.replica, announce.envelope_hash,
                                         announce.size))
        if env.stage in self.held_stages():
            self.contributions.prefetch(env.round, env.stage)

    def _on_close(self, env: Envelope, close: msg.Close, data: bytes) -> None:
        self.book.add_close(env.round, env.stage, env.sender_peer_id, close, data)

    def _on_record(self, env: Envelope, signed: msg.RecordSignature, _data: bytes) -> None:
        """A member's signature over the round's record: verified, then filed (never trusted on the sender's
        word)."""
        if self.record_signer is None:
            return
        try:
            record = RoundRecord(env.run_id, env.round, signed.prev_head, signed.weights_root,
                                 signed.contributions_root, signed.train_loss_micro, signed.eval_loss_micro,
                                 signed.tokens, signed.num_contributors, signed.checkpoint_hash)
        except LedgerError as exc:
            raise msg.ProtocolError(f"record of round {env.round}: {exc}") from None
        signer, digest = self.record_signer(record, signed.account, signed.signature)
        self.book.add_record_signature(env.round, digest, record, signer, signed.signature)

    def _on_accusation(self, env: Envelope, accusation: msg.Accusation, _data: bytes) -> None:
        if self.spot_checks is not None:
            self.spot_checks.on_accusation(env, accusation)

    def _on_verdict(self, env: Envelope, verdict: msg.VerdictSignature, _data: bytes) -> None:
        if self.spot_checks is not None:
            self.spot_checks.on_verdict(env, verdict)

    def _on_attestation(self, env: Envelope, attestation: msg.Attestation, _data: bytes) -> None:
        self.book.add_attestation(env.round, env.stage, env.sender_peer_id, attestation)
