"""``dlx-node leave``, ``dlx-node withdraw`` and ``dlx-node run-info``: a member's and anyone's run commands.

``leave`` and ``withdraw`` act for the account of a node directory's ``node.toml`` (written by
``join`` or ``create-run``): leaving stops the seat signing at once and starts the unbonding
period; withdrawing takes the stake back once it is over (``--wait`` waits for it, showing the
blocks left). ``run-info`` reads a run from its link and sends nothing. ``audit`` and ``pull``
take the same link (:func:`apply_link`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from node.commands.chainops import Spend, add_fee_args, agree, ask_yes, check_funds, eta, seconds_per_block
from node.commitments import version_name
from node.errors import ConfigError, NotYet



def node_identity(data_dir: Path, reuse: str = ""):
    """The node key (a :class:`p2p.identity.Identity`) of node directory ``data_dir``: its ``identity.key``,
    made if it has none. ``reuse``: another node directory's key file to use instead, copied in (mode 0600):
    an account registers one node key, so the node of its next run (create-run, join) needs that key."""
    from p2p.errors import IdentityError
    from p2p.identity import Identity

    path = data_dir / "identity.key"
    if not reuse:
        return Identity.load_or_create(path)
    try:
        identity = Identity.load(Path(reuse).expanduser())
    except IdentityError as exc:
        raise ConfigError(f"--identity {reuse}: {exc}") from None
    if path.exists():
        own = Identity.load(path)
        if own.public_key_bytes != identity.public_key_bytes:
            raise ConfigError(f"--identity {reuse}: {path} already holds another node key ({own.peer_id}, "
                              f"not {identity.peer_id}): pick a new --data-dir")
        return own
    identity.save(path)
    return identity

def add_parsers(sub) -> None:
    for name, helptext in (
        ("leave", "leave the run of a node directory: stop signing, start unbonding the stake"),
        ("withdraw", "take the stake back once the unbonding period is over")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--config", "-c", default="node.toml",
                       help="the member's node.toml (its account, chain and run), written "
                            "by join or create-run")
        add_fee_args(p)
        if name == "withdraw":
            p.add_argument("--wait", action="store_true",
                           help="wait for the unbonding period to end, then withdraw")
    p = sub.add_parser("run-info",
                       help="a run's members, stakes, rounds, last record, accusations and disputes "
                                        "(read-only)")
    p.add_argument("link", nargs="?", default="",
                   help="the run link (dlx://<chain_id>/<ledger>/<run_id>?rpc=...); or give --rpc, --run and "
                        "--deployment (or --registry and --ledger), as for audit and pull")
    p.add_argument("--rpc", default="", help="chain JSON-RPC URL (overrides the link's)")
    p.add_argument("--run", type=int, default=None, help="run id")
    p.add_argument("--ledger", default="", help="TrainingLedger address (default: from --deployment)")
    p.add_argument("--registry", default="", help="NodeRegistry address (default: from --deployment)")
    p.add_argument("--deployment", default="", help="deployment.json written by 'dlx-node demo' or deploy")
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p = sub.add_parser("mine", help="mine N empty blocks on a local dev chain (anvil) that mines only on "
                                    "transactions, e.g. to end an unbonding period or a dispute window")
    p.add_argument("blocks", type=int, help="how many blocks")
    p.add_argument("--rpc", default="http://127.0.0.1:8545", help="the dev chain's JSON-RPC URL")


def member_chain(args: argparse.Namespace):
    """(NodeChain, run id, seat or None) of the node.toml named by --config, the fee options applied."""
    from node.config import load_config
    from node.live.chain.onchain import NodeChain

    from pathlib import Path

    if not Path(args.config).expanduser().is_file():  # not init's hint: a member's file comes from join
        raise ConfigError(f"--config {args.config}: no such file; give the member's node.toml, which join or "
                          "create-run wrote in its data directory (--config DIR/node.toml)")
    overrides = [f"ledger.max_fee_gwei={args.max_fee_gwei}",
                 f"ledger.priority_fee_gwei={args.priority_fee_gwei}"]
    if args.confirmations is not None:  # else the node's own setting
        overrides.append(f"ledger.confirmations={args.confirmations}")
    cfg = load_config(args.config, overrides)
    chain = NodeChain.connect(cfg)
    run_id = cfg.ledger.run_id
    return chain, run_id, chain.client.member(run_id, chain.client.address)


def _fee(client) -> int:
    return client.estimate("ledger", "runCount")[1]["maxFeePerGas"]


def run_leave(args: argparse.Namespace) -> int:
    """``dlx-node leave``."""
    chain, run_id, seat = member_chain(args)
    try:
        client = chain.client
        if seat is None or seat.status != "active":
            raise ConfigError(f"account {client.address} is not an active member of run {run_id} "
                              f"({'no seat' if seat is None else seat.status}): nothing to leave")
        info = client.run_info(run_id)
        gas, fees = client.estimate("ledger", "leaveRun", (run_id,))
        plan = [Spend(
            f"leave run {run_id} (stake {seat.stake / 1e18:g} ETH unbonds for {info.unbonding_blocks} "
            "blocks)", gas, fees["maxFeePerGas"])]
        check_funds(client.balance(), client.address, plan)
        agree(plan, args.yes, "leaving")
        client.leave_run(run_id)
        seat = client.member(run_id, client.address)
        per_block = seconds_per_block(client.w3)
        left = seat.unbonding_end - client.w3.eth.block_number
        print(f"left run {run_id}: the stake of {seat.stake / 1e18:g} ETH can be withdrawn from block "
              f"{seat.unbonding_end} ({left} blocks, {eta(left, per_block)}): dlx-node withdraw --config "
              f"{args.config} --wait")
        print("its node, if running, stops by itself when it next reads the chain (it can no longer sign for "
              "the run)")
    finally:
        chain.close()
    return 0


def run_withdraw(args: argparse.Namespace) -> int:
    """``dlx-node withdraw``."""
    chain, run_id, seat = member_chain(args)
    try:
        client = chain.client
        if seat is None or seat.status != "unbonding":
            state = "no seat (withdrawn already, or never joined)" if seat is None else seat.status
            hint = ": leave first (dlx-node leave)" if seat is not None and seat.status == "active" else ""
            raise ConfigError(
                f"account {client.address} has nothing to withdraw from run {run_id}: {state}{hint}")
        if args.wait and seat.unbonding_end > client.w3.eth.block_number:
            _agree_before_waiting(seat, run_id, args.yes)
            args.yes = True  # agreed now: the wait may be long, and nobody may be there at its end
        _await_unbonding(client, seat, args.wait)
        gas, fees = client.estimate("ledger", "withdrawStake", (run_id,))
        plan = [Spend(f"withdraw the stake of {seat.stake / 1e18:g} ETH from run {run_id}", gas,
                      fees["maxFeePerGas"])]
        check_funds(client.balance(), client.address, plan)
        agree(plan, args.yes, "withdrawing")
        client.withdraw_stake(run_id)
        print(f"withdrew {seat.stake / 1e18:g} ETH from run {run_id} to {client.address}")
    finally:
        chain.close()
    return 0


def _agree_before_waiting(seat, run_id: int, yes: bool) -> None:
    """Ask before ``withdraw --wait`` waits, not after: ConfigError (nothing waited for, nothing sent) when
    declined or when there is no terminal to ask on and no ``--yes``."""
    if yes:
        return
    what = f"withdraw the stake of {seat.stake / 1e18:g} ETH from run {run_id} once unbonding ends"
    if not sys.stdin.isatty():
        raise ConfigError(f"--wait would {what}, and there is no terminal to ask on: pass --yes to agree "
                          "beforehand (nothing was waited for, nothing was sent)")
    if not ask_yes(f"{what} (block {seat.unbonding_end}; gas at the fee then)? [y/N] "):
        raise ConfigError("withdrawing: declined (nothing was waited for, nothing was sent)")


def _await_unbonding(client, seat, wait: bool) -> None:
    """Return once the chain is at the seat's unbonding end (StateError now unless ``wait``)."""
    per_block = seconds_per_block(client.w3)
    shown = None
    while True:
        head = client.w3.eth.block_number
        left = seat.unbonding_end - head
        if left <= 0:
            return
        if not wait:
            raise NotYet(f"still unbonding: {left} blocks left (until block {seat.unbonding_end}, "
                             f"{eta(left, per_block)}); run it again then, or pass --wait")
        if left != shown:
            print(f"unbonding: {left} blocks left (until block {seat.unbonding_end}, {eta(left, per_block)})",
                  flush=True)
            shown = left
        time.sleep(min(max(per_block or 2.0, 0.5), 15.0))


