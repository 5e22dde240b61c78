"""Fixed-order arithmetic: the same bits under every CPU instruction set, thread count and math library.

IEEE 754 specifies the result of one add, subtract, multiply, divide and square root exactly (the correctly
rounded value), so a computation made only of those single operations, in an order that depends on nothing
but the shapes, gives the same bits on any hardware. What differs between platforms is everything else:
the order and grouping of a reduction (torch's sum and matrix product block and vectorise by the instruction
set, the thread count and the BLAS path), fused multiply-adds (a vectorised ``lerp``, ``addcmul`` or ``add``
with ``alpha`` uses an FMA on AVX2 and two roundings without), and the transcendental functions (SLEEF's
vectorised ``exp``, ``tanh``, ``sin`` round differently from the C library's scalar ones).

This module is the arithmetic of the reproducible mode (``training.reproducible``, docs/REPRODUCIBLE.md),
written with single IEEE operations, each its own torch kernel (eager torch never fuses two of them), and
float64 matrix products whose every partial sum is an exact integer (so no order can round them):

* :func:`tree_sum`: a reduction as a pairwise tree of fixed shape (halves added, an odd last element
  carried to the next level);
* :func:`exact_matmul`: a matrix product whose float64 partial products are exact integers (Ozaki's
  error-free splitting), so the BLAS's order, blocking and FMAs cannot change a bit;
* :func:`exp64`, :func:`log64`, :func:`sin_cos64`, :func:`tanh64`: the elementary functions in float64 by
  range reduction and a fixed polynomial (Horner, single multiplies and adds), accurate to ~1e-15, so a
  float32 result rounded from them is the float32 function to within an ulp, and the same bits everywhere.

None of these record autograd history of their own: :mod:`training.exact_ops` gives them explicit backward
passes made of the same arithmetic.
"""

from __future__ import annotations

import math

import torch

LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2: n * LN2_HI is exact for |n| < 2^11
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
SQRT_HALF = 0.70710678118654752440
# pi/2 in three parts (Cody-Waite): k * PIO2_1 and k * PIO2_2 are exact for |k| < 2^20.
PIO2_1 = 1.57079632673412561417e00
PIO2_2 = 6.07710050650619224932e-11
PIO2_3 = 2.02226624879595063154e-21
INV_PIO2 = 6.36619772367581382433e-01
#: exp's argument range: below, the float64 result is 0 in float32 (and in float64 far below); above, inf.
EXP_LOW, EXP_HIGH = -745.0, 709.0
_EXP_TERMS = tuple(1.0 / math.factorial(_k) for _k in range(12, -1, -1))
_LOG_TERMS = tuple(2.0 / _k for _k in (19, 17, 15, 13, 11, 9, 7, 5, 3, 1))
_SIN_TERMS = tuple((-1.0) ** _k / math.factorial(2 * _k + 1) for _k in range(7, -1, -1))  # r * poly(r^2)
_COS_TERMS = tuple((-1.0) ** (_k + 1) / math.factorial(2 * _k) for _k in range(8, 0, -1))  # 1 - r^2 poly(r^2)


def horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """``c0 x^(n-1) + ... + c_(n-1)``, highest power first, one multiply and one add per term."""
    acc = torch.full_like(x, coefficients[0])
    for coefficient in coefficients[1:]:
        acc = acc * x + coefficient
    return acc


