"""Atomic file writes: a crash or a full disk leaves either the old file or the new one, never half of one.

A full disk (``ENOSPC``, ``EDQUOT``) is a transient fault of a running node, not a crash
(issue 45): :func:`retry_on_full_disk` pauses the write that needs the disk, says so in one
rate-limited line, and does it once space is freed; :func:`report_disk_full` is that line for
a write that is only deferred or skipped (a cache, a status file).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from node.errors import DiskFull

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The errors of a write that found no room: a full filesystem or an exhausted quota.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: One line per kind of deferred write at most this often while the disk stays full.
DISK_FULL_REPORT_S = 60.0
#: A write paused by a full disk is tried again after this, doubling up to the max.
DISK_RETRY_MIN_S = 0.5
DISK_RETRY_MAX_S = 15.0


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o644, durable: bool = True) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename.

    ``durable``: also fsync the file and its directory, so the new contents survive a power
    loss. A file only read while the process runs (``status.json``) skips both: readers
    still never see half of it, and the two fsyncs twice a second were ~4% of a node's CPU.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise _naming(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            raise _naming(exc, path) from None
        raise
    if not durable:
        return path
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` with the file the caller meant (a failed ``write`` names no file; the temporary name means
    nothing)."""
    return OSError(exc.errno, exc.strerror, str(path))


def append_line(path: str | Path, line: bytes) -> None:
    """Append ``line`` (one record of a log file) whole or not at all: a write cut short by a full disk is
    truncated away, so a reader never finds half a record (the next line would glue onto it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            os.ftruncate(fd, size)
            raise _naming(exc, Path(path)) from None
    finally:
        os.close(fd)


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n")


def write_diagnostic_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON at ``path``, replaced whole but not fsynced; a failed write is dropped (a
    profile or other diagnostic never stops the node)."""
    try:
        atomic_write_bytes(path, (json.dumps(obj, indent=1) + "\n").encode(), durable=False)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user counts: it exists)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no room (full filesystem, exhausted quota)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


def _free_bytes(path: str | None) -> str:
    probe = Path(path) if path else None
    while probe is not None and not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return f"{shutil.disk_usage(probe).free} bytes free" if probe is not None else "free space unknown"
    except OSError:
        return "free space unknown"


class _Reports:
    """When each kind of full-disk line was last logged (a full disk would otherwise log every write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}

    def due(self, kind: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -DISK_FULL_REPORT_S) < DISK_FULL_REPORT_S:
                return False
            self._last[kind] = now
            return True

    def clear(self, kind: str) -> None:
        with self._lock:
            self._last.pop(kind, None)


_REPORTS = _Reports()


def disk_full_message(exc: OSError, deferred: str) -> str:
    """One line: which file's disk is full, how much is free, and what waits for space."""
    return (f"disk of {exc.filename or '(unnamed file)'} is full ({exc.strerror}, "
            f"{_free_bytes(exc.filename)}): {deferred}")


def report_disk_full(exc: OSError, deferred: str, kind: str | None = None) -> None:
    """Log ``exc`` (a full disk) as one warning line saying what is deferred, at most once per
    DISK_FULL_REPORT_S for each ``kind`` (default: ``deferred``); no traceback."""
    if _REPORTS.due(kind or deferred):
        logger.warning("%s", disk_full_message(exc, deferred))


def retry_on_full_disk(action: Callable[[], T], *, what: str, stop: threading.Event, kind: str | None = None,
                       min_s: float = DISK_RETRY_MIN_S, max_s: float = DISK_RETRY_MAX_S) -> T:
    """``action()``, paused and tried again while it fails on a full disk, until it succeeds.

    ``what`` names the paused work in the log ("round 7's archive seal"); ``kind`` ("archive seal",
    default ``what``) is what the rate limit of its line counts by. Every other error is
    raised at once. ``action`` must be safe to run again after a failed try (each file it writes
    is written atomically: a failed try leaves the old file or none). Raises :class:`DiskFull`
    when ``stop`` is set before space is freed.
    """
    delay = min_s
    failed: OSError | None = None
    while True:
        try:
            result = action()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            failed = exc
            report_disk_full(exc,
                             f"{what} paused; tried again every {max_s:.0f}s at most until space is freed",
                             kind=kind or what)
            if stop.wait(delay):
                raise DiskFull(disk_full_message(exc, f"{what} not done before the node stopped; free space "
                                                      "and start the node again")) from None
            delay = min(2 * delay, max_s)
            continue
        if failed is not None:
            _REPORTS.clear(kind or what)
            logger.warning("disk of %s has space again: %s done", failed.filename, what)
        return result


