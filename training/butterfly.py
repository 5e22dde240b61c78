"""Sliced ("butterfly") exchange of one stage's pseudo-gradients: per-node bytes that do not grow with R.

Today every holder of stage ``s`` fetches the other ``R - 1`` replicas' whole
contributions (``(R - 1) x C`` bytes in, as much out). Here, as in hivemind's
butterfly all-reduce (Ryabinin et al. 2021, "Moshpit SGD", section 3.1), the
stage is cut into ``A`` slices; aggregator ``j`` fetches slice ``j`` of every
replica (``~C`` bytes whatever R, for ``A = R``), aggregates it with today's
rules and publishes one signed partial result; everyone fetches the ``A``
partials (``~C`` bytes) and applies the outer step as before
(docs/DILOCOX.md section 12). Every function here is pure: the slice plan, the
partial's bytes and the assembled average are functions of public inputs, so an
auditor replays any one slice for ``~C`` bytes of inputs and compares bytes.

Per round t and stage s, replicas ``0 .. R-1`` in canonical order::

    plan      = plan_slices(shapes, A)                          # row ranges, a pure function
    replica i: target_i = g_i + e_i; slice_blobs_i = encode(split(target_i, plan)[j], budget_j) for each j
               e_i = target_i - assemble(decode(slice_blobs_i))   # error feedback over the whole target
    agg. j:   partial_j = encode(mean_clip([decode(slice_blobs_i[j]) for i]), budget_j)   # aggregate_slice
    everyone: Delta = assemble([decode(partial_j) for j]); outer_step(theta, m, Delta)

The norm rule (docs/DILOCOX.md section 10) runs per slice: slice ``j`` of replica
``i`` is clipped to ``norm_clip x`` the lower median of the round's slice-``j``
norms. The codec, the exact decoder and the strict validation are those of
:mod:`training.compression` / :mod:`training.codec_wire`, applied to the slice's
sub-tensors (a slice blob *is* a contribution of the slice's shapes).

Payloads (byte layouts; the node signs them in :mod:`p2p.envelope` envelopes):

* slice manifest (one signed envelope per replica and stage, kind ``slices``):
  ``b"dlx-slices/1" || u32 A || slices_root (32)``, the Merkle root of
  :func:`slice_leaf` over the replica's slice blobs;
* slice message (unsigned, bound by the manifest): ``b"dlx-slice/1" || u32 j ||
  u32 A || u8 depth || depth x 32 proof || slice blob``;
* partial (one signed envelope per aggregator and stage, kind ``partial``):
  ``b"dlx-partial/1" || u32 j || u32 A || u32 R || inputs_root (32) || partial blob``,
  ``inputs_root`` the Merkle root of :func:`input_leaf` over the R inputs in
  canonical order (so the partial's signature binds exactly what went in).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from training.codec_wire import decode_contribution, matrix_view_shape
from training.compression import CompressionStats, ErrorFeedbackCompressor, encode_contribution
from training.config import CompressionConfig
from training.diloco import average_contributions
from training.errors import ContributionDecodeError, ContributionEncodeError, TrainingError
from training.robust import ContributionReport, robust_contributions

logger = logging.getLogger(__name__)

# Below this many elements a slice's codec framing and per-column scales outweigh its payload
# (docs/DILOCOX.md section 12 measures the error per byte against the slice count).
DEFAULT_MIN_SLICE_NUMEL = 4096

MANIFEST_PREFIX = b"dlx-slices/1"
SLICE_PREFIX = b"dlx-slice/1"
PARTIAL_PREFIX = b"dlx-partial/1"
MAX_SLICES = 1 << 16
_EMPTY = bytes(32)


class SliceError(TrainingError, ValueError):
    """A slice plan, slice message or partial that is malformed or does not match the round."""


# ----------------------------------------------------------------------------- the slice plan


@dataclass(frozen=True)
class SlicePiece:
    """Rows ``row_start:row_end`` (of the matrix view, i.e. of dim 0) of tensor ``name``."""

    name: str
    row_start: int
    row_end: int
    shape: tuple[int, ...]  # the sub-tensor's shape


@dataclass(frozen=True)
class SlicePlan:
    """How a stage is cut into slices: ``slices[j]`` lists slice j's pieces, names ascending."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    slices: tuple[tuple[SlicePiece, ...], ...]

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def slice_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """``{name: sub-tensor shape}`` of slice ``index``: what its blobs must decode to."""
        return {piece.name: piece.shape for piece in self.slices[index]}

    def slice_numel(self, index: int) -> int:
        return sum(math.prod(piece.shape) for piece in self.slices[index])

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes)


