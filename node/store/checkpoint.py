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
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from node.errors import StateError
from node.store.safetensors_stream import shape_of, write_safetensors
from p2p.blobstore import hash_file
from training.jsonbound import loads_bounded

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "dlx-checkpoint-v1"
#: A checkpoint's header and its ``dlx`` metadata nest a few levels (a model config's sections); deeper is
#: refused before decoding: in a node's process json.loads of deep nesting overflows the C stack and ends it
#: (training/jsonbound.py), and a member's shard is parsed by every node that builds the round's checkpoint.
MAX_JSON_DEPTH = 16
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
    # A chunked run's (docs/FRAUD_PROOF.md): stage -> its leaf of the record's version-2 weights root, which
    # commits the weights and the momentum. Empty, and absent from the metadata, in a hashed run.
    stage_leaves: dict[int, bytes] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return st_save(*self._serializable())

    def _serializable(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The tensors and the metadata safetensors writes (:meth:`to_bytes`)."""
        tensors = {f"weights.{k}": v.detach().contiguous() for k, v in self.weights.items()}
        tensors.update({f"momentum.{k}": v.detach().contiguous() for k, v in self.momentum.items()})
        return tensors, self._metadata()

    def _metadata(self) -> dict[str, str]:
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
        if self.stage_leaves:
            meta["stage_leaves"] = {str(s): leaf.hex() for s, leaf in sorted(self.stage_leaves.items())}
        return {"dlx": json.dumps(meta, sort_keys=True, separators=(",", ":"))}

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
        header = loads_bounded(data[8 : 8 + header_len], MAX_JSON_DEPTH)
        # safetensors allows a null map
        meta = loads_bounded((header.get("__metadata__") or {}).get("dlx", "{}"), MAX_JSON_DEPTH)
        if not isinstance(meta, dict):
            raise ValueError("metadata is not an object")
    except (SafetensorError, ValueError, RecursionError) as exc:  # RecursionError: deeply nested JSON
        raise StateError(
            f"checkpoint is not a valid safetensors file: {type(exc).__name__}: {exc}"[:300]) from None
    return checkpoint_of(tensors, meta)


def checkpoint_of(tensors: dict[str, torch.Tensor], meta: dict) -> Checkpoint:
    """The checkpoint of a safetensors file's tensors and its ``dlx`` metadata (already parsed)."""
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
            stage_leaves={int(s): bytes.fromhex(h) for s, h in meta.get("stage_leaves", {}).items()},
        )
    except (KeyError, ValueError, TypeError, AttributeError, OverflowError) as exc:
        # AttributeError: stage_hashes not a map; OverflowError: int() of an infinite JSON number.
        raise StateError(f"checkpoint metadata is malformed: {type(exc).__name__}: {exc}"[:300]) from None


def read_checkpoint(path: str | Path, expected_hash: bytes | None = None) -> Checkpoint:
    """:func:`parse_checkpoint` of the file at ``path``, never whole in memory (issue 75): hashed in reads
    (p2p.blobstore.hash_file), then each tensor read once through safetensors' map of the file (the same
    checks)."""
    try:
        if expected_hash is not None:
            got = hash_file(Path(path))
            if bytes.fromhex(got) != expected_hash:
                raise StateError(
                    f"checkpoint content hash mismatch: expected {expected_hash.hex()}, got {got}")
        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}  # safetensors allows a null map
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            meta = loads_bounded(metadata.get("dlx", "{}"), MAX_JSON_DEPTH)
            if not isinstance(meta, dict):
                raise ValueError("metadata is not an object")
        except (SafetensorError, ValueError, RecursionError) as exc:
            raise StateError(
                f"checkpoint is not a valid safetensors file: {type(exc).__name__}: {exc}"[:300]) from None
    except OSError as exc:
        raise StateError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None
    return checkpoint_of(tensors, meta)


