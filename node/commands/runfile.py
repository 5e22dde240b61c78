"""The run file ``dlx-node create-run`` reads (docs/DEPLOY.md): a node.toml's run settings plus a ``[run]``
table of the on-chain parameters, every value checked, and the RunParams it creates the run with.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.commitments.values import max_game_steps  # noqa: F401 (create-run's, re-exported)
from node.errors import CONFIG_ERRORS, ConfigError

#: The ``[run]`` table of a run file: key -> (type, minimum, what it is).
RUN_KEYS: dict[str, tuple[type, float, str]] = {
    "stake_eth": (float, 0, "ETH each member stakes to join"),
    "bond_eth": (float, 0, "ETH an accuser or disputer deposits (default: a tenth of the stake)"),
    "quorum": (int, 1, "k: the fewest counted member signatures a round's record needs (safe: >= 2)"),
    "quorum_bps": (int, 0, "the quorum is also at least this fraction (basis points) of the counted members "
                           "(safe: >= 5000)"),
    "tenure_rounds": (int, 1, "rounds a member that joined after the first commit waits before it counts"),
    "unbonding_blocks": (int, 0, "blocks between leaving and withdrawing (0: the longest proof window)"),
    "accusation_blocks": (int, 8, "blocks an accusation stays open"),
    "dispute_blocks": (int, 8, "blocks after a commit during which it may be disputed (default: "
                               "5 x accusation_blocks, room for a contribution case)"),
    "inactivity_rounds": (int, 1, "committed rounds a member may leave unsigned before it can be ejected"),
}

#: The optional ``[pool]`` table of a run file: the run's reward pool (docs/REWARDS.md), opened by create-run
#: right after createRun. key -> (type, minimum, what it is); node/commands/runpool.py fills the defaults.
POOL_KEYS: dict[str, tuple[type, float, str]] = {
    "per_round_eth": (float, 0, "ETH a final round reserves for its contributors and attesters (required)"),
    "funding_eth": (float, 0, "ETH sent with createPool (default: per_round_eth x rounds)"),
    "token": (str, 0, "the ERC-20 the pool is funded and pays in (default: none, native ETH)"),
    "per_round_tokens": (float, 0, "whole tokens a final round reserves (a token pool; required there)"),
    "funding_tokens": (float, 0, "whole tokens pulled with createPool (default: per_round_tokens x rounds)"),
    "attester_bps": (int, 0, "the attesters' part of a round's amount, basis points (default 1000)"),
    "contribution_slots": (int, 0, "equal slots of a stage's contributor budget (default: the run's cap)"),
    "attester_slots": (int, 0, "equal attester shares (default: replicas x stages)"),
    "claim_blocks": (int, 0, "blocks a round's credits can be claimed after it opens (default: unbonding)"),
}


@dataclass
class RunFile:
    """A run file, checked: the node settings (a node.toml table) and the createRun parameters."""

    table: dict[str, Any]  # node settings; paths made absolute
    chain: dict[str, Any]  # the [run] table with defaults filled in
    cfg: Any  # NodeConfig of ``table``
    pool: dict[str, Any] | None = None  # the [pool] table, its values' types checked (None: no pool)


def read_run_file(path: str, init_from: str = "", init_dir: Path | None = None) -> RunFile:
    """Parse and check a run file; ConfigError naming the bad values (every one of the [run] table at
    once). ``init_from``: a Hugging Face model directory the run starts from (:func:`import_model`, its
    files written under ``init_dir``)."""
    from node.config import ConfigProblems, config_from_dict, settings_wrong

    file = Path(path).expanduser()
    try:
        table = tomllib.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"run file {path}: cannot read it ({exc.strerror})") from None
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ConfigError(f"run file {path}: not valid TOML ({exc})") from None
    chain = table.pop("run", None)
    if not isinstance(chain, dict):
        raise ConfigError(f"run file {path}: needs a [run] table ({', '.join(RUN_KEYS)})")
    for section in ("ledger", "p2p"):
        if section in table:
            raise ConfigError(f"run file {path}: [{section}] is the organizer's machine's, not the run's: "
                              "drop it (create-run writes it from the deployment and its options)")
    problems: list[str] = []  # every bad value at once: [run]'s, [pool]'s and the node settings' (issue 80)
    chain = _check_run_table(chain, path, problems)
    pool = table.pop("pool", None)
    if pool is not None:
        if isinstance(pool, dict) and "per_round_eth" not in pool and "per_round_tokens" not in pool:
            problems.append(f"[pool] needs per_round_eth ({POOL_KEYS['per_round_eth'][2]}) or, with a token, "
                            "per_round_tokens")
        pool = _check_table(pool, path, "pool", POOL_KEYS, {}, problems=problems)
    base = file.resolve().parent
    training, model = table.get("training", {}), table.get("model", {})
    if isinstance(training, dict) and training.get("data_path"):
        training["data_path"] = str((base / Path(training["data_path"]).expanduser()).resolve())
    if isinstance(model, dict) and model.get("tokenizer") not in (None, "bytes"):
        model["tokenizer"] = str((base / Path(model["tokenizer"]).expanduser()).resolve())
    if init_from:
        if problems:  # before the import writes anything
            raise ConfigError(f"run file {path}: {settings_wrong(problems)}")
        data_path = training.get("data_path", "") if isinstance(training, dict) else ""
        table["model"] = import_model(init_from, model if isinstance(model, dict) else {},
                                      init_dir or Path.cwd(), path, data_path)
    try:
        cfg = config_from_dict(table)
    except CONFIG_ERRORS as exc:
        errors = [*problems, *(exc.problems if isinstance(exc, ConfigProblems) else [exc])]
        if len(errors) == 1 and not isinstance(exc, ConfigError):
            raise  # a package's own error, as it was raised
        raise ConfigError(f"run file {path}: {settings_wrong(errors)}") from None
    if problems:
        raise ConfigError(f"run file {path}: {settings_wrong(problems)}")
    if cfg.rounds < 1:
        raise ConfigError(f"run file {path}: rounds={cfg.rounds}: a created run needs rounds >= 1")
    most = cfg.diloco.num_replicas * cfg.pipeline.num_stages
    if chain["quorum"] > most:
        raise ConfigError(
            f"run file {path}: [run] quorum={chain['quorum']} can never be met: the run places at "
            f"most {most} nodes ({cfg.diloco.num_replicas} replicas x {cfg.pipeline.num_stages} stages)")
    from ledger.runparams import proof_window_bound

    steps = max_game_steps(cfg)
    floor = proof_window_bound(chain["dispute_blocks"], chain["accusation_blocks"], steps)
    if chain["unbonding_blocks"] and chain["unbonding_blocks"] < floor:
        raise ConfigError(
            f"run file {path}: [run] unbonding_blocks={chain['unbonding_blocks']}: must be at least the "
            f"longest proof window, dispute_blocks + (2 x {steps} game steps + 2) x accusation_blocks = "
            f"{floor} (or 0 for exactly that)")
    return RunFile(table, chain, cfg, pool)


#: What a run file's [model] may still set beside --init-from (the rest is the source's).
INIT_FROM_KEYS = ("block_size", "dropout")


def import_model(directory: str, model: dict[str, Any], node_dir: Path, path: str,
                 data_path: str = "") -> dict[str, Any]:
    """The [model] table of a run started from the Hugging Face model ``directory`` (training/hf_import.py):
    the source's settings, its initial weights written as ``node_dir/initial/<sha256>.safetensors`` and its
    tokenizer kept as ``node_dir/tokenizers/<sha256>.json`` (the node serves both by those hashes). A
    prepared dataset ``data_path`` must have been prepared with the source's tokenizer (checked first)."""
    import shutil

    from training.hf_import import INIT_DIR, HFImportError, check_prepared_data, import_hf, sha256_file

    other = sorted(set(model) - set(INIT_FROM_KEYS))
    if other:
        raise ConfigError(f"run file {path}: [model] {', '.join(other)}: --init-from takes the model from "
                          f"{directory}; the run file may set only {', '.join(INIT_FROM_KEYS)}")
    try:
        check_prepared_data(data_path, directory)
        imported = import_hf(directory, node_dir / INIT_DIR, block_size=int(model.get("block_size", 0) or 0))
    except HFImportError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"--init-from {directory}: cannot read or write ({exc})") from None
    kept = node_dir / "tokenizers" / f"{sha256_file(imported.tokenizer)}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    if not kept.exists():
        shutil.copyfile(imported.tokenizer, kept)
    return {**imported.fields, **model, "tokenizer": str(kept)}


