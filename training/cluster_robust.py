"""The robust aggregation of a round over a stage cut into shards (issue 75; docs/CLUSTER.md).

:func:`training.diloco.aggregate_with_report` decodes each contribution whole, takes its exact norm, leaves
out what does not decode or was screened out, clips to ``norm_clip`` x the lower median, averages and
steps. Over shards (:mod:`training.cluster_plan`) each rank does the per-element part on its own tensors
only, and the decisions that need the whole contribution are made from what every rank reports:

1. :func:`shard_facts`: each rank decodes its part of every contribution (``decode_declared`` over its
   shard's shapes) and takes the exact sum of squares of what decoded (:func:`exact_square_sum`);
2. the ranks exchange these facts (a few integers per contribution: ``all_gather_object``);
3. :func:`round_reports`, the same pure function on every rank: a contribution that failed on any rank
   is left out with the reason of the lowest such rank (its tensors come first in the stage's order,
   where the whole decode fails first); the norm is ``sqrt`` of the exact total, rounded once, the same
   double as the whole contribution's; then exclusion, median, clip scales and the cap on listed
   contributions exactly as :func:`training.robust.robust_contributions` and
   :func:`training.diloco.capped_contributions`;
4. :func:`shard_aggregation`: each rank scales, averages and steps its own tensors
   (:func:`training.diloco.step_with_average`): elementwise float32 operations per tensor, so the result
   is, tensor by tensor, the bits the whole-stage aggregation computes.

Reports carry the same reasons, norms and scales as a whole-stage aggregation; a left-out contribution's
detail text may number its tensor within the shard rather than the stage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from rulebook.norm_clip import clip_bound, clip_scale, lower_median, per_step
from training.cluster_merkle import exact_square_sum, norm_of
from training.codec_wire import decode_declared
from training.config import DilocoConfig
from training.config_base import LISTING_SCHEMES, MAX_LISTED
from training.diloco import Aggregation, average_contributions, step_with_average
from training.errors import ContributionDecodeError
from training.robust import (
    _DECODE_REASONS,
    BAD_STEPS,
    OVER_LIMIT,
    SCREENED,
    ContributionReport,
    scaled,
)


@dataclass(frozen=True)
class ShardFact:
    """What one rank knows of one contribution: its failure (reason, detail) or its exact square sum."""

    reason: str = ""
    detail: str = ""
    numerator: int = 0
    denominator: int = 1
    steps: int | None = None  # the declared inner steps (a time-bounded run's header)

    @property
    def failed(self) -> bool:
        return bool(self.reason)


def shard_facts(parts: Sequence[bytes | None], shapes: Mapping[str, tuple[int, ...]], *, stage_index: int,
                outer_round: int, refuse_raw: bool, split_errors: Mapping[int, ContributionDecodeError] = {},
                ) -> tuple[list[ShardFact], dict[int, dict[str, torch.Tensor]]]:
    """``(facts, decoded)``: each contribution's :class:`ShardFact` on this rank and its decoded tensors.

    ``parts[j]``: this rank's message of contribution j (None where it did not split: ``split_errors[j]``
    is the error, raised by the split on rank 0 and the same on every rank).
    """
    facts: list[ShardFact] = []
    decoded: dict[int, dict[str, torch.Tensor]] = {}
    for index, part in enumerate(parts):
        try:
            if part is None:
                raise split_errors[index]
            steps, tensors = decode_declared(part, shapes, stage_index=stage_index, outer_round=outer_round,
                                             refuse_raw=refuse_raw)
        except ContributionDecodeError as exc:
            reason = next(code for kind, code in _DECODE_REASONS if isinstance(exc, kind))
            facts.append(ShardFact(reason, str(exc)))
            continue
        total = exact_square_sum(tensors)
        if total is None:  # not a decoded contribution's (decode refuses non-finite values)
            facts.append(ShardFact("non_finite", "non-finite values"))
            continue
        decoded[index] = tensors
        facts.append(ShardFact(numerator=total.numerator, denominator=total.denominator, steps=steps))
    return facts, decoded


def _reports(facts: Sequence[Sequence[ShardFact]], norm_clip: float, excluded: Mapping, steps_range):
    count = len(facts[0])
    reports: list[ContributionReport | None] = [None] * count
    norms: dict[int, float] = {}
    clip_norms: dict[int, float] = {}
    for index in range(count):
        per_rank = [rank_facts[index] for rank_facts in facts]
        failed = next((fact for fact in per_rank if fact.failed), None)
        if failed is not None:
            reports[index] = ContributionReport(index, False, failed.reason, failed.detail, None, 0.0)
            continue
        norm = norm_of(sum((Fraction(f.numerator, f.denominator) for f in per_rank), Fraction(0)))
        declared = per_rank[0].steps
        if steps_range is not None:
            low, high = steps_range
            if declared is None or not low <= declared <= high:
                detail = ("declares no inner steps" if declared is None
                          else f"declares {declared} inner steps, outside the run's [{low}, {high}]")
                reports[index] = ContributionReport(index, False, BAD_STEPS, detail, norm, 0.0)
                continue
        if index in excluded:
            why = excluded[index]
            reason, detail = why if isinstance(why, tuple) else (SCREENED, why)
            reports[index] = ContributionReport(index, False, reason, str(detail), norm, 0.0)
            continue
        norms[index] = norm
        clip_norms[index] = per_step(norm, declared) if steps_range is not None else norm
    median = lower_median(list(clip_norms.values())) if clip_norms else 0.0
    bound = clip_bound(median, norm_clip)
    per = " per step" if steps_range is not None else ""
    for index in norms:
        scale = clip_scale(clip_norms[index], bound)
        detail = ("" if scale == 1.0
                  else f"norm{per} {clip_norms[index]:.6g} > {norm_clip:g} x median {median:.6g}")
        reports[index] = ContributionReport(index, True, "", detail, norms[index], scale)
    return [report for report in reports if report is not None]


def round_reports(facts: Sequence[Sequence[ShardFact]], diloco_cfg: DilocoConfig,
                  excluded: Mapping | None = None) -> list[ContributionReport]:
    """Every contribution's report from all ranks' facts (``facts[rank][j]``; module docstring, step 3)."""
    excluded = dict(excluded or {})
    count = len(facts[0])
    unknown = sorted(i for i in excluded if not 0 <= i < count)
    if unknown:
        raise ValueError(f"excluded indices {unknown} outside 0..{count - 1}")
    reports = _reports(facts, diloco_cfg.norm_clip, excluded, diloco_cfg.steps_range)
    listed = [report.index for report in reports if report.accepted]
    if diloco_cfg.commitments not in LISTING_SCHEMES or len(listed) <= MAX_LISTED:
        return reports
    over = {index: (OVER_LIMIT, f"past the {MAX_LISTED} contributions a round of this run may list")
            for index in listed[MAX_LISTED:]}
    return _reports(facts, diloco_cfg.norm_clip, {**excluded, **over}, diloco_cfg.steps_range)


def shard_aggregation(global_shard: Mapping[str, torch.Tensor], momentum_shard: Mapping[str, torch.Tensor],
                      decoded: Mapping[int, Mapping[str, torch.Tensor]],
                      reports: Sequence[ContributionReport],
                      diloco_cfg: DilocoConfig, outer_round: int) -> Aggregation:
    """This rank's :class:`Aggregation` of its shard (step 4): the accepted contributions scaled, averaged
    in canonical order and stepped. Its ``weights_hash`` is the shard's, not the stage's."""
    accepted = []
    for report in reports:
        if report.accepted:
            tensors = decoded[report.index]
            accepted.append(dict(tensors) if report.scale == 1.0 else scaled(tensors, report.scale))
    average = average_contributions(accepted) if accepted else None
    return step_with_average(global_shard, momentum_shard, average, diloco_cfg, outer_round, reports)
