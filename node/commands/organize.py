"""``dlx-node deploy`` and ``dlx-node create-run``: an organizer's commands (docs/DEPLOY.md).

``deploy`` puts a NodeRegistry, a TrainingLedger and a RewardPool (the runs' reward pools, issue 77) on any
JSON-RPC chain from an encrypted keystore, waits for its confirmations, checks the code now at each address
against the committed artifacts (immutables masked) and writes ``deployment.json``.

``create-run`` reads a run file (a node.toml's run settings plus a ``[run]`` table of the on-chain parameters:
node/commands/runfile.py), checks every value, and makes the organizer's node directory (``--data-dir``): its
``node.toml``, ``run.json`` and account. The organizer's node is the run's first member and serves the run
document (and tokenizer) to joiners once it runs (``dlx-node start --config <dir>/node.toml``), as every node
does; the run link printed names it as the peer to fetch from. The order makes a failure harmless: everything
is checked and written before the ``createRun`` transaction; after it only registering and joining remain, and
running the same command again finds the run it created (by creator and configHash) instead of creating a
second one. A run file's ``[pool]`` opens the run's reward pool with ``createPool`` right after ``createRun``
(node/commands/runpool.py; its parameters checked against every rule of the pool first). Before
``createRun``, a run whose ``quorum x stake / 2`` would not pay a prover's worst-case gas
at ten times the chain's gas price is refused (node/provergas.py; ``--allow-unpaid-proofs`` creates it,
warned).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from node.commands.chainops import (
    Spend,
    add_account_args,
    add_fee_args,
    agree,
    check_funds,
    connect_checked,
    ledger_settings,
    read_deployment,
    verify_deployment,
)
from node.commands.member import node_identity
from node.commands.runfile import read_run_file, run_params
from node.commands.runpool import deployment_pool, open_pool, pool_plan, pool_spends, verify_pool
from node.errors import DLX_ERRORS, ConfigError, NodeError, NotRegistered, RunOver
from node.provergas import check_reward, proof_fund_for

logger = logging.getLogger(__name__)

#: Gas reserved for joinRun in the spend plan: it cannot be estimated before the run exists.
JOIN_GAS = 300_000


# ---------------------------------------------------------------------- parsers
def add_parsers(sub) -> None:
    p = sub.add_parser("deploy",
                       help="deploy the registry and ledger contracts to a chain; write deployment.json")
    p.add_argument("--rpc", required=True, help="chain JSON-RPC URL (any provider)")
    p.add_argument("--chain-id", type=int, default=0, help="refuse an RPC that serves another chain")
    p.add_argument("--min-stake-eth", type=float, default=0.0,
                   help="the registry's stake per registered node (default 0: runs set their own)")
    p.add_argument("--out", default="deployment.json",
                   help="where to write the deployment (refused if it exists)")
    add_account_args(p)
    add_fee_args(p)

    p = sub.add_parser("create-run",
                       help="create a run from a run file; write the organizer's node directory; "
                                          "print the run link")
    p.add_argument("run_file", help="TOML: the run's settings (as in node.toml) and a [run] table of stake, "
                                    "quorum, unbonding (docs/DEPLOY.md)")
    p.add_argument("--deployment", required=True, help="deployment.json written by 'dlx-node deploy'")
    p.add_argument("--rpc", default="", help="chain JSON-RPC URL (default: the deployment's)")
    p.add_argument("--data-dir", default="dlx-organizer", help="the organizer's node directory (created)")
    p.add_argument("--identity", default="", metavar="KEY_FILE",
                   help="the node key to use (copied into --data-dir): the identity.key of this account's "
                        "node directory of an earlier run, for a second run (an account registers one key)")
    p.add_argument("--announce", default="127.0.0.1",
                   help="public IP address or DNS name joiners reach the organizer's node "
                        "at (in the run link)")
    p.add_argument("--listen-port", type=int, default=4001, help="the organizer's node's p2p port")
    p.add_argument("--weak-run", action="store_true",
                   help="accept a [run] table below the security model's floor (k < 2, quorum_bps < 5000 or "
                        "a stake of 0): one member or a minority then commits and slashes "
                        "alone (docs/TRUST.md)")
    p.add_argument("--allow-unpaid-proofs", action="store_true",
                   help="create the run even when quorum x stake / 2 does not cover a prover's worst-case "
                        "gas at 10x today's gas price (a test chain): a wrong round may then stand with "
                        "nobody paid to prove it (docs/FRAUD_PROOF.md)")
    p.add_argument("--no-data-terms", action="store_true",
                   help="in a run drawn by account (training.data_windows = \"account\"), do not fix its "
                        "data terms on chain: its contributions' batches can then not be disputed "
                        "(docs/FRAUD_PROOF.md \"The run's data terms\")")
    p.add_argument("--init-from", default="", metavar="DIR",
                   help="start from a Hugging Face model directory (config.json, model.safetensors or a "
                        "sharded index, tokenizer.json): Llama, Qwen2, Mistral or GPT-2; its weights and "
                        "tokenizer are named in the run document by content hash and served to the nodes")
    add_account_args(p, keystore_default="")
    add_fee_args(p)


# ---------------------------------------------------------------------- deploy
def run_deploy(args: argparse.Namespace) -> int:
    """``dlx-node deploy`` (see module docstring)."""
    from eth_abi import encode

    import contracts
    from ledger.account import load_account
    from ledger.client import LedgerClient
    from ledger.config import LedgerConfig, fee_policy
    from ledger.rewards import RewardPoolClient

    out = Path(args.out).expanduser()
    if out.exists():
        raise ConfigError(f"--out {out} exists: a deployment is never overwritten; pick another path")
    if args.min_stake_eth < 0:
        raise ConfigError(f"--min-stake-eth={args.min_stake_eth}: must be >= 0")
    w3 = connect_checked(args.rpc, args.chain_id)
    chain_id = w3.eth.chain_id
    ledger_cfg = LedgerConfig(**ledger_settings(args, args.rpc, chain_id, w3))
    account = load_account(ledger_cfg, chain_id)
    fees = fee_policy(ledger_cfg)
    min_stake = int(args.min_stake_eth * 10**18)
    plan = []
    # The libraries first (the ledger's code is linked to their addresses: the account's stands in for the
    # estimate), then the registry and the ledger, whose constructor creates the prover.
    stand_ins = {name: account.address for name in contracts.LIBRARIES}
    steps = [(name, [], []) for name in contracts.LIBRARIES]
    steps += [("NodeRegistry", ["uint256"], [min_stake]), ("TrainingLedger", ["address"], [account.address]),
              ("RewardPool", ["address"], [account.address])]  # the runs' reward pools (issue 77)
    for name, ctor_args, value in steps:
        data = contracts.link(contracts.artifact(name), stand_ins) + encode(ctor_args, value).hex()
        gas = w3.eth.estimate_gas({"from": account.address, "data": data})
        plan.append((name, gas))
    fee = _max_fee(w3, fees)
    spends = [Spend(f"deploy {name} on chain {chain_id}", int(gas * 1.25) + 10_000, fee)
              for name, gas in plan]
    check_funds(w3.eth.get_balance(account.address), account.address, spends)
    agree(spends, args.yes, "deploying")
    from_block = w3.eth.block_number
    libraries: dict[str, str] = {}
    registry, ledger = LedgerClient.deploy(w3, account, min_stake, fees=fees,
                                           receipt_timeout=ledger_cfg.receipt_timeout, libraries=libraries)
    verify_deployment(w3, registry, ledger)
    pool = RewardPoolClient.deploy(w3, account, ledger, fees=fees, receipt_timeout=ledger_cfg.receipt_timeout)
    verify_pool(w3, pool, ledger)
    deployment = {"chain_id": chain_id, "rpc_url": args.rpc, "registry": registry, "ledger": ledger,
                  "reward_pool": pool, "from_block": from_block, "deployer": account.address,
                  "confirmations": max(1, args.confirmations), "libraries": libraries}
    from node.fsutil import atomic_write_bytes

    atomic_write_bytes(out, (json.dumps(deployment, indent=1) + "\n").encode())
    print(f"deployed NodeRegistry {registry}, TrainingLedger {ledger} and RewardPool {pool} on chain "
          f"{chain_id} ({max(1, args.confirmations)} confirmation(s)), with {len(libraries)} linked "
          "libraries; their code matches the committed artifacts")
    print(f"wrote {out}; next: dlx-node create-run RUN.toml --deployment {out}")
    return 0


def _max_fee(w3, fees) -> int:
    """The maxFeePerGas a transaction would offer now (2 x base fee + tip, under the cap)."""
    base = w3.eth.get_block("latest")["baseFeePerGas"]
    tip = fees.priority_fee if fees.priority_fee is not None else w3.eth.max_priority_fee
    fee = 2 * base + tip
    if fees.max_fee_cap:
        if base >= fees.max_fee_cap:
            raise ConfigError(f"the chain's base fee is {base / 1e9:g} gwei, above --max-fee-gwei "
                              f"{fees.max_fee_cap / 1e9:g}: raise the cap or wait (nothing was sent)")
        fee = min(fee, fees.max_fee_cap)
    return fee


# ---------------------------------------------------------------------- create-run
def peer_multiaddr(announce: str, port: int, peer_id: str) -> str:
    """The organizer node's address in the run link: /ip4/ for an IPv4 address, else /dns4/."""
    import ipaddress

    try:
        kind = "ip6" if ipaddress.ip_address(announce).version == 6 else "ip4"
    except ValueError:
        kind = "dns4"
    return f"/{kind}/{announce}/tcp/{port}/p2p/{peer_id}"


