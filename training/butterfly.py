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

The plan (how a stage is cut, who aggregates each slice) is :mod:`training.slice_plan`. The byte layouts of
the slice messages and partial payloads, and the partial's audit by
replay, are :mod:`training.slicemessages`; a replica's slices travel as one bundle
(:mod:`training.slicebundle`).
"""

from __future__ import annotations

import contextlib
import logging
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
    feedback_target,
)
from training.config_compression import CompressionConfig
from training.diloco import average_contributions
from training.errors import ContributionDecodeError, ContributionEncodeError
from training.exact_codec import ExactCodec
from training.robust import ContributionReport, lower_median, robust_contributions
from training.slice_plan import (
    LIVE_MIN_SLICE_NUMEL,
    SliceError,
    SlicePlan,
    assemble_slices,
    live_plan,
    split_slices,
)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- budgets


def slice_budget(stage_budget: int, plan: SlicePlan, index: int) -> int:
    """Byte budget of slice ``index``: the stage's budget in proportion to its elements (0 stays 0)."""
    if stage_budget <= 0:
        return 0
    return max(1, stage_budget * plan.slice_numel(index) // max(plan.numel, 1))


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

    def __init__(
        self, shapes, cfg: CompressionConfig, plan: SlicePlan, *, bandwidth_budget: int | None = None
    ):
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
            name: (feedback_target(value, self.residual[name], self.cfg) if use_feedback
                   else torch.add(value.to(torch.float32), self.residual[name]))
            if carry
            else value.to(torch.float32)
            for name, value in pseudo_gradient.items()
        }
        with ExactCodec(self.exact) if self.exact else contextlib.nullcontext():  # training.reproducible
            blobs, decoded, stats = encode_slices(
                target,
                self.plan,
                self.cfg,
                self.bandwidth_budget,
                stage_index=stage_index,
                outer_round=outer_round,
            )
        if use_feedback:
            self.residual = {name: torch.sub(target[name], decoded[name]) for name in self.residual}
        elif self._carry:
            self.residual = {
                name: torch.zeros(shape, dtype=torch.float32) for name, shape in self.shapes.items()
            }
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

    def compress(
        self, pseudo_gradient, *, stage_index: int, outer_round: int
    ) -> tuple[bytes, CompressionStats]:
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


def partial_budget(
    slice_blobs: Sequence[bytes], reports: Sequence[ContributionReport], stage_budget: int
) -> int:
    """The partial's byte budget: the lower median of the accepted inputs' sizes (0: code to the error
    budget).

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
    partials: Sequence[bytes],
    plan: SlicePlan,
    *,
    stage_index: int,
    outer_round: int,
    refuse_raw: bool = True,
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
    sliced.exact = old.exact  # a reproducible run's fixed-order codec
    sliced.residual = old.residual
    engine.compressor = sliced
    return plan


def average_of_partials(
    partials: Sequence[bytes],
    plan: SlicePlan,
    *,
    stage_index: int,
    outer_round: int,
    refuse_raw: bool = True,
) -> dict[str, torch.Tensor] | None:
    """The stage's averaged pseudo-gradient from the A partial blobs; None when every partial is empty
    (nothing was accepted anywhere: the round is a no-op, as in the full exchange)."""
    if all(partial == b"" for partial in partials):
        return None
    return assemble_partials(
        partials, plan, stage_index=stage_index, outer_round=outer_round, refuse_raw=refuse_raw
    )
