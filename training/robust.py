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
   reason ``screened``.
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from training.codec_wire import decode_contribution
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
EXCLUSION_REASONS = (UNDECODABLE, WRONG_SHAPE, NON_FINITE, RAW_IN_COMPRESSED, SCREENED)

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


def contribution_norm(decoded: Mapping[str, torch.Tensor]) -> float:
    """``sqrt(fsum of float64(x)^2)`` over every element: exact squares, one rounding of the sum.

    Computed without a Python float per element (``tolist`` + ``math.fsum`` took
    most of an aggregation's time): every float32 ``x`` is ``m * 2**(e - 24)``
    with an integer ``|m| < 2**24`` (``torch.frexp``), so ``x**2 = m**2 * 2**(2e - 48)``
    with ``m**2 < 2**48``. The exact sum is accumulated per exponent ``e`` in int64
    (``m**2`` split into two 24-bit halves so no bucket can overflow), combined
    exactly as a Python integer, and rounded once by Python's correctly rounded
    integer division: the same correctly rounded double ``math.fsum`` returns for
    the exact squares, bit for bit (tests/test_training_robust.py checks both).
    """
    total = 0
    buckets: dict[int, int] = {}
    for name in sorted(decoded):
        value = decoded[name].detach().to(torch.float32).reshape(-1)
        if value.numel() == 0:
            continue
        mantissa, exponent = torch.frexp(value)
        # |mantissa| in [0.5, 1) (0 for 0): times 2**24 it is the float32's integer significand.
        integer = torch.mul(mantissa.to(torch.float64), 16777216.0).to(torch.int64)  # exact: a power of two
        square = integer * integer  # < 2**48: exact in int64
        high, low = square >> 24, square & ((1 << 24) - 1)
        exponent = exponent.to(torch.int64)
        base = int(exponent.min())
        offsets = exponent - base
        width = int(offsets.max()) + 1
        # Each bucket sums < 2**24 values over < 2**39 elements: no int64 overflow.
        high_sums = torch.zeros(width, dtype=torch.int64).index_add_(0, offsets, high).tolist()
        low_sums = torch.zeros(width, dtype=torch.int64).index_add_(0, offsets, low).tolist()
        for offset, (h, lo) in enumerate(zip(high_sums, low_sums)):
            if h or lo:
                buckets[base + offset] = buckets.get(base + offset, 0) + (h << 24) + lo
    if not buckets:
        return 0.0
    lowest = min(buckets)
    for exponent, amount in buckets.items():
        total += amount << (2 * (exponent - lowest))
    shift = 2 * lowest - 48  # the sum is total * 2**shift, exactly
    exact = total << shift if shift >= 0 else total / (1 << -shift)  # int / int: correctly rounded
    return math.sqrt(float(exact))


def lower_median(values: Sequence[float]) -> float:
    """``sorted(values)[(len - 1) // 2]``: a value that occurs, and the smaller middle one for an even count."""
    if not values:
        raise ValueError("lower_median of no values")
    return sorted(values)[(len(values) - 1) // 2]


def clip_scale(norm: float, bound: float) -> float:
    """1.0 if ``norm <= bound``, else ``bound / norm`` (float64, one division)."""
    return 1.0 if norm <= bound else bound / norm


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
    excluded: Mapping[int, str] | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[ContributionReport]]:
    """Decode, exclude and clip one round's contributions (module docstring, steps 1-5).

    Returns the accepted contributions' tensors, in canonical order and already
    scaled, and one report per input contribution. ``excluded`` maps canonical
    indices to a detail string (screening's verdict); ``norm_clip = 0`` turns
    the norm rule off (every accepted scale is 1.0).
    """
    excluded = dict(excluded or {})
    unknown = sorted(i for i in excluded if not 0 <= i < len(contributions))
    if unknown:
        raise ValueError(f"excluded indices {unknown} outside 0..{len(contributions) - 1}")
    reports: list[ContributionReport | None] = [None] * len(contributions)
    decoded: dict[int, dict[str, torch.Tensor]] = {}
    norms: dict[int, float] = {}
    for index, blob in enumerate(contributions):
        try:
            tensors = decode_contribution(
                blob, shapes, stage_index=stage_index, outer_round=outer_round, refuse_raw=refuse_raw
            )
        except ContributionDecodeError as exc:
            reason = next(code for kind, code in _DECODE_REASONS if isinstance(exc, kind))
            reports[index] = ContributionReport(index, False, reason, str(exc), None, 0.0)
            continue
        norm = contribution_norm(tensors)
        if index in excluded:
            reports[index] = ContributionReport(index, False, SCREENED, str(excluded[index]), norm, 0.0)
            continue
        decoded[index], norms[index] = tensors, norm
    median = lower_median(list(norms.values())) if norms else 0.0
    bound = norm_clip * median if norm_clip else math.inf
    accepted = []
    for index, tensors in decoded.items():
        scale = clip_scale(norms[index], bound)
        accepted.append(tensors if scale == 1.0 else scaled(tensors, scale))
        detail = "" if scale == 1.0 else f"norm {norms[index]:.6g} > {norm_clip:g} x median {median:.6g}"
        reports[index] = ContributionReport(index, True, "", detail, norms[index], scale)
    return accepted, [report for report in reports if report is not None]
