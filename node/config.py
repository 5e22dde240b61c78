"""``NodeConfig``: every component's configuration, read from one TOML file.

The TOML file has one table per component (``[model]``, ``[training]``,
``[diloco]``, ``[compression]``, ``[pipeline]``, ``[p2p]``, ``[ledger]``,
``[storage]``, ``[compute]``) plus
node-level keys at the top. CLI flags override single values with dotted keys
(``--set diloco.inner_steps=50``). Validation happens at load time; every error
names the field and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from ledger.config import LedgerConfig
from node.commitments import CommitmentScheme, scheme_of
from node.config_compute import ComputeConfig, check_compute
from node.errors import CONFIG_ERRORS, ConfigError
from p2p.config import P2PConfig
from training.config import (
    DilocoConfig,
    ModelConfig,
    PipelineConfig,
    TrainingConfig,
)
from training.config_compression import CompressionConfig

#: The least ``max_rounds_ahead``: with the one-step delay
#: a node begins round t having finished only round t-2.
MIN_ROUNDS_AHEAD = 2


def claim_window(checkpoint_every: int) -> int:
    """Rounds past the last committed one in which a peer's round claim is believed: the delay, the commit
    lag, a catch-up (the same as :meth:`node.live.round.entry.RunEntry.round_window`)."""
    return 8 + 2 * checkpoint_every


@dataclass
class StorageConfig:
    """How much of its past a node keeps on disk (``[storage]``); see node/store/retention.py.

    ``retention = "windows"`` (the default) keeps what the chain's open windows still need and the newest
    final checkpoint, so a node's disk stays flat however many rounds run; ``"all"`` keeps every round
    (what an audit of the whole run from one node's files needs; it grows by a few stage states a round).
    Whatever the settings, a node never deletes what a restart or a peer still needs: sealed rounds not
    yet committed on chain (a restart re-applies them from the archive) and the checkpoint a joiner
    downloads.
    """

    retention: str = "windows"  # "windows": what open windows need; "all": every round, for ever
    # With "windows": keep at least the newest N besides what the windows need (0: none more).
    keep_rounds: int = 0  # sealed archive rounds (signed contributions, served start states)
    keep_checkpoints: int = 0  # checkpoint rounds (full checkpoint and stage shards)
    # "whole": keep each kept checkpoint round's whole file (every stage: S times a stage of an S-stage run);
    # "stages": in a chunked run keep its header and this node's own stage shards only, the rest served by
    # the other stages' holders and assembled by whoever needs the file (node/store/checkpoint_split.py);
    # "auto" (the default): "stages" where the whole file is 512 MiB or more, else "whole"
    checkpoints: str = "auto"
    # This node's own start states (what a spot check of its contribution reruns from, about 10x the stage's
    # fp32 weights each): "rebuild" (the default) keeps one every ``start_state_every`` rounds (and the first
    # after a start or a gap) and rebuilds any other a peer asks for by replaying its own rounds from the
    # newest kept one before it, bit for bit (node/live/checks/staterebuild.py); "keep" keeps every one the
    # windows need (the setting before issue 75's rebuild)
    start_states: str = "rebuild"
    start_state_every: int = 8  # with "rebuild": the rounds between two kept start states (1 = every one)
    # Where each held stage's outer state (global weights, outer momentum, round-start and pending round-end
    # snapshots, error-feedback residual: 12 to 16 bytes per parameter) waits between the outer steps that
    # read it: "disk" (the default) in files without a name under <data_dir>/outer-state, read a tensor at a
    # time (training/stage_engine_outer.py; nothing a restart reads: it restarts from its checkpoint as
    # before); "ram" in memory. The same bits either way. A cluster node's sharded outer state stays in RAM.
    outer_state: str = "disk"

    def __post_init__(self) -> None:
        if self.start_states not in START_STATE_KEEPING:
            raise ConfigError(f"storage.start_states={self.start_states!r}: must be one of "
                              f"{', '.join(START_STATE_KEEPING)} (\"rebuild\": keep one every "
                              "start_state_every rounds, rebuild the others when asked; \"keep\": every one)")
        if self.outer_state not in OUTER_STATE_PLACES:
            raise ConfigError(f"storage.outer_state={self.outer_state!r}: must be one of "
                              f"{', '.join(OUTER_STATE_PLACES)} (\"disk\": files under "
                              "<data_dir>/outer-state; \"ram\": in memory)")
        if self.start_state_every < 1:
            raise ConfigError(f"storage.start_state_every={self.start_state_every}: must be >= 1 (1 keeps "
                              "every start state)")
        if self.retention not in RETENTIONS:
            raise ConfigError(f"storage.retention={self.retention!r}: must be one of {', '.join(RETENTIONS)} "
                              "(\"windows\": what the chain's open windows need; \"all\": every round)")
        if self.keep_rounds < 0:
            raise ConfigError(f"storage.keep_rounds={self.keep_rounds}: must be >= 0 (0 = no more than the "
                              "windows need)")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"storage.keep_checkpoints={self.keep_checkpoints}: must be >= 0 (0 = no more "
                              "than the windows need)")
        if self.checkpoints not in CHECKPOINT_KEEPING:
            raise ConfigError(f"storage.checkpoints={self.checkpoints!r}: must be one of "
                              f"{', '.join(CHECKPOINT_KEEPING)} (\"whole\": every stage of each kept "
                              "checkpoint; \"stages\": a chunked run's header and this node's own stages; "
                              "\"auto\": \"stages\" from a 512 MiB checkpoint on)")


#: ``storage.outer_state``'s values (training/stage_engine_outer.py).
OUTER_STATE_PLACES = ("disk", "ram")
#: Where ``storage.outer_state = "disk"`` keeps the outer state's files (under ``data_dir``).
OUTER_STATE_DIR = "outer-state"
#: ``storage.retention``'s values (node/store/retention.py).
RETENTIONS = ("windows", "all")
#: ``storage.checkpoints``'s values (node/store/checkpoint_split.py).
CHECKPOINT_KEEPING = ("auto", "whole", "stages")
#: ``storage.start_states``' values (node/live/checks/staterebuild.py).
START_STATE_KEEPING = ("rebuild", "keep")


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "training": TrainingConfig,
    "diloco": DilocoConfig,
    "compression": CompressionConfig,
    "pipeline": PipelineConfig,
    "p2p": P2PConfig,
    "ledger": LedgerConfig,
    "storage": StorageConfig,
    "compute": ComputeConfig,
}


@dataclass
class NodeConfig:
    """Everything one node needs. Sub-configs are validated on construction."""

    data_dir: str = "."  # identity, keystore, archive, checkpoints and state live here
    run_name: str = "dlx-demo"
    cluster: str = "cluster-0"  # nodes on one fast link that together hold one pipeline replica
    cluster_size: int = 1  # members of the cluster; 1 = this node holds every stage
    cluster_master: str = "127.0.0.1:29500"  # torch.distributed rendezvous (host:port) of the cluster
    rounds: int = 0  # outer rounds to train; 0 = until stopped
    checkpoint_every: int = 1  # K: publish a checkpoint every K rounds
    round_timeout: float = 120.0  # deadline for a round's contributions
    join_timeout: float = 60.0  # how long to wait for the run's other replicas before starting
    quorum: int = 1  # minimum replicas per stage to close a round at the deadline
    retention_rounds: int = 0  # older name of storage.keep_rounds (still read: it applies when that is 0)
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    torch_threads: int = 0  # intra-op threads for training; 0 = torch's default (all cores)
    # Re-execution spot checks (docs/DILOCOX.md section 11): expected number of other members that
    # re-execute each contribution; a node checks each other replica with probability
    # spot_checks / (members - 1). 0 = this node checks nobody (it still serves its start states).
    spot_checks: float = 0.06
    # At a normal end of run (the round limit reached), this node's queued spot checks run for up to this many
    # seconds more while it still serves its peers; 0 = none. A stop (SIGINT/SIGTERM) never waits for them.
    # What is left undone is logged and shown in status.json (spot_checks_left_undone).
    spot_check_drain_s: float = 60.0
    # A spot check's rerun (a child process of about 2.7 times the claimant's start state) starts only when
    # the host can hold it beside the reruns other nodes of this user on the host have started
    # (node/live/checks/admission.py); it waits up to this many seconds, then is left undone (nobody is
    # accused). 0 = start at once, whatever the host holds (several large reruns may exhaust its memory).
    spot_check_memory_wait_s: float = 600.0
    # A node does not begin training round t while t - (the last committed round) > max_rounds_ahead: it waits
    # ("waiting for commits" in status.json) until the chain catches up. Peers hear a member's round claims
    # only within 8 + 2 * checkpoint_every rounds of the last commit
    # (node.live.round.entry.RunEntry.round_window), so the bound stays below that window; it is at least 2,
    # because with the one-step delay a node starts round t having finished round t-2 only (the commits it
    # waits for never need its own later rounds).
    max_rounds_ahead: int = 8
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    p2p: P2PConfig = field(default_factory=P2PConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self) -> None:
        if not self.cluster or not self.cluster.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"cluster={self.cluster!r}: use letters, digits, '-' or '_'")
        if self.cluster_size not in (1, self.pipeline.num_stages):
            raise ConfigError(
                f"cluster_size={self.cluster_size}: must be 1 (one node holds every stage) or "
                f"pipeline.num_stages={self.pipeline.num_stages} (one node per stage)"
            )
        if self.cluster_size > 1 and self.training.compile:
            raise ConfigError(
                f"training.compile = true with cluster_size={self.cluster_size}: a replica split over "
                "nodes trains eagerly (training.pipeline_stage.PipelineStageTrainer); set training.compile "
                "= false or cluster_size = 1")
        host, _, port = self.cluster_master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"cluster_master={self.cluster_master!r}: must be HOST:PORT, e.g. 127.0.0.1:29500")
        if self.pipeline.num_stages > self.model.n_layer + 0:
            raise ConfigError(
                f"pipeline.num_stages={self.pipeline.num_stages} exceeds model.n_layer="
                f"{self.model.n_layer}: use at most one stage per transformer block"
            )
        if self.rounds < 0:
            raise ConfigError(f"rounds={self.rounds}: must be >= 0 (0 = until stopped)")
        if self.checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every={self.checkpoint_every}: must be >= 1")
        if self.join_timeout <= 0:
            raise ConfigError(f"join_timeout={self.join_timeout}: must be > 0 seconds")
        if self.round_timeout <= 0:
            raise ConfigError(f"round_timeout={self.round_timeout}: must be > 0 seconds")
        if not 1 <= self.quorum <= self.diloco.num_replicas:
            raise ConfigError(
                f"quorum={self.quorum}: must be in [1, diloco.num_replicas={self.diloco.num_replicas}]"
            )
        # a name the registry knows, on an outer loop it can commit
        self.commitment_scheme.check_config(self.diloco)
        if self.diloco.checkpoint_hash == "header" and not self.commitment_scheme.chunked:
            raise ConfigError(
                f"diloco.checkpoint_hash = \"header\" needs a chunked commitment scheme (diloco.commitments="
                f"{self.diloco.commitments!r} is not): a hashed run's outer momentum is in no record, so "
                "only the whole file's sha256 vouches for it; set diloco.checkpoint_hash = \"file\" or "
                "\"auto\"")
        if self.retention_rounds < 0:
            raise ConfigError(f"retention_rounds={self.retention_rounds}: must be >= 0 (0 = keep all)")
        if self.retention_rounds and not self.storage.keep_rounds:
            self.storage = dataclasses.replace(self.storage, keep_rounds=self.retention_rounds)
        tokenizer = self.model.tokenizer
        is_file = tokenizer != "bytes" and not tokenizer.startswith("sha256:")
        if is_file and not Path(tokenizer).expanduser().is_absolute():
            # a tokenizer file is found where training.data_path is: relative to data_dir
            self.model = dataclasses.replace(self.model, tokenizer=str(self.path(tokenizer)))
        weights = self.model.init_weights
        if weights and not weights.startswith("sha256:") and not Path(weights).expanduser().is_absolute():
            # an imported model's initial weights (training/hf_import.py): relative to data_dir too
            self.model = dataclasses.replace(self.model, init_weights=str(self.path(weights)))
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads={self.torch_threads}: must be >= 0 (0 = torch's default)")
        if not 0.0 <= self.spot_checks <= 1024.0:
            raise ConfigError(
                f"spot_checks={self.spot_checks}: must be in [0, 1024] (expected checks per contribution)")
        if not 0.0 <= self.spot_check_memory_wait_s <= 86400.0:
            raise ConfigError(f"spot_check_memory_wait_s={self.spot_check_memory_wait_s}: must be in "
                              "[0, 86400] seconds (0 = start a rerun at once, whatever the host holds)")
        if not 0.0 <= self.spot_check_drain_s <= 86400.0:
            raise ConfigError(f"spot_check_drain_s={self.spot_check_drain_s}: must be in [0, 86400] seconds "
                              "(0 = stop at the end of the run without finishing queued spot checks)")
        window = claim_window(self.checkpoint_every)
        if not MIN_ROUNDS_AHEAD <= self.max_rounds_ahead < window:
            raise ConfigError(
                f"max_rounds_ahead={self.max_rounds_ahead}: must be in [{MIN_ROUNDS_AHEAD}, {window - 1}]"
                f" (below 8 + 2 * checkpoint_every = {window}, the rounds past the last commit in "
                f"which peers hear a member's round; at least {MIN_ROUNDS_AHEAD}, which the "
                "one-step delay needs to commit)")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port={self.metrics_port}: must be in [0, 65535]")
        check_compute(self)  # [compute] processes > 1: a whole replica, float32 on the CPU

    @property
    def commitment_scheme(self) -> CommitmentScheme:
        """The run's commitment scheme (``diloco.commitments``: node/commitments/)."""
        return scheme_of(self.diloco)

    def path(self, relative: str) -> Path:
        """Resolve a configured path against ``data_dir``."""
        p = Path(relative).expanduser()
        return p if p.is_absolute() else Path(self.data_dir).expanduser() / p

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _show(value: Any) -> str:
    """A short repr for error messages."""
    try:
        return repr(value)[:80]
    except ValueError:  # an int of more than 4300 digits has no repr
        return f"<a {type(value).__name__} too large to print>"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check a TOML/CLI value against a dataclass field's type."""
    text = str(annotation)
    if text in ("bool", "<class 'bool'>"):
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}={_show(value)}: must be true or false")
        return value
    if text in ("int", "<class 'int'>"):
        if isinstance(value, str):
            try:
                value = int(value, 0)
            except ValueError:
                raise ConfigError(f"{where}={_show(value)}: must be an integer") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}={_show(value)}: must be an integer")
        if not -(2**63) <= value < 2**63:  # TOML integers are 64-bit; tomllib reads any size
            raise ConfigError(f"{where}={_show(value)}: out of the 64-bit integer range")
        return value
    if text in ("float", "<class 'float'>"):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"{where}={_show(value)}: must be a number")
        try:
            number = float(value)
        except (ValueError, OverflowError):  # OverflowError: an integer beyond float range
            raise ConfigError(f"{where}={_show(value)}: must be a finite number") from None
        if not math.isfinite(number):  # nan passes every "> 0" check the components make
            raise ConfigError(f"{where}={_show(value)}: must be a finite number")
        return number
    if text in ("str", "<class 'str'>"):
        if not isinstance(value, str):
            raise ConfigError(f"{where}={_show(value)}: must be a string")
        return value
    if text.startswith("list"):
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
            if "int" in text:
                try:
                    value = [int(v) for v in value]
                except ValueError:
                    raise ConfigError(f"{where}={_show(value)}: must be a list of integers") from None
        if not isinstance(value, list):
            raise ConfigError(f"{where}={_show(value)}: must be a list")
        item = "int" if "int" in text else "str" if "str" in text else None
        if item == "int" and any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise ConfigError(f"{where}={_show(value)}: must be a list of integers")
        if item == "str" and any(not isinstance(v, str) for v in value):
            raise ConfigError(f"{where}={_show(value)}: must be a list of strings")
        return value
    return value


