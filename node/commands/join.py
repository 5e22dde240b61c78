"""``dlx-node join``: join a running training run with one command.

From a run link (``dlx://<chain_id>/<ledger>/<run_id>?rpc=<url>&peer=<multiaddr>``, printed by
``dlx-node demo`` and :func:`node.commands.link.run_link`) or the same facts as flags, ``join``:

1. connects to the chain, checks its chain id against the link's and reads the run as created
   (its ``configHash``, stage count, inner steps, stake, rounds) and the ledger's registry;
2. fetches the run document from the run's peers over libp2p: every node serves it as a blob
   under its sha256, which is the on-chain ``configHash`` (docs/P2P.md, "Run documents"), so
   any peer can serve it and none can forge it; it is checked against the hash and against the
   run's on-chain stage count and inner steps;
3. writes ``node.toml`` in the data directory: the run document's settings exactly, the chain
   and the peers from the link, a cluster of its own (one node holding every stage), and the
   run's data and tokenizer as local files checked against the document (:func:`run_inputs`:
   ``--data`` a text file or prepared dataset, ``--tokenizer`` or the dataset's or a peer's
   tokenizer.json);
4. registers the node's key and stakes into the run if needed: the transactions are listed with the
   stake and the gas at the fee offered, refused when the account cannot pay for all of them, and sent
   after asking (``--yes`` agrees beforehand; without a terminal to ask on it refuses rather than spend
   silently). A run whose rounds are all committed is refused at step 1 (node/commands/preflight.py);
5. starts the node, as ``dlx-node start --config <data-dir>/node.toml`` would (``--no-start``
   stops after step 4). Running the same command again reuses what it wrote.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from node.commands.link import RunLink, check_address, check_multiaddr, parse_run_link, relays_of
from node.commands.rundocs import MAX_TOKENIZER_BYTES, PEER_WAIT_S, fetch_blob, fetch_run_document
from node.initfetch import initial_weights
from node.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizers"  # <data_dir>/tokenizers/<sha256>.json, as node/tools/hf_export.py looks for it


# ---------------------------------------------------------------------- the run link of the arguments
def link_from_args(args: argparse.Namespace) -> RunLink:
    """The run link of ``join``'s arguments: LINK, or --rpc/--ledger/--run (flags complete or override it)."""
    if args.link:
        link = parse_run_link(args.link)
    else:
        missing = [flag for flag, value in (("--rpc", args.rpc), ("--ledger", args.ledger),
                                            ("--run", args.run))
                   if value in ("", None)]
        if missing:
            raise ConfigError(f"give a run link (dlx://...) or all of --rpc, --ledger, --run: missing "
                              f"{', '.join(missing)}")
        check_address(args.ledger, "--ledger")
        if args.run < 0:
            raise ConfigError(f"--run {args.run}: must be >= 0")
        link = RunLink(-1, args.ledger, args.run, args.rpc)
    for peer in args.bootstrap:
        check_multiaddr(peer)
    peers = tuple(dict.fromkeys([*link.peers, *args.bootstrap]))
    if not peers:
        raise ConfigError("no peer to fetch the run document from: put peer=<multiaddr> in the link or pass "
                          "--bootstrap <multiaddr> (a node's status.json, listen_addrs)")
    return RunLink(link.chain_id, link.ledger, link.run_id, args.rpc or link.rpc_url, peers, link.settings)