def run_create_run(args: argparse.Namespace) -> int:
    """``dlx-node create-run`` (see module docstring)."""
    from ledger.account import load_account
    from ledger.client import LedgerClient
    from ledger.config import LedgerConfig, fee_policy
    from node.commands.link import run_link
    from node.config import config_from_dict, dump_toml, merge_tables
    from node.fsutil import atomic_write_bytes
    from node.runconfig import canonical_json, run_document
    from training.config_training import weaknesses as training_weaknesses

    data_dir = Path(args.data_dir).expanduser().resolve()
    # an imported model is checked (and refused) before anything is sent; its files land in data_dir
    run = read_run_file(args.run_file, getattr(args, "init_from", ""), data_dir)
    params = run_params(run)
    weak = params.weaknesses() + training_weaknesses(run.cfg.training)
    weak += [run.cfg.commitment_scheme.weakness] if run.cfg.commitment_scheme.weakness else []
    if weak and not getattr(args, "weak_run", False):
        raise ConfigError(f"run file {args.run_file}: [run] is below the security model's floor: "
                          + "; ".join(weak)
                          + ". Raise it, or pass --weak-run to accept what this gives up (docs/TRUST.md)")
    for what in weak:
        print(f"warning: weak run (--weak-run): {what}")
    if not 1 <= args.listen_port <= 65535:
        raise ConfigError(f"--listen-port={args.listen_port}: must be in 1..65535 (the run link names it)")
    deployment = read_deployment(args.deployment)
    rpc = args.rpc or deployment["rpc_url"]
    w3 = connect_checked(rpc, deployment["chain_id"])
    chain_id = w3.eth.chain_id
    verify_deployment(w3, deployment["registry"], deployment["ledger"])
    pool = pool_plan(run, params, f"run file {args.run_file}", w3)  # its every rule, before anything is sent
    config_path = data_dir / "node.toml"
    ledger_table = {**ledger_settings(args, rpc, chain_id, w3), "registry_address": deployment["registry"],
                    "ledger_address": deployment["ledger"], "from_block": deployment["from_block"]}
    ledger_cfg = LedgerConfig(**ledger_table)
    client = LedgerClient.from_config(w3, load_account(ledger_cfg, chain_id), ledger_cfg)
    existing = [r for r in client.find_runs(params.config_hash)
                if r.creator.lower() == client.address.lower()]
    if existing:
        _refuse_ended(client, existing[-1], args.run_file, data_dir)
    else:  # the contract does not check that a proof pays its prover: the node does, first
        _print_reward_check(params, w3, args)
    data_dir.mkdir(parents=True, exist_ok=True)
    identity = node_identity(data_dir, getattr(args, "identity", ""))
    _refuse_other_runs_directory(config_path, deployment["ledger"], existing)
    fund = 0 if existing else proof_fund_for(params, w3)  # the prover's reward (issue 79), with createRun
    fee = _max_fee(w3, fee_policy(ledger_cfg))
    pool_client = _pool_client(w3, client, deployment, pool, args.run_file)
    spends = _create_plan(client, params, identity, existing, fee, fund)
    terms = _data_terms(run.cfg, args, spends, fee)  # from the dataset, before anything is sent
    spends[1:1] = pool_spends(pool, pool_client, existing[-1].run_id if existing else None, fee)
    check_funds(client.balance(), client.address, spends)
    agree(spends, args.yes, "creating the run")
    atomic_write_bytes(data_dir / "run.json", canonical_json(run_document(run.cfg)))
    run_id = _create_or_finish(client, params, existing, bool(weak), fund)
    _open_pool(pool, pool_client, run_id)
    _fix_data_terms(client, run_id, terms)
    table = merge_tables(run.table, {
        "data_dir": str(data_dir), "cluster": f"organizer-{identity.peer_id[-8:]}", "cluster_size": 1,
        "p2p": {"listen_host": "127.0.0.1" if args.announce.startswith("127.") else "0.0.0.0",
                "listen_port": args.listen_port, "bootstrap": []},
        "ledger": {**ledger_table, "run_id": run_id}})
    try:
        cfg = config_from_dict(table)
        atomic_write_bytes(config_path,
                           ("# written by 'dlx-node create-run'\n" + dump_toml(cfg.to_dict())).encode())
        _take_seat(config_path, identity, run_id)
    except (*DLX_ERRORS, OSError) as exc:
        raise NodeError(
            f"run {run_id} is on chain but its organizer's node is not ready ({exc}): run the same "
            "command again to finish (it finds the run and creates no second one)") from exc
    _write_link(run_link(chain_id, deployment["ledger"], run_id, rpc,
                         [peer_multiaddr(args.announce, args.listen_port, identity.peer_id)],
                         checkpoint_every=cfg.checkpoint_every), data_dir, config_path)
    return 0


