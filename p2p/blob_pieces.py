"""A download's pieces: spread over every provider, each written to the staging file as it arrives.

A blob is fetched as 8 MiB pieces, up to two streams per provider at once; the first
piece is asked for beside the size queries rather than after them (:class:`EarlyPiece`);
a piece interrupted by a dying provider is put back with its remaining range and
finished by another provider, and a busy provider is asked again a little later. The
bytes land in the staging file (:mod:`p2p.staging`) and are hashed in order as they
arrive (:class:`p2p.blob_hashing.InOrderHasher`).
"""

from __future__ import annotations

import errno
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import trio
from libp2p.peer.id import ID

from p2p.blob_hashing import InOrderHasher
from p2p.blob_protocol import CHUNK_BYTES, FILE_IO_BYTES, PIECE_BYTES
from p2p.blob_ranges import ProviderFailed
from p2p.errors import BlobStoreFull, BlobUnavailable
from p2p.fastpath import read_raw
from p2p.fastpath_bodies import release_body
from p2p.staging import RangeWriter, StagingFile
from p2p.streams import close_quietly, reset_quietly

if TYPE_CHECKING:
    from p2p.blob_client import BlobFetcher

logger = logging.getLogger(__name__)

_BUSY_RETRIES = 20

class EarlyPiece:
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
        # Out of range, busy, gone: the piece is asked for again later; this task must not end the download.
        except Exception as exc:  # noqa: BLE001 - the early request's task boundary
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
            await reset_quietly(stream)
        self.release()


class _PieceQueue:
    """The pieces of one download not written yet, shared by its workers (all on the host's trio loop)."""

    def __init__(self, total: int, early_in_flight: bool) -> None:
        #: ``(offset, length)`` of the ranges no worker holds, in blob order but for those put back.
        self.waiting: deque[tuple[int, int]] = deque(
            (offset, min(PIECE_BYTES, total - offset)) for offset in range(0, total, PIECE_BYTES)
        )
        self.in_flight = 0
        #: Our own disk took no more: every worker stops, no provider blamed.
        self.disk_full: OSError | None = None
        self._changed = trio.Event()
        # (0, PIECE_BYTES) is the early piece's: in flight until its answer says otherwise.
        if early_in_flight:
            self.waiting.popleft()
            self.in_flight += 1

    def notify(self) -> None:
        """Wake the workers waiting for a piece: one was put back, or finished."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Until :meth:`notify` is next called."""
        await self._changed.wait()


class BlobPieces:
    """Mixin of :class:`p2p.blob_client.BlobFetcher`: fetch a blob's pieces into its staging file.

    Expects of the fetcher: ``store``, ``concurrency``, ``_run_blocking``, ``_limiter``,
    ``_fetch_slots``, ``_write_buffers``, ``_mark`` and ``_request``/``_read_range``
    (:class:`p2p.blob_ranges.BlobRanges`).
    """

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

        ``stream``: the range was already asked for on it (an :class:`EarlyPiece`), and its
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
        await close_quietly(stream)

    async def _download_pieces(
        self,
        digest: bytes,
        total: int,
        providers: list[ID],
        staging: StagingFile,
        errors: dict[str, str],
        hasher: InOrderHasher,
        early: EarlyPiece | None = None,
    ) -> None:
        """Fetch every piece of the blob from ``providers`` into ``staging``.

        ``errors`` gets, per provider that failed, why.
        """
        queue = _PieceQueue(total, early_in_flight=early is not None)
        # Two streams per provider hide the per-piece request round trip; more only add
        # yamux interleaving cost on the receiving event loop (measured: ~15% more CPU).
        streams_per_provider = max(1, min(2, self.concurrency // max(1, len(providers))))
        async with trio.open_nursery() as nursery:
            for peer in providers:
                for index in range(streams_per_provider):
                    takes_early = early is not None and early.peer == peer and index == 0
                    worker_early = early if takes_early else None
                    nursery.start_soon(
                        self._piece_worker, peer, worker_early, queue, digest, total, staging, hasher, errors
                    )
        if queue.disk_full is not None:
            where = queue.disk_full.filename or staging.path  # the file that found no room (its disk)
            raise BlobStoreFull(f"disk of {where} is full ({queue.disk_full.strerror}): blob "
                                f"{digest.hex()[:16]} not fetched")
        if queue.waiting:
            raise BlobUnavailable(
                f"blob {digest.hex()[:16]}: every provider failed with "
                f"{sum(n for _, n in queue.waiting)} bytes missing ({errors})"
            )

    async def _piece_worker(
        self,
        peer: ID,
        early: EarlyPiece | None,
        queue: _PieceQueue,
        digest: bytes,
        total: int,
        staging: StagingFile,
        hasher: InOrderHasher,
        errors: dict[str, str],
    ) -> None:
        """Fetch pieces from ``peer`` until none is left, the peer fails or the disk is full."""
        busy_retries = 0
        while queue.disk_full is None:
            stream = None
            if early is not None:  # this worker's first piece was asked for early
                await early.replied.wait()
                offset, length, stream, taken = 0, PIECE_BYTES, early.stream, early
                early = None
                if stream is None or taken.total != total:  # refused, failed, or another size
                    await taken.drop()
                    queue.waiting.appendleft((offset, length))
                    queue.in_flight -= 1
                    queue.notify()
                    continue
                taken.stream = None  # this worker's now
            elif not queue.waiting:
                if queue.in_flight == 0:
                    return
                await queue.wait_changed()
                continue
            else:
                offset, length = queue.waiting.popleft()
                queue.in_flight += 1
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
            # This provider failed, however: give the rest of the piece back; the other workers go on.
            except Exception as exc:  # noqa: BLE001 - a piece worker's task boundary
                done = progress[0]
                if done < length:
                    queue.waiting.appendleft((offset + done, length - done))
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    queue.disk_full = exc  # our disk, not the provider's fault: the others would fail alike
                    return
                if isinstance(exc, ProviderFailed) and exc.status == "busy" and busy_retries < _BUSY_RETRIES:
                    busy_retries += 1
                    await trio.sleep(0.25)
                    continue
                errors[peer.to_base58()] = f"{type(exc).__name__}: {exc}"
                logger.info("provider %s failed at offset %d: %s; others continue", peer, offset + done, exc)
                return
            finally:
                queue.in_flight -= 1
                queue.notify()
