"""Token-bucket rate caps for blob traffic, to emulate 1 Gbps / 100 Mbps links in experiments."""

from __future__ import annotations

import time

import trio

#: Smallest default burst: two ~1 MiB yamux frames (p2p.fastpath).
MIN_BURST_BYTES = 2 << 20


class TokenBucket:
    """A token bucket refilled at ``rate`` bytes/s holding at most ``burst`` bytes.

    :meth:`consume` may take more than the burst at once (a 1 MiB chunk against a
    small bucket): it then waits for the debt to be refilled, so the long-run rate
    stays at ``rate`` whatever the chunk size. The default burst is 10 ms of the
    rate (a link's short queue), but at least :data:`MIN_BURST_BYTES`, two of the
    ~1 MiB yamux frames blobs travel in: a bucket that cannot hold a whole frame
    loses capacity each time a frame is consumed a little late (measured: a
    100 Mbps cap gave 10.0-11.3 MB/s of 12.5 with 1 MiB frames and a 125 KB
    burst, 11.9-12.1 with 2 MiB). A transfer measured against the cap can beat it
    by at most one burst (the former 50 ms could let a 100 MB transfer at a
    1 Gbps cap finish ~6 % faster than the cap allows; 2 MiB is under 2.1 %).

    ``receiving``: the bucket is charged for bytes as they are *read*, after they
    arrived, so the time they took to arrive was idle time for it. A sending
    bucket charges a chunk before it goes out (store and forward, like a link
    serialising it); a receiving bucket charged the same way with a burst smaller
    than the chunk made every chunk wait its whole transfer time a second time
    (two caps in series: a 344 kB blob under a 16 KiB bucket took ~2x bytes /
    rate). A receiving bucket therefore credits the idle time since its last
    charge up to ``max(burst, amount)`` for a charge of ``amount``: bytes that
    arrived no faster than the rate pass without a wait, a sender that ignores
    the cap is still held to it, and the receiver can beat the cap by at most one
    burst plus one chunk.
    """

    def __init__(self, rate: float, burst: float | None = None, receiving: bool = False) -> None:
        if rate <= 0:
            raise ValueError(f"rate={rate}: must be > 0 bytes/s")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate * 0.01, MIN_BURST_BYTES))
        self.receiving = receiving
        self._tokens = self.burst
        self._stamp = trio.current_time()
        self._lock = trio.Lock()

    async def consume(self, amount: int) -> None:
        """Wait until ``amount`` bytes may pass (FIFO among concurrent callers)."""
        async with self._lock:
            now = trio.current_time()
            ceiling = max(self.burst, amount) if self.receiving else self.burst
            self._tokens = min(ceiling, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= amount
            if self._tokens < 0:
                await trio.sleep(-self._tokens / self.rate)


#: (peer, direction) buckets kept at most; past this, the one used longest ago is dropped (a peer that comes
#: back starts again with a full burst): peers that came and went do not grow the table for the host's life.
MAX_BUCKETS = 2048


class PeerRateLimiter:
    """One :class:`TokenBucket` per (peer, direction); ``rate <= 0`` disables it.

    Direction ``"in"`` buckets are receiving buckets (:class:`TokenBucket`);
    :meth:`expect` starts one's clock when a request is sent, before the bytes
    it asks for can arrive.
    """

    def __init__(self, rate: float, burst: float | None = None) -> None:
        self.rate = rate
        self.burst = burst  # None: TokenBucket's default
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def _bucket(self, peer_id: str, direction: str) -> TokenBucket:
        key = (peer_id, direction)
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.burst, receiving=direction == "in")
            if len(self._buckets) >= MAX_BUCKETS:
                del self._buckets[next(iter(self._buckets))]
        self._buckets[key] = bucket  # last: the dict runs from the bucket used longest ago
        return bucket

    def expect(self, peer_id: str) -> None:
        """Bytes from ``peer_id`` were just asked for: their arrival time counts from now."""
        if self.rate > 0:
            self._bucket(peer_id, "in")

    async def consume(self, peer_id: str, direction: str, amount: int) -> None:
        if self.rate <= 0:
            return
        await self._bucket(peer_id, direction).consume(amount)


class Allowance:
    """A non-blocking token bucket for counting events (streams, requests), not bytes: ``rate`` per
    second, at most ``burst`` saved up. :meth:`take` says whether one more event may pass now."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate={rate}, burst={burst}: must be > 0 and >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = self.burst
        self._stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
