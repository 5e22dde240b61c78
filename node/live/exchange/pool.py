"""The pool of a round's fetched contributions (background, verified, deduplicated; each
exchange owns one), and how a node serves a blob."""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from node import protocol as msg
from node.errors import NodeError
from node.fsutil import keep_evidence, serve_when_space
from node.live.state.roundbook import Announced, RoundBook
from p2p.blobstore import hash_file
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected, P2PError, P2PTimeout
from p2p.host import P2PHost

logger = logging.getLogger(__name__)


#: Own contributions waiting for their DHT announcement beyond this are not announced (logged):
#: the announcements lag the run only when the DHT is slower than the rounds.
MAX_PENDING_ANNOUNCES = 64


#: Live peers asked at random once the sender and the coordinator failed (each costs a stream open:
#: asking every peer multiplied the load exactly when streams were failing).
FALLBACK_PROVIDERS = 3


def serve_blob(host: P2PHost, source, link: bool = False) -> str:
    """Store ``source`` (bytes or a path) in the host's blob store and announce it on the DHT.

    The blob is served from the moment it is stored; a DHT announcement that times out (a loaded
    machine, few DHT peers) only means peers must ask the live providers first, as they do, so it
    is logged, never fatal. Returns the sha256 hex. ``link``: a path is hard-linked into the store, not
    copied (a checkpoint: one copy on disk, never read whole into memory).
    """
    try:
        return host.provide_blob(source, link=link) if link else host.provide_blob(source)
    except P2PTimeout as exc:
        logger.info("blob stored and served; its DHT announcement timed out: %s", exc)
        if isinstance(source, (bytes, bytearray, memoryview)):
            return hashlib.sha256(source).hexdigest()
        return hash_file(Path(source))


