"""Bounding glibc's malloc arenas in a long-running node process (issue 45, "RSS flat").

glibc gives each thread that contends for the heap an arena of its own, up to 8 x cores of them, and a
freed block goes back to its own arena, never to another thread's: a node's many threads (gossip, the
host, the round lane, spot checks, fetches) spread their short-lived buffers over arenas that each keep
their high-water mark. On three loopback nodes that was most of the growth of a node's RSS after warm-up
(446 -> 467 MiB; with ``MALLOC_ARENA_MAX=2``, 444 -> 451 MiB; docs/P2P.md, "What the soak found", where
the 60-minute soak with the bound shows it is not the whole of it under churn). So ``dlx-node start`` and
``join`` set ``M_ARENA_MAX`` to 2 with ``mallopt`` as the process starts, before its threads do. Where the C
library is not glibc (musl, macOS) nothing is done; ``MALLOC_ARENA_MAX`` in the environment, when set, wins
(glibc read it at start).

The interpreter keeps one more table that grows in steps: CPython's dict of interned strings. Python 3.11's
pathlib interns every part of every path it builds, so a node interns and frees a few dozen path names a
second (a blob's hash, ``round-00000071``); a freed string's entry stays spent until the table runs out of
entries and is rebuilt at three times its live count. A node holds about 130,000 live interned strings, so its
first rebuild doubles the table from 2^18 to 2^19 slots (3.7 to 7.3 MiB), half an hour to hours into a run;
after that it is rebuilt at the same size. :func:`settle_interned_strings` makes that first rebuild happen as
the node takes its seat (issue 45: a step of +3.6 MiB in every node's RSS, at a moment set by its file churn).

What the two arenas free stays resident until glibc trims it, and glibc trims only the top of a heap, past
``M_TRIM_THRESHOLD``: a page freed inside a heap is kept. So once a round's old state is dropped the finisher
calls :func:`trim_heap` (``malloc_trim(0)``: every arena's free pages go back to the system), and RSS follows
what the node holds rather than its high-water mark.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
import time

logger = logging.getLogger(__name__)

#: glibc's mallopt parameter number of M_ARENA_MAX (malloc.h).
M_ARENA_MAX = -8
#: Arenas a node process keeps: the main one and one more for every other thread.
NODE_ARENAS = 2


def _glibc():
    """glibc's handle, or None where the C library is another (no gnu_get_libc_version)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def limit_arenas(arenas: int = NODE_ARENAS, libc=None) -> bool:
    """Set glibc's ``M_ARENA_MAX`` to ``arenas``; whether it was set (False: no glibc, refused, or the
    environment's ``MALLOC_ARENA_MAX`` chose already)."""
    done = _mallopt("MALLOC_ARENA_MAX", M_ARENA_MAX, arenas, libc)
    if not done:
        logger.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return done


