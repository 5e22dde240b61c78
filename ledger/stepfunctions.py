"""The elementwise functions of the reproducible mode as StepProver recomputes them (issue 78,
docs/FRAUD_PROOF.md "Elementwise functions"): the Python mirror of contracts/src/Float64Functions.sol.

A program op ``UNARY`` (kind 8) is ``out[e] = f(a[e])``, ``UNARY_SLOPE`` (kind 9) ``out[e] = f'(a[e])``, the
derivative ``training.exact_ops.ExactUnary``'s backward multiplies by; the function is the op's ``inner``
field (:data:`CODES`). Each is training/exact_ops.py's float64 formula (``UNARY``, of training/exact_math.py's
``exp64``, ``log64``, ``tanh64``), one IEEE binary64 operation at a time in the same order, rounded once to
float32; ``sqrt`` (code 8) is the correctly rounded float32 square root of kernel version 3
(``training.exact_kernel.sqrt``, AdamW's update), which has no derivative in training, so no slope.

Python floats are IEEE binary64 with correctly rounded ``+ - * /`` and ``math.sqrt``; what Python raises on
(a division by zero, the root of a negative, a float32 overflow in ``struct``) is given its IEEE result here.
This package knows no torch: the bits are plain integers.
"""

from __future__ import annotations

import math
import struct

UNARY, UNARY_SLOPE = 8, 9
#: The function codes of a unary op's ``inner`` field.
CODES = {"exp": 1, "log": 2, "tanh": 3, "sigmoid": 4, "silu": 5, "gelu_tanh": 6, "rsqrt": 7, "sqrt": 8}
NAMES = {code: name for name, code in CODES.items()}
#: The codes whose slope training computes (every one but ``sqrt``).
SLOPED = frozenset(code for code in NAMES if code != CODES["sqrt"])

#: Every (kind, code) StepProver recomputes.
OPS = tuple([(UNARY, code) for code in sorted(NAMES)] + [(UNARY_SLOPE, code) for code in sorted(SLOPED)])

LN2_HI = 6.93147180369123816490e-01  # training/exact_math.py's constants
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
SQRT_HALF = 0.70710678118654752440
EXP_LOW, EXP_HIGH = -745.0, 709.0
EXP_TERMS = tuple(1.0 / math.factorial(k) for k in range(12, -1, -1))
LOG_TERMS = tuple(2.0 / k for k in (19, 17, 15, 13, 11, 9, 7, 5, 3, 1))
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
GELU_3A = 3.0 * GELU_A
INF, NAN = math.inf, math.nan


class UnaryCodeError(ValueError):
    """A function code (or a slope of one) that StepProver does not recompute."""


def check_code(kind: int, code: int) -> None:
    """Raise :class:`UnaryCodeError` unless ``code`` names a function of op ``kind`` (UNARY, UNARY_SLOPE)."""
    if kind not in (UNARY, UNARY_SLOPE) or code not in NAMES:
        raise UnaryCodeError(f"op kind {kind} function code {code}: expected kind {UNARY} or {UNARY_SLOPE} "
                             f"and a code of {sorted(NAMES)}")
    if kind == UNARY_SLOPE and code not in SLOPED:
        raise UnaryCodeError(f"function code {code} ({NAMES[code]}): training computes no slope of it")


def div(x: float, y: float) -> float:
    """IEEE ``x / y`` (a zero divisor gives a signed infinity or NaN where Python raises)."""
    if y == 0.0:
        if x == 0.0 or x != x:
            return NAN
        return math.copysign(INF, x) * math.copysign(1.0, y)
    return x / y


def sqrt(x: float) -> float:
    """IEEE ``sqrt``: NaN for a negative (``-0`` stays ``-0``)."""
    if x != x or x < 0.0:
        return NAN
    return math.sqrt(x)


def f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def f32(bits: int) -> float:
    """The float32 of ``bits``, exactly, as a Python float."""
    return struct.unpack("<f", struct.pack("<I", bits))[0]


#: The float32 rounding bound: a magnitude at or above it rounds to infinity.
_OVERFLOW32 = (2.0 - 2.0 ** -24) * 2.0 ** 127


def bits32(x: float) -> int:
    """``x`` rounded once to float32 (nearest, ties to even), as its encoding."""
    if x != x:
        return 0x7FC00000 | (0x80000000 if math.copysign(1.0, x) < 0 else 0)
    if abs(x) >= _OVERFLOW32:
        return 0xFF800000 if x < 0 else 0x7F800000
    return struct.unpack("<I", struct.pack("<f", x))[0]


def pow2(n: int) -> float:
    """``2.0 ** n`` for an integer ``n`` in [-1022, 1023], from the exponent bits (exact_math ``pow2_64``)."""
    return f64((n + 1023) << 52)


