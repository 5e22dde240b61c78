"""Bounding glibc's malloc arenas in a long-running node process (issue 45, "RSS flat").

glibc gives each thread that contends for the heap an arena of its own, up to 8 x cores of them, and a
freed block goes back to its own arena, never to another thread's: a node's many threads (gossip, the
host, the round lane, spot checks, fetches) spread their short-lived buffers over arenas that each keep
their high-water mark. On three loopback nodes that was most of the growth of a node's RSS after warm-up
(446 -> 467 MiB; with ``MALLOC_ARENA_MAX=2``, 444 -> 451 MiB; docs/P2P.md, "What the soak found", where
the 60-minute soak with the bound shows it is not the whole of it under churn). So ``dlx-node start`` and ``join`` set
``M_ARENA_MAX`` to 2 with ``mallopt`` as the process starts, before its threads do. Where the C library
is not glibc (musl, macOS) nothing is done; ``MALLOC_ARENA_MAX`` in the environment, when set, wins (glibc
read it at start).

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
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = libc if libc is not None else _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    done = libc.mallopt(M_ARENA_MAX, arenas) == 1  # mallopt returns 1 on success
    if not done:
        logger.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return done


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

