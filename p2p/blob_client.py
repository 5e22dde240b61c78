"""The fetching side of ``/dlx/blob/1.0.0`` (:mod:`p2p.blob_protocol` is the specification).

:class:`BlobFetcher` asks every provider for a blob's size (the most common answer wins),
downloads its pieces from all of them at once into a staging file
(:class:`p2p.blob_pieces.BlobPieces`: up to ``blob_concurrency`` streams, the first piece
asked for beside the size queries, a piece interrupted by a dying provider finished by
another), hashing the bytes in order as they arrive (:class:`p2p.blob_hashing.InOrderHasher`);
only a file matching its sha256 is committed to the :class:`~p2p.blobstore.BlobStore`.
One range from one provider, and the size queries, are :class:`p2p.blob_ranges.BlobRanges`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from p2p.blob_hashing import InOrderHasher
from p2p.blob_pieces import BlobPieces, EarlyPiece
from p2p.blob_protocol import CHUNK_BYTES, FILE_IO_BYTES, PIECE_BYTES, OpenStream, RunBlocking
from p2p.blob_ranges import BlobRanges
from p2p.blobstore import BlobStore, check_sha256_hex
from p2p.errors import BlobHashMismatch, BlobNotFound, BlobTooLarge
from p2p.ratelimit import PeerRateLimiter
from p2p.staging import StagingFile, buffer_pool

logger = logging.getLogger(__name__)

class BlobFetcher(BlobPieces, BlobRanges):
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
    async def download(self, sha256_hex: str, providers: list[ID], max_bytes: int) -> Path:
        """Fetch a blob from ``providers`` into the store and return its store path (hash verified)."""
        sha256_hex = check_sha256_hex(sha256_hex)
        digest = bytes.fromhex(sha256_hex)
        if self.store.has(sha256_hex):
            return self.store.path(sha256_hex)
        if not providers:
            raise BlobNotFound(f"blob {sha256_hex[:16]}: no providers")
        self._mark("download")
        early = EarlyPiece(self, providers[0], digest)
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
        self, sha256_hex: str, digest: bytes, providers: list[ID], max_bytes: int, early: EarlyPiece
    ) -> Path:
        sizes: dict[ID, int] = {}
        errors: dict[str, str] = {}

        async def ask(peer: ID) -> None:
            try:
                sizes[peer] = await self.stat(peer, sha256_hex)
            # A provider unreachable or without the blob must not end the other size queries.
            except Exception as exc:  # noqa: BLE001 - a size query's task boundary
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