def horner(x: float, terms: tuple[float, ...]) -> float:
    acc = terms[0]
    for term in terms[1:]:
        acc = acc * x + term
    return acc


def exp64(x: float) -> float:
    """training/exact_math.py ``exp64``: clamp, ``n = round(x / ln 2)`` (ties to even), Cody-Waite ``r``,
    Horner of degree 12, times ``2^floor(n/2)`` then ``2^(n - floor(n/2))``."""
    if x != x:
        return x
    x = EXP_LOW if x < EXP_LOW else EXP_HIGH if x > EXP_HIGH else x
    n = round(x * INV_LN2)  # an int, ties to even
    r = (x - n * LN2_HI) - n * LN2_LO
    half = n >> 1  # floor(n / 2)
    return horner(r, EXP_TERMS) * pow2(half) * pow2(n - half)


def log64(x: float) -> float:
    """training/exact_math.py ``log64``: ``-inf`` unless ``x > 0``; ``x = m 2^e``, ``m`` in
    ``[sqrt(1/2), sqrt 2)``, ``s = (m - 1) / (m + 1)``, ``e ln2_hi + (e ln2_lo + s horner(s^2))``."""
    if not x > 0.0:
        return -INF
    if x == INF:  # frexp(inf) = (inf, 0): s = inf / inf
        return NAN
    mantissa, exponent = math.frexp(x)
    e = float(exponent)
    if mantissa < SQRT_HALF:
        mantissa *= 2.0
        e -= 1.0
    f = mantissa - 1.0
    s = f / (f + 2.0)
    return e * LN2_HI + (e * LN2_LO + s * horner(s * s, LOG_TERMS))


def tanh64(x: float) -> float:
    """training/exact_math.py ``tanh64``: ``t = e^(-2|x|)``, ``(1 - t) / (1 + t)`` signed like ``x``."""
    t = exp64(abs(x) * -2.0)
    magnitude = (1.0 - t) / (1.0 + t)
    return -magnitude if x < 0 else magnitude


def value_slope(code: int, v: float) -> tuple[float, float]:
    """``(f(v), f'(v))`` in float64 of function ``code`` (training/exact_ops.py ``UNARY``; ``sqrt``: its
    value, the slope NaN)."""
    if code == 1:
        y = exp64(v)
        return y, y
    if code == 2:
        return log64(v), div(1.0, v)
    if code == 3:
        y = tanh64(v)
        return y, 1.0 - y * y
    if code in (4, 5):
        s = div(1.0, exp64(-v) + 1.0)
        if code == 4:
            return s, s * (1.0 - s)
        return v * s, s * (v * (1.0 - s) + 1.0)
    if code == 6:
        t = tanh64((v + v * v * v * GELU_A) * GELU_C)
        slope = (t + 1.0) * 0.5 + v * ((1.0 - t * t) * GELU_C * (v * v * GELU_3A + 1.0)) * 0.5
        return v * (t + 1.0) * 0.5, slope
    if code == 7:
        y = div(1.0, sqrt(v))
        return y, y * y * y * -0.5
    if code == 8:
        return sqrt(v), NAN
    raise UnaryCodeError(f"function code {code}: expected one of {sorted(NAMES)}")


def unary_bits(kind: int, code: int, bits: int) -> int:
    """The float32 bits StepProver requires of ``kind`` (UNARY or UNARY_SLOPE) function ``code`` at float32
    ``bits``."""
    check_code(kind, code)
    value, slope = value_slope(code, f32(bits))
    return bits32(value if kind == UNARY else slope)


def same32(a: int, b: int) -> bool:
    """StepProver's equality of float32 bits: equal, or both NaN."""
    nan = lambda v: (v & 0x7FFFFFFF) > 0x7F800000  # noqa: E731
    return a == b or (nan(a) and nan(b))


#: The float32 inputs where the formulas branch or saturate (tests/test_step_unary.py,
#: bench/bench_step_unary.py): +-0, subnormals, the smallest normals, +-inf, NaNs, the largest finite, exp's
#: clamps (-745, 709) and exp's over/underflow edges in float32, tanh's and sigmoid's saturation, log and
#: rsqrt of negatives, large values for tanh-GELU (3e38: its cube overflows float64), frexp's sqrt(1/2) edge.
EDGE_INPUTS = (0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x00800000, 0x80800000, 0x7F800000,
               0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F7FFFFF, 0xFF7FFFFF) + tuple(
    bits32(v) for v in (-745.0, 709.0, -744.99, 709.01, -103.97, -87.34, 88.72, 88.73, 1.0, -1.0, 0.5, 2.0,
                        1e-30, -1e-30, 9.0, -9.0, 19.06, -19.06, 300.0, -300.0, 1e19, -1e19, 3e38, -3e38,
                        0.7071068, 1.4142135))