# ---------------------------------------------------------------------- the run document
def run_inputs(document: dict, data: str, tokenizer: str, data_dir: Path,
               peers: tuple[str, ...] = ()) -> tuple[str, str]:
    """The training data path and tokenizer a joiner's node.toml names, each checked against the run document.

    ``training.data_sha256`` of the document: "generated" (no file), a text file's sha256 (``data`` must
    hash to it), or ``manifest:<root>`` (``data``, a prepared dataset with that root, or the peers: shards
    missing locally are fetched from ``peers`` by hash, each checked;
    :func:`node.shardfetch.dataset_for_join`).
    ``model.tokenizer``: "bytes", or ``sha256:<hex>``, whose file is taken from ``tokenizer``, else the
    dataset's ``tokenizer.json``, else fetched from ``peers`` (a node that serves its tokenizer as a blob),
    refused unless it hashes to ``<hex>``, and kept as ``<data_dir>/tokenizers/<hex>.json``. Returns (data
    path or "", tokenizer: "bytes" or the kept file's path).
    """
    from node.runconfig import file_sha256
    from training.errors import TokenizerError
    from training.shards import ROOT_PREFIX, TOKENIZER_NAME
    from training.tokenizer import parse_reference

    data_path = ""
    wanted = document.get("training", {}).get("data_sha256")
    if wanted != "generated":
        if str(wanted).startswith(ROOT_PREFIX):  # missing shards come from the peers, each checked
            from node.shardfetch import dataset_for_join

            path = dataset_for_join(str(wanted)[len(ROOT_PREFIX):], data, data_dir, peers)
        elif not data:
            raise ConfigError(f"the run trains on a text file with {wanted}: pass --data with it (the run's "
                              "operator can give it to you)")
        else:
            path = Path(data).expanduser()
            got = file_sha256(path)
            if got != wanted:
                raise ConfigError(f"--data {data}: sha256 {got}, the run's text has {wanted}")
        data_path = str(path.resolve())
    reference = document.get("model", {}).get("tokenizer", "bytes")
    try:
        digest = parse_reference(reference)
    except TokenizerError as exc:
        raise ConfigError(f"the run document's model.tokenizer: {exc}") from None
    if digest is None:
        return data_path, "bytes"
    candidates = [Path(tokenizer).expanduser()] if tokenizer else []
    if data_path and Path(data_path).is_dir():
        candidates.append(Path(data_path) / TOKENIZER_NAME)
    content = None
    for candidate in candidates:
        if candidate.is_file() and file_sha256(candidate) == digest:
            content = candidate.read_bytes()
            break
        if tokenizer and candidate == candidates[0]:
            raise ConfigError(f"--tokenizer {tokenizer}: not the run's tokenizer (sha256:{digest})")
    if content is None:
        if not peers:
            raise ConfigError(f"the run's tokenizer is sha256:{digest}: pass --tokenizer FILE with it")
        data_dir.mkdir(parents=True, exist_ok=True)
        content = fetch_blob(peers, digest, data_dir, MAX_TOKENIZER_BYTES, "the run's tokenizer")
    kept = data_dir / TOKENIZER_DIR / f"{digest}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(content)
    return data_path, str(kept.resolve())


def check_document_against_run(document: dict, info) -> None:
    """The run document must describe the run the chain created (stage count and inner steps)."""
    try:
        stages = document["pipeline"]["num_stages"]
        inner = document["diloco"]["inner_steps"]
    except (KeyError, TypeError):
        raise ConfigError("the run document lacks pipeline.num_stages or diloco.inner_steps") from None
    if (stages, inner) != (info.num_stages, info.inner_steps):
        raise ConfigError(f"the run document says {stages} stages and H={inner}, the run on chain "
                          f"{info.num_stages} and H={info.inner_steps}")


def infer_checkpoint_every(checkpoint_rounds: list[int]) -> int | None:
    """``checkpoint_every`` from the rounds whose records carry a checkpoint: round t has one when
    ``(t + 1) % K == 0``, so K divides every ``t + 1``; the largest such K (None if nothing is known)."""
    if not checkpoint_rounds:
        return None
    return math.gcd(*(r + 1 for r in checkpoint_rounds))


# ---------------------------------------------------------------------- the command
@dataclass
class _Chain:
    w3: object
    client: object  # LedgerClient with the node's account
    info: object  # RunInfo
    registry: str


def _connect(link: RunLink, data_dir: Path, args: argparse.Namespace):
    """Chain, account and run: everything join reads before it fetches or writes anything."""
    import contracts
    from ledger.account import create_keystore, load_account, read_password_file
    from ledger.chain import connect_rpc
    from ledger.client import LedgerClient
    from ledger.config import LedgerConfig
    from ledger.errors import AccountError, LedgerError

    w3 = connect_rpc(link.rpc_url, wait=10)
    chain_id = w3.eth.chain_id
    if link.chain_id >= 0 and chain_id != link.chain_id:
        raise ConfigError(f"{link.rpc_url} serves chain {chain_id}, the run link names chain {link.chain_id}")
    if not w3.eth.get_code(w3.to_checksum_address(link.ledger)):
        raise ConfigError(f"no contract at ledger {link.ledger} on chain {chain_id}")
    abi = contracts.artifact("TrainingLedger")["abi"]
    registry = w3.eth.contract(address=w3.to_checksum_address(link.ledger),
                               abi=abi).functions.registry().call()
    ledger_cfg = {"backend": "rpc", "rpc_url": link.rpc_url, "registry_address": registry,
                  "ledger_address": w3.to_checksum_address(link.ledger), "run_id": link.run_id,
                  "chain_id": chain_id}
    if args.dev_account is not None:
        ledger_cfg["dev_account"] = args.dev_account
    else:
        keystore = Path(args.keystore).expanduser() if args.keystore else data_dir / "keystore.json"
        if not args.password_file:
            raise ConfigError("pass --password-file FILE (a new encrypted account is created in the data "
                              "directory, or --keystore is unlocked with it) or, on a local dev chain, "
                              "--dev-account N")
        try:
            password = read_password_file(args.password_file)
        except AccountError as exc:  # a usage error, not the account's (exit 2)
            raise ConfigError(f"--password-file: {exc}") from None
        if not keystore.exists():
            if args.keystore:
                raise ConfigError(f"--keystore {keystore}: no such file")
            account = create_keystore(keystore, password)
            print(f"created Ethereum account {account.address} in {keystore}")
        ledger_cfg["keystore"] = str(keystore.resolve())
        ledger_cfg["password_file"] = str(Path(args.password_file).expanduser().resolve())
    account = load_account(LedgerConfig(**ledger_cfg), chain_id)
    client = LedgerClient(w3, account, registry, ledger_cfg["ledger_address"])
    try:
        info = client.run_info(link.run_id)
    except LedgerError as exc:
        raise ConfigError(f"run {link.run_id}: {exc}") from None
    return _Chain(w3, client, info, registry), ledger_cfg


