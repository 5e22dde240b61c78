"""The full exchange with contributions in parts (``diloco.exchange_parts`` = P > 1; docs/P2P.md, "Envelope
version 2"; docs/SCALE.md, "The per-shard exchange").

The sender signs its contribution as a version-2 envelope whose parts are the cut every node agrees on
(:func:`training.cluster_parts.exchange_plan`: P runs of whole tensors; part 0 also carries the body's head),
serves the whole envelope as before, and announces beside the usual ``announce`` a ``parts_announce``: the
header (the envelope with an empty payload) and the parts' digests. A holder checks the announcement at once
(the header's signature and slot against the gossip envelope's, the digests against the signed root: a lying
announcement is refused and logged, nothing else changes) and then fetches the contribution as its P parts in
parallel (:mod:`node.live.exchange.partsfetch`: ranges of the whole envelope's blob from the peers that hold
it), each checked alone as it arrives, and assembles the envelope: the same bytes, hash and record as a
version-1 fetch would give. Where no good announcement came, or the parts fail, the holder fetches the whole
blob as in a run without parts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass

from node import protocol as msg
from node.live.exchange.partsfetch import PART_STREAMS, PartsLayout, PartsUnavailable, fetch_parts
from node.live.state.roundbook import Announced
from p2p.envelope import Envelope, assemble, decode_envelope, decode_header, payload_offset
from p2p.errors import EnvelopeRejected
from p2p.parts import PartRejected, check_manifest, cut_at, pack_manifest, part_digests
from training.cluster_parts import blob_cuts, exchange_plan

logger = logging.getLogger(__name__)

#: Seconds a fetch waits for the parts announcement of an announced contribution before it fetches the whole
#: blob (the sender gossips it just before the announce; another path may deliver the announce first).
PARTS_ANNOUNCE_WAIT_S = 2.0


@dataclass(frozen=True)
class KnownParts:
    """A checked parts announcement: the envelope's header and its parts' digests."""

    outer_round: int
    header: Envelope
    digests: tuple[bytes, ...]


def part_sizes(body: bytes, blob: bytes, shapes: dict, parts: int) -> list[int]:
    """The sizes of a contribution body's parts: the blob's cut (:func:`blob_cuts`), part 0 with the body's
    head in front (the body ends with its blob)."""
    if not body.endswith(blob):
        raise ValueError("a contribution body ends with its codec blob")
    sizes = blob_cuts(blob, exchange_plan(shapes, parts))
    sizes[0] += len(body) - len(blob)
    return sizes


class ContributionParts:
    """One node's side of the parts of its run's contributions (module docstring)."""

    def __init__(self, parts: int, *, messenger, host, station, run_id: int, max_bytes: int,
                 transfer_timeout: float, streams: int = PART_STREAMS, stop: threading.Event | None = None):
        self.parts = parts
        self.messenger = messenger
        self.host = host
        self.station = station
        self.run_id = run_id
        self.max_bytes = max_bytes
        self.transfer_timeout = transfer_timeout
        self.streams = streams
        self.stop = stop
        self._known: dict[bytes, KnownParts] = {}
        self._lock = threading.Condition()
        #: Announcements and fetches refused, by reason (a lying announcement, a part every peer got wrong).
        self.refused: Counter[str] = Counter()

    # -- the sender ------------------------------------------------------------------
    def sign(self, outer_round: int, stage: int, body: bytes, blob: bytes) -> bytes:
        """The version-2 envelope bytes of this node's contribution ``body`` (its codec blob ``blob``)."""
        sizes = part_sizes(body, blob, self.station.worker().stage_shapes(stage), self.parts)
        return Envelope.create(self.messenger.identity, self.run_id, outer_round, msg.CONTRIBUTION, body,
                               stage=stage, replica=self.station.replica(), part_sizes=sizes).to_bytes()

    def announce(self, outer_round: int, stage: int, digest: bytes, envelope: bytes) -> None:
        """Gossip the parts announcement of this node's own contribution ``envelope`` (hash ``digest``)."""
        env = decode_envelope(envelope, self.max_bytes)
        if not env.in_parts:
            return
        digests = part_digests(cut_at(env.payload, env.sizes))
        self.messenger.gossip(outer_round, msg.PARTS_ANNOUNCE, msg.PartsAnnounce(
            digest, len(envelope), env.header().to_bytes(), pack_manifest(digests)), stage)

    # -- a holder ----------------------------------------------------------------------
    def on_announce(self, env: Envelope, announce: msg.PartsAnnounce, _data: bytes) -> None:
        """Check a peer's parts announcement and keep it (refused with its reason, logged, otherwise)."""
        try:
            header = decode_header(announce.header, self.max_bytes)
            if (header.kind, header.run_id, header.round, header.stage, header.replica, header.sender) != (
                    msg.CONTRIBUTION, self.run_id, env.round, env.stage, env.replica, env.sender):
                raise PartRejected("announcement_mismatch", "the header is not the announcer's contribution "
                                                            "to this round and stage")
            digests = check_manifest(announce.manifest, header.parts_root, len(header.sizes))
            if payload_offset(header, sum(header.sizes)) + sum(header.sizes) > announce.size:
                raise PartRejected("announcement_mismatch", f"parts past the announced {announce.size} bytes")
        except (EnvelopeRejected, PartRejected) as exc:
            self.refused[exc.reason] += 1
            logger.warning("round %d stage %d: parts announcement of %s refused: %s", env.round, env.stage,
                           env.sender_peer_id[-8:], exc)
            return
        with self._lock:
            self._known[announce.envelope_hash] = KnownParts(env.round, header, tuple(digests))
            self._lock.notify_all()

    def known(self, digest: bytes, wait: float = 0.0) -> KnownParts | None:
        """The checked parts announcement of envelope ``digest``, waiting up to ``wait`` seconds for it."""
        with self._lock:
            self._lock.wait_for(lambda: digest in self._known, timeout=wait)
            return self._known.get(digest)

    def fetch(self, outer_round: int, stage: int, a: Announced, providers: list[str],
              fallback: list[str]) -> bytes | None:
        """The whole envelope ``a`` names, fetched as its parts; None where no checked announcement of it is
        here or the parts could not be had (the caller then fetches the whole blob)."""
        known = self.known(a.envelope_hash, PARTS_ANNOUNCE_WAIT_S)
        if known is None:
            logger.info("round %d stage %d: no parts announcement of contribution %s: the whole blob is "
                        "fetched", outer_round, stage, a.envelope_hash.hex()[:12])
            return None
        sizes = known.header.sizes
        layout = PartsLayout.of(a.envelope_hash.hex(), payload_offset(known.header, sum(sizes)), sizes,
                                known.digests)
        try:
            parts = fetch_parts(self.host, layout, providers, fallback=fallback, streams=self.streams,
                                timeout=self.transfer_timeout, stop=self.stop)
        except PartsUnavailable as exc:
            self.refused["parts_unavailable"] += 1
            logger.warning("round %d stage %d: contribution %s not fetched in parts (the whole blob is asked "
                           "for): %s", outer_round, stage, a.envelope_hash.hex()[:12], exc)
            return None
        data = assemble(known.header, parts).to_bytes()
        if hashlib.sha256(data).digest() != a.envelope_hash:
            self.refused["announcement_mismatch"] += 1
            logger.warning("round %d stage %d: the parts of %s make another envelope than the one announced",
                           outer_round, stage, a.envelope_hash.hex()[:12])
            return None
        logger.info("round %d stage %d: contribution %s fetched in %d parts (%d bytes) from %d peer(s)",
                    outer_round, stage, a.envelope_hash.hex()[:12], len(parts), len(data),
                    len(set(providers) | set(fallback)))
        return data

    def forget_before(self, outer_round: int) -> None:
        with self._lock:
            self._known = {d: k for d, k in self._known.items() if k.outer_round >= outer_round}