#: glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h).
M_MMAP_THRESHOLD = -3
#: Blocks of this size or more are mapped and unmapped on their own (:func:`map_large_blocks`).
LARGE_BLOCK_BYTES = 1 << 20


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES, libc=None) -> bool:
    """Have glibc map every block of ``threshold`` bytes or more on its own and unmap it when freed
    (``M_MMAP_THRESHOLD``); whether it was set (False: no glibc, refused, or ``MALLOC_MMAP_THRESHOLD_`` in the
    environment chose already).

    glibc's default threshold moves up to each mapped block freed, to 32 MiB, after which a tensor of a
    llama-20m or llama-124m stage (0.6 to 9 MiB a matrix) lives in an arena, whose freed pages stay resident
    until :func:`trim_heap` and serve only that arena's threads: a round's transients on the training
    thread, the lane and the finisher then add up in the resident set. A fixed threshold gives each one
    back when it is freed (issue 75; bench/bench_stage_memory.py: a llama-20m stage's peak 6 bytes per
    parameter lower), at the price of fresh pages for each large temporary."""
    return _mallopt("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, threshold, libc)


def _mallopt(variable: str, param: int, value: int, libc=None) -> bool:
    """glibc's ``mallopt(param, value)`` unless the environment's ``variable`` chose already; whether it was
    set (False: no glibc, refused, or chosen by the environment)."""
    if os.environ.get(variable):
        return False
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt(param, value) == 1  # mallopt returns 1 on success


@functools.cache
def _trimming_libc():
    """glibc's handle with ``malloc_trim``'s signature (looked up once), or None."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    return libc


def trim_heap(libc=None) -> float | None:
    """Give every malloc arena's free pages back to the system (glibc's ``malloc_trim(0)``); the seconds it
    took, or None where the C library is not glibc."""
    libc = libc if libc is not None else _trimming_libc()
    if libc is None:
        return None
    start = time.monotonic()
    libc.malloc_trim(0)
    return time.monotonic() - start


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc 2.33+)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def heap_figures(libc=None) -> dict | None:
    """glibc's heap at this moment (``mallinfo2``): bytes the arenas hold, of them in use and free, and the
    blocks mapped on their own; None where the C library is not glibc 2.33+."""
    libc = libc if libc is not None else _trimming_libc()
    try:
        function = libc.mallinfo2
    except AttributeError:
        return None
    function.restype = _MallInfo2
    info = function()
    return {"arena_bytes": info.arena, "in_use_bytes": info.uordblks, "free_in_arenas_bytes": info.fordblks,
            "mapped_bytes": info.hblkhd}


#: How often the trimmer looks (s), and the free bytes in the arenas that make it trim.
TRIM_EVERY_S = 1.0
TRIM_FREE_BYTES = 32 << 20
#: Seconds after which the trimmer trims again though no freeing was seen (blocks taken and freed again
#: between two looks leave the figures as they were).
TRIM_AGAIN_S = 5.0
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set in bytes (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class HeapTrimmer(threading.Thread):
    """Trims the heap (:func:`trim_heap`) once a second while the arenas hold ``free_bytes`` or more free.

    The finisher's trim once a round left the round's freed blocks under 1 MiB resident until then: at a
    llama-20m node's peak its two arenas held 0.84 GB of which 0.57 GB free (node/live/memprofile.py),
    the chunked hashing's, the codec's and the claims' buffers freed on the lane, the prefetch and the
    fetches between two trims (issue 75). Freed pages go back within a second now; what it costs is the
    trims' walks (``seconds``) and fresh pages for the next allocations there."""

    def __init__(self, every: float = TRIM_EVERY_S, free_bytes: int = TRIM_FREE_BYTES, libc=None) -> None:
        super().__init__(name="heap-trim", daemon=True)
        self.every, self.free_bytes, self.libc = every, free_bytes, libc
        self.trims, self.seconds = 0, 0.0
        self.stop = threading.Event()

    def run(self) -> None:
        last_free, most_in_use, last_trim = 0, 0, 0.0
        while not self.stop.wait(self.every):
            figures = heap_figures(self.libc)
            if figures is None:
                return
            free, in_use = figures["free_in_arenas_bytes"], figures["in_use_bytes"]
            most_in_use = max(most_in_use, in_use)
            # a trim walks every free block: only when blocks were freed since the last one (the bytes in use
            # fell, or the free ones grew), or a while after it
            freed = most_in_use - in_use >= self.free_bytes // 2 or free >= last_free + self.free_bytes // 2
            if free >= self.free_bytes and (freed or time.monotonic() - last_trim >= TRIM_AGAIN_S):
                self.seconds += trim_heap(self.libc) or 0.0
                self.trims += 1
                after = heap_figures(self.libc) or figures
                last_trim, last_free, most_in_use = time.monotonic(), after["free_in_arenas_bytes"], in_use


_TRIMMER: list[HeapTrimmer] = []


def start_heap_trimmer(every: float = TRIM_EVERY_S, free_bytes: int = TRIM_FREE_BYTES) -> HeapTrimmer | None:
    """Start this process's :class:`HeapTrimmer` (once; the running one after that); None where the C library
    is not glibc 2.33+ or ``DLX_HEAP_TRIM=0`` turns it off."""
    if os.environ.get("DLX_HEAP_TRIM", "1") == "0" or heap_figures() is None:
        return None
    if not _TRIMMER:
        _TRIMMER.append(HeapTrimmer(every, free_bytes))
        _TRIMMER[0].start()
    return _TRIMMER[0]


def heap_trimmer() -> HeapTrimmer | None:
    """The running trimmer of this process, if one was started."""
    return _TRIMMER[0] if _TRIMMER else None


#: Strings :func:`settle_interned_strings` interns and frees: more than a 2^18-slot table's 174,762 entries.
SETTLE_STRINGS = 180_000


def settle_interned_strings(count: int = SETTLE_STRINGS) -> bool:
    """Intern and free ``count`` fresh strings, so that CPython's table of interned strings is rebuilt now, at
    three times the strings live after the node's imports: the size later rebuilds keep, rather than a
    doubling hours into a run (above). About 35 ms. Whether it ran: only on CPython 3.11, where it was
    measured (3.12 made interned strings immortal, PEP 683, so there the strings would be kept)."""
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return False
    intern = sys.intern
    for index in range(count):
        intern(f"dlx-settle-{index}")  # not kept: freed at once, its entry spent
    return True
