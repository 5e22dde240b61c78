"""A download's staging file: aligned writes from a reused buffer, optionally past the page cache.

Profiled on the fetcher (perf, 100 MiB downloads, docs/P2P.md "Measured"): the kernel's copy of
every received byte into new page-cache pages was the largest single cost, about a third of the
fetcher's samples on the VM measured (a fresh page costs more than its copy: it is zeroed and,
under a hypervisor that reclaims free memory, faulted in again). With ``O_DIRECT``
(``p2p.blob_direct_io``) the block device reads the bytes straight from our buffer; what we pay
instead is one ``memmove`` of each frame body into a reused, page-aligned buffer (those pages
are touched once and kept), since ``O_DIRECT`` wants the buffer address, the file offset and
the length aligned. The same path writes through the page cache when ``O_DIRECT`` is off.

:class:`RangeWriter` writes one range of the blob in order: each write takes the received
chunks, copies them into an aligned buffer, writes every whole aligned block (with ``O_DIRECT``
if on) and carries the unaligned rest (< 4 KiB) into the next write. Bytes that cannot
make a whole aligned block (the blob's last partial block, the unaligned start of a resumed
range, the end of a range whose provider failed) go through the ordinary file descriptor:
a few KiB per range, never the bulk. Direct and buffered writes of one file are coherent on
Linux (a direct write flushes and invalidates the cached pages it covers), and the two kinds
never touch the same 4 KiB block here except when both are buffered.

Durability is unchanged: nothing here is durable until the caller's ``fsync`` (a direct
write may still sit in the device's volatile cache), and the store commits a file only
after its hash matched and that ``fsync`` returned (:meth:`p2p.blobstore.BlobStore.commit`).
Where ``O_DIRECT`` is not available (not Linux, tmpfs, a filesystem that refuses it at
open or at the first write) every write is buffered, with its writeback started at once
(:func:`p2p.blobstore.start_writeback`).

The price of ``O_DIRECT``: the blob is not in the page cache after the download, so whoever
reads it next reads it from the device and fills the page cache then; measured, download and
first read together cost the same CPU either way (``bench/bench_p2p.py --only staging``),
which is why it is off by default.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from p2p.blobstore import start_writeback
from p2p.errors import BlobError

logger = logging.getLogger(__name__)

#: File offsets, lengths and buffer addresses of direct writes are multiples of this (covers
#: devices with 512-byte and with 4 KiB logical blocks; page-sized, so an mmap'd buffer is aligned).
DIRECT_IO_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Aligned buffers kept for reuse per process (their pages stay touched: ~5 MiB each); more are
#: made as needed (the hasher may hold up to 32 MiB of written blocks) and dropped when given back.
KEPT_BUFFERS = 4


def _align_down(value: int) -> int:
    return value - value % DIRECT_IO_ALIGN


def _align_up(value: int) -> int:
    return _align_down(value + DIRECT_IO_ALIGN - 1)


class AlignedBuffer:
    """A page-aligned, anonymous-memory buffer of fixed capacity, with its address for ``memmove``."""

    __slots__ = ("_array", "_map", "address", "capacity", "view")

    def __init__(self, capacity: int) -> None:
        self.capacity = _align_up(capacity)
        self._map = mmap.mmap(-1, self.capacity)
        self._array = (ctypes.c_char * self.capacity).from_buffer(self._map)
        self.address = ctypes.addressof(self._array)
        self.view = memoryview(self._map)

    def copy_in(self, at: int, chunk: Any) -> None:
        """Copy ``chunk`` (bytes-like) to ``[at, at + len(chunk))``; ``memmove`` without the GIL."""
        size = len(chunk)
        if at + size > self.capacity:
            raise ValueError(f"{size} bytes at {at} overflow a buffer of {self.capacity}")
        if type(chunk) is bytes:
            ctypes.memmove(self.address + at, chunk, size)  # (ctypes calls release the GIL)
        elif type(chunk) is bytearray:
            ctypes.memmove(self.address + at, (ctypes.c_char * size).from_buffer(chunk), size)
        else:  # another buffer type: copied holding the GIL
            self.view[at : at + size] = chunk


class _BufferPool:
    """Aligned buffers of one capacity, reused across downloads of this process (thread-safe)."""

    def __init__(self, capacity: int, keep: int = KEPT_BUFFERS) -> None:
        self.capacity = capacity
        self._keep = keep
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self.created = 0  # buffers made (a benchmark's count of first-touched memory)

    def take(self) -> AlignedBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        return AlignedBuffer(self.capacity)

    def give_back(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)


class StagingFile:
    """The file a download writes into: an ordinary descriptor, and a direct one when possible.

    ``fd`` serves ``ftruncate``, the unaligned bytes, any read-back and the final ``fsync``;
    ``direct_fd`` (or None) the aligned blocks.
    """

    def __init__(self, path: Path, total: int, direct: bool = True) -> None:
        self.path = path
        self.total = total
        self.fd = os.open(path, os.O_RDWR)
        self.direct_fd: int | None = None
        try:
            os.ftruncate(self.fd, total)
            if direct and _O_DIRECT:
                try:
                    self.direct_fd = os.open(path, os.O_RDWR | _O_DIRECT)
                except OSError as exc:  # e.g. tmpfs: EINVAL
                    logger.debug("staging %s: no O_DIRECT (%s); buffered writes", path.name, exc)
        except BaseException:
            os.close(self.fd)
            raise
        self._lock = threading.Lock()
        self._writers = 0  # writes running now (on worker threads)
        self._closing = False

    @property
    def direct(self) -> bool:
        return self.direct_fd is not None

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the descriptors open for one write: :meth:`close` waits for the last one to end.

        A cancelled download closes its staging file while a write it no longer awaits may
        still run on a worker thread; closing the descriptors under it could let that write
        land in whatever file reuses the descriptor number next.
        """
        with self._lock:
            if self._closing:
                raise BlobError(f"staging file {self.path.name} is closed")
            self._writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._writers -= 1
                last = self._closing and self._writers == 0
            if last:
                self._close_descriptors()

    def write_aligned(self, view: memoryview, offset: int) -> None:
        """Write ``view`` (aligned address, offset and length) at ``offset``: direct if possible."""
        direct_fd = self.direct_fd
        if direct_fd is not None:
            try:
                _write_all(direct_fd, view, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._give_up_direct(exc)  # this filesystem wants another alignment, or none
        self.write_buffered(view, offset)

    def write_buffered(self, view: memoryview, offset: int) -> None:
        """Write ``view`` at ``offset`` through the page cache and start its writeback."""
        if len(view):
            _write_all(self.fd, view, offset)
            start_writeback(self.fd, offset, len(view))

    def _give_up_direct(self, exc: OSError) -> None:
        with self._lock:
            direct_fd, self.direct_fd = self.direct_fd, None
        if direct_fd is not None:
            logger.info(
                "staging %s: direct write refused (%s); buffered writes from now on", self.path.name, exc
            )
            os.close(direct_fd)

    def close(self) -> None:
        """Close the descriptors, at once or when the last running write ends."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            now = self._writers == 0
        if now:
            self._close_descriptors()

    def _close_descriptors(self) -> None:
        with self._lock:
            direct_fd, self.direct_fd = self.direct_fd, None
            fd, self.fd = self.fd, -1
        if direct_fd is not None:
            os.close(direct_fd)
        if fd >= 0:
            os.close(fd)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (a direct write may be short, e.g. near a full disk)."""
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {written} bytes")
        view = view[written:]
        offset += written


class WrittenBlock:
    """What one :meth:`RangeWriter.write` put on disk: ``view`` holds exactly those bytes, in order.

    The view lives in a pooled buffer: hand it back with :meth:`RangeWriter.release` once hashed.
    """

    __slots__ = ("_buffer", "offset", "view")

    def __init__(self, offset: int, view: memoryview, buffer: AlignedBuffer) -> None:
        self.offset = offset
        self.view = view
        self._buffer = buffer

    def __len__(self) -> int:
        return len(self.view)


class RangeWriter:
    """Writes one range of the blob, in order, from ``offset`` on (:meth:`write` runs on a worker thread).

    ``position`` is the file offset up to which bytes are on disk; ``carried`` bytes were received
    but wait for the next write to complete their aligned block. One write at a time per range.
    """

    def __init__(self, staging: StagingFile, offset: int, pool: _BufferPool) -> None:
        self._staging = staging
        self._pool = pool
        self.position = offset
        self._carry = b""

    @property
    def carried(self) -> int:
        return len(self._carry)

    def write(self, chunks: Iterable[Any], final: bool) -> WrittenBlock:
        """Write the carried bytes and ``chunks`` at ``position``; ``final``: the range ends here.

        Not final: the unaligned tail is carried, not written. Returns the written bytes.
        """
        buffer = self._pool.take()
        try:
            with self._staging.writing():
                return self._write(buffer, chunks, final)
        except BaseException:
            self._pool.give_back(buffer)
            raise

    def _write(self, buffer: AlignedBuffer, chunks: Iterable[Any], final: bool) -> WrittenBlock:
        base = self.position
        slot = base % DIRECT_IO_ALIGN  # file offset and address agree modulo the alignment
        fill = slot
        buffer.copy_in(fill, self._carry)
        fill += len(self._carry)
        for chunk in chunks:
            buffer.copy_in(fill, chunk)
            fill += len(chunk)
        view = buffer.view
        # [slot, head): the start of a range resumed mid-block, buffered (rare)
        head = min(fill, _align_up(slot)) if slot else slot
        # [head, body): whole aligned blocks, direct
        body = head + _align_down(fill - head)
        self._staging.write_buffered(view[slot:head], base)
        if body > head:
            self._staging.write_aligned(view[head:body], base - slot + head)
        end = body
        if final:  # the blob's last partial block, or a range that stops mid-block
            self._staging.write_buffered(view[body:fill], base - slot + body)
            end = fill
        self._carry = bytes(view[end:fill])
        self.position = base - slot + end
        return WrittenBlock(base, view[slot:end], buffer)

    def release(self, block: WrittenBlock) -> None:
        """``block``'s bytes are no longer needed (hashed): its buffer may take the next write."""
        buffer, block._buffer = block._buffer, None
        block.view = memoryview(b"")
        if buffer is not None:
            self._pool.give_back(buffer)


def buffer_pool(max_write_bytes: int) -> _BufferPool:
    """The process's pool of aligned buffers for writes of up to ``max_write_bytes`` received bytes."""
    capacity = _align_up(max_write_bytes + 2 * DIRECT_IO_ALIGN)  # + the slot and the carried tail
    with _POOLS_LOCK:
        pool = _POOLS.get(capacity)
        if pool is None:
            pool = _POOLS[capacity] = _BufferPool(capacity)
        return pool


_POOLS: dict[int, _BufferPool] = {}
_POOLS_LOCK = threading.Lock()