def pow2_64(n: torch.Tensor) -> torch.Tensor:
    """``2.0 ** n`` in float64 for integral float ``n`` in [-1022, 1023], built from the exponent bits."""
    return torch.bitwise_left_shift(n.to(torch.int64) + 1023, 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` of a float64 tensor: ``x = n ln2 + r``, ``|r| <= ln2/2``, a degree-12 Taylor polynomial of
    ``r`` (truncation < 2e-16 relative), times ``2^n`` (applied in two halves so the scale stays normal)."""
    x = x.clamp(EXP_LOW, EXP_HIGH)
    n = torch.round(x * INV_LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    half = torch.floor(n * 0.5)
    return horner(r, _EXP_TERMS) * pow2_64(half) * pow2_64(n - half)


def log64(x: torch.Tensor) -> torch.Tensor:
    """``ln x`` of a float64 tensor of positive normal numbers (0 gives -inf): ``x = m 2^e`` with ``m`` in
    ``[sqrt(1/2), sqrt 2)``, ``ln m = 2 atanh(s)``, ``s = (m - 1) / (m + 1)``, ``|s| < 0.172``, by its odd
    series to ``s^19`` (truncation < 1e-16)."""
    mantissa, exponent = torch.frexp(x)
    small = mantissa < SQRT_HALF
    mantissa = torch.where(small, mantissa * 2.0, mantissa)
    e = exponent.to(torch.float64) - small.to(torch.float64)
    f = mantissa - 1.0
    s = f / (f + 2.0)
    series = s * horner(s * s, _LOG_TERMS)
    out = e * LN2_HI + (e * LN2_LO + series)
    return torch.where(x > 0, out, torch.full_like(x, float("-inf")))


def sin_cos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin x, cos x)`` of a float64 tensor with ``|x| < 2^20``: ``x = k pi/2 + r``, ``|r| <= pi/4``
    (three-part Cody-Waite reduction), Taylor polynomials of ``r`` to ``r^15`` and ``r^16`` (truncation
    < 1e-16), and the quadrant ``k mod 4`` choosing and signing them."""
    k = torch.round(x * INV_PIO2)
    r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3
    z = r * r
    sin_r = r * horner(z, _SIN_TERMS)
    cos_r = 1.0 - z * horner(z, _COS_TERMS)
    quadrant = torch.remainder(k.to(torch.int64), 4)
    sin = torch.where(quadrant == 0, sin_r, torch.where(quadrant == 1, cos_r,
                                                       torch.where(quadrant == 2, -sin_r, -cos_r)))
    cos = torch.where(quadrant == 0, cos_r, torch.where(quadrant == 1, -sin_r,
                                                       torch.where(quadrant == 2, -cos_r, sin_r)))
    return sin, cos


def tanh64(x: torch.Tensor) -> torch.Tensor:
    """``tanh x`` of a float64 tensor: ``(1 - t) / (1 + t)``, ``t = e^(-2|x|)``, signed like ``x``."""
    t = exp64(x.abs() * -2.0)
    magnitude = (1.0 - t) / (1.0 + t)
    return torch.where(x < 0, -magnitude, magnitude)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` (kept, size 1) as a pairwise tree whose shape depends only on the size: each level
    adds the second half onto the first; an odd count's last element is carried to the next level."""
    dim = dim % x.dim()
    count = x.size(dim)
    if count == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_zeros(shape)
    if count == 1:
        return x.clone()
    while count > 1:
        half = count // 2
        summed = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
        x = torch.cat((summed, x.narrow(dim, 2 * half, 1)), dim) if count % 2 else summed
        count = x.size(dim)
    return x


#: Slices each operand of :func:`exact_matmul` is cut into.
SLICES = 2


#: 1.5 * 2^52: ``(v + ROUNDER) - ROUNDER`` is ``v`` rounded to the nearest integer (ties to even) for
#: ``|v| < 2^51``, two IEEE additions (faster than torch's ``round`` or ``trunc`` on float64).
ROUNDER = 6755399441055744.0


def split_slices(
    x: torch.Tensor, dim: int, bits: int, slices: int = SLICES
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``x`` (float64) as ``sum_i slice_i * unit_i`` (the part below half the last unit dropped):
    ``slice_i`` integers of magnitude at most ``2^bits``, ``unit_i`` powers of two per row (``dim`` reduced,
    kept): ``unit_0 = 2^(e - bits)`` for ``max |x| < 2^e`` along ``dim``, each next unit ``2^-bits`` of the
    last. Every operation is exact (division and multiplication by powers of two, rounding to an integer,
    the subtraction of a value's leading part)."""
    _, exponent = torch.frexp(x.abs().amax(dim, keepdim=True))
    exponent = exponent.to(torch.float64)
    unit = pow2_64(exponent - bits)
    # Multiplying by the power of two 1/unit gives the quotient's bits (both exact scalings of the same value,
    # rounded alike) at a fraction of a division's cost; where 1/unit of a later slice would leave the
    # exponent range, the division.
    inverse = pow2_64(bits - exponent) if bool((exponent >= bits * slices - 1022).all()) else None
    parts, rest = [], x
    for index in range(slices):
        scaled = rest * inverse if inverse is not None else rest / unit
        part = (scaled + ROUNDER) - ROUNDER
        parts.append((part, unit))
        if index + 1 < slices:
            rest = rest - part * unit
            unit = unit * 2.0 ** -bits
            inverse = inverse * 2.0 ** bits if inverse is not None else None
    return parts


def exact_matmul(a: torch.Tensor, b: torch.Tensor, slices: int = SLICES) -> torch.Tensor:
    """``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N) (batch dimensions equal), the same bits in any
    summation order (Ozaki et al. 2012's error-free splitting).

    Each row of ``a`` and column of ``b`` is cut into :data:`SLICES` integer slices of ``bits = (52 -
    ceil(log2 K)) // 2`` bits scaled by a power of two (:func:`split_slices`), so every product of two
    slices, and every partial sum of ``K`` of them, is an integer of magnitude at most ``2^52``: the float64
    matrix products of the slices are **exact**, whatever order, blocking, thread count or fused multiply-add
    the BLAS uses. The products of slices ``i + j < SLICES`` (the low-by-low one, below float32's precision,
    is left out) are scaled (powers of two) and added in a fixed order in float64, then rounded once to
    ``a``'s dtype. What is dropped lies below ``2^(-2 bits)`` of a row's (column's) largest entry: at
    ``K <= 1024`` (21-bit slices) far below float32's rounding. ``slices``: more slices for a float64 result
    (the codec's, :mod:`training.exact_codec`: 3 keep ``2^(-3 bits)``)."""
    if a.size(-1) != b.size(-2):
        raise ValueError(f"exact_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    inner = a.size(-1)
    bits = (52 - max(inner - 1, 1).bit_length()) // 2
    left = split_slices(a.to(torch.float64), -1, bits, slices)
    right = split_slices(b.to(torch.float64), -2, bits, slices)
    out = None
    for i, (a_part, a_unit) in enumerate(left):
        for j, (b_part, b_unit) in enumerate(right):
            if i + j >= slices:
                continue
            term = torch.matmul(a_part, b_part) * a_unit * b_unit
            out = term if out is None else out + term
    return out.to(a.dtype)