def serve_when_space(host: Any, data: bytes | Path | Callable[[], Iterable], *, what: str,
                     stop: threading.Event, cuts: list[tuple[int, int]] | None = None) -> str:
    """Store ``data`` in ``host``'s blob store and serve it (not announced: ``host.provide_blob(data,
    announce=False)``, a :class:`p2p.host.P2PHost`; a file's path is hard-linked in, ``link=True``, hashed in
    chunks, never read whole); its sha256 hex. A full disk pauses it until space is
    freed (:func:`retry_on_full_disk`, kind "served blob"): what a node serves (its start states, partials,
    evidence, contributions passed on) is part of the round, so it waits for space like the round's other
    writes and never ends the node (issue 45: a start state written onto a full disk did). ``cuts``: a
    file is kept as a packed blob instead, those runs of it shared with other packed blobs
    (``host.provide_packed``, p2p/blobpack.py). A function: it gives the blob's bytes in order as ``(bytes,
    shared)``, kept as a packed blob with no file of it written first (``host.provide_packed_parts``); called
    again if a full disk interrupted it."""
    if callable(data):
        return retry_on_full_disk(lambda: host.provide_packed_parts(data()), what=what, kind="served blob",
                                  stop=stop)
    if isinstance(data, Path) and cuts is not None:
        return retry_on_full_disk(lambda: host.provide_packed(data, cuts), what=what, kind="served blob",
                                  stop=stop)
    if isinstance(data, Path):
        return retry_on_full_disk(lambda: host.provide_blob(data, announce=False, link=True), what=what,
                                  kind="served blob", stop=stop)
    return retry_on_full_disk(lambda: host.provide_blob(data, announce=False), what=what, kind="served blob",
                              stop=stop)


#: What writes deferred by a full disk may hold in memory
#: together; past it the oldest are dropped (each said).
DEFERRED_MAX_BYTES = 256 << 20


class DeferredWrites:
    """Writes that can wait for space: evidence files and archived copies, whose loss would cost an audit
    or an accusation's record on disk, not the round. One background thread tries them again, oldest first,
    until space is freed; a write dropped past ``max_bytes`` is never made. Process-wide: a node is one
    process, and its disk is one."""

    def __init__(self, max_bytes: int = DEFERRED_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, Callable[[], object], int]] = deque()
        self._bytes = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def add(self, what: str, action: Callable[[], object], size: int) -> None:
        with self._lock:
            self._queue.append((what, action, size))
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._queue) > 1:
                lost, _, lost_size = self._queue.popleft()
                self._bytes -= lost_size
                self.dropped += 1
                logger.warning("disk still full: %s dropped (writes waiting for space hold %d bytes at most)",
                               lost, self.max_bytes)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="deferred-writes", daemon=True)
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        delay = DISK_RETRY_MIN_S
        while True:
            # The attempt runs under the lock that add() drops under: a write dropped is never made
            # afterwards (an attempt read before the drop would otherwise complete once space is freed, after
            # "dropped" was said). add() waits for at most one attempt: a full disk fails it at once.
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                what, action, size = self._queue[0]
                try:
                    action()
                    error = None
                except OSError as exc:
                    error = exc
                if error is None or not is_disk_full(error):  # written, or given up: it leaves the queue
                    self._queue.popleft()
                    self._bytes -= size
            if error is None:
                logger.warning("disk has space again: %s written", what)
                delay = DISK_RETRY_MIN_S
            elif is_disk_full(error):
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(2 * delay, DISK_RETRY_MAX_S)
            else:
                logger.warning("%s not written: %s", what, error)


DEFERRED = DeferredWrites()


def write_when_space(action: Callable[[], object], *, what: str, size: int, kind: str | None = None) -> bool:
    """``action()`` now; where the disk is full, later: kept in memory (:data:`DEFERRED`, up to
    DEFERRED_MAX_BYTES) and done once space is freed, with one rate-limited line. True if done now.

    For a write whose loss costs a record, not the round (evidence, an archived copy of what is also in
    memory): the caller goes on at once. ``action`` must be safe to run again (atomic writes). Every other
    error is raised. A node stopped before space is freed loses what is still waiting.
    """
    try:
        action()
        return True
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        report_disk_full(exc, f"{what} kept in memory and written once space is freed", kind=kind or what)
        DEFERRED.add(what, action, size)
        return False


def keep_evidence(path: str | Path, data: bytes) -> None:
    """Keep ``data`` (signed proof of a fault, read by the audit and served by the accuser) at ``path``:
    atomically; on a full disk once space is freed (:func:`write_when_space`); any other failure is logged,
    never raised (the evidence is still in memory, where the caller serves it from)."""
    path = Path(path)
    try:
        write_when_space(lambda: atomic_write_bytes(path, data), what=f"evidence {path.name}", size=len(data),
                         kind="evidence")
    except OSError as exc:
        logger.warning("evidence %s not kept: %s", path.name, exc)
