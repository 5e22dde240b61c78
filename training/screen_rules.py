"""Screening's rules by name (``diloco.screen_rule``; docs/DILOCOX.md sections 10 and 13, "Screening").

One :class:`ScreenRule` per version, a registry keyed by the config's spelling
(:data:`SCREEN_RULE_KINDS`) and :func:`screen_rule_for`. Each rule is a pure function of the recorded
losses (what an auditor re-derives from a round's record); the measurements are
:func:`training.screening.screen_contributions`'s, whose module docstring writes the rules out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from training.config import SCREEN_RULES, DilocoConfig
from training.robust import lower_median

#: Contributions a round needs before screening excludes any (a majority to measure against).
MIN_SCREENED = 3
#: Version 2 (``screen_rule = "two_sided"``): a contribution must descend by at least this share of the median
#: slope (or by the tolerance, whichever is less) ...
SLOPE_SHARE = 4
#: ... and cost no more than this many times the median's curvature (plus the tolerance): the curvature grows
#: as the square of an update's length, so this is an update twice the median's.
CURVATURE_FACTOR = 4
#: Version 3 (``"paired"``): a slope may fall short of the least one by this many standard errors of its
#: measurement (at most by the tolerance): the two-sided 95% band of a normal estimate.
SLOPE_ERRORS = 2


@dataclass(frozen=True)
class ScreeningReport:
    """The screening verdict on one contribution (canonical ``index``).

    ``loss_after`` is None for a contribution that was not screened (it did not
    decode; aggregation excludes it anyway).
    """

    index: int
    loss_before: float
    loss_after: float | None
    excluded: bool
    detail: str
    #: Versions 2 and 3: the loss of the contribution applied against itself (``theta + outer_lr * d``).
    loss_against: float | None = None
    #: Version 3 only: the standard error of its slope over the screening batch's windows
    #: (:func:`slope_error`).
    slope_error: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def difference(a: float, b: float) -> float:
    """``a - b`` in float64, -inf where that is NaN (both infinite)."""
    value = a - b
    return -math.inf if math.isnan(value) else value


class ScreenRule:
    """One screening rule: what it measures of each contribution and how it judges the measurements."""

    #: The name ``diloco.screen_rule`` gives it.
    name = ""
    #: Whether each contribution is also applied against itself (``theta + outer_lr * d``): versions 2 and 3.
    against = False
    #: Whether the losses are measured per window of the screening batch (version 3: each slope's error).
    per_window = False

    def judge(
        self,
        loss_before: float,
        after: Mapping[int, float],
        count: int,
        diloco_cfg: DilocoConfig,
        against: Mapping[int, float] | None,
        errors: Mapping[int, float] | None,
    ) -> list[ScreeningReport]:
        """The verdict on each of ``count`` contributions (:func:`training.screening.judge`)."""
        raise NotImplementedError


class OneSided(ScreenRule):
    """Version 1: the loss of each contribution applied alone against the median's."""

    name = "one_sided"

    def judge(self, loss_before, after, count, diloco_cfg, against, errors):
        loss_after = after
        tolerance = max(diloco_cfg.screen_abs_tol, diloco_cfg.screen_rel_tol * loss_before)
        median = lower_median(list(loss_after.values())) if loss_after else math.inf
        # Against the median contribution, not min(L_b, median): with the one-step delay every honest
        # contribution, applied alone to weights that already moved, can do worse than L_b late in a
        # run; measuring against L_b then left honest ones out (a bench run lost 1 of 4 in a round).
        threshold = median + tolerance
        if diloco_cfg.budgeted:
            # Replicas of a time-bounded run train different counts: an honest slow replica's shorter update,
            # applied alone, lands above the faster ones' median, yet below L_b. Scaling it up to the mean
            # count does not help: fewer steps buy less than their share of loss, and late in a run the scaled
            # update overshoots (bench/bench_heterogeneous.py screened the honest 4x replica out of 4 of 7
            # rounds that way). Only a contribution worse than both leaving the weights alone and the median
            # is left out.
            threshold = max(loss_before, median) + tolerance
        # With fewer than three screened contributions there is no majority to measure against: the
        # lower median of two is the better one, and the other, honest or not, would fall above it
        # (a 2-replica benchmark run lost an honest contribution that way). Nothing is excluded then;
        # the norm rule still bounds every contribution.
        if len(loss_after) < MIN_SCREENED:
            threshold = math.inf
        reports = []
        for index in range(count):
            if index not in loss_after:
                reports.append(
                    ScreeningReport(index, loss_before, None, False, "not screened (does not decode)")
                )
                continue
            value = loss_after[index]
            excluded = not value <= threshold
            detail = (
                f"loss {loss_before:.6g} -> {value:.6g} alone, above the median {median:.6g} + "
                f"{tolerance:.3g}"
                if excluded
                else ""
            )
            reports.append(ScreeningReport(index, loss_before, value, excluded, detail))
        return reports