class ConfigProblems(ConfigError):
    """Several settings are wrong at once: ``problems`` holds each one's error (the message joins them)."""

    def __init__(self, problems: list[Exception]) -> None:
        self.problems = list(problems)
        super().__init__(settings_wrong(self.problems))


def settings_wrong(problems: list) -> str:
    """One message for several bad settings (errors or messages): each one's, after how many there are."""
    if len(problems) == 1:
        return str(problems[0])
    return f"{len(problems)} settings are wrong: " + "; ".join(map(str, problems))


def _named_key(message: str, prefix: str, keys: list[str]) -> str | None:
    """The key of ``keys`` a validation message is about ("training.batch_size=-3: ..." names batch_size)."""
    for key in sorted(keys, key=len, reverse=True):
        if message.startswith(tuple(f"{prefix}{key}{end}" for end in ("=", ":", " "))):
            return key
    return None


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    """``cls`` built from ``table``; its one error as it was raised, or a ConfigProblems that names every bad
    setting at once (issue 80)."""
    built, problems = _build_all(cls, table, prefix)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigProblems(problems)
    return built


def _build_all(cls: type, table: dict[str, Any], prefix: str) -> tuple[Any, list[Exception]]:
    """``cls`` built from ``table`` without its bad settings (None if that cannot be done), and every bad
    setting's error: each value of the wrong type, and each value a section's checks refuse (the setting a
    refusal names is set back to its default and the checks run again, so one bad value does not hide the
    next). A section built without its bad settings still takes part in the checks across sections."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    problems: list[Exception] = []
    broken = False  # a section that could not be built: the checks across sections would judge its default
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in names:
            problems.append(ConfigError(f"{where}: unknown setting; known ones are {sorted(names)}"))
        elif key in _SECTIONS and cls is NodeConfig:
            if not isinstance(value, dict):
                problems.append(ConfigError(f"[{key}] must be a table"))
                continue
            section, found = _build_all(_SECTIONS[key], value, f"{key}.")
            problems += found
            broken |= section is None
            if section is not None:
                kwargs[key] = section
        else:
            try:
                kwargs[key] = _coerce(value, hints[key], where)
            except CONFIG_ERRORS as exc:
                problems.append(exc)
    while not broken:
        try:
            return cls(**kwargs), problems
        except CONFIG_ERRORS as exc:
            problems.append(exc)
            # a check across fields that names no one value of this table: what follows might come from it
            key = _named_key(str(exc), prefix, [k for k in kwargs if k not in _SECTIONS])
            if key is None:
                break
            del kwargs[key]
    return None, problems


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["diloco.inner_steps=50", "rounds=3"]`` into a nested dict."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. diloco.inner_steps=50")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) > 2 or not all(parts):
            raise ConfigError(f"override {item!r}: keys are 'name' or 'section.name'")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value.strip()
    return tree


def merge_tables(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s keys set over it, table by table (a new dict; neither is changed)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_tables(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> NodeConfig:
    """Read ``path`` (TOML), apply ``KEY=VALUE`` overrides, validate, return."""
    table: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            table = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} not found: create one with 'dlx-node init'") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        except RecursionError:  # tomllib recurses once per nesting level of arrays and tables
            raise ConfigError(f"config file {p} nests arrays or tables too deeply") from None
        except OSError as exc:
            raise ConfigError(f"config file {p} cannot be read: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {p} is not UTF-8 text") from None
    table = merge_tables(table, parse_overrides(overrides or []))
    try:
        return _build(NodeConfig, table, "")
    except TypeError as exc:  # a value of the wrong shape slipped through
        raise ConfigError(f"invalid configuration: {exc}") from None


def config_from_dict(table: dict[str, Any]) -> NodeConfig:
    """Build and validate a ``NodeConfig`` from a nested dict (e.g. ``to_dict()``)."""
    try:
        return _build(NodeConfig, table, "")
    except TypeError as exc:  # a value of the wrong shape slipped through
        raise ConfigError(f"invalid configuration: {exc}") from None


def dump_toml(table: dict[str, Any]) -> str:
    """Serialize a nested dict of plain values as TOML (enough for our configs)."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        raise TypeError(f"cannot write {type(v).__name__} to TOML")

    top = [f"{k} = {scalar(v)}" for k, v in table.items() if not isinstance(v, dict)]
    sections = []
    for k, v in table.items():
        if isinstance(v, dict):
            sections.append(f"\n[{k}]\n" + "\n".join(f"{kk} = {scalar(vv)}" for kk, vv in v.items()))
    return "\n".join(top) + "\n" + "\n".join(sections) + "\n"
