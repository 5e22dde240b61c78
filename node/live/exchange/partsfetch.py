"""A contribution's parts fetched in parallel, each checked alone as it arrives (docs/P2P.md, "Envelope
version 2"; docs/SCALE.md, "The per-shard exchange").

A version-2 contribution's part is a byte range of its whole envelope's blob (the payload is one ``bin`` in
the envelope, the parts consecutive ranges of it: :func:`p2p.envelope.payload_offset`), so every peer that
holds the whole envelope, the sender and every holder that fetched it, serves any part with a range read and
no copy of its own. A holder fetches the P parts over a bounded pool of streams (``streams`` at once, each
part from the peers in turn, starting at a different one for each part, so the parts come from several peers
at once), checks each part against its digest and size the moment it is here (the digests were checked against
the signed root before: :func:`p2p.parts.check_manifest`), and hands it to ``on_part`` (a cluster's rank 0
forwards it to its ranks) or keeps it for the caller to assemble. A part that fails its check at one peer is
asked of the next; the fetch fails with :class:`PartsUnavailable` only when every peer failed one part.

Like :mod:`node.live.exchange.partialfetch` (the sliced exchange's partials), the waiting thread never holds
a stream: the pool's threads do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from node.errors import NodeError
from p2p.errors import P2PError
from p2p.parts import PartRejected, check_part

logger = logging.getLogger(__name__)

#: Parts fetched at once by one holder (the bounded pool of streams), unless the caller says otherwise.
PART_STREAMS = 8


class PartsUnavailable(NodeError):
    """A part could not be fetched from any peer, or came wrong from every one (the reasons are listed)."""


@dataclass(frozen=True)
class PartsLayout:
    """Where a version-2 envelope's parts lie in its whole blob: ``offsets[j]``, ``sizes[j]``,
    ``digests[j]``."""

    blob_hex: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, blob_hex: str, payload_at: int, sizes: Sequence[int],
           digests: Sequence[bytes]) -> PartsLayout:
        offsets, at = [], payload_at
        for size in sizes:
            offsets.append(at)
            at += size
        return cls(blob_hex, tuple(offsets), tuple(sizes), tuple(digests))


def fetch_parts(host, layout: PartsLayout, providers: Sequence[str], *, fallback: Sequence[str] = (),
                streams: int = PART_STREAMS, timeout: float | None = None,
                on_part: Callable[[int, bytes], None] | None = None,
                stop: threading.Event | None = None) -> list[bytes] | None:
    """Every part of ``layout`` from ``providers`` (peer ids that hold the whole envelope: part j asks them
    in turn from the (j mod n)-th on), then ``fallback`` (peers that may hold it), ``streams`` at a time
    (module docstring).

    Returns the parts in order, or None when ``on_part`` took each as it arrived (called from the pool's
    threads, one part at a time per stream). Raises :class:`PartsUnavailable`.
    """
    if not providers and not fallback:
        raise PartsUnavailable(f"blob {layout.blob_hex[:12]}: no peer to fetch its parts from")
    count = len(layout.sizes)
    kept: list[bytes | None] = [None] * count
    failures: list[str] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        reasons = []
        turns = [providers[(index + turn) % len(providers)] for turn in range(len(providers))] + [
            peer for peer in fallback if peer not in providers]
        for peer in turns:
            if stop is not None and stop.is_set():
                raise PartsUnavailable("stopping")
            try:
                data = host.fetch_blob_range(layout.blob_hex, layout.offsets[index], layout.sizes[index],
                                             peer, timeout=timeout)
                check_part(index, data, layout.digests[index], layout.sizes[index])
            except PartRejected as exc:  # a peer that serves other bytes: the next one is asked
                reasons.append(f"{peer[-8:]}: {exc.reason}")
                logger.warning("part %d of %s from %s refused: %s", index, layout.blob_hex[:12], peer[-8:],
                               exc)
                continue
            except P2PError as exc:
                reasons.append(f"{peer[-8:]}: {type(exc).__name__}")
                continue
            if on_part is not None:
                on_part(index, data)
            else:
                kept[index] = data
            return
        with lock:
            failures.append(f"part {index}: {'; '.join(reasons)}")

    with ThreadPoolExecutor(max_workers=max(1, min(streams, count)), thread_name_prefix="part") as pool:
        for future in [pool.submit(one, index) for index in range(count)]:
            future.result()
    if failures:
        raise PartsUnavailable(f"blob {layout.blob_hex[:12]}: " + " | ".join(sorted(failures)))
    return None if on_part is not None else [part for part in kept if part is not None]