# ---------------------------------------------------------------------- run-info
def reader_for_link(link, rpc: str = ""):
    """A read-only LedgerClient of the run link's deployment (registry read from the ledger), chain id
    checked."""
    import contracts
    from ledger.client import LedgerClient
    from node.commands.chainops import connect_checked

    url = rpc or link.rpc_url
    w3 = connect_checked(url, link.chain_id)
    address = w3.to_checksum_address(link.ledger)
    if not w3.eth.get_code(address):
        raise ConfigError(f"no contract at ledger {link.ledger} on chain {link.chain_id}: a wrong link?")
    abi = contracts.artifact("TrainingLedger")["abi"]
    registry = w3.eth.contract(address=address, abi=abi).functions.registry().call()
    return LedgerClient(w3, None, registry, address), url


def run_info_summary(client, run_id: int, history=None) -> dict:
    """What run-info shows, as plain data (``history``: the run's, if the caller read it already)."""
    from ledger.errors import LedgerError

    if history is None:
        try:
            history = client.history(run_id, with_registrations=False)
        except LedgerError as exc:
            raise ConfigError(f"run {run_id}: {exc}") from None
    info, head = history.run, client.w3.eth.block_number
    members = []
    for account in dict.fromkeys(m.account for m in history.memberships):
        seat = client.member(run_id, account)
        members.append({"account": account, "status": seat.status if seat else "withdrawn",
                        "stake_wei": seat.stake if seat else 0,
                        "node_key": seat.node_key.hex() if seat else "",
                        "unbonding_end": seat.unbonding_end if seat and seat.status == "unbonding" else None})
    last = history.commits[-1] if history.commits else None
    return {
        "run_id": run_id, "chain_id": client.chain_id, "ledger": client.ledger_address,
        "registry": client.registry_address, "creator": info.creator, "created_block": info.block_number,
        "config_hash": info.config_hash.hex(), "stages": info.num_stages, "inner_steps": info.inner_steps,
        "quorum": info.quorum, "quorum_bps": info.quorum_bps, "stake_wei": info.min_stake,
        "unbonding_blocks": info.unbonding_blocks, "max_rounds": info.max_rounds, "head_block": head,
        "commitments": info.commitments,
        "rounds_committed": len(history.commits), "members": members,
        "last_record": None if last is None else {
            "round": last.commit.round, "block": last.block_number, "tx": last.tx_hash,
            "weights_root": last.commit.weights_root.hex(), "contributors": last.commit.num_contributors,
            "attesters": list(last.attesters), "eval_loss_micro": last.commit.eval_loss_micro,
            "checkpoint": last.commit.checkpoint_hash.hex() if last.commit.has_checkpoint else None},
        "open_accusations": [{"accused": a.accused, "accuser": a.accuser, "evidence": a.evidence_hash.hex(),
                              "deadline": a.deadline} for a in history.accusations if a.open],
        "disputes": [{"round": d.round, "disputer": d.disputer, "block": d.block_number}
                     for d in history.disputes],
    }


