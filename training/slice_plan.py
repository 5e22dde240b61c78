"""The sliced exchange's plan: how a stage is cut into slices and who aggregates each (pure functions of
public inputs; every node and the auditor derive the same plan; docs/DILOCOX.md section 12)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from training.codec_wire import matrix_view_shape
from training.errors import TrainingError

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
    """``[{name: piece of tensor} for each slice]`` (contiguous copies of column pieces, views of row pieces).
    """
    if set(tensors) != {name for name, _ in plan.shapes}:
        raise SliceError("tensor names differ from the slice plan's")
    return [
        {piece.name: _piece_of(tensors[piece.name], piece).contiguous() for piece in pieces}
        for pieces in plan.slices
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
                # a view into ``target`` (contiguous, so reshape is a view)
                _piece_of(target, piece).copy_(value)
    return out


def aggregator_of(slice_index: int, outer_round: int, num_members: int) -> int:
    """Canonical index of the member that aggregates ``slice_index`` in ``outer_round`` (a rotation).

    With ``A <= R`` slices the A aggregators of a round are distinct, and the
    role moves by one member per round so no member aggregates the same slice
    twice in a row (a Byzantine aggregator cannot camp on one slice).
    """
    if num_members < 1:
        raise SliceError("no members to aggregate")
    return (slice_index + outer_round) % num_members


def candidate(slice_index: int, outer_round: int, num_members: int, turn: int) -> int:
    """Canonical index of slice ``slice_index``'s aggregator (``turn`` 0) or its ``turn``-th fallback."""
    return aggregator_of(slice_index + turn, outer_round, num_members)


def live_plan(shapes: Mapping[str, tuple[int, ...]], num_replicas: int,
              min_slice_numel: int = LIVE_MIN_SLICE_NUMEL) -> SlicePlan:
    """The live node's (and its auditor's) slice plan: :func:`plan_slices` with the run's
    ``diloco.min_slice_numel`` (``LIVE_MIN_SLICE_NUMEL`` by default)."""
    return plan_slices(shapes, num_replicas, min_slice_numel=min_slice_numel)
