"""What each ``dlx-node`` subcommand does (parsing and exit codes live in :mod:`node.cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

from node.config import load_config
from node.errors import ConfigError, NodeError, PortBusy

logger = logging.getLogger(__name__)


def _refuse_busy_port(host: str, port: int, what: str) -> None:
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


# ---------------------------------------------------------------------- init
def cmd_init(args: argparse.Namespace) -> int:
    from importlib.resources import files

    from ledger.account import create_keystore, read_password_file
    from p2p.identity import Identity

    data_dir = Path(args.data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(data_dir / "identity.key")
    template = files("node").joinpath("templates/node.toml").read_text()
    config_path = data_dir / "node.toml"
    if config_path.exists() and not args.force:
        raise ConfigError(f"{config_path} exists: keep it, or pass --force to overwrite it (keys are kept)")
    lines = template.replace('data_dir = "."', f'data_dir = "{data_dir.resolve()}"')
    if args.password_file:
        keystore = data_dir / "keystore.json"
        if keystore.exists():
            print(f"keeping existing keystore {keystore}")
        else:
            account = create_keystore(keystore, read_password_file(args.password_file))
            print(f"created Ethereum account {account.address} in {keystore}")
        lines = lines.replace('keystore = ""  ', f'keystore = "{keystore.resolve()}"  ')
        lines = lines.replace('password_file = ""', f'password_file = "{Path(args.password_file).resolve()}"')
    elif args.dev_account is not None:
        lines = lines.replace("dev_account = -1 ", f"dev_account = {args.dev_account} ")
    from node.fsutil import atomic_write_bytes

    atomic_write_bytes(config_path, lines.encode())
    load_config(config_path)
    print(f"identity: {identity.peer_id} ({data_dir / 'identity.key'})")
    print(f"config:   {config_path}  (set ledger.rpc_url, addresses and run_id, then 'dlx-node start')")
    return 0


# ---------------------------------------------------------------------- start
def _progress_line(p) -> str:
    def mb(n: int) -> str:
        return f"{n / 1e6:.1f}MB"

    loss = "-" if math.isnan(p.loss) else f"{p.loss:.3f}"
    held = "-" if math.isnan(p.eval_loss) else f"{p.eval_loss:.3f}"
    def index(n: int) -> str:  # -1 while joining: nothing yet
        return str(n) if n >= 0 else "-"

    return (f"[{p.state:9s}] round {index(p.round)} step {p.step}/{p.inner_steps} loss {loss} held-out {held} "
            f"sent {mb(p.bytes_sent)} recv {mb(p.bytes_received)} peers {p.peers} committed {index(p.last_commit)}")


class _StoppedLoading(BaseException):
    """A SIGINT/SIGTERM while ``start`` still loads its packages (a BaseException: no ``except Exception`` in
    an imported package may swallow it)."""


def cmd_start(args: argparse.Namespace) -> int:
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
    try:
        cfg = load_config(args.config, args.overrides)
        _refuse_busy_port(cfg.p2p.listen_host, cfg.p2p.listen_port, "p2p.listen_port")
        _refuse_busy_port("127.0.0.1", cfg.metrics_port, "metrics_port")
        from node.live.node import Node

        loading[0] = False
    except _StoppedLoading:
        loading[0] = False  # a second signal now only repeats the request
    if stopping:
        logger.info("stopped during start-up (signal %d), before joining the run", stopping[0])
        return 0
    metrics = _start_metrics(cfg.metrics_port) if cfg.metrics_port else None
    show = not args.no_progress and sys.stderr.isatty()

    def on_progress(p) -> None:
        if metrics is not None:
            metrics(p)
        if show:
            sys.stderr.write("\r" + _progress_line(p)[:160].ljust(160))
            sys.stderr.flush()

    node = Node(cfg, on_progress=on_progress)
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
    logger.info("stopped after round %d (last committed %d)", progress.last_finished, progress.last_commit)
    return 0


def _reenter(outer_round: int) -> None:
    """Start this command again in this process (same pid, arguments, environment), the node fully closed.

    A fresh life enters after the chain's latest checkpoint, as any restart does; doing it
    by ``exec`` leaves nothing of the diverged life behind (threads, the trio loop, torch state).
    """
    logger.warning("round %d's committed record differs from this node's: starting again from the chain's latest "
                   "checkpoint", outer_round)
    logging.shutdown()  # flush the log file: exec runs no exit handlers
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _start_metrics(port: int):
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
                            ("spot_checks", p.spot_checks), ("spot_check_mismatches", p.spot_check_mismatches),
                            ("chain_checks", p.chain_checks)):
            gauges[name].set(value)

    return update


# ---------------------------------------------------------------------- status
def cmd_status(args: argparse.Namespace) -> int:
    path = Path(args.data_dir).expanduser() / "status.json"
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise NodeError(f"no node status at {path}: is a node running with data_dir={args.data_dir}?") from None
    except ValueError as exc:
        raise NodeError(f"status file {path} is unreadable: {exc}") from None
    alive = _pid_alive(status.get("pid", -1))
    if args.json:
        print(json.dumps({**status, "alive": alive}, indent=1))
        return 0 if alive else 1
    age = time.time() - status.get("updated_at", 0)
    placement = status.get("placement") or {}
    print(f"node     {status.get('peer_id')}  ({'running' if alive else 'not running'}, pid {status.get('pid')}, "
          f"updated {age:.0f}s ago)")
    print(f"run      {status.get('run_id')}  state {status.get('state')}  cluster {placement.get('cluster')} "
          f"replica {placement.get('replica')} stages {placement.get('stages')}")
    def index(key: str) -> str:  # -1 while joining: nothing yet
        value = status.get(key)
        return str(value) if isinstance(value, int) and value >= 0 else "-"

    print(f"round    {index('round')} step {status.get('step')}/{status.get('inner_steps')}  "
          f"loss {status.get('loss')}  held-out {status.get('eval_loss')}")
    print(f"network  peers {status.get('peers')}  sent {status.get('bytes_sent')} B  "
          f"received {status.get('bytes_received')} B")
    print(f"chain    last finished round {index('last_finished')}  last commit {index('last_commit')}  "
          f"weights root {status.get('weights_root') or '-'}")
    timing = status.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("utilization"), (int, float)):
        # From the node's own per-round clock (timing.jsonl): time in inner steps / wall time.
        print(f"compute  utilization {100 * timing['utilization']:.1f}% over {timing.get('periods')} period(s) "
              f"({timing.get('inner_s')} s in inner steps of {timing.get('wall_s')} s)")
    return 0 if alive else 1


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    from node.commands.demo import run_demo

    return run_demo(args)


# ---------------------------------------------------------------------- join
def cmd_join(args: argparse.Namespace) -> int:
    from node.commands.join import run_join

    return run_join(args)


# ---------------------------------------------------------------------- audit / pull
def cmd_audit(args: argparse.Namespace) -> int:
    from node.tools.audit import run_audit

    return run_audit(args)


def cmd_pull(args: argparse.Namespace) -> int:
    from node.tools.pull import run_pull

    return run_pull(args)


def cmd_data(args: argparse.Namespace) -> int:
    from node.commands.data import run_prepare

    return run_prepare(args)


#: The subcommands by name (node.cli parses the arguments and calls one of these).
COMMANDS = {
    "data": cmd_data,
    "init": cmd_init,
    "start": cmd_start,
    "join": cmd_join,
    "status": cmd_status,
    "demo": cmd_demo,
    "audit": cmd_audit,
    "pull": cmd_pull,
}