def _node_settings(link: RunLink, chain: _Chain, document: dict, data_dir: Path, identity,
                   args: argparse.Namespace, ledger_cfg: dict) -> tuple[str, str, dict]:
    """The training data's path, the tokenizer's (:func:`run_inputs`) and the node.toml fields besides the
    run document's: this machine's (data directory, cluster, listen address, peers, account) and the run's
    node settings."""
    data_path, tokenizer = run_inputs(document, args.data, getattr(args, "tokenizer", ""), data_dir,
                                      link.peers)
    checkpoint_every = link.settings.get("checkpoint_every")
    if checkpoint_every is None:
        history = chain.client.history(link.run_id, with_registrations=False)
        checkpoint_every = infer_checkpoint_every([c.round for c in history.checkpoints])
    if checkpoint_every is None and not any(o.startswith("checkpoint_every=") for o in args.overrides):
        raise ConfigError(
            "the run has no checkpoint on chain yet, so its checkpoint_every is unknown: use the "
            "run link the run's operator printed (it carries checkpoint_every) or pass "
            "--set checkpoint_every=N")
    loopback = all(p.startswith(("/ip4/127.", "/dns4/localhost")) for p in link.peers)
    listen_host = args.listen_host or ("127.0.0.1" if loopback else "0.0.0.0")
    cluster = args.cluster or f"join-{identity.peer_id[-8:]}"
    return data_path, tokenizer, {
        "data_dir": str(data_dir.resolve()), "cluster": cluster, "cluster_size": 1,
        "rounds": chain.info.max_rounds, "checkpoint_every": checkpoint_every or 1,
        # Peers behind a NAT sit behind the run's relays: reserve there too, to be reachable the same way.
        "p2p": {"listen_host": listen_host, "listen_port": args.listen_port, "bootstrap": list(link.peers),
                "relay_use": relays_of(link.peers)},
        "ledger": ledger_cfg,
    }


def _run_of(config_path: Path, load_config) -> tuple[str, int] | None:
    """(ledger address, run id) a node.toml is for; None if there is none, or it names no ledger (``init``'s
    template, before the run is known)."""
    if not config_path.exists():
        return None
    existing = load_config(config_path)
    if not existing.ledger.ledger_address:
        return None
    return existing.ledger.ledger_address.lower(), existing.ledger.run_id


def _refuse_another_runs(config_path: Path, link: RunLink, force: bool, load_config) -> None:
    """Before anything is fetched: a directory of another run is refused at once (unless ``--force``)."""
    held = None if force else _run_of(config_path, load_config)
    if held is not None and held != (link.ledger.lower(), link.run_id):
        raise ConfigError(f"{config_path} belongs to run {held[1]} of ledger {held[0]}: pick a new "
                          "--data-dir, or pass --force (the other run's state is then set aside)")


def _print_run(chain, info) -> None:
    """What the run is, and the prover-pay warning a member would want before it stakes."""
    from node.commands.preflight import proof_fund_on_chain
    from node.provergas import joining_warning

    print(f"run {info.run_id} on chain {chain.client.chain_id}: ledger {chain.client.ledger_address}, "
          f"registry {chain.registry}, configHash {info.config_hash.hex()[:16]}, {info.num_stages} stage(s), "
          f"H={info.inner_steps}, k={info.quorum}, stake {info.min_stake / 1e18:g} ETH, "
          f"{'open-ended' if not info.max_rounds else f'{info.max_rounds} rounds'}")
    # a member would be the one to prove: say so before it stakes (issue 79: paid from the run's proof fund)
    unpaid = joining_warning(info, chain.w3, proof_fund_on_chain(chain.client, info.run_id))
    if unpaid:
        print(unpaid)


