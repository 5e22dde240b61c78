"""The norm rule of the robust aggregation (docs/DILOCOX.md section 10; contracts/src/NormRule.sol).

From the accepted contributions' norms ``n_j`` (each one IEEE double; per step, ``n_j / k_j``, in a
time-bounded run): ``med`` = the lower median ``sorted(n)[(A-1)//2]``, ``bound = norm_clip * med``
(``norm_clip = 0``: no bound) and ``s_j = 1`` if ``n_j <= bound`` else ``bound / n_j``, each one float64
operation. :mod:`training.robust` clips the decoded tensors with it; :mod:`ledger.normproof` recomputes the
scales from the committed exact sums of squares, as the contract does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def lower_median(values: Sequence[float]) -> float:
    """``sorted(values)[(len - 1) // 2]``: a value that occurs, and the smaller middle one for an even count.
    """
    if not values:
        raise ValueError("lower_median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def clip_bound(median: float, norm_clip: float) -> float:
    """``norm_clip * median`` (float64), or infinity when the rule is off (``norm_clip = 0``)."""
    return norm_clip * median if norm_clip else math.inf


def clip_scale(norm: float, bound: float) -> float:
    """1.0 if ``norm <= bound``, else ``bound / norm`` (float64, one division)."""
    return 1.0 if norm <= bound else bound / norm


def per_step(norm: float, steps: int) -> float:
    """``n_j / k_j`` (one float64 division): the norm a time-bounded run's rule compares."""
    return norm / steps


def clip_scales(norms: Sequence[float], norm_clip: float, steps: Sequence[int] = ()) -> list[float]:
    """The scale of each accepted contribution, from its norm (and, in a time-bounded run, its declared
    inner steps: the rule then runs on the per-step norms)."""
    compared = list(norms)
    if steps:
        compared = [per_step(norm, step) for norm, step in zip(norms, steps, strict=True)]
    if not compared:
        return []
    bound = clip_bound(lower_median(compared), norm_clip)
    return [clip_scale(norm, bound) for norm in compared]
