"""The serving side of ``/dlx/blob/1.0.0`` (:mod:`p2p.blob_protocol` is the specification).

A request is answered from the :class:`~p2p.blobstore.BlobStore`: one reply frame, then
the range's bytes in ~1 MiB writes, read from the page cache on the event loop where it
holds them and on the thread pool where the disk must be read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import trio
from libp2p.network.stream.exceptions import StreamEOF

from p2p.blob_protocol import (
    BLOB_PROTOCOL,
    CHUNK_BYTES,
    FILE_IO_BYTES,
    MAX_FRAME_BYTES,
    RunBlocking,
    bad_request_reply,
    busy_reply,
    not_found_reply,
    ok_reply,
    out_of_range_reply,
    parse_request,
)
from p2p.blobstore import BlobStore
from p2p.errors import BlobError
from p2p.ratelimit import PeerRateLimiter
from p2p.streams import CONNECTION_ERRORS
from p2p.wire import ProtocolViolation, read_frame, write_frame

logger = logging.getLogger(__name__)

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_KEPT_READ_BUFFERS = 2  # read buffers kept between served ranges (~8 MiB)


def read_cached(fd: int, buffer: bytearray, size: int, offset: int) -> memoryview | None:
    """Up to ``size`` bytes at ``offset`` into ``buffer`` if the page cache holds them, else None.

    ``preadv`` with ``RWF_NOWAIT`` (Linux) never waits for the disk: it fails with
    EAGAIN rather than block the event loop; a filesystem or platform that cannot
    tell gives None too. May return fewer bytes than asked (the cached part).
    """
    if _RWF_NOWAIT is None:
        return None
    with memoryview(buffer) as view:
        try:
            count = os.preadv(fd, [view[:size]], offset, _RWF_NOWAIT)
        except OSError:
            return None
    return memoryview(buffer)[:count] if count > 0 else None



def _size(path: Path) -> int | None:
    """The size of the file at ``path``; None if there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


