"""Where a node's wall time goes, round by round: the utilization figures (issue 16).

A *period* runs from the end of one round's training to the end of the next
one's, so it holds exactly one round of inner steps and whatever the schedule
(:func:`training.schedule.round_actions`) put between them: without the delay
``encode(t-1); apply(t-1)``, with it ``encode(t-1); apply(t-2)``, whose exchange
travelled while round t-1 trained. Compute utilization of the period is
``inner_s / wall_s``. The first period of a process has no previous end, so its
wall time is unknown (``None``) and it counts in no utilization.

The node times its phases with :meth:`RoundClock.phase`; every finished round
adds one ``finish`` record (close wait, fetch wait, aggregation, and how long
after this node's own contribution went out the last contribution it
aggregates was here: the round's exchange time). Records go to a JSON-lines
file (``timing.jsonl`` in the data directory) and the last ones to status.json.
A period's record also holds the inner steps it trained, the CPU seconds of its
inner steps (the training thread's) and of the whole process over the period
(every thread: the lane's encode, the prefetch's aggregation, libp2p, the chain).

In a time-bounded run (``diloco.round_budget_s``) the clock is also the round's
budget (:meth:`RoundClock.budget_elapsed`): a round's budget runs from the end
of the previous round's training, less what the training thread waited for
since (closes, contributions, commits), so it covers the node's own work on
that thread (encode, the outer step) as well as the inner steps, and every
replica's period is the budget, however much work a node does around its steps:
replicas stay in step instead of the fast ones drifting ahead of the slow ones
until they wait for them each round (issue 44). Only the count of steps it
yields is declared; nothing computed from it reads a clock.

Timing only reads clocks: it changes nothing the node computes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from node.fsutil import append_line, is_disk_full, report_disk_full

logger = logging.getLogger(__name__)

#: Phases of a period besides the inner steps, in the order they are reported.
#: ``commit_wait``: held before a round's training until
#: the chain's commits catch up (node/live/round/pacing.py).
PHASES = ("start_state", "eval", "encode", "close_wait", "fetch_wait", "aggregate", "finish_other",
          "commit_wait")
#: Work on the node's background lane (node/live/state/lane.py), overlapping the inner steps: reported as
#: ``lane_<name>_s`` per period, not part of the period's phases (it is not on the training thread).
#: ``finish``: a round's seal and attestation after its outer step (RoundFinisher.finish, overlap_tail).
LANE_WORK = ("start_state", "eval", "encode", "finish")
#: Phases in which the training thread waits for others (peers, the chain): not counted in a round's budget.
WAITS = ("close_wait", "fetch_wait", "commit_wait")


class RoundClock:
    """Per-period and per-finished-round timing of one node process (see module docstring)."""

    def __init__(self, path: Path | None = None, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.path = path
        self.clock = clock
        self.cpu_clock = cpu_clock  # the process's CPU seconds, every thread
        self._period_end: float | None = None  # end of the last round's training (None: none in this life)
        self._period_cpu: float | None = None  # the process's CPU seconds then
        self._round_start: float | None = None  # a round's budget start without a period before it
        self._phases: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._lane: dict[str, float] = dict.fromkeys(LANE_WORK, 0.0)
        self._lock = threading.Lock()  # the lane adds its seconds from its own thread
        self._write_lock = threading.Lock()
        self._published: dict[int, float] = {}  # round -> when this node's contribution of it went out
        self.last_period: dict | None = None
        self.last_finish: dict | None = None
        self.inner_total = 0.0  # over periods with a known wall time
        self.wall_total = 0.0
        self.periods = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent in the block to ``name`` of the current period."""
        started = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - started)

    def add(self, name: str, seconds: float) -> None:
        if name not in self._phases:
            raise ValueError(f"unknown phase {name!r}: one of {', '.join(PHASES)}")
        self._phases[name] += max(0.0, seconds)

    @contextmanager
    def lane(self, name: str) -> Iterator[None]:
        """Add the time spent in the block (on the background lane) to ``lane_<name>_s`` of the current
        period."""
        if name not in self._lane:
            raise ValueError(f"unknown lane work {name!r}: one of {', '.join(LANE_WORK)}")
        started = self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._lane[name] += max(0.0, self.clock() - started)

    def published(self, outer_round: int) -> None:
        """This node's contribution of ``outer_round`` is out (announced): the exchange starts."""
        with self._lock:
            self._published[outer_round] = self.clock()

    # -- a time-bounded round's budget (module docstring) ---------------------------------
    def round_starting(self) -> None:
        """A round's training begins: its budget starts now if no period runs (this life's first round,
        or the first after :meth:`interrupted`)."""
        if self._period_end is None:
            self._round_start = self.clock()

    def interrupted(self) -> None:
        """The round being trained was abandoned (a broken pipeline): the next period's wall time is
        unknown (the wait for the partner is in it), and the next round's budget starts with it."""
        self._period_end = self._period_cpu = None
        self._phases = dict.fromkeys(PHASES, 0.0)

    def budget_elapsed(self) -> float:
        """Seconds of the current round's budget used: since the previous round's training ended (or
        :meth:`round_starting`), less the training thread's waits for others meanwhile (WAITS)."""
        start = self._period_end if self._period_end is not None else self._round_start
        if start is None:
            raise RuntimeError("budget_elapsed() before round_starting()")
        return max(0.0, self.clock() - start - sum(self._phases[name] for name in WAITS))

    def trained(self, outer_round: int, inner_seconds: float, steps: int | None = None,
                inner_cpu_seconds: float | None = None) -> dict:
        """Close the period ending with ``outer_round``'s training; return (and log) its record.

        ``steps``: the inner steps the round trained; ``inner_cpu_seconds``: their CPU seconds.
        """
        now, cpu = self.clock(), self.cpu_clock()
        wall = None if self._period_end is None else now - self._period_end
        phases = {name: round(seconds, 4) for name, seconds in self._phases.items()}
        with self._lock:
            lane, self._lane = self._lane, dict.fromkeys(LANE_WORK, 0.0)
        record = {"kind": "period", "round": outer_round, "steps": steps, "inner_s": round(inner_seconds, 4),
                  "wall_s": None if wall is None else round(wall, 4), "utilization": None, **{
                      f"{name}_s": seconds for name, seconds in phases.items()},
                  **{f"lane_{name}_s": round(seconds, 4) for name, seconds in lane.items()},
                  "inner_cpu_s": None if inner_cpu_seconds is None else round(inner_cpu_seconds, 4),
                  "process_cpu_s": None if wall is None or self._period_cpu is None else round(
                      cpu - self._period_cpu, 4)}
        if wall is not None and wall > 0:
            record["utilization"] = round(min(inner_seconds, wall) / wall, 5)
            record["other_s"] = round(max(0.0, wall - inner_seconds - sum(self._phases.values())), 4)
            self.inner_total += min(inner_seconds, wall)
            self.wall_total += wall
            self.periods += 1
        self._period_end, self._period_cpu = now, cpu
        self._phases = dict.fromkeys(PHASES, 0.0)
        self.last_period = record
        self._write(record)
        return record

    def finished(self, outer_round: int, last_arrival: float | None, **seconds: float) -> dict:
        """Record one finished round: its phase ``seconds`` and its exchange time.

        ``last_arrival``: clock time the last contribution it aggregates was here (``None`` if
        all were here before this process published its own, or it published none).
        """
        with self._lock:  # a round's finish may be recorded on the lane (RoundFinisher.finish, overlap_tail)
            sent = self._published.pop(outer_round, None)
            for old in [r for r in self._published if r < outer_round - 8]:
                del self._published[old]
        exchange = None if sent is None or last_arrival is None else max(0.0, last_arrival - sent)
        record = {"kind": "finish", "round": outer_round,
                  "exchange_s": None if exchange is None else round(exchange, 4),
                  **{f"{k}_s": round(v, 4) for k, v in seconds.items()}}
        self.last_finish = record
        self._write(record)
        return record

    def summary(self) -> dict:
        """What status.json shows: the last period and finish, and the utilization over this life."""
        return {"last_period": self.last_period, "last_finish": self.last_finish, "periods": self.periods,
                "inner_s": round(self.inner_total, 3), "wall_s": round(self.wall_total, 3),
                "utilization": round(self.inner_total / self.wall_total, 5) if self.wall_total > 0 else None}

    def _write(self, record: dict) -> None:
        if self.path is None:
            return
        try:
            with self._write_lock:  # the training thread's and the lane's records
                append_line(self.path, (json.dumps(record) + "\n").encode())
        except OSError as exc:  # a full disk must not stop training
            if is_disk_full(exc):
                report_disk_full(exc, "round timing records dropped until space is freed", kind="timing log")
            else:
                logger.debug("timing record not written: %s", exc)