class TwoSided(ScreenRule):
    """Version 2 (time-bounded runs): each contribution must descend (its slope) and its length cost no more
    than four times the median one's (its curvature)."""

    name = "two_sided"
    against = True

    def judge(self, loss_before, after, count, diloco_cfg, against, errors):
        if against is None or set(against) != set(after):
            raise ValueError("version-2 screening judges each contribution's loss applied against itself too")
        return judge_two_sided(loss_before, after, against, count, diloco_cfg)


class Paired(TwoSided):
    """Version 3 (time-bounded runs): version 2 with each slope judged within its measurement error."""

    name = "paired"
    per_window = True

    def judge(self, loss_before, after, count, diloco_cfg, against, errors):
        if against is None or set(against) != set(after):
            raise ValueError("version-2 screening judges each contribution's loss applied against itself too")
        if errors is None or set(errors) != set(after):
            raise ValueError("version-3 screening judges each slope with its standard error")
        return judge_two_sided(loss_before, after, against, count, diloco_cfg, errors)


def judge_two_sided(
    loss_before: float,
    after: Mapping[int, float],
    against: Mapping[int, float],
    count: int,
    diloco_cfg: DilocoConfig,
    errors: Mapping[int, float] | None = None,
) -> list[ScreeningReport]:
    """Versions 2 and 3 (``errors``: each slope's standard error; :mod:`training.screening`; docs/DILOCOX.md
    section 13, "Screening of a time-bounded run")."""
    tolerance = max(diloco_cfg.screen_abs_tol, diloco_cfg.screen_rel_tol * loss_before)
    # Version 3: a slope may fall short of the least one by SLOPE_ERRORS standard errors over the batch (at
    # most by the tolerance); version 2: by nothing.
    margin = {i: min(SLOPE_ERRORS * errors[i], tolerance) if errors is not None else 0.0 for i in after}
    # inf - inf (both sides non-finite) is NaN: such a contribution descends nowhere (-inf), and NaN never
    # enters a median's sort.
    slope = {i: difference(against[i], after[i]) for i in after}
    curvature = {i: (against[i] + after[i]) / 2 - loss_before for i in after}  # +inf if either side is
    screens = len(after) >= MIN_SCREENED  # else no majority to measure against (judge): nothing is excluded
    least_slope = min(tolerance, lower_median(list(slope.values())) / SLOPE_SHARE) if screens else -math.inf
    most_curvature = (
        CURVATURE_FACTOR * max(lower_median(list(curvature.values())), 0.0) + tolerance
        if screens
        else math.inf
    )
    reports = []
    for index in range(count):
        if index not in after:
            reports.append(ScreeningReport(index, loss_before, None, False, "not screened (does not decode)"))
            continue
        descends = not screens or slope[index] + margin[index] > least_slope
        near = not screens or curvature[index] <= most_curvature
        detail = ""
        if not descends:
            within = f" + {margin[index]:.3g}" if errors is not None else ""
            detail = (f"loss {loss_before:.6g} -> {after[index]:.6g} alone, {against[index]:.6g} against it: "
                      f"slope {slope[index]:.3g}{within} not above {least_slope:.3g}")
        elif not near:
            detail = (f"loss {loss_before:.6g} -> {after[index]:.6g} alone, {against[index]:.6g} against it: "
                      f"curvature {curvature[index]:.3g} above {most_curvature:.3g}")
        reports.append(ScreeningReport(index, loss_before, after[index], not (descends and near), detail,
                                       against[index], None if errors is None else errors[index]))
    return reports


#: Every rule a run can name, by ``diloco.screen_rule`` (the config checks the name against
#: :data:`training.config.SCREEN_RULES`, the same names, at load, and resolves "auto").
SCREEN_RULE_KINDS: dict[str, ScreenRule] = {kind.name: kind for kind in (OneSided(), TwoSided(), Paired())}
assert tuple(SCREEN_RULE_KINDS) == SCREEN_RULES, "training.config.SCREEN_RULES names every kind"


def screen_rule_for(diloco_cfg: DilocoConfig) -> ScreenRule:
    """The rule ``diloco_cfg.screen_rule`` names; a fixed-H run screens by version 1."""
    return (
        SCREEN_RULE_KINDS[diloco_cfg.screen_rule] if diloco_cfg.budgeted else SCREEN_RULE_KINDS["one_sided"]
    )