def _create_or_finish(client, params, existing: list, weak: bool, fund: int) -> int:
    """The run's id: the one this account created before from the same configHash (being finished), else a
    new run's (``createRun`` with the proof fund ``fund``)."""
    if existing:
        run_id = existing[-1].run_id
        print(f"run {run_id} with this configHash was created by {client.address} before: finishing it")
        return run_id
    run_id = client.create_run_with(params, f"dlx://blob/{params.config_hash.hex()}", allow_weak_quorum=weak,
                                    proof_fund=fund)
    print(f"created run {run_id} on chain {client.chain_id} (configHash {params.config_hash.hex()[:16]})")
    return run_id


def _write_link(link: str, data_dir: Path, config_path: Path) -> None:
    """Write the run link beside the organizer's node.toml and print both."""
    from node.fsutil import atomic_write_bytes

    atomic_write_bytes(data_dir / "run-link.txt", (link + "\n").encode())
    print(f"wrote {config_path}; the organizer's node serves the run document once started:\n"
          f"  dlx-node start --config {config_path}")
    print(f"run link (dlx-node join, run-info, audit, pull):\n{link}")


def _data_terms(cfg, args, spends: list[Spend], fee: int):
    """The data terms create-run fixes (node/dataterms.py): a run drawn by account's, from its dataset, unless
    ``--no-data-terms`` (said); None for a run drawn by replica index. Its setData joins ``spends``."""
    from node.dataterms import SET_DATA_GAS, own_terms
    from training.errors import TrainingError

    if cfg.training.data_windows != "account":
        return None
    if getattr(args, "no_data_terms", False):
        print("warning: --no-data-terms: the run draws its windows by account but fixes no data terms; its "
              "contributions' batches cannot be disputed (docs/FRAUD_PROOF.md)")
        return None
    try:
        terms = own_terms(cfg)
    except (OSError, ValueError, TrainingError) as exc:
        raise ConfigError(f"the run's data terms: its dataset (training.data_path = "
                          f"{cfg.training.data_path!r}) cannot be read ({exc}); nothing was sent") from exc
    spends.insert(1, Spend(f"fix the run's data terms (StepProver.setData: {terms.tokens:,} training tokens, "
                           f"{terms.rows} rows of block {terms.window})", SET_DATA_GAS, fee))
    return terms


