"""A queue of named jobs run one at a time, by priority then in order, on one thread of its own.

The spot checker keeps two (node/live/checks/verifier.py): one for its reruns, which run one at
a time in one child process so that they take no more of the machine than one rerun, and
one for the tribunal's work (accusing, confirming, signing and resolving verdicts), so a
charge against a member already found wrong never waits behind a rerun of someone else.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

from ledger.errors import LedgerError
from node.errors import NodeError
from p2p.errors import P2PError

logger = logging.getLogger(__name__)

#: How often an idle queue looks at its ``tick`` (and at ``stop``).
POLL_S = 0.5


class JobQueue:
    """Jobs ``(priority, kind, args)`` run on one thread by ``handlers[kind](*args)``, lowest priority first,
    in submission order within a priority. ``tick`` runs before each wait for a job (timers, intake).
    A failing job is logged and costs only itself. The thread runs from :meth:`start` on, so an owner
    whose tick or handlers read its other attributes starts it once it is fully built."""

    def __init__(self, name: str, handlers: dict[str, Callable], stop: threading.Event,
                 tick: Callable[[], None] | None = None) -> None:
        self.name = name
        self.handlers = handlers
        self.stop = stop
        self.tick = tick
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._pending: Counter = Counter()  # kind -> jobs queued, not started
        self._running: str | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> JobQueue:
        self._thread.start()
        return self

    def put(self, priority: int, kind: str, *args) -> None:
        if kind not in self.handlers:
            raise ValueError(f"{self.name}: no handler for job kind {kind!r}")
        with self._cond:
            self._pending[kind] += 1
        self._jobs.put((priority, next(self._seq), kind, args))

    def pending(self, kind: str | None = None) -> int:
        """Jobs queued and not started (of ``kind``, or all)."""
        with self._cond:
            return sum(self._pending.values()) if kind is None else self._pending[kind]

    @property
    def running(self) -> str | None:
        """The kind of the job in flight, if any."""
        return self._running

    def wait_idle(self, timeout: float) -> bool:
        """Wait until nothing is queued or in flight (True), ``timeout`` passed or ``stop`` was set
        (False)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while sum(self._pending.values()) or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    return False
                self._cond.wait(min(left, POLL_S))
        return True

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        while not self.stop.is_set():
            if self.tick is not None:
                self._run("tick", self.tick, ())
            try:
                _priority, _seq, kind, args = self._jobs.get(timeout=POLL_S)
            except queue.Empty:
                continue
            with self._cond:
                self._pending[kind] -= 1
                self._running = kind
            try:
                self._run(kind, self.handlers[kind], args)
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def _run(self, kind: str, handler: Callable, args: tuple) -> None:
        try:
            handler(*args)
        except (NodeError, LedgerError, P2PError, OSError) as exc:
            logger.warning("%s: %s job failed: %s", self.name, kind, exc)
        except Exception:  # thread boundary: the queue's thread outlives one bad job
            logger.exception("%s: %s job failed", self.name, kind)
