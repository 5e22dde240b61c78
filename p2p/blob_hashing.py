"""In-order hashing of a blob whose pieces land out of order.

The client's verification (:mod:`p2p.blob_client`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import trio

from p2p.blob_protocol import FILE_IO_BYTES, HASH_MEMORY_BYTES, RunBlocking
from p2p.errors import BlobError
from p2p.fastpath_bodies import release_body
from p2p.staging import RangeWriter, WrittenBlock


class InOrderHasher:
    """Hashes the blob front to back while pieces land out of order.

    Runs beside the download so the final verification costs no extra wall time.
    Ranges arrive with the chunks just written to disk; a range is hashed from
    those chunks in memory (no read back) unless holding them would exceed
    ``memory_budget`` bytes, in which case it is read back from the staging file
    when its turn comes. Hashing runs on the host's thread pool (hashlib
    releases the GIL). Buffered writes start their own writeback
    (:meth:`p2p.staging.StagingFile.write_buffered`), so the final ``fsync`` has little left to write.
    """

    def __init__(
        self, fd: int, total: int, run_blocking: RunBlocking, memory_budget: int = HASH_MEMORY_BYTES
    ) -> None:
        self._fd = fd
        self._total = total
        self._run_blocking = run_blocking
        self._memory_budget = memory_budget
        self._digest = hashlib.sha256()
        self._hashed = 0
        self._held = 0  # bytes of chunks kept in memory for hashing
        # start -> (end, chunks or None, how to give the chunks back once hashed)
        self._ranges: dict[int, tuple[int, list[Any] | None, Callable[[Any], None]]] = {}
        self._changed = trio.Event()
        self._busy = False  # the digest is being updated (by run() or by a writer's job)
        self.read_back = 0  # bytes hashed from the staging file rather than from memory
        self.hashed_with_write = 0  # bytes hashed in the job that wrote them (claim())

    def claim(self, offset: int) -> bool:
        """Let the writer of the range at ``offset`` hash it in its own job, right after writing it.

        True only if that range is the next to hash and nothing is being hashed:
        then the caller runs :meth:`write_and_hash` and reports with
        :meth:`hashed_inline` (or :meth:`unclaim` if its write failed). One
        thread hop per range instead of two, and the bytes are hashed while the
        copy into the write buffer has just brought them into the CPU cache.
        """
        if self._busy or offset != self._hashed:
            return False
        self._busy = True
        return True

    def write_and_hash(self, writer: RangeWriter, chunks: list[Any], final: bool) -> WrittenBlock:
        """Write the chunks with ``writer``, then hash what it wrote (thread pool, after :meth:`claim`)."""
        block = writer.write(chunks, final)
        self._digest.update(block.view)
        return block

    def hashed_inline(self, offset: int, chunks: list[bytes]) -> None:
        """The claimed range is written and hashed (called on the event loop)."""
        length = sum(len(chunk) for chunk in chunks)
        self.hashed_with_write += length
        self._hashed = offset + length
        self._busy = False
        self._changed.set()

    def unclaim(self) -> None:
        """The claimed range's write failed (its job has ended): nothing was hashed."""
        self._busy = False
        self._changed.set()

    def written(self, offset: int, chunks: list[Any], release: Callable[[Any], None] = release_body) -> bool:
        """Record that ``chunks`` are on disk from ``offset`` on (called on the event loop).

        Returns whether the chunks are kept for hashing; if so, each is handed to
        ``release`` once hashed, and the caller must not release them itself.
        """
        length = sum(len(chunk) for chunk in chunks)
        if not length:
            return False
        kept: list[Any] | None = chunks
        if self._held + length > self._memory_budget:
            kept = None  # read it back later rather than hold unbounded memory
        else:
            self._held += length
        self._ranges[offset] = (offset + length, kept, release)
        self._changed.set()
        return kept is not None

    def _contiguous(self) -> list[tuple[int, int, list[Any] | None, Callable[[Any], None]]]:
        """Pop the written ranges that continue the hashed prefix, in order."""
        batch = []
        position = self._hashed
        while position in self._ranges:
            end, chunks, release = self._ranges.pop(position)
            batch.append((position, end, chunks, release))
            position = end
        return batch

    async def run(self) -> None:
        while self._hashed < self._total:
            batch = [] if self._busy else self._contiguous()
            if not batch:
                self._changed = trio.Event()  # no await since _contiguous(): nothing is missed
                await self._changed.wait()
                continue
            self._busy = True
            await self._run_blocking(self._hash_batch, batch)
            self._busy = False  # (not on cancellation: the job may still run, and the download is over)
            self._held -= sum(end - start for start, end, chunks, _ in batch if chunks is not None)
            for _, _, chunks, release in batch:
                for chunk in chunks or ():
                    release(chunk)  # hashed and on disk: its buffer can take the next bytes
            self._hashed = batch[-1][1]

    def _hash_batch(self, batch: list[tuple[int, int, list[Any] | None, Callable[[Any], None]]]) -> None:
        for start, end, chunks, _ in batch:
            if chunks is not None:
                for chunk in chunks:
                    self._digest.update(chunk)
                continue
            self.read_back += end - start
            while start < end:
                block = os.pread(self._fd, min(FILE_IO_BYTES, end - start), start)
                if not block:
                    raise BlobError("staging file is shorter than the bytes written to it")
                self._digest.update(block)
                start += len(block)

    def hexdigest(self) -> str:
        return self._digest.hexdigest()