def _fix_data_terms(client, run_id: int, terms) -> None:
    """node.dataterms.fix_data_terms of ``terms`` (None: none to fix); a failure leaves the run on chain,
    finished by the same command again."""
    from node.dataterms import fix_data_terms

    if terms is None:
        return
    try:
        print(fix_data_terms(client, run_id, terms))
    except DLX_ERRORS as exc:
        raise NodeError(f"run {run_id} is on chain but its data terms were not fixed ({exc}): run the same "
                        "command again to finish, before any round is committed") from exc


def _pool_client(w3, client, deployment: dict, plan, run_file: str):
    """The deployment's RewardPool as the organizer, checked, where the run file has a ``[pool]``."""
    if plan is None:
        return None
    from ledger.rewards import RewardPoolClient

    address = deployment_pool(w3, deployment, f"run file {run_file}")
    return RewardPoolClient(w3, client.sender.account, address, fees=client.sender.fees,
                            receipt_timeout=client.sender.receipt_timeout)


def _open_pool(plan, pool_client, run_id: int) -> None:
    """runpool.open_pool; a failure leaves the run on chain, finished by the same command again."""
    try:
        open_pool(plan, pool_client, run_id)
    except DLX_ERRORS as exc:
        raise NodeError(f"run {run_id} is on chain but its reward pool was not opened ({exc}): run the same "
                        "command again to finish (it finds the run and creates no second one)") from exc