class ContributionPool:
    """Verified contribution envelopes by (round, stage) and envelope hash."""

    def __init__(self, host: P2PHost, book: RoundBook, run_id: int, incoming: Path, max_bytes: int,
                 transfer_timeout: float, workers: int,
                 check_payload: Callable[[int, int, bytes], None] | None = None,
                 evidence_dir: Path | None = None, lazy: bool = False,
                 fallback_providers: Callable[[], list[str]] | None = None,
                 inputs_held: Callable[[int, int, bytes, bytes], bool] | None = None,
                 stop: threading.Event | None = None,
                 envelope_fetch: Callable[..., bytes | None] | None = None) -> None:
        self.host = host
        #: The node's: a serve paused by a full disk gives up when it is set (none: waits for space).
        self.stop = stop or threading.Event()
        self.book = book
        self.run_id = run_id
        self.incoming = incoming
        self.max_bytes = max_bytes
        self.transfer_timeout = transfer_timeout
        self.check_payload = check_payload
        self.evidence_dir = evidence_dir
        self.lazy = lazy
        self._wanted: set[tuple[int, int]] = set()  # (round, stage) a lazy pool fetches everything of
        self._have: dict[tuple[int, int], dict[bytes, bytes]] = {}
        self._rejected: dict[tuple[int, int], dict[bytes, tuple[str, str]]] = {}  # digest -> (sender, reason)
        self._senders: dict[bytes, tuple[int, str]] = {}  # digest -> (replica, peer id) of envelopes held
        self._arrived: dict[bytes, float] = {}  # digest -> time.monotonic() it was added (utilization timing)
        self._in_flight: set[bytes] = set()
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=max(2, workers), thread_name_prefix="fetch")
        self._announcer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="announce")
        self._announcing = 0
        self._announced: dict[int, list[str]] = {}  # round -> own contributions announced on the DHT
        # rounds before this are forgotten: their contributions no longer announced
        self._forgotten_before = 0
        #: Peers a fetch falls back to once the sender and the coordinator failed (the live peers).
        self.fallback_providers: Callable[[], list[str]] = fallback_providers or list
        #: Whether a coordinator holds what a contribution here needs besides its envelope (round, stage,
        #: envelope hash, envelope): the sliced exchange's whole bundle. None: the envelope is all.
        self.inputs_held = inputs_held
        #: (round, stage, Announced, holders, fallback peers) -> the envelope's bytes fetched another way (a
        #: parts run's parallel parts, node.live.exchange.parts), or None: the whole blob is fetched.
        self.envelope_fetch = envelope_fetch

    def serve_own(self, outer_round: int, envelope: bytes) -> bytes:
        """Serve this node's own contribution to ``outer_round`` at once and announce it on the DHT in the
        background, until the pool forgets the round (:meth:`forget_before`; served after, not announced).

        Fetchers ask the sender directly, so the announcement never holds the caller (the training
        lane) up. Returns the envelope's sha256.
        """
        digest = serve_when_space(self.host, envelope, what=f"round {outer_round}'s own contribution",
                                  stop=self.stop)
        with self._lock:
            live = outer_round >= self._forgotten_before
            queued = live and self._announcing < MAX_PENDING_ANNOUNCES
            self._announcing += queued
        if not live:
            logger.debug("contribution %s of round %d served; not announced (the round is past)", digest[:12],
                         outer_round)
        elif not queued:
            logger.info("contribution %s served; not announced on the DHT (%d announcements pending)",
                        digest[:12], MAX_PENDING_ANNOUNCES)
        else:
            try:
                self._announcer.submit(self._announce, outer_round, envelope, digest)
            except RuntimeError:  # closed: the node is stopping
                with self._lock:
                    self._announcing -= 1
        return bytes.fromhex(digest)

    def _announce(self, outer_round: int, envelope: bytes, digest: str) -> None:
        try:
            with self._lock:
                if outer_round < self._forgotten_before:  # forgotten while it waited: not announced
                    return
            serve_blob(self.host, envelope)
            with self._lock:  # registered once announced: a forget_before while it announced missed it
                late = outer_round < self._forgotten_before
                if not late:
                    self._announced.setdefault(outer_round, []).append(digest)
            if late:
                self._retire([digest])
        except (P2PError, OSError) as exc:
            logger.info("contribution not announced on the DHT: %s", exc)
        finally:
            with self._lock:
                self._announcing -= 1

    def add(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> None:
        """Register an envelope this node holds (its own contribution, or one fetched and checked)."""
        env = decode_envelope(envelope, self.max_bytes)
        with self._lock:
            self._have.setdefault((outer_round, stage), {})[digest] = envelope
            self._senders[digest] = (env.replica, env.sender_peer_id)
            self._arrived.setdefault(digest, time.monotonic())

    def arrived_at(self, digest: bytes) -> float | None:
        """``time.monotonic()`` when the envelope ``digest`` was here and checked (None if it is not)."""
        with self._lock:
            return self._arrived.get(digest)

    def holds(self, outer_round: int, stage: int, replica: int, peer_id: str, digest: bytes) -> bool:
        """Whether the checked envelope ``digest`` of (round, stage) is here and was signed by that replica's
        peer."""
        with self._lock:
            return digest in self._have.get((outer_round, stage), {}) \
                and self._senders.get(digest) == (replica, peer_id)

    def in_flight(self, digest: bytes) -> bool:
        """Whether a fetch of the envelope ``digest`` is under way."""
        with self._lock:
            return digest in self._in_flight

    def have(self, outer_round: int, stage: int) -> dict[bytes, bytes]:
        with self._lock:
            return dict(self._have.get((outer_round, stage), {}))

    def closable(self, outer_round: int, stage: int) -> dict[bytes, bytes]:
        """The envelopes of (round, stage) a coordinator may close with: those here whose inputs it holds
        too (``inputs_held``, which may start fetching them; see docs/PROTOCOL.md, "Sliced exchange")."""
        have = self.have(outer_round, stage)
        if self.inputs_held is None:
            return have
        return {digest: envelope for digest, envelope in have.items()
                if self.inputs_held(outer_round, stage, digest, envelope)}

    def rejected(self, outer_round: int, stage: int) -> dict[bytes, tuple[str, str]]:
        """Envelope hashes of (round, stage) proven bad: digest -> (sender peer id, reason)."""
        with self._lock:
            return dict(self._rejected.get((outer_round, stage), {}))

    def _reject(self, outer_round: int, stage: int, a: Announced, reason: str, data: bytes) -> None:
        with self._lock:
            self._rejected.setdefault((outer_round, stage), {})[a.envelope_hash] = (a.peer_id, reason)
        logger.warning("round %d stage %d: contribution %s of %s rejected: %s", outer_round, stage,
                       a.envelope_hash.hex()[:12], a.peer_id[-8:], reason)
        if self.evidence_dir is not None:
            keep_evidence(self.evidence_dir
                          / f"round-{outer_round:08d}-stage{stage}-{a.envelope_hash.hex()}.envelope",
                          data)  # the signed envelope is the proof

    def want(self, outer_round: int, stage: int) -> None:
        """Fetch every announced contribution of (round, stage) from now on, also in a lazy pool."""
        with self._lock:
            self._wanted.add((outer_round, stage))
        self.prefetch(outer_round, stage)

    def prefetch(self, outer_round: int, stage: int) -> None:
        """Start fetching every announced contribution of (round, stage) not yet here (a lazy pool:
        only once :meth:`want` asked for that round and stage)."""
        if self.lazy:
            with self._lock:
                if (outer_round, stage) not in self._wanted:
                    return
            if self.inputs_held is not None:
                self.closable(outer_round, stage)  # inputs of the envelopes already here: fetched from now on
        for a in self.book.snapshot_announces(outer_round, stage).values():
            self.fetch(outer_round, stage, a)

    def fetch(self, outer_round: int, stage: int, a: Announced, also_from: str | None = None) -> None:
        """Start fetching one contribution (announced, or named by a close) unless it is here or refused.

        ``also_from``: another peer that should hold it (the coordinator of a close naming it).
        """
        with self._lock:
            if (a.envelope_hash in self._have.get((outer_round, stage), {})
                or a.envelope_hash in self._in_flight
                    or a.envelope_hash in self._rejected.get((outer_round, stage), {})):
                return
            self._in_flight.add(a.envelope_hash)
        self._executor.submit(self._fetch_one, outer_round, stage, a, also_from)

    def _fetch_one(self, outer_round: int, stage: int, a: Announced, also_from: str | None = None) -> None:
        try:
            dest = self.incoming / f"{a.envelope_hash.hex()}.part"
            dest.parent.mkdir(parents=True, exist_ok=True)
            providers = list(dict.fromkeys(p for p in (a.peer_id, also_from) if p and p != self.host.peer_id))
            data = self._fetch_envelope(outer_round, stage, a, providers, dest)
            env = decode_envelope(data, self.max_bytes)
            if (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id) != (
                    msg.CONTRIBUTION, self.run_id, outer_round, stage, a.replica, a.peer_id):
                raise EnvelopeRejected("mismatch", "contribution header does not match its announcement")
            if self.check_payload is not None:
                try:
                    self.check_payload(stage, outer_round, env.payload, env.sender_peer_id)
                except (ValueError, msg.ProtocolError) as exc:  # the codec's errors are ValueErrors
                    self._reject(outer_round, stage, a, f"payload does not decode: {exc}", data)
                    return
            self.add(outer_round, stage, a.envelope_hash, data)
            # Served onward (not announced: module docstring);
            # the fetch stored it already, so this writes nothing.
            serve_when_space(self.host, data, what=f"round {outer_round}'s contribution of {a.peer_id[-8:]}",
                             stop=self.stop)
            self._fetch_inputs(outer_round, stage, a.envelope_hash, data)
        except (P2PError, OSError) as exc:  # a header that does not match its announcement included
            logger.warning("round %d stage %d: contribution %s from %s not fetched: %s", outer_round, stage,
                           a.envelope_hash.hex()[:12], a.peer_id[-8:], exc)
        finally:
            with self._lock:
                self._in_flight.discard(a.envelope_hash)
            self.book.notify()  # wake whoever waits on the book

    def _others(self, providers: list[str]) -> list[str]:
        """A few live peers besides ``providers`` (they fetched it), at random."""
        others = [p for p in self.fallback_providers() if p not in providers and p != self.host.peer_id]
        return random.sample(others, min(FALLBACK_PROVIDERS, len(others)))

    def _fetch_envelope(self, outer_round: int, stage: int, a: Announced, providers: list[str],
                        dest: Path) -> bytes:
        """The announced envelope's bytes (unchecked): in parts where the run moves them so
        (:attr:`envelope_fetch`), else, or where that failed, the whole blob."""
        if self.envelope_fetch is not None:
            data = self.envelope_fetch(outer_round, stage, a, providers, self._others(providers))
            if data is not None:
                return data
        try:
            self.host.fetch_blob(a.envelope_hash.hex(), dest, providers=providers or None,
                                 timeout=self.transfer_timeout)
        except P2PError:  # the sender may be gone: a few live peers that fetched it, else the DHT
            others = self._others(providers)
            self.host.fetch_blob(a.envelope_hash.hex(), dest, providers=others or None,
                                 timeout=self.transfer_timeout)
        data = dest.read_bytes()
        dest.unlink(missing_ok=True)
        return data

    def _fetch_inputs(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> None:
        """Where this node may close (round, stage) (:meth:`want`), start fetching what a close needs of a
        contribution besides its envelope (``inputs_held``: the sliced exchange's bundle) as soon as the
        envelope is here, not only at this node's turn to close: a fallback coordinator wants the
        contributions from the deadline on and closes CLOSE_FALLBACK_S later with the inputs it then holds
        (asking for them only then left every honest bundle but its own out of its close)."""
        with self._lock:
            wanted = (outer_round, stage) in self._wanted
        if self.inputs_held is not None and wanted:
            self.inputs_held(outer_round, stage, digest, envelope)

    def collect(self, outer_round: int, stage: int, close: msg.Close) -> list[bytes]:
        """The closed set's envelopes in the close's (canonical) order, fetching any still missing."""
        deadline = time.monotonic() + self.transfer_timeout
        while True:
            have = self.have(outer_round, stage)
            missing = [e for e in close.contributions if e[2] not in have]
            if not missing:
                return [have[e[2]] for e in close.contributions]
            if time.monotonic() > deadline:
                raise NodeError(f"round {outer_round} stage {stage}: contributions "
                                f"{[e[2].hex()[:12] for e in missing]} could not be fetched")
            for replica, peer_id, digest, size in missing:
                self.fetch(outer_round, stage, Announced(peer_id, replica, digest, size))
            time.sleep(0.2)

    def forget_before(self, outer_round: int) -> None:
        """Drop what the pool holds of rounds before ``outer_round``, and stop announcing this node's own
        contributions to them: the archive keeps them (an audit reads them there) and the blob store still
        serves them to a peer that names this node, but no peer looks them up any more, and announced for
        ever they grew the DHT's provider store by every round's (issue 45's soak)."""
        with self._lock:
            self._forgotten_before = max(self._forgotten_before, outer_round)
            retired = [d for r in [r for r in self._announced if r < outer_round]
                       for d in self._announced.pop(r)]
            self._wanted = {key for key in self._wanted if key[0] >= outer_round}
            for book in (self._have, self._rejected):
                for key in [k for k in book if k[0] < outer_round]:
                    for digest in book[key]:
                        self._senders.pop(digest, None)
                        self._arrived.pop(digest, None)
                    del book[key]
        self._retire(retired)

    def _retire(self, digests: list[str]) -> None:
        for digest in digests:
            try:
                self.host.stop_announcing(digest)
            except (P2PError, OSError) as exc:  # the record ages out of no one's store but ours: logged
                logger.debug("contribution %s still announced: %s", digest[:12], exc)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._announcer.shutdown(wait=False, cancel_futures=True)
