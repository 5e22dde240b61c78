"""Host-wide admission of spot-check reruns by memory (issue 75).

A spot check reruns a claimant's whole replica in a child process (node/live/checks/spotcheck.py) of about
``RERUN_BYTES_PER_STATE_BYTE`` times the claimant's start-state files (docs/SCALE.md: about 108 bytes per
replica parameter against a state of about 40 at llama-20m). Several nodes on one host (the demo, a
machine room's nodes, the scale benches) may start their reruns in the same seconds; at llama-20m four
children beside four nodes were what the kernel's OOM killer chose from. So a rerun starts only when the
host can hold it: with a host-wide lock held, a node reads ``MemAvailable`` and subtracts what the reruns
admitted before it have reserved and not yet taken (a reservation less its child's resident memory); it
is admitted when its need fits, and records its own reservation (a file named by its process id in a
directory of this user's, removed when the rerun ends or, for a process that died, by the next reader).

A rerun that waits longer than its owner allows is left undone with the figures (need, available,
reserved by others), as a check whose inputs never came is: nobody is accused for it. A need that is
larger than the host's whole memory is refused at once.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from node.errors import NodeError
from node.fsutil import pid_alive

logger = logging.getLogger(__name__)

#: A rerun child's peak resident memory over its job's start-state files, rounded up: 1.6 measured since
#: the child keeps the parsed state rather than copies of it (issue 75, bench/bench_stage_memory.py, AMD
#: EPYC: a llama-20m child peaks 2.11 GB above its interpreter over 1.34 GB of state files; 2.7 before,
#: 3.2 to 4.0 GB over 1.49 GB in the demo's nodes).
RERUN_BYTES_PER_STATE_BYTE = 1.8
#: What a rerun child holds before its job (the interpreter, torch): 350 MB measured, rounded up.
RERUN_BASE_BYTES = 512 << 20
#: The environment variable that names the admission directory (the default is per user, under the
#: system's temporary directory, so that every node of this user on the host shares it).
DIRECTORY_ENV = "DLX_RERUN_ADMISSION_DIR"
#: How often a waiting rerun reads the host's memory again.
POLL_S = 1.0


class HostMemoryBusy(NodeError):
    """The host could not hold a rerun in the time its owner allowed (or ever)."""


def rerun_need(state_bytes: int) -> int:
    """Bytes a rerun child of a job whose start-state files total ``state_bytes`` is expected to peak at."""
    return RERUN_BASE_BYTES + int(RERUN_BYTES_PER_STATE_BYTE * state_bytes)


def default_directory() -> Path:
    named = os.environ.get(DIRECTORY_ENV)
    return Path(named) if named else Path(tempfile.gettempdir()) / f"dlx-rerun-admission-{os.getuid()}"


def read_meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes; NodeError if the file does not say both."""
    values: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if key in ("MemTotal", "MemAvailable") and len(fields) == 2 and fields[1] == "kB":
                values[key] = int(fields[0]) * 1024
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot read the host's memory from {path}: {exc}") from None
    if len(values) != 2:
        raise NodeError(f"{path} does not give MemTotal and MemAvailable in kB")
    return values["MemTotal"], values["MemAvailable"]


def resident_bytes(pid: int) -> int | None:
    """A live process's resident memory (VmRSS), or None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Reservation:
    """One admitted rerun's claim on the host's memory; :meth:`set_child` names the process that takes it
    (its resident memory then counts as taken), :meth:`release` ends it."""

    def __init__(self, path: Path, need: int) -> None:
        self.path = path
        self.need = need

    def set_child(self, pid: int | None) -> None:
        _write_json(self.path, {"owner": os.getpid(), "child": pid, "bytes": self.need})

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class RerunAdmission:
    """See the module docstring. ``meminfo`` is read for the host's memory (a test names its own file)."""

    def __init__(self, directory: Path | None = None, meminfo: Callable[[], tuple[int, int]] = read_meminfo,
                 poll_s: float = POLL_S) -> None:
        self.directory = directory or default_directory()
        self.meminfo = meminfo
        self.poll_s = poll_s

    def _open_directory(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.directory.stat()
        if st.st_uid != os.getuid():
            raise NodeError(f"{self.directory} belongs to another user: reruns admitted without it would "
                            f"trust its reservations (set {DIRECTORY_ENV} to a directory of your own)")

    @contextmanager
    def _locked(self):
        with open(self.directory / ".lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def reserved(self) -> int:
        """Bytes the live reservations hold and their children have not taken yet (call under the lock);
        reservations of processes that are gone are removed."""
        total = 0
        for path in self.directory.glob("*.json"):
            try:
                doc = json.loads(path.read_text())
                owner, child, need = int(doc["owner"]), doc.get("child"), int(doc["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)  # only this user's processes write here: a torn or foreign file
                continue
            if not pid_alive(owner):
                path.unlink(missing_ok=True)
                continue
            taken = resident_bytes(int(child)) if isinstance(child, int) else None
            total += max(0, need - (taken or 0))
        return total

    def admit(self, need: int, timeout: float, stop: threading.Event | None = None) -> Reservation:
        """Wait until the host can hold ``need`` more bytes, then reserve them; HostMemoryBusy if it cannot
        within ``timeout`` seconds (or ever: a need above the host's whole memory), or ``stop`` is set."""
        self._open_directory()
        deadline = time.monotonic() + timeout
        while True:
            with self._locked():
                total, available = self.meminfo()
                if need > total:
                    raise HostMemoryBusy(f"a rerun needs about {need / 2**30:.1f} GiB; this host has "
                                         f"{total / 2**30:.1f} GiB in all")
                others = self.reserved()
                if available - others >= need:
                    reservation = Reservation(self.directory / f"{os.getpid()}-{uuid.uuid4().hex}.json", need)
                    reservation.set_child(None)
                    return reservation
            if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                raise HostMemoryBusy(
                    f"the host could not hold a rerun of about {need / 2**30:.2f} GiB within {timeout:.0f}s "
                    f"({available / 2**30:.2f} GiB available, {others / 2**30:.2f} GiB reserved by other "
                    "reruns)")
            time.sleep(self.poll_s)
