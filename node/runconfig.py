"""The run configuration and its hash: what a run's on-chain ``configHash`` pins.

The run document is canonical JSON (sorted keys, no whitespace, UTF-8) of every
setting that changes the training math: model, training, DiLoCoX, compression,
pipeline stage count, and the sha256 of the training text (or the root of a prepared
dataset's manifest) and of the tokenizer (not their paths, which differ between machines). A byte-level GPT-2
run's document has no family or tokenizer fields (:meth:`training.config.ModelConfig.document`). ``config_hash
= sha256(document)``. The initial weights follow from ``model`` and ``training.seed`` (``training.model.
init_state_dict``), so the hash pins them too. Node-local settings (ports,
keys, timeouts, data_dir) are not part of it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from node.commitments import UNNAMED
from node.config import NodeConfig
from node.errors import ConfigError
from node.exchangekinds import EXCHANGE_TRAITS
from training.config import AUTO, LEGACY_ENCODER, LEGACY_OPTIMIZER, LEGACY_RANDOM, OUTER_ADAM_ONLY
from training.config_training import LEGACY_KERNELS
from training.config_compression import LEGACY_ERROR_FEEDBACK
from training.jsonbound import loads_bounded

RUN_FORMAT = "dlx-run-v1"
#: A run document nests its sections a few levels; deeper is refused before decoding (training/jsonbound.py:
#: a joiner's process would otherwise die on a creator's document of deep brackets).
MAX_DOCUMENT_DEPTH = 32


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_document(cfg: NodeConfig) -> dict[str, Any]:
    """The settings every replica of a run must share, as plain data."""
    training = cfg.training.document()  # without the node's device and precision
    data_path = training.pop("data_path")
    training["data_sha256"] = data_reference(cfg, data_path)
    return {
        "format": RUN_FORMAT,
        "run_name": cfg.run_name,
        "model": _model_document(cfg),
        "training": training,
        "diloco": _diloco_document(cfg),
        "compression": cfg.compression.document(),
        "pipeline": {"num_stages": cfg.pipeline.num_stages},
    }


def data_reference(cfg: NodeConfig, data_path: str) -> str:
    """``training.data_sha256`` of the run document: "generated", the sha256 of a text file, or
    ``manifest:<root>`` of a prepared dataset (its manifest's Merkle root over every shard, the split and
    the tokenizer; training/shards.py)."""
    if not data_path:
        return "generated"
    from training.errors import ShardError
    from training.shards import ROOT_PREFIX
    from training.sharded_corpus import is_dataset, read_manifest

    path = cfg.path(data_path)
    if is_dataset(path):
        try:
            return ROOT_PREFIX + read_manifest(path)[1].root
        except ShardError as exc:
            raise ConfigError(f"training.data_path={data_path!r}: {exc}") from None
    try:
        return file_sha256(path)
    except OSError as exc:
        raise ConfigError(f"training.data_path={data_path!r}: cannot read it ({exc.strerror})") from None


def tokenizer_reference(cfg: NodeConfig) -> str:
    """``model.tokenizer`` as the run document names it: ``"bytes"``, or ``"sha256:<hex>"`` of the file
    (a path differs between machines; the content does not)."""
    from training.tokenizer import SHA256_PREFIX, TokenizerError, parse_reference

    spec = cfg.model.tokenizer
    try:
        if parse_reference(spec) is not None or spec == "bytes":
            return spec
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return SHA256_PREFIX + file_sha256(cfg.path(spec))
    except OSError as exc:
        raise ConfigError(f"model.tokenizer={spec!r}: cannot read it ({exc.strerror})") from None


def _model_document(cfg: NodeConfig) -> dict[str, Any]:
    """The [model] table: only the settings of the model's family (a byte-level GPT-2 run's table is what it
    was before families existed, so its hash is unchanged), the tokenizer by content hash."""
    model = cfg.model.document()
    if "tokenizer" in model:
        model["tokenizer"] = tokenizer_reference(cfg)
    if model.get("init_weights"):  # an imported model's initial weights, by content (training/hf_import.py)
        model["init_weights"] = init_weights_reference(cfg)
    return model


def init_weights_reference(cfg: NodeConfig) -> str:
    """``model.init_weights`` as the run document names it: ``"sha256:<hex>"`` of the file."""
    spec = cfg.model.init_weights
    if spec.startswith("sha256:"):
        return spec
    path = cfg.path(spec)
    try:
        stat = path.stat()
        return "sha256:" + _weights_sha256(str(path), stat.st_size, stat.st_mtime_ns)
    except OSError as exc:
        raise ConfigError(f"model.init_weights={spec!r}: cannot read it ({exc.strerror})") from None


@functools.lru_cache(maxsize=8)
def _weights_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A weights file's sha256, read once per (path, size, mtime): the document is made many times."""
    return file_sha256(Path(path))