def _check_run_table(chain: dict, path: str, problems: list[str] | None = None) -> dict:
    from ledger.runparams import (
        DEFAULT_ACCUSATION_BLOCKS,
        DEFAULT_DISPUTE_BLOCKS,
        DEFAULT_INACTIVITY_ROUNDS,
        DEFAULT_TENURE_ROUNDS,
        SAFE_MIN_QUORUM,
        SAFE_MIN_QUORUM_BPS,
        case_dispute_blocks,
    )

    out = {"stake_eth": 0.0, "bond_eth": None, "quorum": SAFE_MIN_QUORUM, "quorum_bps": SAFE_MIN_QUORUM_BPS,
           "unbonding_blocks": 0, "accusation_blocks": DEFAULT_ACCUSATION_BLOCKS,
           "dispute_blocks": DEFAULT_DISPUTE_BLOCKS, "inactivity_rounds": DEFAULT_INACTIVITY_ROUNDS,
           "tenure_rounds": DEFAULT_TENURE_ROUNDS}
    out = _check_table(chain, path, "run", RUN_KEYS, out, maxima={"quorum_bps": 10_000}, problems=problems)
    if "dispute_blocks" not in chain:  # room for a contribution case (issue 78) after each commit
        out["dispute_blocks"] = case_dispute_blocks(out["accusation_blocks"])
    return out


