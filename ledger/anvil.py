"""A managed local anvil: the binary found, started as a child process and stopped by PID.

:class:`AnvilProcess` runs a local anvil from the pinned npm package
(``contracts/node_modules/@foundry-rs/anvil-linux-amd64/bin/anvil``; ``DLX_ANVIL`` overrides the path).
The binary is started directly, never through ``npx`` (that wrapper survives a SIGKILL and leaks the real
process), in its own session (a terminal's Ctrl-C goes to its owner, which stops it last), and stopped by
PID: by :meth:`AnvilProcess.stop`, or at interpreter exit if its owner forgot. An owner that must survive
SIGTERM installs a handler that ends in ``stop()`` (``dlx-node demo`` and ``dlx-node start`` do).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Self

from contracts import CONTRACTS_DIR
from ledger.errors import ChainUnavailable

logger = logging.getLogger(__name__)

DEFAULT_ANVIL = CONTRACTS_DIR / "node_modules" / "@foundry-rs" / "anvil-linux-amd64" / "bin" / "anvil"
_LISTENING = re.compile(r"Listening on ([0-9.]+):(\d+)")


def anvil_binary() -> Path:
    """Path of the anvil binary: ``$DLX_ANVIL`` if set, else the one the pinned npm package installs."""
    override = os.environ.get("DLX_ANVIL")
    path = Path(override) if override else DEFAULT_ANVIL
    if not path.is_file():
        raise ChainUnavailable(
            f"anvil binary not found at {path}: run `npm ci --prefix contracts` or set DLX_ANVIL to its path"
        )
    return path


def _load_prctl():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl if sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved in the parent: the child only makes one call between fork and exec
_PR_SET_PDEATHSIG = 1


def _set_parent_death_signal() -> None:
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGTERM when its parent dies, even by SIGKILL (Linux).

    A launcher killed outright then leaves no node or anvil behind (each child handles
    SIGTERM as a clean stop). The kernel ties the signal to the spawning *thread*, so it is
    only armed for children spawned from the main thread (None elsewhere: a child started
    from a short-lived thread would otherwise be stopped when that thread ends).
    """
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    return _set_parent_death_signal


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


class AnvilProcess:
    """A local anvil node run as a child process, stopped by PID.

    Usage::

        with AnvilProcess(state_file="chain.json") as anvil:
            w3 = connect_rpc(anvil.url)

    Args:
        state_file: If set, anvil loads the chain from this file at start and dumps it there every
            ``state_interval`` seconds and on a clean stop, so the chain survives restarts.
        port: TCP port on 127.0.0.1; 0 lets the OS choose (read back from anvil's ``Listening on`` line).
        state_interval: Seconds between state dumps.
        extra_args: More anvil command-line arguments.
        start_timeout: Seconds to wait for the ``Listening on`` line.
        history_states: How many recent states anvil keeps (in memory; ``--prune-history``). By its
            default anvil writes every older state to ``~/.foundry/anvil/tmp`` without a bound and leaves
            the files there when it stops: 6.2 GB in 30 minutes of this project's test suite, which
            filled CI's disk, and as much again for every hour of a user's local run. Blocks, receipts
            and logs are kept whatever the setting; only a call or a reorg at a block older than the last
            ``history_states`` fails, and no code here makes one (a failed transaction's revert is read
            at its own block, just mined). ``None`` gives anvil's default (full state history, on disk).
    """

    def __init__(
        self,
        state_file: str | os.PathLike | None = None,
        port: int = 0,
        *,
        state_interval: int = 1,
        extra_args: tuple[str, ...] = (),
        start_timeout: float = 30.0,
        history_states: int | None = 64,
    ):
        if history_states is not None and history_states < 1:
            raise ValueError(f"history_states={history_states}: must be >= 1 (or None for anvil's default)")
        self.history_states = history_states
        self.state_file = Path(state_file) if state_file else None
        self.port = port
        self.state_interval = state_interval
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self.url: str | None = None
        self._process: subprocess.Popen | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=200)
        self._finalizer: weakref.finalize | None = None
        self._drainer: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The anvil process id while running."""
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        """Whether the anvil process is alive."""
        return self._process is not None and self._process.poll() is None

    def start(self) -> str:
        """Start anvil and return its URL (``http://127.0.0.1:<port>``)."""
        if self.running():
            raise ChainUnavailable(f"anvil already running (pid {self.pid})")
        command = [
            str(anvil_binary()),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--hardfork",
            "prague",
        ]
        if self.state_file is not None:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            command += ["--state", str(self.state_file), "--state-interval", str(self.state_interval)]
        if self.history_states is not None:
            command += ["--prune-history", str(self.history_states)]
        command += list(self.extra_args)
        self._output.clear()
        # Its own session: a Ctrl-C at the terminal reaches the process that owns this anvil, not anvil
        # itself, so the owner can stop its nodes first and the chain last.
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=terminate_with_parent(),
        )
        self._process = process
        try:
            return self._await_listening(process)
        except BaseException:
            # Includes an exception a signal handler raises while we wait: never leave anvil behind.
            self.kill()
            raise

    def _await_listening(self, process: subprocess.Popen) -> str:
        self._finalizer = weakref.finalize(self, _kill, process)
        listening = threading.Event()
        found: list[str] = []

        def drain() -> None:
            # Keeps reading for the process's whole life so anvil never blocks on a full pipe.
            for line in process.stdout:
                self._output.append(line.rstrip())
                if not listening.is_set():
                    match = _LISTENING.search(line)
                    if match:
                        found.append(match.group(2))
                        listening.set()
            listening.set()

        self._drainer = threading.Thread(target=drain, name=f"anvil-{process.pid}-output", daemon=True)
        self._drainer.start()
        output_ended_or_listening = listening.wait(self.start_timeout)
        if not found:
            code = None
            if output_ended_or_listening:  # its output ended without the line: anvil is exiting
                try:
                    code = process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            tail = "\n".join(list(self._output)[-15:])
            why = (
                f"exited with code {code}"
                if code is not None
                else f"did not start within {self.start_timeout}s"
            )
            raise ChainUnavailable(f"anvil {why}; its output ended:\n{tail}")
        self.url = f"http://127.0.0.1:{found[0]}"
        logger.info("anvil pid %d listening on %s (state file: %s)", process.pid, self.url, self.state_file)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop anvil cleanly (SIGTERM, which makes it dump its state file), SIGKILL after ``timeout``."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("anvil pid %d ignored SIGTERM for %.0fs: killing it", process.pid, timeout)
                process.kill()
                process.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL anvil (fault injection: state since the last periodic dump is lost)."""
        if self._process is not None:
            _kill(self._process)
        self._forget()

    def output(self) -> list[str]:
        """The last lines anvil printed (for diagnostics)."""
        return list(self._output)

    def _forget(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._drainer is not None:
            self._drainer.join(timeout=5)  # the process is gone: its output pipe reaches EOF
        if self._process is not None and self._process.stdout is not None:
            self._process.stdout.close()
        self._drainer = None
        self._process = None
        self._finalizer = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