def write_checkpoint(path: str | Path, checkpoint: Checkpoint) -> bytes:
    """Write atomically (durably, through a temporary name); return the content hash (sha256 of the file).

    The bytes of :meth:`Checkpoint.to_bytes`, never whole in memory (issue 75): written one tensor at a time
    (node/store/safetensors_stream.py, the same bytes as safetensors' ``save_file``), so a checkpoint whose
    tensors are spilled (an assembled one: node/live/record/checkpointbuild.py) is read a tensor at a time,
    then hashed in 4 MiB reads. ``to_bytes`` held the whole file in one buffer beside the tensors: 8 bytes
    per parameter of the model, 1 GB at llama-124m.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        with open(tmp, "wb") as out:
            write_safetensors(out, CheckpointTensors(checkpoint), checkpoint._metadata())
            out.flush()
            os.fsync(out.fileno())
        digest = bytes.fromhex(hash_file(Path(tmp)))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return digest


def checkpoint_digest(checkpoint: Checkpoint) -> bytes:
    """The content hash :func:`write_checkpoint` would return for ``checkpoint``, nothing written: its bytes
    streamed into sha256 a tensor at a time (a published stage state served only when asked binds its hash
    so: node/live/fraud/stateserve.py)."""
    digest = hashlib.sha256()
    write_safetensors(_HashSink(digest), CheckpointTensors(checkpoint), checkpoint._metadata())
    return digest.digest()


class _HashSink:
    """A writable that hashes what is written to it."""

    def __init__(self, digest) -> None:
        self._digest = digest

    def write(self, data) -> int:
        self._digest.update(data)
        return len(data)


class CheckpointTensors(Mapping):
    """A checkpoint's tensors by their names in the file (``weights.<name>``, ``momentum.<name>``), each read
    from the checkpoint's mappings when written (:func:`write_checkpoint`)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._parts = {"weights.": checkpoint.weights, "momentum.": checkpoint.momentum}

    def _split(self, name: str) -> tuple[Mapping[str, torch.Tensor], str]:
        for prefix, part in self._parts.items():
            if name.startswith(prefix) and name[len(prefix):] in part:
                return part, name[len(prefix):]
        raise KeyError(name)

    def __getitem__(self, name: str) -> torch.Tensor:
        part, key = self._split(name)
        return part[key]

    def __iter__(self) -> Iterator[str]:
        for prefix, part in self._parts.items():
            yield from (prefix + key for key in part)

    def __len__(self) -> int:
        return sum(len(part) for part in self._parts.values())

    def shape_of(self, name: str) -> tuple[int, ...]:
        part, key = self._split(name)
        return shape_of(part, key)


# ---------------------------------------------------------------------- checked against the run
@dataclass(frozen=True)
class RunLayout:
    """What a run document fixes about its checkpoints: the metadata and every stage's tensors.

    A checkpoint is trusted only as far as it agrees with this: its metadata is written from
    the run document (never copied from a peer's shard), and its tensors are exactly the
    stages' parameters, with the run's shapes, whose hashes give the attested weights root.
    """

    run_id: int
    config_hash: bytes
    model_config: dict[str, Any]
    stage_shapes: tuple[dict[str, tuple[int, ...]], ...]  # per stage: parameter name -> shape
    # the run's scheme commits stage leaves (node.commitments: CommitmentScheme.chunked)
    chunked: bool = False
    # outer state tensors per weight: 2 with outer Adam (diloco.outer_optimizer), stacked
    outer_moments: int = 1
    # the records' checkpointHash is the hash of the file's header, not of the file (diloco.checkpoint_hash =
    # "header": node/store/checkpoint_hash.py)
    header_hashed: bool = False

    @classmethod
    def of_document(cls, run_id: int, config_hash: bytes, document: dict[str, Any]) -> RunLayout:
        """The layout of the run document ``document`` (already checked against ``config_hash``).

        The checkpoint's model config is the document's ``model`` section as it stands (a tokenizer
        named by its hash, no field the family does not use), so a checkpoint carries nothing of
        the machine that wrote it.
        """
        from node.runconfig import node_config_from_run
        from training.errors import TrainingError
        from training.stages import split_stages, stage_param_shapes

        cfg = node_config_from_run(document)
        try:
            specs = split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)
            shapes = tuple(stage_param_shapes(cfg.model, spec) for spec in specs)
        except TrainingError as exc:
            raise StateError(f"the run document's model does not split into its stages: {exc}") from None
        return cls(run_id, config_hash, dict(document["model"]), shapes, cfg.commitment_scheme.chunked,
                   cfg.diloco.outer_moments, cfg.diloco.checkpoint_hash == "header")

    @property
    def num_stages(self) -> int:
        return len(self.stage_shapes)

    def stage_names(self, stage: int) -> list[str]:
        return list(self.stage_shapes[stage])


