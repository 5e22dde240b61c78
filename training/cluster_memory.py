"""A process's resident memory, for measuring a cluster's ranks over a round (issue 75; docs/CLUSTER.md).

:func:`memory_row` gives a rank's resident set now (``VmRSS``) and its peak since the last reset
(``VmHWM``); with ``reset`` it first gives the C library's free pages back (glibc's ``malloc_trim``, so the
next peak is measured from what the rank holds, not from its heap's high-water mark) and resets the peak
(``/proc/self/clear_refs``, Linux's "5": ``VmHWM`` becomes ``VmRSS``). The bench drives it on every rank
with the cluster's ``memory`` command (:meth:`training.cluster_replica.ClusterReplicaTrainer.memory`),
before and after each part of a round. Where ``/proc`` or glibc is not there the figures are 0 and the
reset does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """This process's peak resident set in bytes since start or the last :func:`reset_peak` (VmHWM)."""
    return _status_kib("VmHWM") * 1024


def rss_now() -> int:
    """This process's resident set in bytes now (VmRSS)."""
    return _status_kib("VmRSS") * 1024


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def reset_peak() -> None:
    """Free pages back to the system (``malloc_trim(0)``), then the peak reset to the resident set now."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def memory_row(reset: bool) -> dict[str, int]:
    """``{"rss": VmRSS, "peak": VmHWM}`` in bytes; with ``reset``, taken after :func:`reset_peak`."""
    if reset:
        reset_peak()
    return {"rss": rss_now(), "peak": peak_rss()}
