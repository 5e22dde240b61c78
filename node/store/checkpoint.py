"""Checkpoint files: one safetensors file per published round, content-addressed.

A checkpoint holds the run's *global* state after an outer round, which every
honest replica computes bit-identically: the stage weights (``weights.<name>``,
GPT-2 parameter names) and the outer Nesterov momentum (``momentum.<name>``),
with metadata: format, run id, round, model config, tokenizer, config hash,
per-stage weight hashes and the weights root. The bytes are deterministic
(safetensors sorts its header; metadata values are canonical JSON), so every
node that assembles round t's checkpoint serves the same content hash, and the
chain's content hash identifies the file whoever serves it.

A *stage shard* is the same format restricted to one stage; a node holding
one stage publishes its shard and assembles the full checkpoint from the
shards of all stages.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from node.errors import StateError
from node.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "dlx-checkpoint-v1"
TOKENIZER = "byte-level-v1"


@dataclass
class Checkpoint:
    run_id: int
    round: int
    model_config: dict[str, Any]
    config_hash: bytes
    stage_hashes: dict[int, bytes]  # stage index -> stage weights hash
    weights: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]

    def to_bytes(self) -> bytes:
        tensors = {f"weights.{k}": v.detach().contiguous() for k, v in self.weights.items()}
        tensors.update({f"momentum.{k}": v.detach().contiguous() for k, v in self.momentum.items()})
        # One metadata key holding canonical JSON: safetensors writes its metadata
        # map in hash-map order, so several keys would make the bytes vary run to run.
        meta = {
            "format": CHECKPOINT_FORMAT,
            "run_id": self.run_id,
            "round": self.round,
            "model_config": self.model_config,
            "tokenizer": TOKENIZER,
            "config_hash": self.config_hash.hex(),
            "stage_hashes": {str(s): h.hex() for s, h in sorted(self.stage_hashes.items())},
        }
        return st_save(tensors, metadata={"dlx": json.dumps(meta, sort_keys=True, separators=(",", ":"))})

    def stage_state(self, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The (weights, momentum) of one stage, by its parameter names."""
        missing = [n for n in names if n not in self.weights]
        if missing:
            raise StateError(f"checkpoint of round {self.round} lacks parameters {missing[:3]}...")
        return ({n: self.weights[n] for n in names},
                {n: self.momentum.get(n, torch.zeros_like(self.weights[n])) for n in names})


def parse_checkpoint(data: bytes, expected_hash: bytes | None = None) -> Checkpoint:
    """Decode checkpoint bytes; with ``expected_hash`` (from the chain), refuse any other content."""
    if expected_hash is not None:
        got = hashlib.sha256(data).digest()
        if got != expected_hash:
            raise StateError(
                f"checkpoint content hash mismatch: expected {expected_hash.hex()}, got {got.hex()}"
            )
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads((header.get("__metadata__") or {}).get("dlx", "{}"))  # safetensors allows a null map
        if not isinstance(meta, dict):
            raise ValueError("metadata is not an object")
    except (SafetensorError, ValueError, RecursionError) as exc:  # RecursionError: deeply nested JSON
        raise StateError(f"checkpoint is not a valid safetensors file: {type(exc).__name__}: {exc}"[:300]) from None
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise StateError(f"checkpoint format {meta.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    try:
        weights = {k[len("weights."):]: v for k, v in tensors.items() if k.startswith("weights.")}
        momentum = {k[len("momentum."):]: v for k, v in tensors.items() if k.startswith("momentum.")}
        return Checkpoint(
            run_id=int(meta["run_id"]),
            round=int(meta["round"]),
            model_config=dict(meta["model_config"]),
            config_hash=bytes.fromhex(meta["config_hash"]),
            stage_hashes={int(s): bytes.fromhex(h) for s, h in meta["stage_hashes"].items()},
            weights=weights,
            momentum=momentum,
        )
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        # AttributeError: stage_hashes not a map; OverflowError: int() of an infinite JSON number.
        raise StateError(f"checkpoint metadata is malformed: {type(exc).__name__}: {exc}"[:300]) from None


def read_checkpoint(path: str | Path, expected_hash: bytes | None = None) -> Checkpoint:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StateError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    return parse_checkpoint(data, expected_hash)


def write_checkpoint(path: str | Path, checkpoint: Checkpoint) -> bytes:
    """Write atomically; return the content hash (sha256 of the file)."""
    data = checkpoint.to_bytes()
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).digest()


def merge_shards(shards: list[Checkpoint]) -> Checkpoint:
    """Assemble a full checkpoint from per-stage shards of the same run and round."""
    if not shards:
        raise StateError("no shards to merge")
    first = shards[0]
    for s in shards[1:]:
        if (s.run_id, s.round, s.config_hash) != (first.run_id, first.round, first.config_hash):
            raise StateError(
                f"shards disagree: run/round {s.run_id}/{s.round} vs {first.run_id}/{first.round}"
            )
    weights: dict[str, torch.Tensor] = {}
    momentum: dict[str, torch.Tensor] = {}
    stage_hashes: dict[int, bytes] = {}
    for s in shards:
        weights.update(s.weights)
        momentum.update(s.momentum)
        stage_hashes.update(s.stage_hashes)
    return Checkpoint(first.run_id, first.round, first.model_config, first.config_hash, stage_hashes,
                      weights, momentum)