def _check_table(table, path: str, name: str, keys: dict, out: dict, required: tuple = (),
                 maxima: dict | None = None, problems: list[str] | None = None) -> dict:
    """``out`` updated with ``table``'s good values, each checked against ``keys`` (and ``maxima``); every
    bad, unknown or missing one at once: added to ``problems``, or (None) a ConfigError naming them."""
    if not isinstance(table, dict):
        raise ConfigError(f"run file {path}: [{name}] must be a table ({', '.join(keys)})")
    found = problems if problems is not None else []  # every bad value at once, not one per attempt
    unknown = sorted(set(table) - set(keys))
    if unknown:
        found.append(f"unknown [{name}] key(s) {unknown}; known: {', '.join(keys)}")
    found += [f"[{name}] needs {key} ({keys[key][2]})" for key in required if key not in table]
    out = dict(out)
    for key, value in table.items():
        if key not in keys:
            continue
        kind, minimum, what = keys[key]
        if kind is str:
            if not isinstance(value, str):
                found.append(f"[{name}] {key}={value!r}: must be a string ({what})")
            else:
                out[key] = value
            continue
        good = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
        if isinstance(value, bool) or not good or value < minimum:
            found.append(f"[{name}] {key}={value!r}: must be "
                         f"{'a number' if kind is float else 'an integer'} >= {minimum:g} ({what})")
            continue
        if value > (maxima or {}).get(key, value):
            found.append(f"[{name}] {key}={value!r}: must be <= {maxima[key]}")
            continue
        out[key] = value
    if found and problems is None:
        raise ConfigError(f"run file {path}: " + "; ".join(found))
    return out


def run_params(run: RunFile):
    """The RunParams of a checked run file."""
    from ledger.runparams import RunParams
    from node.commitments.values import run_values
    from node.runconfig import config_hash, run_document

    chain = run.chain
    stake = round(chain["stake_eth"] * 10**18)
    return RunParams(config_hash(run_document(run.cfg)), run.cfg.pipeline.num_stages,
                     run.cfg.diloco.inner_steps, min_stake=stake, quorum=chain["quorum"],
                     quorum_bps=chain["quorum_bps"], bond=None if chain["bond_eth"] is None
                     else round(chain["bond_eth"] * 10**18),
                     unbonding_blocks=chain["unbonding_blocks"] or None,
                     accusation_blocks=chain["accusation_blocks"], dispute_blocks=chain["dispute_blocks"],
                     inactivity_rounds=chain["inactivity_rounds"], max_rounds=run.cfg.rounds,
                     tenure_rounds=chain["tenure_rounds"], commitments=run.cfg.commitment_scheme.version,
                     max_game_steps=max_game_steps(run.cfg), **run_values(run.cfg))
