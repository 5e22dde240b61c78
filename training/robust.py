"""Byzantine-tolerant aggregation of one round of one stage: exclusion and the norm rule.

A member can send anything: bytes that do not decode, tensors of the wrong
shape, a codec the run forbids, or a well-formed pseudo-gradient that is huge,
flipped or noise. :func:`robust_contributions` turns the round's contribution
bytes (canonical order) into the decoded tensors to average plus one
:class:`ContributionReport` per contribution, so one bad contribution costs only
itself and the round goes on with the rest (docs/DILOCOX.md section 10).

Order of operations, per stage and round, ``c_0 .. c_{K-1}`` in canonical order:

1. Decode ``c_j`` strictly (``refuse_raw`` in a compressed run). Failure: excluded,
   reason ``undecodable`` / ``wrong_shape`` / ``non_finite`` / ``raw_in_compressed``.
2. Indices the caller excludes (screening, :mod:`training.screening`): excluded,
   reason ``screened`` (or the caller's own, e.g. ``other_result``).
3. ``n_j = sqrt(fsum_k float64(d_jk)^2)`` over every element of every tensor of
   the stage: each square is exact in float64 (a float32 has 24 significant bits)
   and ``math.fsum`` rounds the exact sum once, so the norm is one well-defined
   IEEE double whatever the order, thread count or machine.
4. ``med`` = the lower median of the accepted norms, ``sorted(n)[(A-1)//2]`` for A
   accepted; ``bound = norm_clip * med`` (float64).
5. ``s_j = 1`` if ``n_j <= bound`` (the contribution is left untouched, bit for
   bit), else ``s_j = bound / n_j`` and ``d_j <- float32(float64(d_j) * s_j)``
   (one correctly rounded float64 multiply, one rounding to float32).

The survivors are then averaged exactly as before (``training.diloco``); with
none left the round is a no-op.

In a run whose rounds are bounded by time (``steps_range`` given: ``diloco.round_budget_s > 0``,
issue 44) every contribution declares the inner steps ``k_j`` it trained (codec_wire version 2).
One that declares none, or a count outside the run's ``[min_inner_steps, inner_steps]``, is
excluded with reason ``bad_steps`` at step 1. Steps 3-5 then run on the per-step norms
``p_j = n_j / k_j`` (one float64 division): ``med`` is the lower median of the ``p_j``, ``bound =
norm_clip * med`` and ``s_j = bound / p_j`` where ``p_j > bound``. An honest replica that trained
a quarter of the steps sends a pseudo-gradient about a quarter as long; per step it is like the
others, and it is neither clipped nor made the median. Each report's ``norm`` stays ``n_j``.

Why a clipped norm and not a coordinate-wise median or trimmed mean: the norm
rule is cheap, keeps honest rounds bit-identical to the plain average, and
bounds what any one member can move the weights by to ``norm_clip * med / A``;
the direction of a bad contribution is screened separately where the whole
model is at hand (Karimireddy, He, Jaggi 2021, "Learning from history for
Byzantine robust optimization", centered clipping; Templar's Gauntlet for the
screening).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction

import numpy as np
import torch

# lower_median and clip_scale re-exported: training.robust is their address too
from rulebook.norm_clip import (
    clip_bound,
    clip_scale,
    lower_median,
    per_step,
)
from training.codec_wire import decode_declared, header_steps
from training.errors import (
    ContributionCodecRefused,
    ContributionDecodeError,
    ContributionNonFiniteError,
    ContributionShapeError,
)

UNDECODABLE = "undecodable"
WRONG_SHAPE = "wrong_shape"
NON_FINITE = "non_finite"
RAW_IN_COMPRESSED = "raw_in_compressed"
SCREENED = "screened"
#: A time-bounded run's contribution that declares no inner steps, or a count outside the run's range.
BAD_STEPS = "bad_steps"
#: Built on another result of the round before than the holder's (a forked member's round; the caller
#: compares the contribution's bound ``applied_hash``: docs/PROTOCOL.md "When a node's weights leave the
#: record").
OTHER_RESULT = "other_result"
#: Accepted beyond the most contributions a fraud-provable run's round may list (RunParams.maxContributions,
#: issue 62: training/diloco.py caps the accepted set in canonical order; more: a provably wrong round);
#: re-derived by every aggregation of the round, so not a caller's reason.
OVER_LIMIT = "over_limit"
EXCLUSION_REASONS = (
    UNDECODABLE,
    WRONG_SHAPE,
    NON_FINITE,
    RAW_IN_COMPRESSED,
    SCREENED,
    OTHER_RESULT,
    BAD_STEPS,
    OVER_LIMIT,
)
#: The reasons a caller excludes by (step 2 of the module docstring), not re-derivable from the bytes alone.
CALLER_REASONS = (SCREENED, OTHER_RESULT)

# Most specific first: the subclasses of ContributionDecodeError say which way it failed.
_DECODE_REASONS = (
    (ContributionCodecRefused, RAW_IN_COMPRESSED),
    (ContributionShapeError, WRONG_SHAPE),
    (ContributionNonFiniteError, NON_FINITE),
    (ContributionDecodeError, UNDECODABLE),
)


@dataclass(frozen=True)
class ContributionReport:
    """What the aggregation did with one contribution of a round (canonical ``index``).

    ``reason`` is ``""`` when accepted, else one of :data:`EXCLUSION_REASONS`;
    ``detail`` says more (the decoder's message, the screening losses).
    ``norm`` is the float64 L2 norm of the decoded contribution (None if it did
    not decode); ``scale`` the factor the norm rule applied (1.0 untouched,
    0.0 when excluded). Every field is a pure function of the round's inputs,
    so an auditor re-derives the list exactly.
    """

    index: int
    accepted: bool
    reason: str
    detail: str
    norm: float | None
    scale: float

    def to_dict(self) -> dict:
        return asdict(self)


_scratch = threading.local()  # per thread: two float64 buffers reused across calls


def _buffers(count: int) -> tuple[np.ndarray, np.ndarray]:
    """Two float64 work arrays of ``count`` elements (reused: fresh large arrays cost page faults). Arrays
    longer than a block (:func:`_levels_norm`'s fallback over a whole contribution) are not kept: kept per
    thread, they held 16 bytes per element of a stage's largest contribution in every thread that ever fell
    back (300 MB a thread at a llama-20m stage)."""
    if count > _CHUNK:
        return np.empty(count, dtype=np.float64), np.empty(count, dtype=np.float64)
    held = getattr(_scratch, "arrays", None)
    if held is None or held[0].size < count:
        held = _scratch.arrays = (np.empty(count, dtype=np.float64), np.empty(count, dtype=np.float64))
    return held[0][:count], held[1][:count]


_CHUNK = 1 << 15  # float64 values per block of the one-pass norm: two blocks stay in the L2 cache


def contribution_norm(decoded: Mapping[str, torch.Tensor]) -> float:
    """``sqrt(fsum of float64(x)^2)`` over every element: exact squares, one rounding of the sum.

    The first level of :func:`_levels_norm` in one pass over cache-sized blocks:
    ``mu`` is taken from the float32 values (``max |x|``, squared exactly) instead
    of a pass over the squares, and each block of squares is split into its
    high parts ``q`` (summed exactly: every partial sum is a multiple of ``h``
    below ``sigma``, whichever blocks and order) and its remainders (summed in
    float64 in some order, which the bound covers) while it is in the cache.
    When the bound decides the rounding the result is the correctly rounded
    total, the same double :func:`_levels_norm` returns; otherwise that
    function decides. Same result, about a third of the memory traffic.

    Each block's remainders are summed on their own, and those block sums are
    added exactly: the float64 error is then bounded block by block
    (``sum of size^2`` units, not ``count^2``), so the bound decides at any
    count (with one bound over all ``count`` values it could not above ~2**26
    values, a llama-124m contribution: every call fell back to the levels).
    """
    arrays = []
    for name in sorted(decoded):
        value = decoded[name].detach().to(torch.float32).reshape(-1)
        if value.numel():
            arrays.append(value.contiguous().numpy())
    count = sum(array.size for array in arrays)
    if count == 0:
        return 0.0
    peaks = [max(float(array.max()), -float(array.min())) for array in arrays]  # nan if the array has one
    if any(math.isnan(x) for x in peaks):
        return math.nan  # not a decoded contribution (those are finite)
    peak = max(peaks)
    largest = peak * peak  # exact: a float32 squared fits in a double
    if not math.isfinite(largest):
        return math.inf
    if largest == 0.0:
        return 0.0
    spread = count.bit_length() + 1  # 2**spread > 2 * count
    exponent = math.frexp(largest)[1] + spread
    sigma = math.ldexp(1.0, exponent)
    squares, scratch = _buffers(min(count, _CHUNK))
    high = 0.0
    rests: list[float] = []  # each block's float64 sum of remainders
    units = 0  # sum over blocks of size^2: the blocks' summation errors together are <= units * 2**-52 * h
    filled = 0

    def flush(size: int) -> None:
        nonlocal high, units
        block, grid = squares[:size], scratch[:size]
        np.add(block, sigma, out=grid)
        np.subtract(grid, sigma, out=grid)  # q: exact, a multiple of h
        high += float(grid.sum())  # exact (see above)
        np.subtract(block, grid, out=block)  # exact; |r_i| <= h
        rests.append(float(block.sum()))  # within (size - 1) u sum |r_i| <= size^2 2**-53 h of the exact sum
        units += size * size

    for array in arrays:
        start = 0
        while start < array.size:
            take = min(array.size - start, _CHUNK - filled)
            part = array[start : start + take]
            np.multiply(part, part, out=squares[filled : filled + take], dtype=np.float64)  # exact
            filled += take
            start += take
            if filled == _CHUNK:
                flush(filled)
                filled = 0
    if filled:
        flush(filled)
    half_ulp = math.ldexp(1.0, exponent - 53)  # h = ulp(sigma) / 2
    error = Fraction(half_ulp) * units / (1 << 52)
    total = Fraction(high) + sum(map(Fraction, rests), Fraction(0))  # the block sums added exactly
    low, high_end = float(total - error), float(total + error)  # correctly rounded
    if low == high_end:
        return math.sqrt(low)
    return _levels_norm(arrays, count)


def _levels_norm(arrays: Sequence[np.ndarray], count: int) -> float:
    """``sqrt(fsum of float64(x)^2)`` over the float32 ``arrays`` (``count`` values), level by level.

    The same correctly rounded double ``math.fsum`` returns for the exact
    squares, bit for bit (tests/test_training_robust.py checks both), in a few
    vectorized passes. Each float32 square is exact in float64 (48 significant
    bits). Their exact sum is taken apart level by level (Rump, Ogita, Oishi
    2008, "Accurate floating-point summation", ExtractVector): with ``mu`` the
    largest remaining magnitude, ``mu < 2**e``, ``2**M > 2 n`` and
    ``sigma = 2**(e + M)``, ``q_i = (sigma + r_i) - sigma`` is exact (Sterbenz),
    ``r_i - q_i`` is the exact rounding error of that addition (so
    ``|r_i - q_i| <= h = ulp(sigma) / 2``), and every ``q_i`` is a multiple of
    ``h`` with ``sum |q_i| < sigma``: fewer than ``2**53`` units, so ``sum(q)``
    is exact in float64 in any order (numpy's pairwise sum, any machine). The
    levels' sums are added as exact fractions. After each level the plain
    float64 sum ``s`` of the remainders is within ``(n-1) u / (1 - (n-1) u) *
    sum |r_i| <= n 2**-52 * n h`` of their exact sum for any summation order
    (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2); when both
    ends of that interval round to the same double, rounding being monotonic,
    so does the exact total. Else the next level is extracted (until nothing
    remains, which is then exact). One level suffices unless the total lies
    within ~2**-40 of a rounding boundary.
    """
    remainder, scratch = _buffers(count)
    offset = 0
    for array in arrays:
        np.multiply(array, array, out=remainder[offset : offset + array.size], dtype=np.float64)  # exact
        offset += array.size
    spread = count.bit_length() + 1  # 2**spread > 2 * count
    total = Fraction(0)
    largest = float(remainder.max())  # the squares are >= 0
    if not math.isfinite(largest):
        return math.sqrt(largest)  # not a decoded contribution (those are finite): inf or nan
    while largest != 0.0:
        exponent = math.frexp(largest)[1] + spread
        sigma = math.ldexp(1.0, exponent)
        np.add(remainder, sigma, out=scratch)
        np.subtract(scratch, sigma, out=scratch)  # q: exact, a multiple of h
        total += Fraction(float(scratch.sum()))  # exact in any order
        np.subtract(remainder, scratch, out=remainder)  # exact; |r_i| <= h
        half_ulp = math.ldexp(1.0, exponent - 53)  # h = ulp(sigma) / 2
        estimate = Fraction(float(remainder.sum()))
        error = Fraction(half_ulp) * count * count / (1 << 52)
        low, high = float(total + estimate - error), float(total + estimate + error)  # correctly rounded
        if low == high:
            return math.sqrt(low)
        np.abs(remainder, out=scratch)
        largest = float(scratch.max())
    return math.sqrt(float(total))


def scaled(decoded: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``float32(float64(x) * scale)`` per tensor: one correctly rounded product, one rounding."""
    return {
        name: torch.mul(value.to(torch.float64), scale).to(torch.float32) for name, value in decoded.items()
    }


def robust_contributions(
    contributions: Sequence[bytes],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    norm_clip: float,
    stage_index: int | None = None,
    outer_round: int | None = None,
    refuse_raw: bool = False,
    excluded: Mapping[int, str | tuple[str, str]] | None = None,
    known: Sequence[tuple[bytes, Mapping[str, torch.Tensor]]] = (),
    steps_range: tuple[int, int] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[ContributionReport]]:
    """Decode, exclude and clip one round's contributions (module docstring, steps 1-5).

    ``steps_range``: ``(min_inner_steps, inner_steps)`` of a time-bounded run (None: fixed H); each
    contribution must then declare its steps inside it, and the norm rule runs per step (module
    docstring).

    Returns the accepted contributions' tensors, in canonical order and already
    scaled, and one report per input contribution. ``excluded`` maps canonical
    indices to a detail string (screening's verdict; reason ``screened``) or to a ``(reason, detail)``
    pair (another of :data:`CALLER_REASONS`); ``norm_clip = 0`` turns
    the norm rule off (every accepted scale is 1.0). ``known`` lists
    ``(bytes, decoded tensors)`` the caller already holds, exactly what
    :func:`decode_contribution` returns for those bytes with these arguments
    (a replica's own contribution: the encoder returns the decoder's output
    bit for bit); a contribution equal to such bytes is not decoded again.
    """
    excluded = dict(excluded or {})
    unknown = sorted(i for i in excluded if not 0 <= i < len(contributions))
    if unknown:
        raise ValueError(f"excluded indices {unknown} outside 0..{len(contributions) - 1}")
    reports: list[ContributionReport | None] = [None] * len(contributions)
    decoded: dict[int, dict[str, torch.Tensor]] = {}
    norms: dict[int, float] = {}
    clip_norms: dict[int, float] = {}  # what the norm rule compares: n_j, or n_j / k_j in a time-bounded run
    steps: dict[int, int] = {}
    for index, blob in enumerate(contributions):
        try:
            tensors = next((dict(tensors) for data, tensors in known if data == blob), None)
            if tensors is None:
                declared, tensors = decode_declared(
                    blob, shapes, stage_index=stage_index, outer_round=outer_round, refuse_raw=refuse_raw
                )
            else:
                declared = header_steps(blob) if steps_range is not None else None
        except ContributionDecodeError as exc:
            reason = next(code for kind, code in _DECODE_REASONS if isinstance(exc, kind))
            reports[index] = ContributionReport(index, False, reason, str(exc), None, 0.0)
            continue
        norm = contribution_norm(tensors)
        if steps_range is not None:
            low, high = steps_range
            if declared is None or not low <= declared <= high:
                detail = ("declares no inner steps" if declared is None
                          else f"declares {declared} inner steps, outside the run's [{low}, {high}]")
                reports[index] = ContributionReport(index, False, BAD_STEPS, detail, norm, 0.0)
                continue
            steps[index] = declared
        if index in excluded:
            why = excluded[index]
            reason, detail = why if isinstance(why, tuple) else (SCREENED, why)
            reports[index] = ContributionReport(index, False, reason, str(detail), norm, 0.0)
            continue
        decoded[index], norms[index] = tensors, norm
        clip_norms[index] = per_step(norm, steps[index]) if steps_range is not None else norm
    median = lower_median(list(clip_norms.values())) if clip_norms else 0.0
    bound = clip_bound(median, norm_clip)
    per = " per step" if steps_range is not None else ""
    accepted = []
    for index, tensors in decoded.items():
        scale = clip_scale(clip_norms[index], bound)
        if scale != 1.0:  # each tensor replaced as it is scaled: the unscaled one goes at once (issue 75)
            for name, value in tensors.items():
                tensors[name] = scaled({name: value}, scale)[name]
        accepted.append(tensors)
        detail = (
            "" if scale == 1.0 else f"norm{per} {clip_norms[index]:.6g} > {norm_clip:g} x median {median:.6g}"
        )
        reports[index] = ContributionReport(index, True, "", detail, norms[index], scale)
    return accepted, [report for report in reports if report is not None]

