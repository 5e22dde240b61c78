"""Slow a process down with the cgroup v1 cpu controller: heterogeneous contributors on one machine (issue
44).

A :class:`CpuGroup` is a cgroup v1 cpu group (``/sys/fs/cgroup/cpu/<name>``) whose ``cpu.cfs_quota_us`` lets
its processes use ``cpus`` CPUs at most (``cpus`` x ``cpu.cfs_period_us`` of every 100 ms period), whatever
they ask for: a node in a group of 0.25 CPU trains like one on a machine a fraction as fast (its inner steps,
and everything else it does, run at that rate). ``dlx-node demo --throttle``, the tests' throttled replica
(tests/test_heterogeneous_e2e.py) and bench/bench_heterogeneous.py use it. Needs root and the cgroup v1 cpu
controller (:func:`unavailable` says why not); a machine with only cgroup v2 has ``cpu.max`` instead, not
written here.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from node.errors import NodeError

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000
#: The kernel's smallest quota (1 ms a period).
MIN_QUOTA_US = 1000


def unavailable() -> str | None:
    """Why a :class:`CpuGroup` cannot be made here, None if it can."""
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    if os.geteuid() != 0 or not os.access(CGROUP_CPU, os.W_OK):
        return f"the cgroup v1 cpu controller at {CGROUP_CPU} is writable by root only"
    return None


class CpuGroup:
    """A cgroup v1 cpu group limited to ``cpus`` CPUs; :meth:`add` moves processes in, :meth:`remove` ends
    it."""

    def __init__(self, name: str, cpus: float) -> None:
        reason = unavailable()
        if reason is not None:
            raise NodeError(f"cannot limit CPU time: {reason}")
        if not 0 < cpus < float("inf"):
            raise NodeError(f"a CPU limit of {cpus!r} CPUs: must be a positive number")
        self.path = CGROUP_CPU / name
        self.path.mkdir(exist_ok=True)
        self.cpus = cpus
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(max(MIN_QUOTA_US, int(PERIOD_US * cpus))))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (every thread; its future children follow) into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def add_thread(self, tid: int) -> None:
        """Move only thread ``tid`` into the group (the bench slows a replica's inner steps only)."""
        (self.path / "tasks").write_text(str(tid))

    @staticmethod
    def release_thread(tid: int) -> None:
        """Move thread ``tid`` back to the root group (no limit)."""
        (CGROUP_CPU / "tasks").write_text(str(tid))

    def remove(self) -> None:
        """Move what is left back to the root group and delete the group (retried while the kernel lets
        go)."""
        for _ in range(50):
            try:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    try:
                        (CGROUP_CPU / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # exited meanwhile
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
