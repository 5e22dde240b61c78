"""A joiner's stages of a chunked run's checkpoint, fetched by range: not the whole model (issue 75).

A node that enters a run from a checkpoint needs only the stages it holds, but it downloaded the whole
file: at the 107B layout's 10 stages, 10 times its stage (weights and momentum: 856 GB to load 86 GB),
kept on disk afterwards. In a chunked run (node/commitments/) the record's weights root is the Merkle root
over one leaf per stage, and each leaf commits the chunk roots of its stage's weights *and* momentum, so a
stage can be checked alone: :func:`fetch_checkpoint_stages` reads the checkpoint's header by range,
checks its metadata against the run (run id, round, config hash, model config) and its stage leaves
against the record's weights root, then fetches each held stage's tensors by range and checks them
against the stage's leaf. Nothing else of the file is read, and nothing of it is written to disk.

A hashed run's momentum is in no record (only the whole file's sha256 vouches for it), so a hashed run's
joiner still downloads the whole file. Every field read here is an adversary's until checked: a header
length or offsets past the bounds, a tensor of another dtype or shape, a metadata field that is not the
run's, or data whose chunks are not the leaf's are refused with a :class:`~node.errors.StateError` naming
it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable

import torch

from node.errors import StateError
from node.store.checkpoint import MAX_JSON_DEPTH, Checkpoint, RunLayout, checkpoint_of, metadata_problems
from training.jsonbound import loads_bounded

#: A checkpoint header larger than this is refused before it is read (a header names each tensor in about
#: 100 bytes: a model of 650,000 tensors).
MAX_HEADER_BYTES = 64 << 20

#: ``fetch_range(offset, length) -> bytes``: the checkpoint's bytes at ``offset`` (from a peer).
FetchRange = Callable[[int, int], bytes]


def fetch_checkpoint_stages(fetch_range: FetchRange, layout: RunLayout, round_index: int, weights_root: bytes,
                            stages: Iterable[int]) -> Checkpoint:
    """The checkpoint of ``round_index`` restricted to ``stages``, read by range and checked (module
    docstring): its ``weights`` and ``momentum`` hold those stages' tensors only, its ``stage_leaves`` every
    stage's. ``weights_root``: the attested record's. StateError naming what is wrong; the fetch's own
    errors (a peer that does not answer) pass through."""
    ckpt, leaves, header, data_start = checked_header(fetch_range, layout, round_index, weights_root)
    for stage in sorted(set(stages)):
        weights, momentum = stage_tensors(fetch_range, header, data_start, layout, stage)
        check_stage(ckpt, layout, stage, leaves[stage], weights, momentum)
        ckpt.weights.update(weights)
        ckpt.momentum.update(momentum)
    return ckpt


def checked_header(fetch_range: FetchRange, layout: RunLayout, round_index: int, weights_root: bytes
                   ) -> tuple[Checkpoint, list, dict, int]:
    """``(the checkpoint's metadata with no tensors, every stage's parsed leaf, the parsed header, the offset
    its data starts at)`` from a header read by ``fetch_range``, checked: a chunked run's, the run's metadata,
    stage leaves that give ``weights_root``. StateError naming what is wrong."""
    if not layout.chunked:
        raise StateError("a hashed run's checkpoint is checked whole (its momentum is in no record)")
    header, data_start = read_header(fetch_range)
    try:
        meta = loads_bounded((header.get("__metadata__") or {}).get("dlx", "{}"), MAX_JSON_DEPTH)
    except (AttributeError, TypeError, ValueError, RecursionError) as exc:
        raise StateError(f"checkpoint metadata unreadable: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(meta, dict):
        raise StateError("checkpoint metadata is not an object")
    ckpt = checkpoint_of({}, meta)
    problems = metadata_problems(ckpt, layout, round_index)
    if problems:
        raise StateError("; ".join(problems))
    return ckpt, checked_stage_leaves(ckpt, layout, weights_root), header, data_start


def raw_header(fetch_range: FetchRange) -> bytes:
    """The file's first ``8 + n`` bytes: its length field ``n`` and the header's bytes (not parsed)."""
    head = fetch_range(0, 8)
    if len(head) != 8:
        raise StateError("checkpoint shorter than its header's length field")
    length = struct.unpack("<Q", head)[0]
    if not 2 <= length <= MAX_HEADER_BYTES:
        raise StateError(f"checkpoint header of {length} bytes (at most {MAX_HEADER_BYTES})")
    raw = fetch_range(8, length)
    if len(raw) != length:
        raise StateError(f"checkpoint header cut short: {len(raw)} of {length} bytes")
    return bytes(head) + bytes(raw)


def read_header(fetch_range: FetchRange) -> tuple[dict, int]:
    """The safetensors header (parsed) and the offset its data starts at."""
    raw = raw_header(fetch_range)
    try:
        header = loads_bounded(raw[8:], MAX_JSON_DEPTH)
    except (ValueError, RecursionError) as exc:
        raise StateError(f"checkpoint header is not JSON: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(header, dict):
        raise StateError("checkpoint header is not an object")
    return header, len(raw)


def checked_stage_leaves(ckpt: Checkpoint, layout: RunLayout, weights_root: bytes) -> list:
    """Every stage's leaf from the metadata, checked to give the record's weights root."""
    from ledger.chunkproof import chunked_weights_root
    from ledger.errors import LedgerInputError
    from node.fraudproof import parse_stage_leaf

    if sorted(ckpt.stage_leaves) != list(range(layout.num_stages)):
        raise StateError(f"its metadata holds stage leaves of stages {sorted(ckpt.stage_leaves)[:8]}, not of "
                         f"each of the run's {layout.num_stages}")
    try:
        leaves = [parse_stage_leaf(ckpt.stage_leaves[s], s) for s in range(layout.num_stages)]
        root = chunked_weights_root(leaves)
    except LedgerInputError as exc:
        raise StateError(f"its stage leaves: {exc}") from None
    if root != weights_root:
        raise StateError(f"its stage leaves' weights root {root.hex()[:16]} is not the attested record's "
                         f"weightsRoot {weights_root.hex()[:16]}")
    return leaves


def stage_tensors(fetch_range: FetchRange, header: dict, data_start: int, layout: RunLayout,
                   stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``stage``'s weights and momentum, each tensor fetched by the range its header entry gives."""
    out: tuple[dict, dict] = ({}, {})
    for name, shape in layout.stage_shapes[stage].items():
        for kind, tensors in (("weights", out[0]), ("momentum", out[1])):
            want = tuple(shape) if kind == "weights" or layout.outer_moments == 1 else (
                layout.outer_moments, *shape)
            key = f"{kind}.{name}"
            entry = header.get(key)
            if not isinstance(entry, dict):
                raise StateError(f"the checkpoint has no tensor {key[:120]!r} of stage {stage}")
            offsets = entry.get("data_offsets")
            size = 4 * math.prod(want)
            if entry.get("dtype") != "F32" or entry.get("shape") != list(want) or not (
                    isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] and offsets[1] - offsets[0] == size):
                raise StateError(f"its tensor {key[:120]!r} is not float32 {want} at sound offsets")
            data = fetch_range(data_start + offsets[0], size) if size else b""
            if len(data) != size:
                raise StateError(f"its tensor {key[:120]!r} cut short: {len(data)} of {size} bytes")
            tensors[name] = torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(want) if size \
                else torch.zeros(want, dtype=torch.float32)
    return out


def check_stage(ckpt: Checkpoint, layout: RunLayout, stage: int, leaf, weights: dict,
                 momentum: dict) -> None:
    """The stage's tensors against its leaf's chunk roots and the metadata's stage hash."""
    from ledger.chunkproof import tree_root
    from training.chunks import tensor_leaves
    from training.hashing import stage_weights_hash

    names = layout.stage_names(stage)
    weight_leaves = tensor_leaves({n: weights[n] for n in names})
    momentum_root = tree_root(tensor_leaves({n: momentum[n] for n in names}))
    if (len(weight_leaves), tree_root(weight_leaves), momentum_root) != (
            leaf.num_chunks, leaf.weights_root, leaf.momentum_root):
        raise StateError(f"its stage {stage} weights or momentum are not the chunks its stage leaf commits")
    if ckpt.stage_hashes.get(stage) != stage_weights_hash(weights):
        raise StateError(f"the stage hash of stage {stage} in its metadata is not that of its tensors")
