"""``dlx-node start``: run a node from its configuration until its run ends or a signal stops it.

Callable with a configuration file by every face that starts a node (the ``start``
command, ``join`` once it has written one); signals, the progress line and the
Prometheus exporter are set up here, the node itself is :class:`node.live.node.Node`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from node.config import load_config
from node.errors import PortBusy

logger = logging.getLogger(__name__)


def refuse_busy_port(host: str, port: int, what: str) -> None:
    """Raise PortBusy if ``port`` (0: any, never busy) cannot be bound on ``host``."""
    if port == 0:
        return
    with socket.socket() as s:
        # As a real listener does: TIME_WAIT leftovers of a killed process do not count as busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            raise PortBusy(f"{what}={port} on {host} is already in use: stop the other process or pick "
                           "another port (0 = any free port)") from None


def progress_line(p) -> str:
    """The one-line progress ``dlx-node start`` shows on a terminal."""
    def mb(n: int) -> str:
        return f"{n / 1e6:.1f}MB"

    loss = "-" if math.isnan(p.loss) else f"{p.loss:.3f}"
    held = "-" if math.isnan(p.eval_loss) else f"{p.eval_loss:.3f}"
    def index(n: int) -> str:  # -1 while joining: nothing yet
        return str(n) if n >= 0 else "-"

    return (
        f"[{p.state:9s}] round {index(p.round)} step {p.step}/{p.inner_steps} loss {loss} held-out {held} "
        f"sent {mb(p.bytes_sent)} recv {mb(p.bytes_received)} peers {p.peers} committed "
        f"{index(p.last_commit)}")


class _StoppedLoading(BaseException):
    """A SIGINT/SIGTERM while ``start`` still loads its packages (a BaseException: no ``except Exception`` in
    an imported package may swallow it)."""


def start(config: str | Path, overrides: list[str] = (), *, show_progress: bool = True, kinds=None,
          yes: bool | None = None, chain_wait: float | None = None) -> int:
    """Run a node from the TOML file ``config`` (with ``KEY=VALUE`` ``overrides``) until its run ends or a
    signal.

    ``show_progress``: a progress line on stderr when it is a terminal. ``kinds``: the node's part
    classes (node.live.assembly.Kinds; tests inject faults). ``yes``: run the command's pre-flight
    (node/commands/preflight.py: the data directory claimed for the run, a finished run refused, a seat's
    transactions asked for, ``True`` agreeing beforehand); None: none (a caller that seated the node).
    ``chain_wait``: how long the pre-flight waits for a chain that does not answer (None: its default,
    node/commands/chainwait.py). A node whose weights left the run's record starts again in this process
    (:func:`_reenter`).
    """
    # SIGINT/SIGTERM are caught from the first line: one that arrives while torch, libp2p and web3
    # load (seconds, a minute on a busy machine) ends the loading at once, exit 0, instead of the
    # process dying of the signal; one during the node's construction stops it before it joins;
    # from then on it stops the node.
    stopping: list[int] = []
    loading = [True]
    running: list = []

    def handle(signum, _frame) -> None:
        logger.info("signal %d: finishing up", signum)
        stopping.append(signum)
        if loading[0]:
            raise _StoppedLoading(signum)
        for node_ in running:
            node_.stop()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    command_line_read = time.time()
    try:
        from node.live.startup import StartupClock  # in the try: a signal may come while it imports

        startup = StartupClock()
        cfg = load_config(config, list(overrides))
        refuse_busy_port(cfg.p2p.listen_host, cfg.p2p.listen_port, "p2p.listen_port")
        refuse_busy_port("127.0.0.1", cfg.metrics_port, "metrics_port")
        if yes is not None:
            from node.commands.preflight import preflight

            preflight(cfg, yes, chain_wait)
        # Logged once the settings are good: a refused start prints its one error line and nothing else.
        startup.mark("interpreter and command line", at=command_line_read)
        from node.live.node import Node

        startup.mark("imports")
        from node.live.costprofile import start_from_env

        start_from_env(Path(cfg.data_dir).expanduser())
        loading[0] = False
    except _StoppedLoading:
        loading[0] = False  # a second signal now only repeats the request
    if stopping:
        logger.info("stopped during start-up (signal %d), before joining the run", stopping[0])
        return 0
    metrics = start_metrics(cfg.metrics_port) if cfg.metrics_port else None
    show = show_progress and sys.stderr.isatty()

    def on_progress(p) -> None:
        if metrics is not None:
            metrics(p)
        if show:
            sys.stderr.write("\r" + progress_line(p)[:160].ljust(160))
            sys.stderr.flush()

    node = Node(cfg, on_progress=on_progress, kinds=kinds, startup=startup)
    running.append(node)
    if stopping:  # a signal during the construction: nothing joined yet
        node.close()
        logger.info("stopped during start-up (signal %d), before joining the run", stopping[0])
        return 0
    progress = node.run()
    if show:
        sys.stderr.write("\n")
    if node.reenter_after is not None and not stopping:
        _reenter(node.reenter_after)
    _log_stopped(progress)
    return 0


def _log_stopped(progress) -> None:
    committed = progress.last_commit if progress.last_commit >= 0 else "none"
    if progress.last_finished < 0:
        logger.info("stopped before finishing a round (last committed %s)", committed)
    else:
        logger.info("stopped after round %d (last committed %s)", progress.last_finished, committed)


def _reenter(outer_round: int) -> None:
    """Start this command again in this process (same pid, arguments, environment), the node fully closed.

    A fresh life enters after the chain's latest checkpoint, as any restart does; doing it
    by ``exec`` leaves nothing of the diverged life behind (threads, the trio loop, torch state).
    """
    logger.warning(
        "round %d's committed record differs from this node's: starting again from the chain's latest "
        "checkpoint", outer_round)
    logging.shutdown()  # flush the log file: exec runs no exit handlers
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def start_metrics(port: int):
    """Serve the node's figures to Prometheus on 127.0.0.1:``port``; return the function that updates them."""
    from prometheus_client import Gauge, start_http_server

    start_http_server(port, addr="127.0.0.1")
    gauges = {name: Gauge(f"dlx_{name}", help_) for name, help_ in (
        ("round", "outer round being trained"), ("inner_step", "inner step within the round"),
        ("loss", "last inner training loss"), ("eval_loss", "held-out loss after the last round"),
        ("peers", "connected libp2p peers"), ("bytes_sent", "application bytes sent"),
        ("bytes_received", "application bytes received"), ("last_commit", "last round committed on chain"),
        ("spot_checks", "other replicas' contributions this node re-executed"),
        ("spot_check_mismatches", "re-executed contributions or start-state links that did not hold"),
        ("chain_checks", "start states checked against the rerun of the replica's previous round"))}

    def update(p) -> None:
        for name, value in (("round", p.round), ("inner_step", p.step), ("loss", p.loss),
                            ("eval_loss", p.eval_loss), ("peers", p.peers), ("bytes_sent", p.bytes_sent),
                            ("bytes_received", p.bytes_received), ("last_commit", p.last_commit),
                            ("spot_checks", p.spot_checks),
                            ("spot_check_mismatches", p.spot_check_mismatches),
                            ("chain_checks", p.chain_checks)):
            gauges[name].set(value)

    return update
