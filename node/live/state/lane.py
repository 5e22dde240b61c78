"""The node's per-round work off the training thread, in order (issue 16 item 1: utilization).

With the one-step delay, round t's encode and exchange may overlap round t+1's
inner steps (docs/DILOCOX.md section 4). What of a round's work does not touch
the live weights (compressing the contribution, signing, archiving and serving
it; serialising and hashing the start state the spot checks bind; the held-out
eval on a copy of the weights) runs on one background thread, the *lane*, in
the order the training thread submitted it. The training thread first takes,
itself, every copy of what the inner steps change, and joins the lane before
it changes what a queued task still reads: that ordering, not timing, is what
keeps every result bit for bit the one of the inline run.

A task that fails poisons the lane: later tasks do not run, and every join
raises the first failure, on the training thread, where the inline run would
have raised it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)


class RoundLane:
    """One background thread running submitted tasks in submission order (see module docstring)."""

    def __init__(self, name: str = "round-lane") -> None:
        self._tasks: queue.Queue = queue.Queue()
        self._last: Future | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], Any]) -> Future:
        """Queue ``task``; its future holds its result (or the lane's first failure)."""
        if self._closed:
            raise RuntimeError("round lane is closed")
        future: Future = Future()
        self._last = future
        self._tasks.put((task, future))
        return future

    def join(self, future: Future | None = None) -> Any:
        """Wait for ``future`` (default: every task submitted so far); raise the lane's first failure."""
        target = self._last if future is None else future
        if target is None:
            return None
        result = target.result()
        if self._error is not None:
            raise self._error
        return result

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def close(self, timeout: float = 30.0) -> None:
        """Let the queued tasks finish (up to ``timeout``), then stop the thread; errors are only logged."""
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("round lane still busy after %.0f s at close", timeout)
        if self._error is not None:
            logger.debug("round lane had failed: %s", self._error)

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            task, future = item
            if self._error is not None:
                future.set_exception(self._error)
                continue
            try:
                future.set_result(task())
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread at its next join
                self._error = exc
                future.set_exception(exc)