def stage_problems(layout: RunLayout, stage: int, weights: dict[str, torch.Tensor],
                   momentum: dict[str, torch.Tensor], weights_hash: bytes | None) -> list[str]:
    """Why one stage's (weights, momentum) is not a state of the run's stage ``stage`` (empty: it is).

    Weights and momentum must name exactly the stage's parameters, as float32 tensors of the run's
    shapes (the momentum of an outer-Adam run: both moments stacked, ``(2, *shape)``); the weights must
    hash to ``weights_hash`` (the round's agreed stage hash), if given.
    """
    from training.hashing import stage_weights_hash

    problems = []
    for what, tensors in (("weights", weights), ("momentum", momentum)):
        shapes = layout.stage_shapes[stage]
        if what == "momentum" and layout.outer_moments != 1:
            shapes = {name: (layout.outer_moments, *shape) for name, shape in shapes.items()}
        missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
        if missing:
            problems.append(f"stage {stage} {what} lack {len(missing)} parameter(s), e.g. {missing[0]!r}")
        if extra:
            problems.append(
                f"stage {stage} {what} hold {len(extra)} tensor(s) the run has not, e.g. {extra[0][:80]!r}")
        for name in sorted(set(shapes) & set(tensors)):
            tensor = tensors[name]
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != tuple(shapes[name]):
                problems.append(
                    f"stage {stage} {what} {name!r} is {tensor.dtype} {tuple(tensor.shape)}, the run's "
                    f"is float32 {tuple(shapes[name])}")
                break
    if not problems and weights_hash is not None and stage_weights_hash(weights) != weights_hash:
        problems.append(
            f"stage {stage} weights hash to {stage_weights_hash(weights).hex()[:16]}, not the round's "
            f"agreed {weights_hash.hex()[:16]}")
    return problems


def checkpoint_problems(ckpt: Checkpoint, layout: RunLayout, round_index: int,
                        weights_root: bytes | None) -> list[str]:
    """Why ``ckpt`` is not the run's checkpoint of ``round_index`` (empty: it is).

    Every metadata field must be what the run document gives (run id, round, config hash, model
    config, tokenizer, and stage hashes equal to the ones recomputed from the tensors), the tensors
    exactly the run's stages (:func:`stage_problems`), and, with ``weights_root`` (the attested
    record's), the recomputed stage hashes must give that root. The momentum is checked for shape
    only: no record commits it, so whoever loads it trusts the checkpoint's signers for it.
    """
    from training.hashing import stage_weights_hash
    from training.hashing import weights_root as root_of

    problems = metadata_problems(ckpt, layout, round_index)
    known = {n for shapes in layout.stage_shapes for n in shapes}
    for what, tensors in (("weights", ckpt.weights), ("momentum", ckpt.momentum)):
        extra = sorted(set(tensors) - known)
        if extra:
            problems.append(f"it holds {len(extra)} {what} tensor(s) the run has not, e.g. {extra[0][:80]!r}")
    hashes = []
    for stage in range(layout.num_stages):
        names = layout.stage_names(stage)
        weights = {n: ckpt.weights[n] for n in names if n in ckpt.weights}
        momentum = {n: ckpt.momentum[n] for n in names if n in ckpt.momentum}
        found = stage_problems(layout, stage, weights, momentum, None)
        problems += found
        if not found:
            hashes.append(stage_weights_hash(weights))
    if len(hashes) == layout.num_stages:
        if dict(enumerate(hashes)) != ckpt.stage_hashes:
            problems.append("the stage hashes in its metadata are not those of its tensors")
        if layout.chunked:
            problems += chunked_problems(ckpt, layout, weights_root)
        elif weights_root is not None and root_of(hashes) != weights_root:
            problems.append(f"its tensors' weights root {root_of(hashes).hex()[:16]} is not the attested "
                            f"record's weightsRoot {weights_root.hex()[:16]}")
    return problems


