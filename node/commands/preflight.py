"""What ``dlx-node start`` settles before a node starts: whose data directory this is, whether the run can
still be trained, and what taking a seat would send.

A node directory keeps one run's state at a time (:data:`RUN_STATE`: what it signed, its archive,
checkpoints, state file, evidence, ...), and :data:`SCOPE_FILE` names that run: its chain (id and
genesis block hash, so a fresh dev chain at the same addresses is another chain), its ledger and its run id.
Starting the node of another run in the same directory first sets the earlier run's state aside, whole,
under ``earlier-runs/`` (nothing is deleted): the new run starts from nothing, and no slot the node
signed for round t of the first run keeps it from signing round t of the second (issue 65). A directory
of a node from before the scope file is taken as this run's unless its state says otherwise (another run
id in ``state.json``, another run document in its archive).

A run whose last round is committed is not started at all (nothing it trains could ever commit). A node
without a seat (not registered, or not a member) lists the transactions that would give it one, with the
stake and the gas at the fee offered, refuses if the account cannot pay for them, and asks before it
sends them (``--yes`` agrees beforehand; no terminal to ask on: refused), as ``join`` does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from node.errors import ConfigError

logger = logging.getLogger(__name__)

#: The run the state of a node directory belongs to (see module docstring).
SCOPE_FILE = "run-scope.json"
#: Where the state of the runs a directory held before lies, one folder each.
EARLIER_RUNS = "earlier-runs"
#: A node directory's files and folders that belong to one run. Kept across runs: the identity and
#: keystore, node.toml, content-addressed blobs, datasets and tokenizers.
RUN_STATE = ("said", "archive", "checkpoints", "incoming", "evidence", "spotchecks", "chunk-states", "proofs",
             "state.json", "timing.jsonl", "status.json")


# ---------------------------------------------------------------------- the data directory's run
def run_scope(chain_id: int, genesis: str, ledger: str, run_id: int) -> dict:
    """The identity of a run, as :data:`SCOPE_FILE` holds it (``genesis``: the chain's block 0 hash, "" if
    unknown)."""
    return {"chain_id": int(chain_id), "genesis": genesis.lower(), "ledger": ledger.lower(),
            "run_id": int(run_id)}


def _legacy_scope_differs(data_dir: Path, run_id: int, config_hash: bytes) -> str:
    """Why a directory's state from before :data:`SCOPE_FILE` is another run's ("" if nothing says so)."""
    state = data_dir / "state.json"
    try:
        held = json.loads(state.read_text()).get("run_id") if state.exists() else run_id
    except (OSError, ValueError, AttributeError, RecursionError):
        held = run_id  # a corrupt state file is the node's to report (exit 4), not a reason to move it
    if held != run_id:
        return f"its state.json is run {held}'s"
    document = data_dir / "archive" / f"run-{run_id}" / "run.json"
    if document.exists() and hashlib.sha256(document.read_bytes()).digest() != config_hash:
        return f"its archive holds another run {run_id} (another run document)"
    return ""


def claim_data_dir(data_dir: Path, scope: dict, config_hash: bytes) -> Path | None:
    """Make ``data_dir`` the directory of the run ``scope``: another run's state is moved, whole, under
    ``earlier-runs/`` first. Returns where it went (None: nothing moved)."""
    data_dir = Path(data_dir)
    path = data_dir / SCOPE_FILE
    present = [name for name in RUN_STATE if (data_dir / name).exists()]
    reason = ""
    if path.exists():
        try:
            held = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            held = None
        if not isinstance(held, dict):
            reason = f"{SCOPE_FILE} is unreadable"
        elif scope["genesis"] and held.get("genesis") and held["genesis"] != scope["genesis"]:
            reason = f"it was chain {held.get('chain_id')} with genesis {str(held['genesis'])[:12]}..."
        elif any(held.get(key) != scope[key] for key in ("chain_id", "ledger", "run_id")):
            reason = (f"it was run {held.get('run_id')} of ledger {held.get('ledger')} on chain "
                      f"{held.get('chain_id')}")
    elif present:
        reason = _legacy_scope_differs(data_dir, scope["run_id"], config_hash)
    moved = None
    if reason and present:
        moved = data_dir / EARLIER_RUNS / time.strftime("%Y%m%d-%H%M%S")
        suffix = 1
        while moved.exists():
            moved, suffix = moved.with_name(f"{moved.name.split('.')[0]}.{suffix}"), suffix + 1
        moved.mkdir(parents=True)
        for name in [*present, SCOPE_FILE]:
            if (data_dir / name).exists():
                (data_dir / name).rename(moved / name)
        logger.warning("%s held another run's state (%s): moved to %s; this run starts from nothing there",
                       data_dir, reason, moved)
        print(f"{data_dir} held another run's state ({reason}): moved it to {moved}", flush=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(scope, indent=1) + "\n")
    return moved


# ---------------------------------------------------------------------- the settings
#: What ``start`` tells a node.toml whose settings are not the run's.
JOIN_HINT = ("or take every setting of the run from its link: dlx-node join LINK --data-dir DIR --force (the "
             "run link its organizer printed)")


def missing_settings(cfg) -> list[str]:
    """The chain settings a node.toml still lacks (``init``'s template leaves them to fill), every one."""
    lc, missing = cfg.ledger, []
    for name in ("registry_address", "ledger_address"):
        if not getattr(lc, name):
            missing.append(f"ledger.{name}")
    if lc.run_id == 0:  # run ids start at 1
        missing.append("ledger.run_id")
    return missing


def _flat(table, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differing_fields(own: dict, run: dict) -> list[str]:
    """The run-document fields in which ``own`` (this node's settings) differs from ``run``, with both
    values."""
    mine, theirs = _flat(own), _flat(run)
    return [f"{key} = {mine.get(key, '(unset)')!r}, the run's {theirs.get(key, '(unset)')!r}"
            for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]


def run_document_of(cfg, config_hash: bytes) -> dict | None:
    """The run's document, to name the fields that differ: the data directory's run.json if it is the run's,
    else from the bootstrap peers (None if neither has it)."""
    from node.runconfig import parse_run_document

    local = Path(cfg.data_dir).expanduser() / "run.json"
    if local.is_file() and hashlib.sha256(local.read_bytes()).digest() == config_hash:
        return parse_run_document(local.read_bytes(), config_hash)
    if not cfg.p2p.bootstrap:
        return None
    from node.commands.rundocs import fetch_run_document
    from node.errors import NodeError
    from p2p.errors import P2PError

    try:
        data = fetch_run_document(tuple(cfg.p2p.bootstrap), config_hash, Path(cfg.data_dir).expanduser(),
                                  timeout=20.0)
        return parse_run_document(data, config_hash)
    except (NodeError, P2PError, OSError) as exc:
        logger.info("the run document was not fetched from the bootstrap peers (%s)", exc)
        return None


def settings_problems(cfg, chain, info, digest: bytes) -> list[str]:
    """Every way this node's settings are not the run's (rounds, configHash with the fields named, an empty
    bootstrap list for a node about to take a seat in a run with members), all at once."""
    from node.runconfig import run_document

    problems = []
    if cfg.rounds != info.max_rounds:
        problems.append(f"rounds={cfg.rounds}, but run {info.run_id} on chain has "
                        f"maxRounds={info.max_rounds} (set rounds = {info.max_rounds})")
    if digest != info.config_hash:
        document = run_document_of(cfg, info.config_hash)
        fields = differing_fields(run_document(cfg), document) if document is not None else []
        problems.append(
            f"the settings hash to configHash {digest.hex()[:16]}, run {info.run_id}'s is "
            f"{info.config_hash.hex()[:16]}: use exactly the run's [model], [training], [diloco], "
            "[compression] and pipeline.num_stages settings and the same training text ("
            + ("; ".join(fields) if fields else "no bootstrap peer served the run's document to name the "
               "fields that differ") + ")")
    client = chain.client
    if not cfg.p2p.bootstrap:
        # A member already seated may have none (the organizer's node: the others dial it); one about to
        # stake would find nobody to train with ("no providers" after the stake).
        own = client.member(info.run_id, client.address)
        others = client.member_count(info.run_id)
        if (own is None or not own.active) and others > 0:
            problems.append(f"p2p.bootstrap is empty: this node would find none of the run's {others} "
                            "member(s); set it to a member's multiaddr (the run link's peer=)")
    return problems


def preflight(cfg, yes: bool, chain_wait: float | None = None) -> None:
    """Before ``start`` builds its node (see module docstring): the data directory claimed for the run, the
    run not over, the seat's transactions agreed and affordable, and sent. ``chain_wait``: ``--chain-wait``'s
    seconds (node/commands/chainwait.py)."""
    from node.commands.chainwait import chain_wait_for, wait_for_chain
    from node.commands.chainops import agree, check_funds, check_rounds_left, refuse_finished, seat_plan
    from node.live.chain.onchain import NodeChain
    from node.live.state.status import StateFile
    from node.platforms import own_platforms
    from node.provergas import joining_warning
    from node.runconfig import config_hash, run_document
    from p2p.identity import Identity

    data_dir = Path(cfg.data_dir).expanduser()
    digest = config_hash(run_document(cfg))
    lc = cfg.ledger
    missing = missing_settings(cfg)
    if missing:
        raise ConfigError(f"{', '.join(missing)} not set in the node.toml: the run's deployment and id (its "
                          f"link dlx://<chain>/<ledger>/<run>, deployment.json), {JOIN_HINT}")
    if lc.backend != "rpc":  # a managed anvil: the node's own local chain, started with the node
        claim_data_dir(data_dir, run_scope(lc.chain_id, "", lc.ledger_address, lc.run_id), digest)
        return
    wait_for_chain(lc.rpc_url, *chain_wait_for(lc, data_dir, chain_wait), lc.request_timeout)
    chain = NodeChain.connect(cfg)
    try:
        w3, client = chain.client.w3, chain.client
        genesis = w3.eth.get_block(0)["hash"]
        genesis = genesis.hex() if isinstance(genesis, bytes) else str(genesis)
        info = client.run_info(lc.run_id)
        problems = settings_problems(cfg, chain, info, digest)
        if problems:
            raise ConfigError(f"this node's settings are not run {lc.run_id}'s: " + " | ".join(problems)
                              + f"; {JOIN_HINT}")
        chain.check_run(lc.run_id, digest, rounds=cfg.rounds, commitments=cfg.diloco.commitments)
        refuse_finished(client, info)
        claim_data_dir(data_dir, run_scope(client.chain_id, genesis, lc.ledger_address, lc.run_id), digest)
        StateFile(data_dir / "state.json", lc.run_id)  # a corrupt one: exit 4, before anything is sent
        identity = Identity.load_or_create(cfg.path(cfg.p2p.key_file))
        platform, legacy = own_platforms(cfg.training, cfg.compute.processes)
        plan = seat_plan(client, info, identity, platform)
        if not plan:
            return
        check_rounds_left(client, info, yes)  # issue 80: how many rounds are left, before staking
        # about to stake in a run whose proofs may not pay their prover (issue 79: paid from its proof fund)
        unpaid = joining_warning(info, w3, proof_fund_on_chain(client, info.run_id))
        if unpaid:
            print(unpaid, flush=True)
        check_funds(client.balance(), client.address, plan)
        agree(plan, yes, "taking a seat in the run")
        chain.ensure_registered(identity)
        chain.ensure_member(lc.run_id, platform, also=(legacy,))
    finally:
        chain.close()


def proof_fund_on_chain(client, run_id: int) -> int | None:
    """Run ``run_id``'s proof fund on chain (issue 79), or None where it cannot be read (then the reward
    check assumes the fund create-run deposits)."""
    from web3.exceptions import Web3Exception

    from ledger.errors import LedgerError

    try:
        return client.proof_fund_of(run_id)
    except (LedgerError, Web3Exception, OSError, ValueError, AttributeError):
        return None
