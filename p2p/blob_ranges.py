"""One range of a blob from one provider over ``/dlx/blob/1.0.0``: the request, the reply, the raw bytes.

:class:`BlobRanges` asks a provider for ``[offset, offset+length)`` (a size query is the
empty range at 0), checks its reply (:func:`p2p.blob_protocol.parse_reply`) and reads the
range's bytes under the stall timeout and the rate floor, counting and rate-limiting them.
A refusal (``not_found``, ``out_of_range``, ``busy``, ``bad_request``) raises
:class:`ProviderFailed`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from p2p.blob_protocol import BLOB_PROTOCOL, MAX_FRAME_BYTES, parse_reply, request_frame
from p2p.blobstore import check_sha256_hex
from p2p.errors import ProviderTooSlow
from p2p.fastpath import grant_receive_window
from p2p.streams import close_quietly, reset_quietly
from p2p.wire import ProtocolViolation, read_frame, write_frame


class ProviderFailed(Exception):
    """A provider's reply other than ``ok``: ``status`` says why."""

    def __init__(self, status: str, total: int | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.total = total  # the blob's size, if the reply gave one (out_of_range)


class BlobRanges:
    """Mixin of :class:`p2p.blob_client.BlobFetcher`: ask one provider for one range and read it.

    Expects of the fetcher: ``stall_timeout``, ``min_rate``, ``_open_stream``, ``_limiter``
    (:class:`p2p.ratelimit.PeerRateLimiter`), ``_stats`` (the host's transfer counters),
    ``_fetch_slots`` (a ``trio.CapacityLimiter``) and ``_mark``.
    """

    async def _request(self, peer: ID, digest: bytes, offset: int, length: int) -> tuple[Any, dict[str, Any]]:
        self._mark(f"request {offset}+{length}")
        with trio.fail_after(self.stall_timeout):  # dialling included: a dead provider costs one stall
            stream = await self._open_stream(peer, BLOB_PROTOCOL)
        self._mark(f"stream open {offset}+{length}")
        try:
            with trio.fail_after(self.stall_timeout):
                # Open the yamux window to the whole range before asking for it: granted
                # after the request, the grant raced the provider's first 256 KiB, and a
                # provider that lost the race idled for py-libp2p's 10 ms window poll.
                await grant_receive_window(stream, length)
                await write_frame(stream, request_frame(digest, offset, length))
                header = await read_frame(stream, MAX_FRAME_BYTES)
            self._mark(f"reply {offset}+{length}")
            status, total = parse_reply(header, digest, offset, length)
            if status != "ok":
                raise ProviderFailed(status, total)
        except BaseException:
            await reset_quietly(stream)
            raise
        return stream, header

    async def stat(self, peer: ID, sha256_hex: str) -> int:
        """Total size of the blob at ``peer``; raises ProviderFailed/ProtocolViolation/libp2p errors."""
        digest = bytes.fromhex(check_sha256_hex(sha256_hex))
        stream, header = await self._request(peer, digest, 0, 0)
        await close_quietly(stream)
        return int(header["total"])
    async def _read_range(
        self, stream: Any, peer_text: str, offset: int, length: int, take: Callable[[Any], Awaitable[None]]
    ) -> None:
        """Read the ``length`` raw bytes of an ``ok`` reply, handing each chunk to ``take`` in order.

        The one reader of range bytes: it refuses a stream that ends early or returns more
        than asked, bounds each read by the stall timeout and the whole range by
        ``stall_timeout + length / min_rate`` (:class:`ProviderTooSlow`), counts and caps what arrives.
        """
        received = 0
        # A provider trickling bytes forever: the range must arrive by this time. Only reads are cut
        # short by it (never a write of received bytes, whose job could outlive its cancellation).
        allowed = self.stall_timeout + length / self.min_rate if self.min_rate > 0 else float("inf")
        give_up_at = trio.current_time() + allowed
        while received < length:
            left = give_up_at - trio.current_time()
            with trio.move_on_after(max(0.0, min(self.stall_timeout, left))) as waited:
                chunk = await stream.read(length - received)
            if waited.cancelled_caught:
                if left < self.stall_timeout:
                    raise ProviderTooSlow(
                        f"range {offset}+{length}: {received} bytes in {allowed:.0f} s, under "
                        f"p2p.blob_min_rate={self.min_rate:.0f} B/s"
                    )
                raise trio.TooSlowError(f"no byte for {self.stall_timeout:.0f} s (p2p.blob_stall_timeout)")
            if not chunk:
                raise ProtocolViolation(f"stream ended {length - received} bytes early")
            if len(chunk) > length - received:  # a read never returns more than asked
                raise ProtocolViolation("stream returned more bytes than requested")
            if not received:
                self._mark(f"first bytes {offset}+{length}")
            self._stats.add(BLOB_PROTOCOL, received=len(chunk))
            self._stats.add_peer(peer_text, received=len(chunk))
            await self._limiter.consume(peer_text, "in", len(chunk))
            received += len(chunk)
            await take(chunk)
        self._mark(f"received {offset}+{length}")

    async def fetch_range(self, peer: ID, digest: bytes, offset: int, length: int) -> bytes:
        """``[offset, offset+length)`` of a blob from one provider, in memory and unverified.

        For small ranges whose bytes the caller checks itself (a Merkle path to a signed root):
        one request, no size query first. Raises ProviderFailed/ProtocolViolation/libp2p errors.
        """
        peer_text = peer.to_base58()
        chunks: list[bytes] = []

        async def take(chunk: bytes) -> None:
            chunks.append(chunk)

        async with self._fetch_slots:
            stream, _ = await self._request(peer, digest, offset, length)
            try:
                await self._read_range(stream, peer_text, offset, length, take)
            finally:
                await close_quietly(stream)
        return b"".join(chunks)
