"""Where a p2p benchmark's time, CPU and memory go: /proc readers, trio and data-path counters, perf.

Used by bench/bench_p2p.py.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import trio

from p2p import fastpath_bodies, fastpath_tcp

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class LoopCounter(trio.abc.Instrument):
    """Counts a trio loop's passes (waits for I/O), task steps, and the seconds it spent waiting."""

    def __init__(self) -> None:
        self.passes = 0
        self.task_steps = 0
        self.io_wait_s = 0.0
        self._since = 0.0

    def before_task_step(self, task: object) -> None:
        self.task_steps += 1

    def before_io_wait(self, timeout: float) -> None:
        self.passes += 1
        self._since = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self.io_wait_s += time.perf_counter() - self._since


def thread_cpu_seconds() -> dict[str, float]:
    """User and system CPU seconds of this process's live threads, by Python thread name.

    Keys ``<name> user`` and ``<name> system``; the host's event loop is ``p2p-host-*``, its
    disk/hash pool ``p2p-io-*`` (its threads summed), the calling thread ``MainThread``.
    """
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    seconds: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name), "other")
        name = name.rsplit("_", 1)[0] if name.startswith("p2p-io-") else name  # the pool, as one
        for kind, index in (("user", 11), ("system", 12)):
            key = f"{name} {kind}"
            seconds[key] = seconds.get(key, 0.0) + int(fields[index]) / CLOCK_TICKS
    return seconds


class DataPathCounter:
    """Counts ``recv`` calls and fresh (not pooled) frame-body buffers on the fetcher's connections.

    Wraps p2p.fastpath_tcp's ``_receive`` and p2p.fastpath_bodies' ``new_body`` while installed (a ``with``
    block).
    """

    def __init__(self) -> None:
        self.recv_calls = 0
        self.fresh_bodies = 0
        self._originals = (fastpath_tcp._receive, fastpath_bodies.new_body)

    def __enter__(self) -> DataPathCounter:
        receive, new_body = self._originals

        async def counted_receive(tcp: object, buffer: object) -> bool:
            self.recv_calls += 1
            return await receive(tcp, buffer)

        def counted_new_body(size: int) -> bytearray:
            if size == fastpath_bodies.YAMUX_FRAME_PAYLOAD_BYTES and not fastpath_bodies._BODY_POOL:
                self.fresh_bodies += 1
            return new_body(size)

        fastpath_tcp._receive, fastpath_bodies.new_body = counted_receive, counted_new_body
        return self

    def __exit__(self, *exc: object) -> None:
        fastpath_tcp._receive, fastpath_bodies.new_body = self._originals


#: With ``BENCH_P2P_PERF=<dir>``, each blob run records both processes with ``perf record`` (call graphs,
#: CPU clock) for exactly the timed fetch, into ``<dir>/{fetcher,provider}-*.data``: ``perf report -i``.
PERF_DIR = os.environ.get("BENCH_P2P_PERF")


def perf_record(pid: int, name: str) -> subprocess.Popen:
    """Start ``perf record`` on ``pid``; returns once it is sampling (it prints nothing until then)."""
    Path(PERF_DIR).mkdir(parents=True, exist_ok=True)
    recorder = subprocess.Popen(
        ["perf", "record", "-q", "-e", "cpu-clock", "-F", "2999", "-g", "-p", str(pid),
         "-o", str(Path(PERF_DIR) / f"{name}.data")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)  # perf attaches to every thread of the process before sampling
    return recorder


def timeline_breakdown(timeline: list[tuple[float, str]], start: float, end: float) -> dict:
    """Seconds from the fetch_blob call to each download event, and the phases between them."""
    at = [(round(t - start, 4), event) for t, event in timeline]  # (seconds from the call, event)
    def first(prefix):
        return next((t for t, e in at if e.startswith(prefix)), None)

    def last(prefix):
        return next((t for t, e in reversed(at) if e.startswith(prefix)), None)
    points = {
        "download": first("download"),
        "size_known": first("size known"),
        # the first piece's reply (a size query asks for "0+0"); it may come before the size is known
        "first_reply": next((t for t, e in at if e.startswith("reply") and not e.endswith("+0")), None),
        "first_bytes": first("first bytes"),
        "last_received": last("received"),
        "last_written": last("written"),
        "hashed": first("hashed"),
        "fsynced": first("fsynced"),
        "committed": first("committed"),
        "returned": round(end - start, 4),
    }
    names = list(points)
    phases = {}
    for before, after in zip(names, names[1:]):
        if points[before] is not None and points[after] is not None:
            phases[f"{before}->{after}"] = round(points[after] - points[before], 4)
    return {"seconds_from_call": points, "phases_s": phases}
