"""Gathering round t-1's inputs ahead, on a prefetch thread while round t trains (the one-step
delay of arXiv 2506.21263; RoundFinisher's)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from node.live.state.roundstate import Gathered, StageInputs


class ApplyPrefetch:
    """A finisher\'s prefetch of the inputs it applies (see the module docstring)."""

    # -- gathering ------------------------------------------------------------------------
    def gather_stage(self, outer_round: int, stage: int, sealed_before, waited: dict[str, float],
                     prepare: bool = False, clock_from=None) -> StageInputs:
        """The close of one stage of a round and what the exchange gathered for it.

        Waits for the close and the contributions it names; ``prepare``: also aggregates (the pure
        part of the outer step, valid while no round is applied). Runs on the training thread, or
        on the prefetch thread while the next round trains (:meth:`prefetch`; ``clock_from``: when
        the round deadline starts, see RoundCoordinator.await_close).
        """
        if sealed_before is not None:
            self.coordinator.adopt(outer_round, stage, sealed_before[stage])
        mark = time.monotonic()
        close = self.coordinator.accepted(outer_round, stage) or self.coordinator.await_close(
            outer_round, stage, clock_from=clock_from)
        waited["close_wait"] += time.monotonic() - mark
        return self.exchange.gather(outer_round, stage, close, waited, prepare)

    def prefetch(self, outer_round: int) -> None:
        """Close, fetch and aggregate ``outer_round`` on the prefetch thread while the next round trains.

        With the one-step delay round t-1 is applied after round t's inner steps; its close,
        its contributions and the pure part of its outer step do not depend on them (the
        global state changes only when a round is applied, and none is until then), so they
        are done meanwhile. The apply on the training thread joins it and uses the result
        (:meth:`_take_gathered`); an error there is raised as the inline gathering would.
        """
        if outer_round in self.rounds.prefetched or outer_round in self._replays:
            return
        sealed_before = self.recovery.sealed_closes(outer_round)

        # The deadline runs from when the training thread reaches the apply, as inline (set by
        # _take_gathered): only a decision that needs no deadline is taken sooner.
        def clock_from() -> float | None:
            return self.rounds.apply_reached.get(outer_round)

        def gather() -> Gathered:
            waited = {"close_wait": 0.0, "fetch_wait": 0.0, "aggregate": 0.0}
            stages = {stage: self.gather_stage(outer_round, stage, sealed_before, waited, prepare=True,
                                               clock_from=clock_from)
                      for stage in self.worker.stages}
            return Gathered(sealed_before, stages, waited)

        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(gather())
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread by _take_gathered
                future.set_exception(exc)

        # A daemon thread: one blocked on a close when the process exits must not hold the exit.
        threading.Thread(target=run, name=f"round-prefetch-{outer_round}", daemon=True).start()
        self.rounds.prefetched[outer_round] = future

    def _take_gathered(self, outer_round: int) -> tuple[Gathered, dict[str, float]]:
        """The prefetched gathering of ``outer_round`` (waiting for it), or an empty one to fill inline."""
        future = self.rounds.prefetched.pop(outer_round, None)
        if future is None:
            return Gathered(self.recovery.sealed_closes(outer_round), {}, {}), {}
        mark = time.monotonic()
        self.rounds.apply_reached[outer_round] = mark  # the prefetch's round deadline starts now
        self.book.notify()
        try:
            gathered = future.result()
        finally:
            self.rounds.apply_reached.pop(outer_round, None)
        gathered.joined_s = time.monotonic() - mark
        overlapped = {f"prefetch_{k}": v for k, v in gathered.waited.items()}
        return gathered, overlapped
