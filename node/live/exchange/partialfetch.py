"""Announced partial envelopes fetched in the background, so that no slow provider holds up a holder's round.

A holder of the sliced exchange (node.live.exchange.sliced) waits for one partial per slice and
lets each slice's candidates' turns open on a clock. It used to fetch an announced
partial on its own waiting thread: one provider that did not answer (a starved
process: 16 nodes on 2 cores) held that thread for the whole transfer timeout, then
for the same again from each fallback peer, on every pass, while the turns of every
slice went by. Here each announced partial has at most one fetch under way, on a small
pool; the waiting thread only looks at what has come, so the other slices and the other
candidates' partials are taken as soon as they are here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from p2p.backoff import RetryBook

logger = logging.getLogger(__name__)

#: Fetches under way at once (a holder fetches about one partial per slice and stage).
FETCH_WORKERS = 4
#: Seconds before a fetch that failed is tried again (a provider that refuses at once must not spin).
RETRY_AFTER_S = 1.0


class PartialFetcher:
    """Background fetches of announced partials, one at a time per envelope hash.

    ``fetch(digest, sender)`` returns the envelope's bytes (sha256-checked) or None; it
    asks the sender, then a few live peers (node.live.exchange.sliced). :meth:`get` never blocks
    longer than its ``wait``.
    """

    def __init__(self, fetch: Callable[[bytes, str], bytes | None], on_arrival: Callable[[], None],
                 workers: int = FETCH_WORKERS, retry_after: float = RETRY_AFTER_S) -> None:
        self._fetch = fetch
        self._retry_after = retry_after
        self._on_arrival = on_arrival  # wakes whoever waits for partials
        self._lock = threading.Condition()
        self._arrived: dict[bytes, tuple[int, bytes]] = {}  # digest -> (round, envelope bytes)
        self._in_flight: set[bytes] = set()
        self._failed = RetryBook(retry_after)  # digests whose last fetch failed under retry_after s ago
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="partial")

    def get(self, outer_round: int, digest: bytes, sender: str, wait: float = 0.0) -> bytes | None:
        """The partial envelope ``digest`` if it has come; otherwise start its fetch (unless one is under way
        or the last one failed under ``retry_after`` seconds ago) and wait up to ``wait`` seconds for it."""
        deadline = time.monotonic() + wait
        with self._lock:
            while True:
                if digest in self._arrived:
                    return self._arrived[digest][1]
                if digest not in self._in_flight and not self._failed.blocked(digest):
                    self._in_flight.add(digest)
                    try:
                        self._executor.submit(self._run, outer_round, digest, sender)
                    except RuntimeError:  # closed: the node is stopping
                        self._in_flight.discard(digest)
                        return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, self._retry_after))

    def in_flight(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._in_flight

    def _run(self, outer_round: int, digest: bytes, sender: str) -> None:
        data = None
        try:
            data = self._fetch(digest, sender)
        except Exception as exc:  # noqa: BLE001 - thread boundary: a fetch's failure is this fetch's only
            logger.warning("partial %s of %s not fetched: %s", digest.hex()[:12], sender[-8:], exc)
        with self._lock:
            self._in_flight.discard(digest)
            if data is None:
                self._failed.failed(digest)
            else:
                self._arrived[digest] = (outer_round, data)
                self._failed.succeeded(digest)
            self._lock.notify_all()
        if data is not None:
            self._on_arrival()

    def forget_before(self, outer_round: int) -> None:
        with self._lock:
            self._arrived = {d: v for d, v in self._arrived.items() if v[0] >= outer_round}
            self._failed.forget_older_than(600.0)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
