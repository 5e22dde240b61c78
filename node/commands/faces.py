"""What each ``dlx-node`` subcommand does (parsing and exit codes live in :mod:`node.cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from node.config import load_config
from node.errors import ConfigError, StateError
from node.fsutil import pid_alive

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- init
def cmd_init(args: argparse.Namespace) -> int:
    from importlib.resources import files

    from ledger.account import create_keystore, read_password_file
    from ledger.errors import AccountError
    from p2p.identity import Identity

    data_dir = Path(args.data_dir).expanduser()
    config_path = data_dir / "node.toml"
    if config_path.exists() and not args.force:
        raise ConfigError(f"{config_path} exists: keep it, or pass --force to overwrite it (keys are kept)")
    password = None
    if args.password_file:  # read before any file is written: a missing one is a usage error
        try:
            password = read_password_file(args.password_file)
        except AccountError as exc:
            raise ConfigError(f"--password-file: {exc}") from None
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = Identity.load_or_create(data_dir / "identity.key")
    template = files("node").joinpath("templates/node.toml").read_text()
    lines = template.replace('data_dir = "."', f'data_dir = "{data_dir.resolve()}"')
    if args.password_file:
        keystore = data_dir / "keystore.json"
        if keystore.exists():
            print(f"keeping existing keystore {keystore}")
        else:
            account = create_keystore(keystore, password)
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
def cmd_start(args: argparse.Namespace, kinds=None) -> int:
    """``dlx-node start``; ``kinds``: the node's part classes (node.live.assembly.Kinds; tests inject
    faults)."""
    from node.commands.start import start

    return start(args.config, args.overrides, show_progress=not args.no_progress, kinds=kinds, yes=args.yes,
                 chain_wait=getattr(args, "chain_wait", None))


# ---------------------------------------------------------------------- status
def cmd_status(args: argparse.Namespace) -> int:
    """``dlx-node status``: 0 with a running node's status, 15 (not running) with a stopped one's last."""
    from node.exitcodes import ExitCode

    data_dir = Path(args.data_dir).expanduser()
    path = data_dir / "status.json"
    if not data_dir.is_dir():
        raise ConfigError(f"--data-dir {args.data_dir}: no such directory (a node's data directory, as its "
                          "node.toml's data_dir names it)")
    try:
        status = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no node status in {data_dir} (no status.json): no node has run with this data "
                          "directory; pass the data_dir of a node's node.toml") from None
    except ValueError as exc:
        raise StateError(f"status file {path} is unreadable: {exc}") from None
    alive = pid_alive(status.get("pid", -1))
    code = 0 if alive else int(ExitCode.NOT_RUNNING)
    if args.json:
        print(json.dumps({**status, "alive": alive}, indent=1))
        return code
    for line in status_lines(status, alive):
        print(line)
    return code


def _figure(value: object, digits: int = 4) -> str:
    """A float rounded to ``digits`` significant digits; "-" for a value not there yet (None, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _bytes(value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def status_lines(status: dict, alive: bool) -> list[str]:
    """What ``dlx-node status`` prints of a node's ``status.json``: figures rounded, "-" for none yet."""
    updated = status.get("updated_at")
    age = f"updated {time.time() - updated:.0f}s ago" if isinstance(updated, (int, float)) else "not updated"
    placement = {key: value for key, value in (status.get("placement") or {}).items() if value is not None}

    def index(key: str) -> str:  # -1 while joining: nothing yet
        value = status.get(key)
        return str(value) if isinstance(value, int) and value >= 0 else "-"

    lines = [
        f"node     {status.get('peer_id')}  ({'running' if alive else 'not running'}, pid "
        f"{status.get('pid')}, {age})",
        f"run      {status.get('run_id')}  state {status.get('state')}  "
        f"cluster {placement.get('cluster', '-')} replica {placement.get('replica', '-')} "
        f"stages {placement.get('stages', '-')}",
        f"round    {index('round')} step {_figure(status.get('step'))}/{_figure(status.get('inner_steps'))}  "
        f"loss {_figure(status.get('loss'))}  held-out {_figure(status.get('eval_loss'))}",
        f"network  peers {_figure(status.get('peers'))}  sent {_bytes(status.get('bytes_sent'))}  "
        f"received {_bytes(status.get('bytes_received'))}",
        f"chain    last finished round {index('last_finished')}  last commit {index('last_commit')}  "
        f"weights root {status.get('weights_root') or '-'}",
    ]
    timing = status.get("timing")
    if isinstance(timing, dict) and isinstance(timing.get("utilization"), (int, float)):
        # From the node's own per-round clock (timing.jsonl): time in inner steps / wall time.
        lines.append(
            f"compute  utilization {100 * timing['utilization']:.1f}% over {timing.get('periods')} period(s) "
            f"({_figure(timing.get('inner_s'))} s in inner steps of {_figure(timing.get('wall_s'))} s)")
    return lines


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
    from node.commands.member import apply_link
    from node.tools.audit_cli import run_audit

    apply_link(args)

    return run_audit(args)


def cmd_pull(args: argparse.Namespace) -> int:
    from node.commands.member import apply_link
    from node.tools.pull_cli import run_pull

    apply_link(args)

    return run_pull(args)


def cmd_data(args: argparse.Namespace) -> int:
    from node.commands.data import run_data

    return run_data(args)


def cmd_explorer(args: argparse.Namespace) -> int:
    from node.commands.explorer import run_explorer

    return run_explorer(args)


# ---------------------------------------------------------------------- organizer and member chain commands
def cmd_deploy(args: argparse.Namespace) -> int:
    from node.commands.organize import run_deploy

    return run_deploy(args)


def cmd_create_run(args: argparse.Namespace) -> int:
    from node.commands.organize import run_create_run

    return run_create_run(args)


def cmd_leave(args: argparse.Namespace) -> int:
    from node.commands.member import run_leave

    return run_leave(args)


def cmd_withdraw(args: argparse.Namespace) -> int:
    from node.commands.member import run_withdraw

    return run_withdraw(args)


def cmd_run_info(args: argparse.Namespace) -> int:
    from node.commands.member import run_run_info

    return run_run_info(args)


def cmd_mine(args: argparse.Namespace) -> int:
    from node.commands.member import run_mine

    return run_mine(args)


def cmd_rewards(args: argparse.Namespace) -> int:
    from node.commands.rewards import run_rewards

    return run_rewards(args)


def cmd_challenge(args: argparse.Namespace) -> int:
    from node.commands.challenge import run_challenge

    return run_challenge(args)


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
    "deploy": cmd_deploy,
    "create-run": cmd_create_run,
    "leave": cmd_leave,
    "withdraw": cmd_withdraw,
    "run-info": cmd_run_info,
    "mine": cmd_mine,
    "rewards": cmd_rewards,
    "challenge": cmd_challenge,
    "explorer": cmd_explorer,
}
