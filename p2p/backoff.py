"""A "failed recently: do not ask again yet" book, bounded whatever the keys that flood it.

A node asks peers for things (a partial envelope, a range of a bundle) on every pass of a
waiting loop; a request that failed must not be sent again on the next pass, a fraction of
a second later (a retry storm against a provider that withholds or is gone), nor must the
book of failures grow with every key a peer makes up. :class:`RetryBook` keeps, per key,
when its last request failed; :meth:`RetryBook.blocked` says whether ``retry_after`` seconds
have passed since. At most ``max_entries`` keys are kept: past that, expired keys go first,
then the oldest failures (a key dropped early is only asked again sooner). Thread-safe.
(:class:`p2p.dialbook.DialBook` keeps failure *counts* per peer, a different rule.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

#: Keys a book keeps at most unless told otherwise.
MAX_ENTRIES = 4096


class RetryBook:
    """Per key, when its last attempt failed; a key is blocked for ``retry_after`` seconds after."""

    def __init__(self, retry_after: float, max_entries: int = MAX_ENTRIES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if retry_after < 0 or max_entries < 1:
            raise ValueError(f"retry_after={retry_after} must be >= 0 and max_entries={max_entries} >= 1")
        self.retry_after = retry_after
        self.max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._failed_at: dict[Hashable, float] = {}  # insertion order: oldest failure first

    def blocked(self, key: Hashable) -> bool:
        """True if ``key`` failed less than ``retry_after`` seconds ago: do not ask again yet."""
        with self._lock:
            failed = self._failed_at.get(key)
        return failed is not None and self._clock() - failed < self.retry_after

    def failed(self, key: Hashable) -> None:
        """An attempt for ``key`` failed now."""
        with self._lock:
            self._failed_at.pop(key, None)  # re-inserted last: the order stays oldest first
            self._failed_at[key] = self._clock()
            if len(self._failed_at) > self.max_entries:
                self._evict()

    def succeeded(self, key: Hashable) -> None:
        """An attempt for ``key`` succeeded: it is not blocked any more."""
        with self._lock:
            self._failed_at.pop(key, None)

    def forget_older_than(self, age: float) -> None:
        """Drop the failures more than ``age`` seconds old (a periodic clean-up)."""
        with self._lock:
            stale = self._clock() - age
            self._failed_at = {key: at for key, at in self._failed_at.items() if at > stale}

    def __len__(self) -> int:
        with self._lock:
            return len(self._failed_at)

    def _evict(self) -> None:
        """Under the lock, with one key too many: drop the expired failures, then the oldest ones. The
        book is in failure order, so both are at its front."""
        now = self._clock()
        while self._failed_at:
            oldest = next(iter(self._failed_at))
            if len(self._failed_at) <= self.max_entries and now - self._failed_at[oldest] < self.retry_after:
                break
            del self._failed_at[oldest]