def _diloco_document(cfg: NodeConfig) -> dict[str, Any]:
    """The [diloco] table; ``exchange`` and ``min_slice_numel`` only in a sliced run, ``round_budget_s`` and
    ``min_inner_steps`` only in a run whose rounds are bounded by time, ``outer_lr_other_scale`` only when it
    is not 1, ``commitments`` only when not the unnamed scheme's ("hashed": node.commitments.UNNAMED),
    ``screen_rule`` only when not "one_sided", ``exchange_parts`` only when not 1, ``put_back`` only when
    false, ``outer_optimizer`` and its ``outer_adam_*`` settings only when it is "adam" (the hash of every
    "full", fixed-H, one-outer-lr, Nesterov run stays what it was)."""
    diloco = dataclasses.asdict(cfg.diloco)
    for key in EXCHANGE_TRAITS[cfg.diloco.exchange].omitted_from_document:
        del diloco[key]
    if not cfg.diloco.budgeted:
        del diloco["round_budget_s"]
        del diloco["min_inner_steps"]
    if cfg.diloco.outer_lr_other_scale == 1.0:
        del diloco["outer_lr_other_scale"]
    if cfg.diloco.commitments == UNNAMED:
        del diloco["commitments"]  # version 1: every run made before version 2 (its hash unchanged)
    if cfg.diloco.outer_optimizer == "nesterov":
        for name in ("outer_optimizer", *OUTER_ADAM_ONLY):
            del diloco[name]  # every run made before outer Adam existed (its hash unchanged)
    if cfg.diloco.exchange_parts == 1:
        del diloco["exchange_parts"]  # whole contributions: every run made before parts (hash unchanged)
    if cfg.diloco.put_back:
        del diloco["put_back"]  # a left-out update put back: every run made before it (hash unchanged)
    if cfg.diloco.screen_rule == "one_sided":
        # version 1: every fixed-H run, and every time-bounded run made before version 2
        del diloco["screen_rule"]
    diloco["checkpoint_hash"] = checkpoint_hash_rule(cfg)
    if diloco["checkpoint_hash"] == "file":
        del diloco["checkpoint_hash"]  # every run made before "header" existed, and every small one since
    return diloco


def checkpoint_hash_rule(cfg: NodeConfig) -> str:
    """``diloco.checkpoint_hash`` as the run document names it: "auto" resolved to "header" where the run is
    chunked and its whole checkpoint (weights and outer state, float32) is ``SPLIT_ABOVE_BYTES`` or more,
    where its nodes keep checkpoints split by default (node/store/checkpoint_split.py), else "file" (the
    demo's and every small run's: their documents and checkpoint hashes are what they were)."""
    rule = cfg.diloco.checkpoint_hash
    if rule != AUTO:
        return rule
    if not cfg.commitment_scheme.chunked:
        return "file"
    from node.store.checkpoint_size import SPLIT_ABOVE_BYTES, tensor_bytes
    from training.stages import split_stages, stage_param_shapes

    shapes = [stage_param_shapes(cfg.model, spec)
              for spec in split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)]
    return "header" if tensor_bytes(shapes, cfg.diloco.outer_moments) >= SPLIT_ABOVE_BYTES else "file"


def canonical_json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def config_hash(document: dict[str, Any]) -> bytes:
    """32-byte sha256 of the canonical run document."""
    return hashlib.sha256(canonical_json(document)).digest()


def parse_run_document(data: bytes, expected_hash: bytes | None = None) -> dict[str, Any]:
    """Decode a run document fetched from a peer or a file; check it against the chain's hash."""
    if expected_hash is not None and hashlib.sha256(data).digest() != expected_hash:
        raise ConfigError(
            f"run document hash {hashlib.sha256(data).hexdigest()} does not match the chain's "
            f"configHash {expected_hash.hex()}"
        )
    try:
        document = loads_bounded(data, MAX_DOCUMENT_DEPTH)
    except (ValueError, RecursionError) as exc:
        # ValueError: bad UTF-8 or JSON, an integer of more than 4300 digits, or nesting past the bound
        raise ConfigError(f"run document is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(document, dict) or document.get("format") != RUN_FORMAT:
        raise ConfigError(f"run document has no format {RUN_FORMAT!r}")
    return document


def node_config_from_run(document: dict[str, Any], **node_fields: Any) -> NodeConfig:
    """A NodeConfig whose training settings are exactly those of ``document``."""
    from node.config import config_from_dict

    try:
        # A run document that names no inner optimizer is an AdamW run's (made before training.optimizer
        # existed, or since: an AdamW run's table leaves it out, so its hash is what it was). One that names
        # no kernel version is of version 1 (made before versions existed, or since with version 1).
        training = {"optimizer": LEGACY_OPTIMIZER, "reproducible_kernels": LEGACY_KERNELS,
                    **document["training"]}
        training.pop("data_sha256", None)
        table = {
            "run_name": document["run_name"],
            # A run made before model.init existed names none: its weights were drawn by torch's generator.
            "model": {"init": LEGACY_RANDOM.value, **document["model"]},
            "training": training,
            # A run made before chunked commitments names none: its records commit version-1 roots.
            # A run made before screening rules had versions names none: it screened by version 1.
            # A run made before diloco.checkpoint_hash names none: its records name the whole file's sha256.
            "diloco": {"commitments": UNNAMED, "screen_rule": "one_sided", "checkpoint_hash": "file",
                       **document["diloco"]},
            # A run made before compression.encoder existed names none: it was coded by v1; before
            # compression.sketch, with torch's sketch. Every run document names error_feedback; one without it
            # would be older than new runs' default (off, issue 66), so it reads as on.
            "compression": {"encoder": LEGACY_ENCODER.value, "sketch": LEGACY_RANDOM.value,
                            "error_feedback": LEGACY_ERROR_FEEDBACK, **document["compression"]},
            "pipeline": {"num_stages": document["pipeline"]["num_stages"]},
            **node_fields,
        }
    except (KeyError, TypeError, ValueError) as exc:  # a section missing or not a table
        raise ConfigError(
            f"run document lacks a setting or a section is not a table: {exc!r}"[:300]) from None
    return config_from_dict(table)
