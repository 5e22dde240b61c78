"""What the organizer's and the members' chain commands share: the chain and account, fees, the spend plan.

Every command that sends transactions lists them first with what each may cost (gas at the fee
cap, plus any stake), refuses if the account cannot pay for all of them, and asks before it
sends (``--yes`` agrees beforehand; without a terminal it refuses rather than spend silently),
as ``dlx-node join`` does (docs/DEPLOY.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from node.errors import ConfigError, NotRegistered, RunOver  # noqa: F401 (RunOver: the commands' name)

#: Blocks a command waits on top of its transactions' own before it counts them final (--confirmations).
DEFAULT_CONFIRMATIONS = 2


def add_account_args(p: argparse.ArgumentParser, *, keystore_default: str = "") -> None:
    """--keystore/--password-file or --dev-account: the account that sends."""
    acct = p.add_mutually_exclusive_group()
    acct.add_argument("--password-file", default=None, help="password of the encrypted keystore (--keystore)")
    acct.add_argument("--dev-account", type=int, default=None, metavar="N",
                      help="use well-known local dev key N (local chains only)")
    p.add_argument("--keystore", default=keystore_default,
                   help="encrypted keystore JSON of the sending account (with --password-file)")


def add_fee_args(p: argparse.ArgumentParser) -> None:
    """Fee cap, tip, confirmations and --yes."""
    p.add_argument("--max-fee-gwei", type=float, default=0.0,
                   help="cap on maxFeePerGas in gwei (default: no cap; the fee offered "
                        "is 2 x base fee + tip)")
    p.add_argument("--priority-fee-gwei", type=float, default=-1.0,
                   help="tip in gwei (default: what the RPC node suggests)")
    p.add_argument("--confirmations", type=int, default=None,
                   help="blocks, its own included, before a transaction counts as final "
                        "(default: the node.toml's "
                        f"for leave/withdraw, else {DEFAULT_CONFIRMATIONS}; a reorg before that "
                        "makes it be sent again)")
    p.add_argument("--yes", "-y", action="store_true",
                   help="agree beforehand to the transactions listed (else asked on the terminal)")


def ledger_settings(args: argparse.Namespace, rpc_url: str, chain_id: int, w3=None) -> dict:
    """The [ledger] table of the sending account and the fee settings (node.toml's, LedgerConfig's fields).

    ``w3``: the chain, to tell one that mines only on demand (:func:`mines_on_demand`), where the default
    confirmations would wait for blocks that no transaction brings: 1 there, said so (an explicit
    ``--confirmations`` is kept).
    """
    from ledger.config import LedgerConfig

    if args.confirmations is None:
        args.confirmations = DEFAULT_CONFIRMATIONS
        if DEFAULT_CONFIRMATIONS > 1 and w3 is not None and mines_on_demand(w3):
            args.confirmations = 1
            print(f"chain {chain_id} mines a block only when a transaction comes (a dev chain): a "
                  "transaction counts as final once mined (--confirmations 1)", flush=True)
    table: dict = {"backend": "rpc", "rpc_url": rpc_url, "chain_id": chain_id,
                   "confirmations": args.confirmations, "max_fee_gwei": args.max_fee_gwei,
                   "priority_fee_gwei": args.priority_fee_gwei}
    if args.dev_account is not None:
        table["dev_account"] = args.dev_account
    elif args.keystore:
        if not args.password_file:
            raise ConfigError(f"--keystore {args.keystore} needs --password-file")
        keystore = Path(args.keystore).expanduser()
        if not keystore.is_file():
            raise ConfigError(f"--keystore {args.keystore}: no such file")
        table["keystore"] = str(keystore.resolve())
        table["password_file"] = str(Path(args.password_file).expanduser().resolve())
    else:
        raise ConfigError(
            "no account: pass --keystore FILE --password-file FILE (an encrypted keystore), or on a "
            "local dev chain --dev-account N")
    if args.confirmations < 0:
        raise ConfigError(f"--confirmations={args.confirmations}: must be >= 0")
    LedgerConfig(**table)  # the fee settings' own checks, as a one-line error
    return table


def connect_checked(rpc_url: str, chain_id: int = 0):
    """Web3 on ``rpc_url``; ConfigError if it serves another chain than ``chain_id`` (0: any)."""
    from ledger.chain import connect_rpc

    w3 = connect_rpc(rpc_url, wait=10)
    actual = w3.eth.chain_id
    if chain_id and actual != chain_id:
        raise ConfigError(
            f"{rpc_url} serves chain id {actual}, not {chain_id}: point --rpc at the right chain")
    return w3


def verify_deployment(w3, registry: str, ledger: str) -> None:
    """Both addresses, the ledger's prover and its StepProver hold the committed build of the contracts
    (immutables masked), with their linked libraries', the ledger bound to the registry; ConfigError with
    what is wrong otherwise."""
    import contracts
    from ledger.bytecode import verify_bytecode
    from ledger.errors import AuditError

    for name, address in (("NodeRegistry", registry), ("TrainingLedger", ledger)):
        try:
            verify_bytecode(w3, w3.to_checksum_address(address), contracts.artifact(name))
        except AuditError as exc:
            raise ConfigError(f"{name} at {address} on chain {w3.eth.chain_id}: {exc}") from None
    abi = contracts.artifact("TrainingLedger")["abi"]
    bound = w3.eth.contract(address=w3.to_checksum_address(ledger), abi=abi)
    trusted = bound.functions.registry().call()
    if trusted.lower() != registry.lower():
        raise ConfigError(f"TrainingLedger {ledger} is bound to registry {trusted}, not {registry}")
    prover = bound.functions.prover().call()
    try:
        verify_bytecode(w3, prover, contracts.artifact("AggregationProver"))
    except AuditError as exc:
        raise ConfigError(f"the AggregationProver {prover} of TrainingLedger {ledger}: {exc}") from None
    aggregation = w3.eth.contract(address=prover, abi=contracts.artifact("AggregationProver")["abi"])
    step = aggregation.functions.stepProver().call()  # the ledger's contribution proof (issue 78)
    try:
        verify_bytecode(w3, step, contracts.artifact("StepProver"))
    except AuditError as exc:
        raise ConfigError(f"the StepProver {step} of TrainingLedger {ledger}: {exc}") from None


def read_deployment(path: str) -> dict:
    """deployment.json as ``dlx-node deploy`` writes it, its fields checked."""
    from node.commands.link import check_address

    try:
        deployment = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--deployment {path}: cannot read it ({exc})") from None
    if not isinstance(deployment, dict):
        raise ConfigError(f"--deployment {path}: not a JSON object")
    problems = []
    for key in ("registry", "ledger"):
        try:
            check_address(str(deployment.get(key, "")), f"{key}")
        except ConfigError as exc:
            problems.append(str(exc))
    for key in ("chain_id", "from_block"):  # both may be left out (the demo's has no from_block): 0
        value = deployment.setdefault(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            problems.append(f"{key} must be an integer >= 0")
    if not str(deployment.get("rpc_url", "")).startswith(("http://", "https://")):
        problems.append("rpc_url must be an http(s):// URL")
    if problems:  # every one at once
        raise ConfigError(f"--deployment {path}: " + "; ".join(problems))
    return deployment


@dataclass(frozen=True)
class Spend:
    """One transaction a command will send: what it does, its gas limit, the fee cap offered, any value."""

    what: str
    gas: int
    max_fee: int
    value: int = 0

    @property
    def most(self) -> int:
        """The most it can cost, in wei: gas x maxFeePerGas + value."""
        return self.gas * self.max_fee + self.value

    def line(self) -> str:
        value = f" + {self.value / 1e18:g} ETH" if self.value else ""
        return (f"{self.what}: gas {self.gas:,} at most {self.max_fee / 1e9:.3g} gwei = "
                f"{self.gas * self.max_fee / 1e18:.6f} ETH{value}")


def check_funds(balance: int, address: str, plan: list[Spend]) -> None:
    """ConfigError unless ``balance`` covers every transaction of ``plan`` at its most."""
    need = sum(step.most for step in plan)
    if balance < need:
        raise ConfigError(f"account {address} holds {balance / 1e18:.6f} ETH; the transactions need up to "
                          f"{need / 1e18:.6f} ETH (stake plus gas at the fee offered): "
                          "fund it first (nothing "
                          "was sent)")


def agree(plan: list[Spend], yes: bool, verb: str) -> None:
    """List ``plan`` and ask; ConfigError (nothing sent) when declined or when there is no terminal to ask
    on."""
    if not plan:
        return
    listing = "\n".join(f"  - {step.line()}" for step in plan)
    total = sum(step.most for step in plan)
    print(f"{verb} needs these transactions (at most {total / 1e18:.6f} ETH in all):\n{listing}", flush=True)
    if yes:
        return
    if not sys.stdin.isatty():
        raise ConfigError(
            f"{verb} needs the transactions listed above and there is no terminal to ask on: pass "
            "--yes to agree to them (nothing was sent)")
    if not ask_yes("send them? [y/N] "):
        raise ConfigError(f"{verb}: the transactions were declined (nothing was sent)")


def ask_yes(prompt: str) -> bool:
    """Ask ``prompt`` on the terminal: True for y/yes; an end of input (Ctrl-D) or Ctrl-C is a no."""
    try:
        answer = input(prompt)
    except (EOFError, KeyboardInterrupt):
        print(flush=True)  # the prompt's line ends
        return False
    return answer.strip().lower() in ("y", "yes")


def mines_on_demand(w3) -> bool:
    """Whether the chain makes a block only when a transaction comes: a dev chain's automine without an
    interval (anvil, hardhat). A chain that does not know these methods (any public one) does not."""
    def ask(method: str):
        try:
            return w3.provider.make_request(method, []).get("result")
        except (OSError, ValueError, AttributeError):
            return None

    if not any(ask(method) is True for method in ("anvil_getAutomine", "hardhat_getAutomine")):
        return False
    return not ask("anvil_getIntervalMining")


def seconds_per_block(w3, sample: int = 20) -> float | None:
    """The chain's recent block time (for "about N minutes"); 12 s if it cannot tell; None for a chain that
    mines only on demand (:func:`mines_on_demand`: no time tells when its next block comes)."""
    if mines_on_demand(w3):
        return None
    head = w3.eth.block_number
    if head < 2:
        return 12.0
    first = max(0, head - sample)
    span = w3.eth.get_block(head)["timestamp"] - w3.eth.get_block(first)["timestamp"]
    return span / (head - first) if span > 0 else 12.0


#: What :func:`eta` says of a chain that mines only on demand.
ON_DEMAND = ("no time estimate: this chain mines a block only when a transaction comes (a dev chain; "
             "`dlx-node mine N --rpc URL` mines N)")


def eta(blocks: int, per_block: float | None) -> str:
    """``blocks`` as a rough duration (``per_block`` None: a chain that mines only on demand)."""
    if per_block is None:
        return ON_DEMAND
    seconds = max(0, blocks) * per_block
    if seconds < 120:
        return f"about {seconds:.0f} s"
    if seconds < 7200:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"


#: Gas of joinRun when it cannot be estimated yet (the account registers first): as ``create-run`` counts.
JOIN_GAS = 300_000




# ---------------------------------------------------------------------- the seat
def seat_plan(client, info, identity, platform: bytes) -> list:
    """The transactions the account still needs to hold a seat in run ``info`` (chainops.Spend each: gas at
    the fee offered now, plus the stake); NotRegistered for a seat that no transaction can give."""
    from ledger.binding import binding_message

    plan = []
    key = client.key_of(client.address)
    if key is not None and key != identity.public_key_bytes:
        raise NotRegistered(f"account {client.address} is registered with another node key: an account has "
                            "one node key; pass --identity OLD_DIR/identity.key (the node directory of its "
                            "other run) to use it here, or use another account")
    fee = None
    if key is None:
        stake = client.min_stake()
        message = binding_message(client.chain_id, client.registry_address, client.address)
        gas, fees = client.estimate("registry", "register",
                                    (identity.public_key_bytes, identity.sign(message)), stake)
        fee = fees["maxFeePerGas"]
        plan.append(Spend(f"register node key {identity.peer_id} to account {client.address}"
                          + (f" (registry stake {stake / 1e18:g} ETH)" if stake else ""), gas, fee, stake))
    seat = client.member(info.run_id, client.address)
    if seat is not None and seat.active:
        return plan
    if seat is not None:
        raise NotRegistered(f"account {client.address} holds a {seat.status} seat in run {info.run_id}: a "
                            "member that left must withdraw its stake after unbonding before joining again "
                            "(dlx-node withdraw), and a slashed member cannot rejoin")
    if key is None:
        gas = JOIN_GAS
    else:
        gas, fees = client.estimate("ledger", "joinRun", (info.run_id, platform), info.min_stake)
        fee = fees["maxFeePerGas"]
    plan.append(Spend(f"join run {info.run_id} with a stake of {info.min_stake / 1e18:g} ETH (returned after "
                      f"leaving and {info.unbonding_blocks} blocks, unless slashed)", gas, fee,
                      info.min_stake))
    return plan


def rounds_left_line(client, info) -> tuple[str, bool]:
    """Before a seat is staked (issue 80): how many of the run's rounds are left, in one line, and whether a
    joiner's seat would be too short to be of use: fewer rounds left than the run's minimum useful tenure
    (``tenure_rounds`` + 1: a joiner's signature counts only after ``tenure_rounds`` rounds in force, so it
    would never count toward a quorum before the run ends). A founder (no round committed yet) counts at
    once; an open-ended run never ends."""
    if not info.max_rounds:
        return f"run {info.run_id} is open-ended (no last round)", False
    committed = client.commit_count(info.run_id)
    left = max(info.max_rounds - committed, 0)
    line = f"run {info.run_id}: {left} of its {info.max_rounds} rounds left ({committed} committed)"
    useful = info.tenure_rounds + 1
    if committed and left < useful:
        return (line + "; a joiner's signature counts only after tenure_rounds = "
                f"{info.tenure_rounds} rounds in force, so a seat taken now needs at least {useful} rounds "
                "left to count once"), True
    return line, False


def check_rounds_left(client, info, yes: bool) -> None:
    """Say how many rounds are left before staking; with fewer than the run's minimum useful tenure left
    (:func:`rounds_left_line`), ask on a terminal, and refuse (RunOver, exit 6, nothing sent) without one or
    with ``--yes`` (which agrees to transactions, not to a seat that would never count)."""
    line, short = rounds_left_line(client, info)
    print(line, flush=True)
    if not short:
        return
    if not yes and sys.stdin.isatty():
        try:
            answer = input("stake a seat that would never count toward a quorum? [y/N] ").strip().lower()
        except EOFError:
            answer = ""
        if answer in ("y", "yes"):
            return
    raise RunOver(f"{line}: not staking (nothing was sent); join a run with more rounds left, or pull this "
                  "one's model when it ends")


def refuse_finished(client, info) -> None:
    """RunOver if every round of the run is committed (an open-ended run never is)."""
    if not info.max_rounds:
        return
    committed = client.commit_count(info.run_id)
    if committed >= info.max_rounds:
        raise RunOver(f"run {info.run_id} is over: all its {info.max_rounds} rounds are committed, so "
                      "nothing a node trains for it could commit; nothing was sent (its model: dlx-node pull "
                      "<run link> OUT)")