def metadata_problems(ckpt: Checkpoint, layout: RunLayout, round_index: int) -> list[str]:
    """Why ``ckpt``'s metadata is not the run's of ``round_index``: its run id, round, config hash and model
    config (empty: they are)."""
    meta = {"run id": (ckpt.run_id, layout.run_id), "round": (ckpt.round, round_index),
            "config hash": (ckpt.config_hash.hex(), layout.config_hash.hex()),
            "model config": (ckpt.model_config, layout.model_config)}
    return [f"its {field_name} is {str(got)[:200]}, the run's is {str(want)[:200]}"
            for field_name, (got, want) in meta.items() if got != want]


def chunked_problems(ckpt: Checkpoint, layout: RunLayout, weights_root: bytes | None) -> list[str]:
    """Why a chunked run's checkpoint (tensors of the run's shapes) is not committed by ``weights_root`` (the
    record's version-2 root; None: only its own stage leaves are checked): every stage's leaf must be in its
    metadata and hold the chunk roots of its weights and momentum (docs/FRAUD_PROOF.md)."""
    from ledger.chunkproof import chunked_weights_root, tree_root
    from ledger.errors import LedgerInputError
    from node.fraudproof import parse_stage_leaf
    from training.chunks import tensor_leaves

    if sorted(ckpt.stage_leaves) != list(range(layout.num_stages)):
        return [
            f"its metadata holds stage leaves of stages {sorted(ckpt.stage_leaves)[:8]}, not of each of the "
            f"run's {layout.num_stages} (a chunked run's)"]
    problems, leaves = [], []
    for stage in range(layout.num_stages):
        try:
            leaf = parse_stage_leaf(ckpt.stage_leaves[stage], stage)
        except LedgerInputError as exc:
            return [f"its stage leaf {stage}: {exc}"]
        leaves.append(leaf)
        names = layout.stage_names(stage)
        weights = tensor_leaves({n: ckpt.weights[n] for n in names})
        momentum = tensor_leaves({n: ckpt.momentum[n] for n in names})
        if (len(weights), tree_root(weights), tree_root(momentum)) != (leaf.num_chunks, leaf.weights_root,
                                                                        leaf.momentum_root):
            problems.append(
                f"its stage {stage} weights or momentum are not the chunks its stage leaf commits")
    root = chunked_weights_root(leaves)
    if not problems and weights_root is not None and root != weights_root:
        problems.append(
            f"its stage leaves' weights root {root.hex()[:16]} is not the attested record's weightsRoot "
            f"{weights_root.hex()[:16]}")
    return problems


def build_checkpoint(layout: RunLayout, round_index: int,
                     states: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
                     stage_leaves: dict[int, bytes] | None = None) -> Checkpoint:
    """The run's checkpoint of ``round_index`` from every stage's verified (weights, momentum).

    The metadata comes from the run (``layout``) and the stage hashes are recomputed here, so
    the bytes depend only on the tensors: every node that verified the same tensors builds the
    same file, whoever served it the shards.
    """
    from training.hashing import stage_weights_hash

    from training.spilled import ChainedTensors

    hashes = {stage: stage_weights_hash(states[stage][0]) for stage in range(layout.num_stages)}
    # the stages' mappings seen as one, not copied: a spilled stage stays in its file until written
    weights = ChainedTensors([states[stage][0] for stage in range(layout.num_stages)])
    momentum = ChainedTensors([states[stage][1] for stage in range(layout.num_stages)])
    return Checkpoint(layout.run_id, round_index, dict(layout.model_config), layout.config_hash, hashes,
                      weights, momentum, dict(stage_leaves or {}))