def format_run_info(s: dict) -> str:
    rounds = f"{s['rounds_committed']} of {s['max_rounds']}" if s["max_rounds"] \
        else f"{s['rounds_committed']}"
    lines = [f"run {s['run_id']} on chain {s['chain_id']}: ledger {s['ledger']}, registry {s['registry']}",
             (f"  created by {s['creator']} in block {s['created_block']}; configHash {s['config_hash'][:16]}"
              f"; {s['stages']} stage(s), H={s['inner_steps']}; commitments version {s['commitments']} "
              f"({version_name(s['commitments'])})"),
             f"  quorum k={s['quorum']}" + (f" (and {s['quorum_bps'] / 100:g}% of members)" if s["quorum_bps"]
                                            else "")
             + f"; stake {s['stake_wei'] / 1e18:g} ETH; unbonding {s['unbonding_blocks']} blocks",
             f"  rounds committed: {rounds}; chain head block {s['head_block']}",
             f"members ({sum(m['status'] == 'active' for m in s['members'])} active):"]
    for m in s["members"]:
        extra = f", withdrawable from block {m['unbonding_end']}" if m["unbonding_end"] else ""
        lines.append(f"  {m['account']}  {m['status']:9s}  stake {m['stake_wei'] / 1e18:g} ETH{extra}")
    last = s["last_record"]
    if last is None:
        lines.append("last record: none yet")
    else:
        lines.append(f"last record: round {last['round']} in block {last['block']}, weights root "
                     f"{last['weights_root'][:16]}, {last['contributors']} contributions, "
                     f"{len(last['attesters'])} attesters, held-out loss {last['eval_loss_micro'] / 1e6:.4f}"
                     + (f", checkpoint {last['checkpoint'][:16]}" if last["checkpoint"] else ""))
    lines.append(f"open accusations: {len(s['open_accusations']) or 'none'}")
    for a in s["open_accusations"]:
        lines.append(f"  {a['accused']} accused by {a['accuser']} (evidence {a['evidence'][:16]}, lapses at "
                     f"block {a['deadline']})")
    lines.append(f"disputes: {len(s['disputes']) or 'none'}")
    for d in s["disputes"]:
        lines.append(f"  round {d['round']} disputed by {d['disputer']} in block {d['block']}")
    return "\n".join(lines)


