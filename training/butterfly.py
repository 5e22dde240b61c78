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

    plan      = plan_slices(shapes, R)                          # line ranges, a pure function
    replica i: target_i = g_i + e_i; slice_blobs_i = encode(split(target_i, plan)[j], budget_ij) for each j
               e_i = target_i - assemble(decode(slice_blobs_i))   # error feedback over the whole target
    agg. j:   partial_j = encode(mean_clip([decode(slice_blobs_i[j]) for i]),
                                 lower median of the accepted inputs' sizes)      # aggregate_slice
    everyone: Delta = assemble([decode(partial_j) for j]); outer_step(theta, m, Delta)

The norm rule (docs/DILOCOX.md section 10) runs per slice: slice ``j`` of replica
``i`` is clipped to ``norm_clip x`` the lower median of the round's slice-``j``
norms. The codec, the exact decoder and the strict validation are those of
:mod:`training.compression` / :mod:`training.codec_wire`, applied to the slice's
sub-tensors (a slice blob *is* a contribution of the slice's shapes).

The byte layouts of the slice messages and partial payloads, and the partial's audit by
replay, are :mod:`training.slicemessages`; a replica's slices travel as one bundle
(:mod:`training.slicebundle`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from training.codec.allocation import framing_bytes
from training.codec_wire import declare_steps, decode_contribution, matrix_view_shape
from training.compression import (
    CompressionStats,
    ErrorFeedbackCompressor,
    encode_contribution,
    encode_within_bandwidth,
)
from training.config_compression import CompressionConfig
from training.diloco import average_contributions
from training.errors import ContributionDecodeError, ContributionEncodeError, TrainingError
from training.robust import ContributionReport, lower_median, robust_contributions

logger = logging.getLogger(__name__)

# Below this many elements a slice's codec framing and per-column scales outweigh its payload
# (docs/DILOCOX.md section 12 measures the error per byte against the slice count).
DEFAULT_MIN_SLICE_NUMEL = 8192
# The live node's plan (slice_stage, the auditor) by default: A = R down to slices of this many
# elements, so an aggregator's inputs stay ~C whatever R (docs/DILOCOX.md section 12, "Minimum
# slice"). A run sets its own with diloco.min_slice_numel (training.config).
LIVE_MIN_SLICE_NUMEL = 1024

# A slice boundary moves to a tensor boundary if that shifts it by at most SNAP_EIGHTHS / 8 of a slice.
SNAP_EIGHTHS = 2

MAX_SLICES = 1 << 16


class SliceError(TrainingError, ValueError):
    """A slice plan, slice message or partial that is malformed or does not match the round."""


# ----------------------------------------------------------------------------- the slice plan


@dataclass(frozen=True)
class SlicePiece:
    """Lines ``start:end`` of tensor ``name``'s matrix view: rows (``axis`` 0) or columns (``axis`` 1)."""

    name: str
    axis: int
    start: int
    end: int
    shape: tuple[int, ...]  # the sub-tensor's shape (rows: (end-start, *shape[1:]); columns: (m, end-start))


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


def cut_axis(shape: tuple[int, ...]) -> int:
    """0 (rows) or 1 (columns): the matrix view is cut across its longer side.

    A block of a cut matrix repeats what the codec stores per line of the side
    that is not cut: the per-column scales of ``quant`` (cutting columns repeats
    none) and the low-rank factor of the uncut side (``r x`` that side's length
    per block). Cutting the longer side repeats the shorter one.
    """
    m, n = matrix_view_shape(shape)
    return 1 if len(shape) >= 2 and n > m else 0


def plan_slices(
    shapes: Mapping[str, tuple[int, ...]], num_slices: int, *, min_slice_numel: int = DEFAULT_MIN_SLICE_NUMEL
) -> SlicePlan:
    """Cut a stage into at most ``num_slices`` slices of whole lines, balanced by element count.

    The tensors (names ascending) are laid end to end as one sequence of lines
    of their matrix views (``matrix_view_shape``): rows, or columns for a matrix
    wider than tall (:func:`cut_axis`). Slice ``j`` starts at the first line
    where the element count so far reaches ``j * numel / A`` (integer arithmetic,
    so the plan is exact and the same everywhere), moved to the nearest tensor
    boundary if that is within half a slice (a cut matrix codes worse).
    ``A = min(num_slices, numel // min_slice_numel, lines)``, at least 1: a small
    stage is not cut into slices too small to code well. Every element is in
    exactly one slice; empty tensors go whole into slice 0.
    """
    if num_slices < 1 or min_slice_numel < 1:
        raise SliceError(f"num_slices={num_slices}, min_slice_numel={min_slice_numel}: both must be >= 1")
    ordered = tuple((name, tuple(int(d) for d in shapes[name])) for name in sorted(shapes))
    lines = []  # (name, axis, number of lines, elements per line) of the non-empty tensors, in order
    for name, shape in ordered:
        m, n = matrix_view_shape(shape)
        if m * n > 0:
            axis = cut_axis(shape)
            lines.append((name, axis, n, m) if axis else (name, axis, m, n))
    total_lines = sum(count for _, _, count, _ in lines)
    numel = sum(count * size for _, _, count, size in lines)
    slice_count = max(1, min(num_slices, numel // min_slice_numel, total_lines, MAX_SLICES))
    # Line index and elements before each tensor's first line: a boundary there cuts no matrix.
    starts, seen_lines, seen_elements = [], 0, 0
    for _, _, count, size in lines:
        starts.append((seen_lines, seen_elements))
        seen_lines, seen_elements = seen_lines + count, seen_elements + count * size
    bounds = [0]
    tensor, line, elements = 0, 0, 0
    for j in range(1, slice_count):
        # Advance whole lines until the elements before `line` reach j * numel / A (tensor by tensor).
        while line < total_lines and elements * slice_count < j * numel:
            name, axis, count, size = lines[tensor]
            end = starts[tensor][0] + count
            needed = -(-(j * numel - elements * slice_count) // (slice_count * size))  # ceil
            step = min(needed, end - line)
            line, elements = line + step, elements + step * size
            if line == end:
                tensor += 1
        near = min(starts, key=lambda start: (abs(start[1] - elements), start[0]))
        # |near - elements| <= SNAP_EIGHTHS/8 of a slice, in integers.
        if near[0] > bounds[-1] and abs(near[1] - elements) * slice_count * 8 <= SNAP_EIGHTHS * numel:
            chosen = near[0]
        else:
            chosen = line
        # Every slice keeps at least one line.
        bounds.append(min(max(chosen, bounds[-1] + 1), total_lines - (slice_count - j)))
    bounds.append(total_lines)
    shape_of = dict(ordered)
    slices: list[list[SlicePiece]] = [[] for _ in range(slice_count)]
    for name, shape in ordered:
        if math.prod(shape) == 0:
            slices[0].append(SlicePiece(name, 0, 0, shape[0] if shape else 0, shape))
    for (name, axis, count, _), (first, _) in zip(lines, starts):
        shape = shape_of[name]
        m, n = matrix_view_shape(shape)
        for j in range(slice_count):
            start, end = max(bounds[j], first), min(bounds[j + 1], first + count)
            if start < end:
                if axis:
                    sub = (m, end - start)
                else:
                    sub = (end - start, *shape[1:]) if shape else ()
                slices[j].append(SlicePiece(name, axis, start - first, end - first, sub))
    return SlicePlan(ordered, tuple(tuple(sorted(s, key=lambda p: p.name)) for s in slices))


def _piece_of(value: torch.Tensor, piece: SlicePiece) -> torch.Tensor:
    if value.dim() == 0:
        return value
    if piece.axis:
        return value.reshape(value.shape[0], -1)[:, piece.start:piece.end]
    return value[piece.start:piece.end]


def split_slices(tensors: Mapping[str, torch.Tensor], plan: SlicePlan) -> list[dict[str, torch.Tensor]]:
    """``[{name: piece of tensor} for each slice]`` (contiguous copies of column pieces, views of row pieces)."""
    if set(tensors) != {name for name, _ in plan.shapes}:
        raise SliceError("tensor names differ from the slice plan's")
    return [
        {piece.name: _piece_of(tensors[piece.name], piece).contiguous() for piece in pieces} for pieces in plan.slices
    ]


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
            target = out[piece.name]
            if target.dim() == 0:
                target.copy_(value)
            else:
                _piece_of(target, piece).copy_(value)  # a view into ``target`` (contiguous, so reshape is a view)
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
        return encode_within_bandwidth(tensors, cfg, budget, stage_index=stage_index, outer_round=outer_round)
    return encode_contribution(tensors, cfg, stage_index=stage_index, outer_round=outer_round)


def guided_slice_budgets(
    tensors: Mapping[str, torch.Tensor], plan: SlicePlan, cfg: CompressionConfig, stage_budget: int
) -> list[int]:
    """Per-slice byte budgets that follow the whole stage's allocation (:mod:`training.codec.allocation`).

    The stage's greedy allocation spends bytes where they remove the most
    error (big compressible matrices, not biases); a budget proportional to
    element counts would undo that. Slice j gets, per piece, the bytes the
    whole-stage allocation gave its tensor times the piece's share of the
    tensor's lines, plus its framing. A replica's own choice (the aggregator
    only needs the blobs), so it may depend on its data.
    """
    if not cfg.enabled or stage_budget <= 0:
        return [0] * plan.num_slices
    _, _, stats = encode_within_bandwidth(tensors, cfg, stage_budget, stage_index=0, outer_round=0)
    payload = {tensor.name: tensor.payload_bytes for tensor in stats.tensors}
    shapes = dict(plan.shapes)
    budgets = []
    for pieces in plan.slices:
        total = 32.0
        for piece in pieces:
            lines = matrix_view_shape(shapes[piece.name])[piece.axis]
            share = (piece.end - piece.start) / lines if lines else 1.0
            total += framing_bytes(piece.name, piece.shape) + payload.get(piece.name, 0) * share
        budgets.append(max(1, int(total)))
    return budgets


def encode_slices(
    tensors: Mapping[str, torch.Tensor], plan: SlicePlan, cfg: CompressionConfig, stage_budget: int, *,
    stage_index: int, outer_round: int, guided: bool = True,
) -> tuple[list[bytes], dict[str, torch.Tensor], list[CompressionStats]]:
    """Code each slice with the stage codec: ``(blobs, assembled decode, stats)``.

    Budgets: :func:`guided_slice_budgets` (``guided``), else :func:`slice_budget`
    (in proportion to the elements).
    """
    parts = split_slices(tensors, plan)
    if guided:
        budgets = guided_slice_budgets(tensors, plan, cfg, stage_budget)
    else:
        budgets = [slice_budget(stage_budget, plan, index) for index in range(plan.num_slices)]
    blobs, decoded, stats = [], [], []
    for part, budget in zip(parts, budgets):
        blob, values, slice_stats = _encode(part, cfg, budget, stage_index, outer_round)
        blobs.append(blob)
        decoded.append(values)
        stats.append(slice_stats)
    return blobs, assemble_slices(decoded, plan), stats


class SlicedErrorFeedbackCompressor(ErrorFeedbackCompressor):
    """:class:`ErrorFeedbackCompressor` whose contribution is ``A`` slice blobs.

    Error feedback stays on the whole target: ``e = target - assemble(decoded
    slices)``. :meth:`compress_slices` returns the slice blobs; :meth:`compress`
    (the interface :class:`~training.stage_engine.StageEngine` calls) returns them
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

    def declare(self, blob: bytes, steps: int) -> bytes:
        """:meth:`compress`'s bytes with ``steps`` declared in every slice blob (codec_wire version 2, a
        time-bounded run); :attr:`last_slices` become the declared blobs (what the bundle serves)."""
        import msgpack

        self.last_slices = [declare_steps(part, steps) for part in self.last_slices]
        return msgpack.packb(self.last_slices, use_bin_type=True)

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
    steps_range: tuple[int, int] | None = None,
) -> SliceAggregate:
    """Decode, exclude, clip, average and re-encode slice ``slice_index`` of one round (module docstring).

    ``slice_blobs`` holds replica i's slice blob at index i (canonical order),
    None for one that never arrived. The rules are :func:`training.robust.robust_contributions`
    on the slice's shapes (a bad blob costs only itself, the norm rule uses the
    lower median of the slice norms) and :func:`training.diloco.average_contributions`
    (float32, the given order); the average is coded like a contribution
    of the slice (same codec, same budget). Pure: :func:`replay_partial` is this.

    ``steps_range``: ``(min_inner_steps, inner_steps)`` of a time-bounded run (``DilocoConfig.steps_range``):
    each slice blob declares its replica's inner steps (codec_wire version 2), one outside the range (or
    none) is excluded (``bad_steps``) and the norm rule runs per step, as in the full exchange
    (docs/DILOCOX.md section 13); the average stays the plain mean.
    """
    if not 0 <= slice_index < plan.num_slices:
        raise SliceError(f"slice {slice_index} outside 0..{plan.num_slices - 1}")
    shapes = plan.slice_shapes(slice_index)
    missing = {i: "never arrived" for i, blob in enumerate(slice_blobs) if blob is None}
    blobs = [b"" if blob is None else blob for blob in slice_blobs]
    accepted, reports = robust_contributions(
        blobs, shapes, norm_clip=norm_clip, stage_index=stage_index, outer_round=outer_round,
        refuse_raw=cfg.enabled, steps_range=steps_range,
    )
    reports = [
        ContributionReport(r.index, False, r.reason, missing[r.index], None, 0.0) if r.index in missing else r
        for r in reports
    ]
    if not accepted:
        return SliceAggregate(slice_index, b"", None, reports)
    average = average_contributions(accepted)
    with single_thread():
        partial, decoded, _ = _encode(
            average, cfg, partial_budget(blobs, reports, stage_budget), stage_index, outer_round
        )
    return SliceAggregate(slice_index, partial, decoded, reports)


@contextmanager
def single_thread():
    """Run the partial's encoder on one intra-op thread: its SVD and QR (LAPACK) round differently with
    another thread count, and the partial must be replayable bit for bit (measured: a node with 1
    thread and an auditor with 2 coded 2 of 3 partials differently). Not shown across CPUs or torch
    builds (docs/PROTOCOL.md, "Sliced exchange")."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def partial_budget(slice_blobs: Sequence[bytes], reports: Sequence[ContributionReport], stage_budget: int) -> int:
    """The partial's byte budget: the lower median of the accepted inputs' sizes (0: code to the error budget).

    A public function of the inputs (replayable), and it follows the replicas'
    own allocation of bytes between slices, so the partials of a round sum to
    about one contribution.
    """
    if stage_budget <= 0:
        return 0
    return lower_median([len(slice_blobs[report.index]) for report in reports if report.accepted])


def replay_partial(
    slice_blobs: Sequence[bytes | None], plan: SlicePlan, slice_index: int, cfg: CompressionConfig,
    stage_budget: int, *, norm_clip: float, stage_index: int, outer_round: int,
    steps_range: tuple[int, int] | None = None,
) -> bytes:
    """The partial's bytes an honest aggregator publishes for these inputs: compare to what was signed."""
    return aggregate_slice(
        slice_blobs, plan, slice_index, cfg, stage_budget, norm_clip=norm_clip, stage_index=stage_index,
        outer_round=outer_round, steps_range=steps_range,
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


# ----------------------------------------------------------------------------- the live node's pieces


def candidate(slice_index: int, outer_round: int, num_members: int, turn: int) -> int:
    """Canonical index of slice ``slice_index``'s aggregator (``turn`` 0) or its ``turn``-th fallback."""
    return aggregator_of(slice_index + turn, outer_round, num_members)


def live_plan(shapes: Mapping[str, tuple[int, ...]], num_replicas: int,
              min_slice_numel: int = LIVE_MIN_SLICE_NUMEL) -> SlicePlan:
    """The live node's (and its auditor's) slice plan: :func:`plan_slices` with the run's
    ``diloco.min_slice_numel`` (``LIVE_MIN_SLICE_NUMEL`` by default)."""
    return plan_slices(shapes, num_replicas, min_slice_numel=min_slice_numel)


def slice_for_exchange(engine, diloco_cfg) -> SlicePlan | None:
    """:func:`slice_stage` of ``engine`` when the run's exchange slices its stages (``diloco_cfg.sliced``),
    its plan; None (the engine left whole) for the full exchange."""
    if not diloco_cfg.sliced:
        return None
    return slice_stage(engine, diloco_cfg.num_replicas, diloco_cfg.min_slice_numel)


def slice_stage(engine, num_replicas: int, min_slice_numel: int = LIVE_MIN_SLICE_NUMEL) -> SlicePlan:
    """Make a :class:`~training.stage_engine.StageEngine` encode sliced contributions; returns its plan.

    The plan is :func:`live_plan` of the stage's shapes for ``num_replicas`` and
    ``min_slice_numel`` (run settings, so every node derives the same plan); the
    error-feedback residual and the byte budget carry over.
    """
    plan = live_plan(engine.shapes, num_replicas, min_slice_numel)
    old = engine.compressor
    sliced = SlicedErrorFeedbackCompressor(engine.shapes, engine.compression_cfg, plan,
                                           bandwidth_budget=old.bandwidth_budget)
    sliced.residual = old.residual
    engine.compressor = sliced
    return plan


def average_of_partials(
    partials: Sequence[bytes], plan: SlicePlan, *, stage_index: int, outer_round: int, refuse_raw: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The stage's averaged pseudo-gradient from the A partial blobs; None when every partial is empty
    (nothing was accepted anywhere: the round is a no-op, as in the full exchange)."""
    if all(partial == b"" for partial in partials):
        return None
    return assemble_partials(partials, plan, stage_index=stage_index, outer_round=outer_round, refuse_raw=refuse_raw)
