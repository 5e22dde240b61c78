"""Progress of long transfers: a one-line updater with size and rate on a terminal, two log lines otherwise.

A joiner's shards and checkpoint and ``dlx-node pull`` move up to gigabytes. On a terminal
(``stream.isatty()``, or ``tty=True``) :class:`TransferProgress` rewrites one line of ``stream``
(stderr by default) at most every ``interval`` seconds::

    shards of dataset 3f2a1c...: 412.0 MiB of 1.9 GiB (21%), 38.2 MiB/s

In logs (not a terminal) it stays quiet: one log line when the transfer starts and one when it ends,
with the size moved, the time and the mean rate. Byte counts come from the caller (:meth:`update`)
or from a p2p host's blob counters (:func:`watch_host`), polled on a thread.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from p2p.errors import P2PError

logger = logging.getLogger(__name__)

BLOB_PROTOCOL = "/dlx/blob/1.0.0"  # the key of a host's transfer_stats() that counts blob bytes


def human_bytes(count: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"  # not reached


class TransferProgress:
    """One transfer's progress (see the module docstring). Use as a context manager or call :meth:`close`."""

    def __init__(self, what: str, total: int | None = None, stream: IO[str] | None = None,
                 tty: bool | None = None, interval: float = 0.5) -> None:
        self.what = what
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty()) if tty is None and isatty is not None else bool(tty)
        self.interval = interval
        self.done = 0
        self._started = time.monotonic()
        self._shown = 0.0
        self._closed = False
        self._lock = threading.Lock()
        if self.tty:
            self._draw(force=True)
        else:
            size = f" ({human_bytes(total)})" if total else ""
            logger.info("%s: started%s", what, size)

    def update(self, done: int) -> None:
        """``done`` bytes moved so far (absolute)."""
        with self._lock:
            self.done = max(0, int(done))
            if self.tty and not self._closed:
                self._draw()

    def advance(self, count: int) -> None:
        self.update(self.done + count)

    def line(self) -> str:
        """The terminal line as it reads now."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        rate = f"{human_bytes(self.done / elapsed)}/s"
        if self.total:
            share = min(100, int(100 * self.done / self.total))
            return f"{self.what}: {human_bytes(self.done)} of {human_bytes(self.total)} ({share}%), {rate}"
        return f"{self.what}: {human_bytes(self.done)}, {rate}"

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._shown < self.interval:
            return
        self._shown = now
        self.stream.write("\r\x1b[2K" + self.line())
        self.stream.flush()

    def close(self, ok: bool = True, note: str = "") -> None:
        """End the transfer: the terminal line is finished with a newline; in logs, one closing line."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            elapsed = time.monotonic() - self._started
            outcome = "done" if ok else "stopped"
            rate = human_bytes(self.done / max(elapsed, 1e-9))
            tail = f"{outcome}: {human_bytes(self.done)} in {elapsed:.1f} s ({rate}/s)"
            if note:
                tail += f", {note}"
            if self.tty:
                self.stream.write("\r\x1b[2K" + self.line() + f" - {outcome}\n")
                self.stream.flush()
            else:
                logger.info("%s: %s", self.what, tail)

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(self, kind: Any, *_: object) -> None:
        self.close(ok=kind is None)


class HostWatch:
    """Feeds a :class:`TransferProgress` from a p2p host's received blob bytes (polled on a thread)."""

    def __init__(self, progress: TransferProgress, host: Any, interval: float = 0.25) -> None:
        self.progress = progress
        self.host = host
        self.interval = interval
        self.base = self._received()
        self.extra = 0  # bytes that came from elsewhere (a local copy), added by the caller
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transfer-progress", daemon=True)
        self._thread.start()

    def _received(self) -> int:
        try:
            return int(self.host.transfer_stats().get(BLOB_PROTOCOL, {}).get("received", 0))
        except (P2PError, OSError, AttributeError):  # a closed host, or one keeping no stats: the count stays
            return self.base if hasattr(self, "base") else 0

    def poll(self) -> None:
        self.progress.update(self._received() - self.base + self.extra)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()


def watch_host(progress: TransferProgress, host: Any, interval: float = 0.25) -> HostWatch:
    """Start polling ``host``'s blob bytes into ``progress``; call ``.stop()`` on the result when done."""
    return HostWatch(progress, host, interval)


@contextlib.contextmanager
def host_progress(host: Any, what: str, total: int | None = None, tty: bool | None = None,
                  stream: IO[str] | None = None) -> Iterator[TransferProgress]:
    """Show the blob bytes ``host`` receives while the block runs as the progress of ``what``."""
    progress = TransferProgress(what, total, stream=stream, tty=tty)
    watch = watch_host(progress, host)
    ok = False
    try:
        yield progress
        ok = True
    finally:
        watch.stop()
        progress.close(ok=ok)