def run_run_info(args: argparse.Namespace) -> int:
    """``dlx-node run-info``."""
    from node.commands.link import parse_run_link
    from node.tools.evidence import reader_client

    if args.link:
        link = parse_run_link(args.link)
        if args.run is not None and args.run != link.run_id:
            raise ConfigError(f"--run {args.run} and the link's run {link.run_id} differ: give one")
        client, _ = reader_for_link(link, args.rpc)
        run_id = link.run_id
    else:  # as audit and pull: --rpc, --run and the deployment's addresses
        _rpc_and_run_given(args)
        client, run_id = reader_client(args), args.run
    summary = run_info_summary(client, run_id)
    print(json.dumps(summary, indent=1) if args.json else format_run_info(summary))
    return 0


def run_mine(args: argparse.Namespace) -> int:
    """``dlx-node mine N``: anvil's ``anvil_mine`` on a chain that mines only on demand; refused elsewhere."""
    from ledger.chain import connect_rpc
    from node.commands.chainops import mines_on_demand

    if args.blocks < 1:
        raise ConfigError(f"mine {args.blocks}: give a number of blocks of at least 1")
    w3 = connect_rpc(args.rpc, wait=5)
    if not mines_on_demand(w3):
        raise ConfigError(f"{args.rpc} is not a local dev chain that mines only on transactions (anvil's "
                          "automine): its blocks come by themselves, nothing to mine")
    before = w3.eth.block_number
    reply = w3.provider.make_request("anvil_mine", [hex(args.blocks)])
    if "error" in reply:
        raise ConfigError(f"{args.rpc} refused anvil_mine: {reply['error']}")
    print(f"mined {w3.eth.block_number - before} blocks: the head is block {w3.eth.block_number}")
    return 0


def _deployment_rpc(path: str) -> str:
    """The rpc_url of deployment.json ``path`` ("" when it names none), said on stderr as the --rpc used."""
    try:
        url = json.loads(Path(path).read_text()).get("rpc_url") or ""
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--deployment {path}: cannot read it ({exc})") from None
    if url:
        print(f"chain RPC {url}: the rpc_url of --deployment {path} (--rpc URL to use another)",
              file=sys.stderr)
    return url


def _rpc_and_run_given(args: argparse.Namespace) -> None:
    """--run and an RPC URL, without a link: --rpc, else the rpc_url of --deployment; ConfigError if not."""
    if not args.rpc and args.deployment:
        args.rpc = _deployment_rpc(args.deployment)
    if not args.rpc or args.run is None:
        raise ConfigError("pass the run link, or --run with --deployment (its rpc_url is the default --rpc) "
                          "or with --rpc and --registry/--ledger")


def apply_link(args: argparse.Namespace) -> None:
    """Fill ``audit``'s and ``pull``'s --rpc, --run, --ledger, --registry and --bootstrap from a run link."""
    from node.commands.link import parse_run_link

    if not args.link:
        _rpc_and_run_given(args)
        return
    link = parse_run_link(args.link)
    if args.run is not None and args.run != link.run_id:
        raise ConfigError(f"--run {args.run} and the link's run {link.run_id} differ: give one")
    client, url = reader_for_link(link, args.rpc)
    args.rpc, args.run = url, link.run_id
    args.ledger, args.registry = client.ledger_address, client.registry_address
    args.bootstrap = list(args.bootstrap) + [p for p in link.peers if p not in args.bootstrap]