def _refuse_ended(client, run, run_file: str, data_dir: Path) -> None:
    """RunOver when the run this account created from ``run_file`` has every round committed: the same
    command would only "finish" a run that is over. A run file makes one run; what makes the next one."""
    if not run.max_rounds or client.commit_count(run.run_id) < run.max_rounds:
        return
    raise RunOver(
        f"run {run.run_id}, which {client.address} created from {run_file}, is over: all its "
        f"{run.max_rounds} rounds are committed (its model: dlx-node pull <run link> OUT). A run file makes "
        "one run; for a new run give the run file another run_name (a new configHash) and create it in a new "
        "node directory with this account's node key: dlx-node create-run RUN2.toml --data-dir NEW_DIR "
        f"--identity {data_dir / 'identity.key'} (nothing was sent)")


def _refuse_other_runs_directory(config_path: Path, ledger: str, existing: list) -> None:
    """A node directory holds one run: its node.toml may only be that of the run being finished."""
    from node.config import load_config

    if not config_path.exists():
        return
    cfg = load_config(config_path)
    finishing = existing and cfg.ledger.ledger_address.lower() == ledger.lower() \
        and cfg.ledger.run_id == existing[-1].run_id
    if not finishing:
        raise ConfigError(
            f"{config_path} exists for another run: pick a new --data-dir (one run per node directory)")


def _print_reward_check(params, w3, args) -> None:
    """node.provergas.check_reward's lines for a new run (ConfigError when its proofs would not pay)."""
    for line in check_reward(params, w3, allow=getattr(args, "allow_unpaid_proofs", False),
                             where=f"run file {args.run_file}"):
        print(line)


def _create_plan(client, params, identity, existing, fee: int, fund: int = 0) -> list[Spend]:
    """The transactions create-run still needs, estimated (a bad parameter is refused by the contract
    here); ``fund``: the proof fund sent with createRun."""
    from ledger.binding import binding_message

    spends = []
    if not existing:
        # An account that cannot pay the fund makes the chain refuse the estimate itself ("insufficient
        # funds", exit 11); estimated without it, check_funds then refuses the plan first, nothing sent (2).
        value = fund if client.balance() >= fund else 0
        gas, fees = client.estimate("ledger", "createRun",
                                    (params.fields(), "dlx://blob/" + params.config_hash.hex()), value)
        spends.append(
            Spend(f"create run ({params.num_stages} stage(s), H={params.inner_steps}, k={params.quorum}, "
                  f"stake {params.min_stake / 1e18:g} ETH, unbonding {params.unbonding_blocks} blocks, "
                  f"{params.max_rounds} rounds, proof fund {fund / 1e18:g} ETH: the fraud prover's reward)",
                  gas, fees["maxFeePerGas"], fund))
    key = client.key_of(client.address)
    if key is not None and key != identity.public_key_bytes:
        raise NotRegistered(f"account {client.address} is registered with another node key: an account has "
                            "one node key; pass --identity OLD_DIR/identity.key (the node directory of its "
                            "earlier run) to create this run's node with it, or use another account")
    if key is None:
        stake = client.min_stake()
        message = binding_message(client.chain_id, client.registry_address, client.address)
        gas, fees = client.estimate("registry", "register",
                                    (identity.public_key_bytes, identity.sign(message)), stake)
        spends.append(Spend(f"register node key {identity.peer_id} to {client.address}", gas,
                            fees["maxFeePerGas"], stake))
    spends.append(Spend(f"join the run as its first member (stake {params.min_stake / 1e18:g} ETH, returned "
                        f"{params.unbonding_blocks} blocks after leaving unless slashed)", JOIN_GAS, fee,
                        params.min_stake))
    return spends


def _take_seat(config_path: Path, identity, run_id: int) -> None:
    """Register the organizer's node key and join the run, as ``dlx-node join`` does (idempotent)."""
    from node.config import load_config
    from node.live.chain.onchain import NodeChain
    from node.platforms import own_platforms
    from node.runconfig import config_hash, run_document

    cfg = load_config(config_path)
    chain = NodeChain.connect(cfg)
    try:
        chain.check_run(run_id, config_hash(run_document(cfg)), cfg.rounds,
                        commitments=cfg.diloco.commitments, cfg=cfg)
        chain.ensure_registered(identity)
        platform, legacy = own_platforms(cfg.training, cfg.compute.processes)
        chain.ensure_member(run_id, platform, also=(legacy,))
    finally:
        chain.close()