def run_join(args: argparse.Namespace) -> int:
    """``dlx-node join`` (see module docstring)."""
    from node.commands.chainops import agree, check_funds, check_rounds_left, refuse_finished, seat_plan
    from node.config import config_from_dict, dump_toml, load_config, merge_tables, parse_overrides
    from node.fsutil import atomic_write_bytes
    from node.live.chain.onchain import NodeChain
    from node.platforms import own_platforms
    from node.runconfig import canonical_json, config_hash, node_config_from_run, parse_run_document
    from node.runconfig import run_document
    from node.commands.member import node_identity

    link = link_from_args(args)
    data_dir = Path(args.data_dir).expanduser()
    data_dir.mkdir(parents=True, exist_ok=True)
    config_path = data_dir / "node.toml"
    _refuse_another_runs(config_path, link, args.force, load_config)
    identity = node_identity(data_dir, getattr(args, "identity", ""))
    chain, ledger_cfg = _connect(link, data_dir, args)
    info = chain.info
    refuse_finished(chain.client, info)  # before anything is fetched, written or sent
    seat = chain.client.member(info.run_id, chain.client.address)
    if seat is None or not seat.active:  # issue 80: how many rounds are left, before a seat is staked
        check_rounds_left(chain.client, info, args.yes)
    # An account that cannot pay for its seat learns it now, before anything is fetched or written (the
    # estimate with no platform declared: the seat's own is known once node.toml is).
    check_funds(chain.client.balance(), chain.client.address,
                seat_plan(chain.client, info, identity, bytes(32)))
    _print_run(chain, info)
    data = fetch_run_document(link.peers, info.config_hash, data_dir,
                              peer_wait=getattr(args, "peer_wait", PEER_WAIT_S))
    document = parse_run_document(data, info.config_hash)
    check_document_against_run(document, info)
    print(f"run document {info.config_hash.hex()[:16]} fetched from the run's peers and checked against the "
          f"chain: model {document['model'].get('n_layer')} layers x {document['model'].get('n_embd')}, "
          f"{document['diloco'].get('num_replicas')} replicas")
    data_path, tokenizer, settings = _node_settings(link, chain, document, data_dir, identity, args,
                                                    ledger_cfg)
    table = node_config_from_run(document, **settings).to_dict()
    table["training"]["data_path"] = data_path
    table["model"]["tokenizer"] = tokenizer  # a local file hashes to the document's sha256:<hex>
    table["model"]["init_weights"] = initial_weights(document, data_dir, link.peers)  # an imported model's
    table = merge_tables(table, parse_overrides(args.overrides))
    cfg = config_from_dict(table)
    if config_hash(run_document(cfg)) != info.config_hash:
        raise ConfigError("the settings written would not hash to the run's configHash (an override of a run "
                          "setting?): drop --set for [model], [training], [diloco], [compression], pipeline")
    text = "# written by 'dlx-node join'\n# " + str(link) + "\n" + dump_toml(cfg.to_dict())
    if config_path.exists() and config_path.read_text() != text and not args.force \
            and _run_of(config_path, load_config) is not None:  # init's node.toml is for no run: rewritten
        print(f"keeping {config_path} (written before; --force rewrites it)")
    else:
        atomic_write_bytes(config_path, text.encode())
        atomic_write_bytes(data_dir / "run.json", canonical_json(document))
        print(f"wrote {config_path}")
    cfg = load_config(config_path)
    plan = seat_plan(chain.client, info, identity, own_platforms(cfg.training, cfg.compute.processes)[0])
    if plan:  # nothing is sent that the account cannot pay for, nor without a yes
        check_funds(chain.client.balance(), chain.client.address, plan)
        agree(plan, args.yes, "joining")
    node_chain = NodeChain.connect(cfg)
    try:
        node_chain.check_run(info.run_id, config_hash(run_document(cfg)), commitments=cfg.diloco.commitments,
                             cfg=cfg)
        node_chain.ensure_registered(identity)
        platform, legacy = own_platforms(cfg.training, cfg.compute.processes)
        node_chain.ensure_member(info.run_id, platform, also=(legacy,))
    finally:
        node_chain.close()
    print(f"account {chain.client.address} is a member of run {info.run_id} with node {identity.peer_id}")
    if args.no_start:
        print(f"start it with: dlx-node start --config {config_path}")
        return 0
    from node.commands.start import start

    return start(config_path, show_progress=not args.no_progress, yes=True)  # agreed above
