"""The fetching side of ``/dlx/blob/1.0.0`` (:mod:`p2p.blob_protocol` is the specification).

A blob is downloaded as 8 MiB pieces spread over every provider at once (up to
``blob_concurrency`` streams); the first piece is asked for beside the size queries
rather than after them (:class:`_EarlyPiece`); a piece interrupted by a dying provider
is put back with its remaining range and finished by another provider. The bytes land
in a staging file (:mod:`p2p.staging`) and are hashed in order as they arrive
(:class:`p2p.blob_hashing.InOrderHasher`); only a file matching its sha256 is committed
to the :class:`~p2p.blobstore.BlobStore`.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from p2p.blob_hashing import InOrderHasher
from p2p.blob_protocol import (
    BLOB_PROTOCOL,
    CHUNK_BYTES,
    FILE_IO_BYTES,
    MAX_FRAME_BYTES,
    PIECE_BYTES,
    OpenStream,
    RunBlocking,
    parse_reply,
    request_frame,
)
from p2p.blobstore import BlobStore, check_sha256_hex
from p2p.errors import (
    BlobHashMismatch,
    BlobStoreFull,
    BlobNotFound,
    BlobTooLarge,
    BlobUnavailable,
    ProviderTooSlow,
)
from p2p.fastpath import grant_receive_window, read_raw
from p2p.fastpath_bodies import release_body
from p2p.ratelimit import PeerRateLimiter
from p2p.staging import RangeWriter, StagingFile, buffer_pool
from p2p.wire import ProtocolViolation, read_frame, write_frame

logger = logging.getLogger(__name__)

_BUSY_RETRIES = 20


async def _reset_quietly(stream: Any) -> None:
    """Reset a stream we give up on, shielded and bounded (it may already be broken)."""
    with trio.move_on_after(1) as cleanup:
        cleanup.shield = True
        try:
            await stream.reset()
        except Exception:
            pass


class _ProviderFailed(Exception):
    def __init__(self, status: str, total: int | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.total = total  # the blob's size, if the reply gave one (out_of_range)


class _EarlyPiece:
    """The first piece of a download, asked for beside the size queries instead of after them.

    Its bytes start to flow one request (a stream negotiation and a round trip) sooner.
    The request goes to one provider with the size queries; its ``ok`` reply carries the
    size too. The piece is only taken if that provider is among those whose size won the
    vote, and the blob holds a whole piece; otherwise (a small blob gets ``out_of_range``, a
    busy or failing provider, a size the others outvoted) the stream is dropped and the piece
    is asked for as any other. It holds a fetch slot from its request until it is dropped
    or its piece is done.
    """

    def __init__(self, service: BlobFetcher, peer: ID, digest: bytes) -> None:
        self._service = service
        self.peer = peer
        self._digest = digest
        self.replied = trio.Event()  # the request has its answer (or failed)
        self.stream: Any = None  # the stream carrying the piece, once its ok reply was read
        self.total: int | None = None  # the size that reply gave
        self._holds_slot = False
        self._dropped = False

    async def request(self) -> None:
        """Ask ``peer`` for the first piece (run in a nursery; never raises but on cancellation)."""
        service = self._service
        try:
            await service._fetch_slots.acquire_on_behalf_of(self)
            self._holds_slot = True
            if self._dropped:
                return
            service._limiter.expect(self.peer.to_base58())
            self.stream, header = await service._request(self.peer, self._digest, 0, PIECE_BYTES)
            self.total = header["total"]
            if self._dropped:  # not wanted any more: stop the provider's bytes at once
                await self.drop()
        except Exception as exc:  # out of range, busy, gone: the piece is asked for again later
            logger.debug("early first piece from %s: %s: %s", self.peer, type(exc).__name__, exc)
        finally:
            if self.stream is None:
                self.release()
            self.replied.set()

    def release(self) -> None:
        """Give back the fetch slot (the piece is done, or the early request is not used)."""
        if self._holds_slot:
            self._holds_slot = False
            self._service._fetch_slots.release_on_behalf_of(self)

    async def drop(self) -> None:
        """Not used (now or when its answer comes): reset the stream, if any, and give back the slot."""
        self._dropped = True
        stream, self.stream = self.stream, None
        if stream is not None:
            await _reset_quietly(stream)
        self.release()


class BlobFetcher:
    """Downloads blobs from providers into a store (runs on the host's trio loop)."""

    def __init__(
        self,
        store: BlobStore,
        open_stream: OpenStream,
        run_blocking: RunBlocking,
        limiter: PeerRateLimiter,
        stats: Any,
        concurrency: int,
        stall_timeout: float,
        direct_io: bool = False,
        min_rate: float = 0.0,
    ) -> None:
        self.store = store
        self._open_stream = open_stream
        self._run_blocking = run_blocking
        self._limiter = limiter
        self._stats = stats
        self._fetch_slots = trio.CapacityLimiter(concurrency)
        self.concurrency = concurrency
        self.stall_timeout = stall_timeout
        #: A range of n bytes must arrive within stall_timeout + n / min_rate (0: only the stall timeout).
        self.min_rate = min_rate
        #: Staging writes without the page cache where the filesystem allows (p2p.staging).
        self.direct_io = direct_io
        # One write holds up to FILE_IO_BYTES plus the chunk that crossed it.
        self._write_buffers = buffer_pool(FILE_IO_BYTES + CHUNK_BYTES)
        #: When a list (a benchmark's ``--profile``), downloads append ``(time.monotonic(), event)`` to it.
        self.timeline: list[tuple[float, str]] | None = None

    def _mark(self, event: str) -> None:
        if self.timeline is not None:
            self.timeline.append((time.monotonic(), event))

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
                raise _ProviderFailed(status, total)
        except BaseException:
            await _reset_quietly(stream)
            raise
        return stream, header

    async def stat(self, peer: ID, sha256_hex: str) -> int:
        """Total size of the blob at ``peer``; raises _ProviderFailed/ProtocolViolation/libp2p errors."""
        digest = bytes.fromhex(check_sha256_hex(sha256_hex))
        stream, header = await self._request(peer, digest, 0, 0)
        await self._close(stream)
        return int(header["total"])

    async def _fetch_piece(
        self,
        peer: ID,
        digest: bytes,
        offset: int,
        length: int,
        staging: StagingFile,
        progress: list[int],
        hasher: InOrderHasher,
        stream: Any = None,
    ) -> None:
        """Write ``[offset, offset+length)`` of the blob into ``staging``; ``progress[0]``: bytes on disk.

        ``stream``: the range was already asked for on it (an :class:`_EarlyPiece`), and its
        ``ok`` reply read; else it is asked for here.
        """
        peer_text = peer.to_base58()
        if stream is None:
            self._limiter.expect(peer_text)  # the range's bytes take at least length / rate to arrive
            stream, _ = await self._request(peer, digest, offset, length)
        # Received, not yet on disk: copied into one aligned buffer and written per ~4 MiB
        # (p2p.staging: whole blocks without the page cache, an unaligned tail carried over).
        chunks: list[Any] = []
        buffered = 0
        writer = RangeWriter(staging, offset, self._write_buffers)

        async def flush(final: bool) -> None:
            nonlocal chunks, buffered
            batch, chunks = chunks, []
            buffered = 0
            at = writer.position
            claimed = hasher.claim(at)  # the next range to hash: hash it in the writing job
            try:
                if claimed:
                    block = await self._run_blocking(hasher.write_and_hash, writer, batch, final)
                else:
                    block = await self._run_blocking(writer.write, batch, final)
            except trio.Cancelled:
                raise  # the job may still be running: the hasher stays claimed, the download is over
            except BaseException:
                if claimed:
                    hasher.unclaim()
                raise
            for chunk in batch:  # copied into the block: the frame bodies can take the next frames
                release_body(chunk)
            if claimed:
                hasher.hashed_inline(at, [block.view])
                writer.release(block)
            elif not hasher.written(at, [block.view], lambda _view, block=block: writer.release(block)):
                writer.release(block)  # on disk, and the hasher will read it back from there
            progress[0] = writer.position - offset

        async def take(chunk: Any) -> None:
            nonlocal buffered
            if len(chunk) > CHUNK_BYTES:  # not one frame body (a peer's own framing): in frame-sized parts
                view = memoryview(chunk)
                for start in range(0, len(view), CHUNK_BYTES):
                    await take(view[start : start + CHUNK_BYTES])
                return
            chunks.append(chunk)
            buffered += len(chunk)
            if buffered >= FILE_IO_BYTES:
                await flush(final=False)

        try:
            # The frame bodies are only written and hashed: take them as they
            # arrived, uncopied (the window was opened to the range by _request).
            read_raw(stream)
            await self._read_range(stream, peer_text, offset, length, take)
        finally:
            # Bytes already received are valid for resumption (the final hash check covers them),
            # and so are those a write carried over to complete its last block.
            if chunks or writer.carried:
                with trio.CancelScope(shield=True):
                    await flush(final=True)
        self._mark(f"written {offset}+{length}")
        await self._close(stream)

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

    @staticmethod
    async def _close(stream: Any) -> None:
        """Close our side of a stream, giving up after 1 s (the peer may be gone)."""
        with trio.move_on_after(1):
            try:
                await stream.close()
            except Exception:
                pass

    async def fetch_range(self, peer: ID, digest: bytes, offset: int, length: int) -> bytes:
        """``[offset, offset+length)`` of a blob from one provider, in memory and unverified.

        For small ranges whose bytes the caller checks itself (a Merkle path to a signed root):
        one request, no size query first. Raises _ProviderFailed/ProtocolViolation/libp2p errors.
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
                await self._close(stream)
        return b"".join(chunks)

    async def download(self, sha256_hex: str, providers: list[ID], max_bytes: int) -> Path:
        """Fetch a blob from ``providers`` into the store and return its store path (hash verified)."""
        sha256_hex = check_sha256_hex(sha256_hex)
        digest = bytes.fromhex(sha256_hex)
        if self.store.has(sha256_hex):
            return self.store.path(sha256_hex)
        if not providers:
            raise BlobNotFound(f"blob {sha256_hex[:16]}: no providers")
        self._mark("download")
        early = _EarlyPiece(self, providers[0], digest)
        try:
            async with trio.open_nursery() as nursery:
                # The early piece's answer is not waited for here: a busy provider may take
                # blob_stall_timeout to give it; the pieces' workers wait for it instead.
                nursery.start_soon(early.request)
                path = await self._download(sha256_hex, digest, providers, max_bytes, early)
                nursery.cancel_scope.cancel()  # an early request nobody took may still await its answer
            return path
        except BaseExceptionGroup as group:  # trio wraps even a lone failure: surface it as is
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            await early.drop()  # (a no-op if its piece was taken and done)

    async def _download(
        self, sha256_hex: str, digest: bytes, providers: list[ID], max_bytes: int, early: _EarlyPiece
    ) -> Path:
        sizes: dict[ID, int] = {}
        errors: dict[str, str] = {}

        async def ask(peer: ID) -> None:
            try:
                sizes[peer] = await self.stat(peer, sha256_hex)
            except Exception as exc:  # provider unreachable or without the blob: the others may serve
                errors[peer.to_base58()] = f"{type(exc).__name__}: {exc}"

        async with trio.open_nursery() as nursery:
            for peer in providers:
                nursery.start_soon(ask, peer)
        # Every provider of a content address must report the same size; the most common
        # answer wins and the final hash check settles the rest.
        total = max(set(sizes.values()), key=list(sizes.values()).count) if sizes else None
        usable = [peer for peer in providers if sizes.get(peer) == total]
        if total is None:
            raise BlobNotFound(f"blob {sha256_hex[:16]}: no provider could serve it ({errors})")
        if total > max_bytes:
            raise BlobTooLarge(f"blob {sha256_hex[:16]} has {total} bytes > max_blob_bytes={max_bytes}")
        self._mark("size known")
        if total < PIECE_BYTES or early.peer not in usable:
            await early.drop()  # (its request may still be pending: nothing will take it)
            early = None

        staged = self.store.new_staging_file()
        staging = StagingFile(staged, total, direct=self.direct_io)
        try:
            hasher = InOrderHasher(staging.fd, total, self._run_blocking)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(hasher.run)  # cancelled if the download fails
                    await self._download_pieces(digest, total, usable, staging, errors, hasher, early)
            except BaseExceptionGroup as group:  # trio wraps even a lone failure: surface it as is
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
            self._mark("hashed")
            if hasher.hexdigest() != sha256_hex:
                logger.warning("blob %s from %s failed its hash check; discarded", sha256_hex[:16], usable)
                raise BlobHashMismatch(f"bytes hash to {hasher.hexdigest()}, expected {sha256_hex}")
            # Direct writes too are durable only after this (the device may cache them).
            await self._run_blocking(os.fsync, staging.fd)
            self._mark("fsynced")
        except BaseException:
            staging.close()
            staged.unlink(missing_ok=True)
            raise
        staging.close()
        path = await self._run_blocking(self.store.commit, staged, sha256_hex, True)
        self._mark("committed")
        return path

    async def _download_pieces(
        self,
        digest: bytes,
        total: int,
        providers: list[ID],
        staging: StagingFile,
        errors: dict[str, str],
        hasher: InOrderHasher,
        early: _EarlyPiece | None = None,
    ) -> None:
        pieces: deque[tuple[int, int]] = deque(
            (offset, min(PIECE_BYTES, total - offset)) for offset in range(0, total, PIECE_BYTES)
        )
        in_flight = 0
        changed = trio.Event()
        disk_full: OSError | None = None  # our own disk took no more: every worker stops, no provider blamed
        if early is not None:  # (0, PIECE_BYTES) is early's: in flight until its answer says otherwise
            pieces.popleft()
            in_flight += 1

        def notify() -> None:
            nonlocal changed
            changed.set()
            changed = trio.Event()

        async def worker(peer: ID, early: _EarlyPiece | None = None) -> None:
            nonlocal in_flight, disk_full
            busy_retries = 0
            while disk_full is None:
                stream = None
                if early is not None:  # this worker's first piece was asked for early
                    await early.replied.wait()
                    offset, length, stream, taken = 0, PIECE_BYTES, early.stream, early
                    early = None
                    if stream is None or taken.total != total:  # refused, failed, or another size
                        await taken.drop()
                        pieces.appendleft((offset, length))
                        in_flight -= 1
                        notify()
                        continue
                    taken.stream = None  # this worker's now
                elif not pieces:
                    if in_flight == 0:
                        return
                    await changed.wait()
                    continue
                else:
                    offset, length = pieces.popleft()
                    in_flight += 1
                progress = [0]
                try:
                    if stream is None:
                        async with self._fetch_slots:
                            await self._fetch_piece(peer, digest, offset, length, staging, progress, hasher)
                    else:
                        try:
                            await self._fetch_piece(
                                peer, digest, offset, length, staging, progress, hasher, stream
                            )
                        finally:
                            taken.release()
                except Exception as exc:  # this provider failed: give the rest of the piece back
                    done = progress[0]
                    if done < length:
                        pieces.appendleft((offset + done, length - done))
                    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        disk_full = exc  # our disk, not the provider's fault: the others would fail alike
                        return
                    if (
                        isinstance(exc, _ProviderFailed)
                        and exc.status == "busy"
                        and busy_retries < _BUSY_RETRIES
                    ):
                        busy_retries += 1
                        await trio.sleep(0.25)
                        continue
                    errors[peer.to_base58()] = f"{type(exc).__name__}: {exc}"
                    logger.info(
                        "provider %s failed at offset %d: %s; others continue", peer, offset + done, exc
                    )
                    return
                finally:
                    in_flight -= 1
                    notify()

        # Two streams per provider hide the per-piece request round trip; more only add
        # yamux interleaving cost on the receiving event loop (measured: ~15% more CPU).
        streams_per_provider = max(1, min(2, self.concurrency // max(1, len(providers))))
        async with trio.open_nursery() as nursery:
            for peer in providers:
                for index in range(streams_per_provider):
                    takes_early = early is not None and early.peer == peer and index == 0
                    nursery.start_soon(worker, peer, early if takes_early else None)
        if disk_full is not None:
            raise BlobStoreFull(f"disk of {self.store.root} is full ({disk_full.strerror}): blob "
                                f"{digest.hex()[:16]} not fetched")
        if pieces:
            raise BlobUnavailable(
                f"blob {digest.hex()[:16]}: every provider failed with "
                f"{sum(n for _, n in pieces)} bytes missing ({errors})"
            )