def plan_slices(
    shapes: Mapping[str, tuple[int, ...]], num_slices: int, *, min_slice_numel: int = DEFAULT_MIN_SLICE_NUMEL
) -> SlicePlan:
    """Cut a stage into at most ``num_slices`` slices of whole rows, balanced by element count.

    The tensors (names ascending) are laid end to end as one sequence of rows
    of their matrix views (``matrix_view_shape``); slice ``j`` is the run of
    rows from the first row where the element count so far reaches
    ``j * numel / A`` (integer arithmetic, so the plan is exact and the same
    everywhere). ``A = min(num_slices, numel // min_slice_numel, rows)``, at
    least 1: a tiny stage is not cut into slices too small to code well.
    Every element is in exactly one slice; empty tensors go whole into slice 0.
    """
    if num_slices < 1 or min_slice_numel < 1:
        raise SliceError(f"num_slices={num_slices}, min_slice_numel={min_slice_numel}: both must be >= 1")
    names = sorted(shapes)
    ordered = tuple((name, tuple(int(d) for d in shapes[name])) for name in names)
    rows = []  # (name, rows, elements per row) of the non-empty tensors, in order
    for name, shape in ordered:
        m, n = matrix_view_shape(shape)
        if m * n > 0:
            rows.append((name, m, n))
    total_rows = sum(m for _, m, _ in rows)
    numel = sum(m * n for _, m, n in rows)
    count = max(1, min(num_slices, numel // min_slice_numel, total_rows, MAX_SLICES))
    # Global row boundaries: bound[j] = first row k whose preceding elements reach j * numel / count.
    bounds = [0]
    k, elements = 0, 0
    row_sizes = [n for _, m, n in rows for _ in range(m)] if count > 1 else []
    for j in range(1, count):
        while k < total_rows and elements * count < j * numel:
            elements += row_sizes[k]
            k += 1
        # Every slice keeps at least one row.
        bounds.append(min(max(k, bounds[-1] + 1), total_rows - (count - j)))
    bounds.append(total_rows)
    slices: list[list[SlicePiece]] = [[] for _ in range(count)]
    for name, shape in ordered:
        if math.prod(shape) == 0:
            slices[0].append(SlicePiece(name, 0, shape[0] if shape else 0, shape))
    first = 0
    for name, m, _ in rows:
        shape = dict(ordered)[name]
        for j in range(count):
            start, end = max(bounds[j], first), min(bounds[j + 1], first + m)
            if start < end:
                sub = (end - start, *shape[1:]) if shape else ()
                slices[j].append(SlicePiece(name, start - first, end - first, sub))
        first += m
    return SlicePlan(ordered, tuple(tuple(sorted(s, key=lambda p: p.name)) for s in slices))


def split_slices(tensors: Mapping[str, torch.Tensor], plan: SlicePlan) -> list[dict[str, torch.Tensor]]:
    """``[{name: tensor[row_start:row_end]} for each slice]`` (views, no copy)."""
    if set(tensors) != {name for name, _ in plan.shapes}:
        raise SliceError("tensor names differ from the slice plan's")
    out = []
    for pieces in plan.slices:
        part = {}
        for piece in pieces:
            value = tensors[piece.name]
            part[piece.name] = value if value.dim() == 0 else value[piece.row_start:piece.row_end]
        out.append(part)
    return out


def assemble_slices(parts: Sequence[Mapping[str, torch.Tensor]], plan: SlicePlan) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_slices`: the whole stage's float32 tensors (a copy)."""
    if len(parts) != plan.num_slices:
        raise SliceError(f"{len(parts)} slices given, the plan has {plan.num_slices}")
    out = {name: torch.empty(shape, dtype=torch.float32) for name, shape in plan.shapes}
    for part, pieces in zip(parts, plan.slices):
        for piece in pieces:
            value = part[piece.name].to(torch.float32)
            if tuple(value.shape) != piece.shape:
                raise SliceError(f"slice piece {piece.name!r}: shape {tuple(value.shape)} != {piece.shape}")
            if out[piece.name].dim() == 0:
                out[piece.name].copy_(value)
            else:
                out[piece.name][piece.row_start:piece.row_end] = value
    return out


def slice_budget(stage_budget: int, plan: SlicePlan, index: int) -> int:
    """Byte budget of slice ``index``: the stage's budget in proportion to its elements (0 stays 0)."""
    if stage_budget <= 0:
        return 0
    return max(1, stage_budget * plan.slice_numel(index) // max(plan.numel, 1))


def aggregator_of(slice_index: int, outer_round: int, num_members: int) -> int:
    """Canonical index of the member that aggregates ``slice_index`` in ``outer_round`` (a rotation).

    With ``A <= R`` slices the A aggregators of a round are distinct, and the
    role moves by one member per round so no member aggregates the same slice
    twice in a row (a Byzantine aggregator cannot camp on one slice).
    """
    if num_members < 1:
        raise SliceError("no members to aggregate")
    return (slice_index + outer_round) % num_members


# ----------------------------------------------------------------------------- encoding and aggregation


def _encode(tensors, cfg: CompressionConfig, budget: int, stage_index: int, outer_round: int):
    if cfg.enabled and budget > 0:
        from training.bandwidth import encode_within_bandwidth

        return encode_within_bandwidth(tensors, cfg, budget, stage_index=stage_index, outer_round=outer_round)
    return encode_contribution(tensors, cfg, stage_index=stage_index, outer_round=outer_round)


def encode_slices(
    tensors: Mapping[str, torch.Tensor], plan: SlicePlan, cfg: CompressionConfig, stage_budget: int, *,
    stage_index: int, outer_round: int,
) -> tuple[list[bytes], dict[str, torch.Tensor], list[CompressionStats]]:
    """Code each slice with the stage codec and budget ``slice_budget``: ``(blobs, assembled decode, stats)``."""
    blobs, decoded, stats = [], [], []
    for index, part in enumerate(split_slices(tensors, plan)):
        blob, values, slice_stats = _encode(
            part, cfg, slice_budget(stage_budget, plan, index), stage_index, outer_round
        )
        blobs.append(blob)
        decoded.append(values)
        stats.append(slice_stats)
    return blobs, assemble_slices(decoded, plan), stats


class SlicedErrorFeedbackCompressor(ErrorFeedbackCompressor):
    """:class:`ErrorFeedbackCompressor` whose contribution is ``A`` slice blobs.

    Error feedback stays on the whole target: ``e = target - assemble(decoded
    slices)``. :meth:`compress_slices` returns the slice blobs; :meth:`compress`
    (the interface :class:`~training.diloco.StageEngine` calls) returns them
    packed as one msgpack array, with :attr:`last_slices` holding the list.
    """

    def __init__(self, shapes, cfg: CompressionConfig, plan: SlicePlan, *, bandwidth_budget: int | None = None):
        super().__init__(shapes, cfg, bandwidth_budget=bandwidth_budget)
        if {name for name, _ in plan.shapes} != set(self.shapes):
            raise ContributionEncodeError("slice plan names differ from the stage's tensors")
        self.plan = plan
        self.last_slices: list[bytes] = []

    def compress_slices(
        self, pseudo_gradient: Mapping[str, torch.Tensor], *, stage_index: int, outer_round: int
    ) -> tuple[list[bytes], list[CompressionStats]]:
        if set(pseudo_gradient) != set(self.shapes):
            raise ContributionEncodeError("pseudo-gradient names differ from the stage's tensors")
        use_feedback = self.cfg.enabled and self.cfg.error_feedback
        carry = use_feedback or self._carry
        target = {
            name: torch.add(value.to(torch.float32), self.residual[name]) if carry else value.to(torch.float32)
            for name, value in pseudo_gradient.items()
        }
        blobs, decoded, stats = encode_slices(
            target, self.plan, self.cfg, self.bandwidth_budget, stage_index=stage_index, outer_round=outer_round
        )
        if use_feedback:
            self.residual = {name: torch.sub(target[name], decoded[name]) for name in self.residual}
        elif self._carry:
            self.residual = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()}
        self._carry = False
        self.last_decoded = decoded
        self.last_slices = blobs
        return blobs, stats

    def compress(self, pseudo_gradient, *, stage_index: int, outer_round: int) -> tuple[bytes, CompressionStats]:
        import msgpack

        blobs, stats = self.compress_slices(pseudo_gradient, stage_index=stage_index, outer_round=outer_round)
        merged = CompressionStats(outer_round=outer_round, stage_index=stage_index)
        for part in stats:
            merged.tensors.extend(part.tensors)
            merged.raw_bytes += part.raw_bytes
            merged.encoded_bytes += part.encoded_bytes
        return msgpack.packb(blobs, use_bin_type=True), merged


@dataclass
class SliceAggregate:
    """Aggregator j's work on one round: the partial's bytes, its exact decode and each input's fate."""

    slice_index: int
    partial: bytes  # codec blob of the re-encoded average ("" when nothing was accepted)
    decoded: dict[str, torch.Tensor] | None  # exactly what every receiver decodes from ``partial``
    reports: list[ContributionReport]  # one per input, canonical replica order

    @property
    def accepted(self) -> list[int]:
        return [report.index for report in self.reports if report.accepted]


def aggregate_slice(
    slice_blobs: Sequence[bytes | None], plan: SlicePlan, slice_index: int, cfg: CompressionConfig,
    stage_budget: int, *, norm_clip: float, stage_index: int, outer_round: int,
) -> SliceAggregate:
    """Decode, exclude, clip, average and re-encode slice ``slice_index`` of one round (module docstring).

    ``slice_blobs`` holds replica i's slice blob at index i (canonical order),
    None for one that never arrived. The rules are :func:`training.robust.robust_contributions`
    on the slice's shapes (a bad blob costs only itself, the norm rule uses the
    lower median of the slice norms) and :func:`training.diloco.average_contributions`
    (float32, the given order); the average is coded like a contribution
    of the slice (same codec, same budget). Pure: :func:`replay_partial` is this.
    """
    if not 0 <= slice_index < plan.num_slices:
        raise SliceError(f"slice {slice_index} outside 0..{plan.num_slices - 1}")
    shapes = plan.slice_shapes(slice_index)
    missing = {i: "never arrived" for i, blob in enumerate(slice_blobs) if blob is None}
    blobs = [b"" if blob is None else blob for blob in slice_blobs]
    accepted, reports = robust_contributions(
        blobs, shapes, norm_clip=norm_clip, stage_index=stage_index, outer_round=outer_round,
        refuse_raw=cfg.enabled,
    )
    reports = [
        ContributionReport(r.index, False, r.reason, missing[r.index], None, 0.0) if r.index in missing else r
        for r in reports
    ]
    if not accepted:
        return SliceAggregate(slice_index, b"", None, reports)
    average = average_contributions(accepted)
    partial, decoded, _ = _encode(
        average, cfg, slice_budget(stage_budget, plan, slice_index), stage_index, outer_round
    )
    return SliceAggregate(slice_index, partial, decoded, reports)


def replay_partial(
    slice_blobs: Sequence[bytes | None], plan: SlicePlan, slice_index: int, cfg: CompressionConfig,
    stage_budget: int, *, norm_clip: float, stage_index: int, outer_round: int,
) -> bytes:
    """The partial's bytes an honest aggregator publishes for these inputs: compare to what was signed."""
    return aggregate_slice(
        slice_blobs, plan, slice_index, cfg, stage_budget, norm_clip=norm_clip, stage_index=stage_index,
        outer_round=outer_round,
    ).partial


def assemble_partials(
    partials: Sequence[bytes], plan: SlicePlan, *, stage_index: int, outer_round: int, refuse_raw: bool = True,
) -> dict[str, torch.Tensor]:
    """Decode the A partials strictly and assemble the stage's averaged pseudo-gradient Delta.

    An empty partial (nothing accepted for that slice) contributes zeros.
    Raises :class:`ContributionDecodeError` naming the slice whose partial
    does not decode (the caller replaces it by the backup aggregator's).
    """
    if len(partials) != plan.num_slices:
        raise SliceError(f"{len(partials)} partials given, the plan has {plan.num_slices}")
    parts = []
    for index, partial in enumerate(partials):
        shapes = plan.slice_shapes(index)
        if partial == b"":
            parts.append({name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()})
            continue
        try:
            parts.append(decode_contribution(
                partial, shapes, stage_index=stage_index, outer_round=outer_round, refuse_raw=refuse_raw
            ))
        except ContributionDecodeError as exc:
            raise type(exc)(f"partial of slice {index}: {exc}") from None
    return assemble_slices(parts, plan)


# ----------------------------------------------------------------------------- payloads and Merkle proofs


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def slice_leaf(slice_index: int, blob: bytes) -> bytes:
    """Leaf of a replica's slices root: ``sha256(b"slice" || u32 j || sha256(blob))``."""
    return _sha(b"slice" + struct.pack(">I", slice_index) + _sha(blob))


def input_leaf(replica: int, manifest_hash: bytes, blob: bytes | None) -> bytes:
    """Leaf of a partial's inputs root: ``sha256(b"input" || u32 i || manifest hash || sha256(blob) or 0^32)``."""
    return _sha(b"input" + struct.pack(">I", replica) + manifest_hash + (_EMPTY if blob is None else _sha(blob)))


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """Binary sha256 Merkle root; an odd node is carried up unchanged; no leaves: 32 zero bytes."""
    level = list(leaves)
    if not level:
        return _EMPTY
    while len(level) > 1:
        level = [_sha(level[k] + level[k + 1]) if k + 1 < len(level) else level[k] for k in range(0, len(level), 2)]
    return level[0]


def merkle_proof(leaves: Sequence[bytes], index: int) -> list[bytes]:
    """The sibling hashes from leaf ``index`` to the root (carried odd nodes have none)."""
    proof, level = [], list(leaves)
    while len(level) > 1:
        sibling = index ^ 1
        if sibling < len(level):
            proof.append(level[sibling])
        level = [_sha(level[k] + level[k + 1]) if k + 1 < len(level) else level[k] for k in range(0, len(level), 2)]
        index //= 2
    return proof


def verify_merkle(leaf: bytes, index: int, count: int, proof: Sequence[bytes], root: bytes) -> bool:
    """True iff ``proof`` leads from ``leaf`` at ``index`` of ``count`` leaves to ``root``."""
    if not 0 <= index < count:
        return False
    node, width, used = leaf, count, 0
    while width > 1:
        sibling = index ^ 1
        if sibling < width:
            if used >= len(proof):
                return False
            node = _sha(proof[used] + node) if index & 1 else _sha(node + proof[used])
            used += 1
        index //= 2
        width = (width + 1) // 2
    return used == len(proof) and node == root


def manifest_payload(slice_blobs: Sequence[bytes]) -> bytes:
    """Payload of a replica's ``slices`` envelope: prefix, A, the Merkle root of its slice leaves."""
    leaves = [slice_leaf(j, blob) for j, blob in enumerate(slice_blobs)]
    return MANIFEST_PREFIX + struct.pack(">I", len(leaves)) + merkle_root(leaves)


def parse_manifest(payload: bytes, num_slices: int) -> bytes:
    """The slices root of a manifest payload for a round with ``num_slices`` slices; SliceError otherwise."""
    size = len(MANIFEST_PREFIX) + 4 + 32
    if len(payload) != size or not payload.startswith(MANIFEST_PREFIX):
        raise SliceError(f"slice manifest: {len(payload)} bytes, expected {size} with prefix {MANIFEST_PREFIX!r}")
    (count,) = struct.unpack_from(">I", payload, len(MANIFEST_PREFIX))
    if count != num_slices:
        raise SliceError(f"slice manifest names {count} slices, the round has {num_slices}")
    return payload[-32:]


def slice_message(slice_blobs: Sequence[bytes], slice_index: int) -> bytes:
    """What a replica sends aggregator j: slice index, count, Merkle proof to its manifest, the slice blob."""
    leaves = [slice_leaf(j, blob) for j, blob in enumerate(slice_blobs)]
    proof = merkle_proof(leaves, slice_index)
    header = SLICE_PREFIX + struct.pack(">IIB", slice_index, len(leaves), len(proof))
    return header + b"".join(proof) + slice_blobs[slice_index]


def parse_slice_message(message: bytes, slices_root: bytes, slice_index: int, num_slices: int) -> bytes:
    """The slice blob of ``message`` after checking index, count and the proof to ``slices_root``."""
    head = len(SLICE_PREFIX) + 9
    if len(message) < head or not message.startswith(SLICE_PREFIX):
        raise SliceError("slice message: too short or wrong prefix")
    index, count, depth = struct.unpack_from(">IIB", message, len(SLICE_PREFIX))
    if index != slice_index or count != num_slices:
        raise SliceError(f"slice message for slice {index} of {count}, expected {slice_index} of {num_slices}")
    if len(message) < head + 32 * depth:
        raise SliceError("slice message: truncated proof")
    proof = [message[head + 32 * k: head + 32 * (k + 1)] for k in range(depth)]
    blob = message[head + 32 * depth:]
    if not verify_merkle(slice_leaf(index, blob), index, count, proof, slices_root):
        raise SliceError(f"slice {index}: blob does not match the signed slices root")
    return blob


@dataclass(frozen=True)
class Partial:
    """A parsed partial payload."""

    slice_index: int
    num_slices: int
    num_inputs: int
    inputs_root: bytes
    blob: bytes


def partial_payload(slice_index: int, num_slices: int, inputs_root: bytes, num_inputs: int, blob: bytes) -> bytes:
    """Payload of aggregator j's ``partial`` envelope (module docstring)."""
    if len(inputs_root) != 32:
        raise SliceError("inputs_root must be 32 bytes")
    return PARTIAL_PREFIX + struct.pack(">III", slice_index, num_slices, num_inputs) + inputs_root + blob


def parse_partial(payload: bytes) -> Partial:
    """Strictly parse a partial payload; SliceError on anything else."""
    head = len(PARTIAL_PREFIX) + 12 + 32
    if len(payload) < head or not payload.startswith(PARTIAL_PREFIX):
        raise SliceError("partial: too short or wrong prefix")
    index, count, inputs = struct.unpack_from(">III", payload, len(PARTIAL_PREFIX))
    if not 0 <= index < count <= MAX_SLICES:
        raise SliceError(f"partial: slice {index} of {count}")
    return Partial(index, count, inputs, payload[head - 32:head], payload[head:])


def check_partial(
    partial: Partial, slice_blobs: Sequence[bytes | None], manifest_hashes: Sequence[bytes], plan: SlicePlan,
    cfg: CompressionConfig, stage_budget: int, *, norm_clip: float, stage_index: int, outer_round: int,
) -> str:
    """Audit one partial by replay: ``""`` if it is exactly what these inputs give, else the reason.

    Costs the slice's inputs (``~C`` bytes whatever R for ``A = R``) and one
    aggregation of one slice.
    """
    if partial.num_slices != plan.num_slices:
        return f"partial names {partial.num_slices} slices, the plan has {plan.num_slices}"
    if partial.num_inputs != len(slice_blobs):
        return f"partial binds {partial.num_inputs} inputs, the round has {len(slice_blobs)}"
    leaves = [input_leaf(i, h, blob) for i, (h, blob) in enumerate(zip(manifest_hashes, slice_blobs))]
    if merkle_root(leaves) != partial.inputs_root:
        return "inputs root differs from the round's inputs"
    expected = replay_partial(
        slice_blobs, plan, partial.slice_index, cfg, stage_budget, norm_clip=norm_clip,
        stage_index=stage_index, outer_round=outer_round,
    )
    if expected != partial.blob:
        return f"partial bytes differ from the replay (sha256 {_sha(partial.blob).hex()[:16]} != {_sha(expected).hex()[:16]})"
    return ""
