"""The trio-thread plumbing of :class:`p2p.host.P2PHost`: one event loop in its own thread, a sync face.

py-libp2p is trio-based, the rest of the node is plain threads (and torch), so the host runs
``trio.run`` in a dedicated thread and every public method hands a coroutine to it with
``trio.from_thread.run`` (~50 µs per call) under a timeout (:meth:`HostThread._call`). Blocking work
the loop must not do (disk I/O, hashing) runs on a small thread pool the host owns
(:meth:`HostThread._run_blocking`), so ``close()`` can join every thread it started.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from p2p.errors import HostClosed, P2PTimeout

logger = logging.getLogger(__name__)

T = TypeVar("T")


class HostThread:
    """Mixin of :class:`p2p.host.P2PHost`: runs its ``_main`` coroutine on the host thread and calls into it.

    Expects of the host: ``peer_id``, ``_main()``, ``_ready`` (threading.Event), ``_startup_error``,
    ``_token``, ``_closing`` (trio.Event), ``_closed`` and ``_executor`` (a ThreadPoolExecutor).
    """

    def _thread_main(self) -> None:
        """The host thread: run the event loop until the host closes."""
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start() or logged; the thread must end cleanly
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                logger.exception("p2p host %s stopped with an error", self.peer_id)
        finally:
            self._closed = True
            self._ready.set()

    def _request_close(self) -> None:
        """On the host thread: let ``_main`` leave its nursery and close everything."""
        assert self._closing is not None
        self._closing.set()

    def _call(self, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
        """Await ``fn(*args)`` on the host's loop from another thread; P2PTimeout after ``timeout`` s."""
        if self._closed or self._token is None:
            raise HostClosed(f"p2p host {self.peer_id} is closed")

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn(*args)

        try:
            return trio.from_thread.run(bounded, trio_token=self._token)
        except trio.TooSlowError:
            raise P2PTimeout(f"{what} did not finish within {timeout} s") from None
        except trio.RunFinishedError:
            raise HostClosed(f"p2p host {self.peer_id} is closed") from None
        except trio.Cancelled:
            raise HostClosed(f"p2p host {self.peer_id} closed while {what} ran") from None
        except BaseExceptionGroup as group:
            # The host's loop shut down under a call that runs tasks of its own (a blob download's
            # nursery): only cancellations came back. A BaseException out of a caller's thread killed
            # it (the 60-minute soak: a spot check's fetch at stop, "Exception in thread spotcheck").
            _cancelled, rest = group.split(trio.Cancelled)
            if rest is None:
                raise HostClosed(f"p2p host {self.peer_id} closed while {what} ran") from None
            raise

    async def _run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the host's own thread pool without blocking the event loop."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = self._executor.submit(fn, *args, **kwargs)
        def wake(_: concurrent.futures.Future) -> None:
            try:
                token.run_sync_soon(done.set, idempotent=True)
            except trio.RunFinishedError:
                pass  # the host closed meanwhile; nobody waits for this result

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def _check_open(self) -> None:
        if self._closed:
            raise HostClosed(f"p2p host {self.peer_id} is closed")
