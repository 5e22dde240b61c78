"""Where a starting node's time goes: one log line per phase, in seconds since the process started.

A restarted node is back in the run only once it contributes again; on a loaded machine the
way there (interpreter and package imports, the chain, the libp2p host, its placement, the
pipeline rendezvous with its partner, the checkpoint it restores, the rounds it catches up)
took longer than several rounds (issue 30). Each phase's end is logged as
``start-up: <phase> at <seconds> s`` (:data:`MARK_PREFIX`), counted from the process's start
time as the kernel records it, so the interpreter's own start is included;
bench/bench_restart.py reads these lines.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

#: The prefix of every start-up log line (bench/bench_restart.py parses ``<prefix><phase> at <s> s``).
MARK_PREFIX = "start-up: "


def process_start_time(pid: int | str = "self") -> float:
    """The wall-clock time (``time.time()`` scale) process ``pid`` (default: this one) started, from /proc;
    now where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # Field 22 (starttime, clock ticks after boot); the command name (field 2) may hold spaces.
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """The phases of one node process's start, each logged once (see module docstring)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = process_start_time() if started is None else started
        self.marks: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None) -> float:
        """Log that ``phase`` ended now, or at wall-clock time ``at`` (only the first time); return the
        seconds since the process started."""
        elapsed = round((time.time() if at is None else at) - self.started, 2)
        if phase not in self.marks:
            self.marks[phase] = elapsed
            logger.info("%s%s at %.2f s", MARK_PREFIX, phase, elapsed)
        return elapsed


def parse_marks(log_text: str) -> dict[str, float]:
    """The phases and seconds of the start-up lines in a node's log (the first of each phase)."""
    marks: dict[str, float] = {}
    for line in log_text.splitlines():
        _, found, rest = line.partition(MARK_PREFIX)
        if not found or " at " not in rest:
            continue
        phase, _, seconds = rest.rpartition(" at ")
        try:
            marks.setdefault(phase.strip(), float(seconds.split()[0]))
        except (ValueError, IndexError):
            continue
    return marks