class BlobServer:
    """Serves blobs from a store to the peers that ask (runs on the host's trio loop)."""

    def __init__(
        self,
        store: BlobStore,
        run_blocking: RunBlocking,
        limiter: PeerRateLimiter,
        stats: Any,
        concurrency: int,
        stall_timeout: float,
    ) -> None:
        self.store = store
        self._run_blocking = run_blocking
        self._limiter = limiter
        self._stats = stats
        self._serve_slots = trio.Semaphore(concurrency)
        self.stall_timeout = stall_timeout
        self._read_buffers: list[bytearray] = []  # FILE_IO_BYTES each, reused by served ranges

    def _take_read_buffer(self, length: int) -> bytearray:
        """The buffer a served range of ``length`` bytes is read into: a kept one of FILE_IO_BYTES for a
        range that fills it, a buffer of its own size for a smaller one. (Every range took a 4 MiB buffer,
        zeroed, so every page of it resident; each concurrent serve of a few-kB contribution beyond the two
        kept made one more, and a soak's nodes' RSS stepped by 4 MiB as they came and went, and by 4 MiB for
        good when a catch-up's concurrent fetches first filled the kept pair: issue 45.)"""
        if length < FILE_IO_BYTES:
            return bytearray(length)
        return self._read_buffers.pop() if self._read_buffers else bytearray(FILE_IO_BYTES)

    def _give_back_read_buffer(self, buffer: bytearray) -> None:
        if len(buffer) == FILE_IO_BYTES and len(self._read_buffers) < _KEPT_READ_BUFFERS:
            self._read_buffers.append(buffer)

    async def handle_stream(self, stream: Any) -> None:
        """Answer one request; any peer misbehaviour resets the stream and is logged, never raised."""
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            try:
                with trio.fail_after(self.stall_timeout):
                    request = await read_frame(stream, MAX_FRAME_BYTES)
            except (ProtocolViolation, StreamEOF) as exc:
                # An oversized, malformed or cut-short request frame: the peer is told why (a bare reset
                # told a client with a bug nothing), then the stream ends; nothing else is read from it.
                detail = str(exc) if isinstance(exc, ProtocolViolation) else "request frame cut short"
                logger.debug("bad blob request from %s: %s", peer, detail)
                await write_frame(stream, bad_request_reply(detail))
                await stream.close()
                return
            await self._serve(stream, peer, request)
        # A peer's bad request or a dropped connection ends only this stream, never the host's handler.
        except Exception as exc:  # noqa: BLE001 - the stream handler's boundary
            logger.debug("blob request from %s failed: %s: %s", peer, type(exc).__name__, exc)
            with trio.move_on_after(1):
                try:
                    await stream.reset()
                except CONNECTION_ERRORS:
                    pass  # already broken: nothing left to tell the peer

    async def _serve(self, stream: Any, peer: str, request: dict[str, Any]) -> None:
        try:
            digest, offset, length = parse_request(request)
        except ProtocolViolation as exc:
            await write_frame(stream, bad_request_reply(str(exc)))
            await stream.close()
            return
        sha256_hex = digest.hex()
        path = self.store.served_path(sha256_hex)
        packed = None
        total = _size(path)
        if total is None:
            packed = self.store.served_packed(sha256_hex)  # no file: perhaps pieces (blobpack.py), or aliased
            if packed is None and self.store.rebuildable(sha256_hex) and \
                    await self._run_blocking(self.store.rebuild, sha256_hex):
                # a rebuilt blob (set_rebuilder): packed, or a file
                packed, path = self.store.served_packed(sha256_hex), self.store.served_path(sha256_hex)
            total = packed.size if packed is not None else _size(path)
            if total is None:
                await write_frame(stream, not_found_reply())
                await stream.close()
                return
        if offset + length > total:
            await write_frame(stream, out_of_range_reply(total))
            await stream.close()
            return
        header = ok_reply(total, digest, offset, length)
        if length == 0:
            await write_frame(stream, header)
            await stream.close()
            return
        with trio.move_on_after(self.stall_timeout) as waited:
            await self._serve_slots.acquire()
        if waited.cancelled_caught:
            await write_frame(stream, busy_reply())
            await stream.close()
            return
        try:
            await write_frame(stream, header)
            if packed is not None:
                await self._send_packed(stream, peer, packed, offset, length)
                return
            handle = await self._run_blocking(open, path, "rb", buffering=0)
            buffer = self._take_read_buffer(length)
            try:
                position, end = offset, offset + length
                while position < end:
                    size = min(FILE_IO_BYTES, end - position)
                    # A blob being served is usually in the page cache: read it here, without a
                    # thread hop per 4 MiB (each one a wake-up the sender waits for); a block
                    # the kernel would have to fetch from disk is read on the thread pool.
                    block = read_cached(handle.fileno(), buffer, size, position)
                    if block is None:
                        block = await self._run_blocking(os.pread, handle.fileno(), size, position)
                    if not block:
                        raise BlobError(f"blob {sha256_hex} shrank while being served")
                    position += len(block)
                    await self._send_block(stream, peer, block)
            finally:
                handle.close()
                self._give_back_read_buffer(buffer)  # stream.write has consumed every slice of it
            await stream.close()
        finally:
            self._serve_slots.release()

    async def _send_block(self, stream: Any, peer: str, block: bytes | memoryview) -> None:
        """Send ``block`` in CHUNK_BYTES slices, each counted by the rate limiter and the stats."""
        view = memoryview(block)  # slices of it go to the stream without a copy
        for start in range(0, len(view), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            await self._limiter.consume(peer, "out", len(chunk))
            with trio.fail_after(self.stall_timeout):
                await stream.write(chunk)
            self._stats.add(BLOB_PROTOCOL, sent=len(chunk))
            self._stats.add_peer(peer, sent=len(chunk))

    async def _send_packed(self, stream: Any, peer: str, packed: Any, offset: int, length: int) -> None:
        """Bytes ``[offset, offset + length)`` of a packed blob (p2p/blobpack.py), read from its pieces on the
        thread pool, FILE_IO_BYTES at a time. A piece gone since (its blob removed) ends the stream: the
        fetcher tries another provider."""
        position, end = offset, offset + length
        while position < end:
            block = await self._run_blocking(packed.pread, position, min(FILE_IO_BYTES, end - position))
            if not block:
                raise BlobError(f"packed blob {packed.sha256_hex[:16]} shorter than its manifest")
            position += len(block)
            await self._send_block(stream, peer, block)
        await stream.close()
