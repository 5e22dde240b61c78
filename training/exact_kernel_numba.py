"""Version 2's compiled loops (training/exact_kernel.py), apart so that only a run that uses them imports
Numba: the plain product loop (the reference of :mod:`training.exact_kernel_tile`'s register tiles, which
compute its bits), the elementwise functions, the tree sums, and the optimizers' passes (AdamW's, the
gradient norm's: both kernel versions). No ``fastmath``: every multiply and add is its own IEEE operation
(LLVM fuses neither into an FMA nor reassociates them without the flags), and the compiler vectorises the
innermost loops across independent elements only, which leaves each output's order of operations as
written."""

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)
def ordered(a, b, c):  # pragma: no cover: compiled
    """``c[p] = a[p] @ b[p]``, each ``c[p, i, j]`` the sum over ``k`` in increasing order from 0. Two rows
    of ``c`` at a time share each load of ``b``'s row ``k`` (each output's order is unchanged)."""
    for p in range(a.shape[0]):
        rows, inner, cols = a.shape[1], a.shape[2], b.shape[2]
        i = 0
        while i < rows:
            pair = i + 1 < rows
            c0 = c[p, i]
            c1 = c[p, i + 1] if pair else c[p, i]
            for j in range(cols):
                c0[j] = 0.0
                c1[j] = 0.0
            for k in range(inner):
                a0 = a[p, i, k]
                bk = b[p, k]
                if pair:
                    a1 = a[p, i + 1, k]
                    for j in range(cols):
                        x = bk[j]
                        c0[j] = c0[j] + a0 * x
                        c1[j] = c1[j] + a1 * x
                else:
                    for j in range(cols):
                        c0[j] = c0[j] + a0 * bk[j]
            i += 2


# ----------------------------------------------------------------------------- elementwise functions
# training/exact_math.py's and training/exact_ops.py's float64 formulas, operation for operation (the same
# IEEE operations in the same order, so the same bits as the torch versions), one pass over the elements.

LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
SQRT_HALF = 0.70710678118654752440
EXP_LOW, EXP_HIGH = -745.0, 709.0
EXP_TERMS = tuple(1.0 / math.factorial(_k) for _k in range(12, -1, -1))
LOG_TERMS = tuple(2.0 / _k for _k in (19, 17, 15, 13, 11, 9, 7, 5, 3, 1))
GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715
GELU_3A = 3.0 * GELU_A


@intrinsic
def _pow2(typingctx, n):
    """``2.0 ** n`` (float64) for integral float64 ``n`` in [-1022, 1023], from the exponent bits (exact, as
    training/exact_math.py's ``pow2_64``): integer operations the compiler vectorises, where a table lookup
    would be a gather."""
    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        bits = builder.shl(builder.add(builder.fptosi(args[0], i64), i64(1023)), i64(52))
        return builder.bitcast(bits, ir.DoubleType())

    return types.float64(types.float64), codegen


@numba.njit(inline="always", fastmath=False, error_model="numpy")
def _exp64(x):  # pragma: no cover: compiled
    if x < EXP_LOW:
        x = EXP_LOW
    elif x > EXP_HIGH:
        x = EXP_HIGH
    n = np.rint(x * INV_LN2)
    r = (x - n * LN2_HI) - n * LN2_LO
    half = np.floor(n * 0.5)
    acc = EXP_TERMS[0]
    for index in numba.literal_unroll(EXP_TERMS[1:]):
        acc = acc * r + index
    return acc * _pow2(half) * _pow2(n - half)


@numba.njit(inline="always", fastmath=False, error_model="numpy")
def _log64(x):  # pragma: no cover: compiled
    if not x > 0:
        return -np.inf
    mantissa, exponent = math.frexp(x)
    e = float(exponent)
    if mantissa < SQRT_HALF:
        mantissa = mantissa * 2.0
        e = e - 1.0
    f = mantissa - 1.0
    s = f / (f + 2.0)
    z = s * s
    acc = LOG_TERMS[0]
    for term in numba.literal_unroll(LOG_TERMS[1:]):
        acc = acc * z + term
    return e * LN2_HI + (e * LN2_LO + s * acc)


@numba.njit(inline="always", fastmath=False, error_model="numpy")
def _tanh64(x):  # pragma: no cover: compiled
    t = _exp64(abs(x) * -2.0)
    magnitude = (1.0 - t) / (1.0 + t)
    return -magnitude if x < 0 else magnitude


@numba.njit(inline="always", fastmath=False, error_model="numpy")
def _one(code, v):  # pragma: no cover: compiled
    """``(value, slope)`` in float64 of function ``code`` at ``v``."""
    if code == 0:  # exp
        y = _exp64(v)
        d = y
    elif code == 1:  # log
        y = _log64(v)
        d = 1.0 / v
    elif code == 2:  # tanh
        y = _tanh64(v)
        d = 1.0 - y * y
    elif code == 3:  # sigmoid
        y = 1.0 / (_exp64(-v) + 1.0)
        d = y * (1.0 - y)
    elif code == 4:  # silu
        s = 1.0 / (_exp64(-v) + 1.0)
        y = v * s
        d = s * (v * (1.0 - s) + 1.0)
    elif code == 5:  # gelu_tanh
        t = _tanh64((v + v * v * v * GELU_A) * GELU_C)
        y = v * (t + 1.0) * 0.5
        d = (t + 1.0) * 0.5 + v * ((1.0 - t * t) * GELU_C * (v * v * GELU_3A + 1.0)) * 0.5
    else:  # rsqrt
        y = 1.0 / np.sqrt(v)
        d = y * y * y * -0.5
    return y, d


@numba.njit(inline="always", fastmath=False, error_model="numpy")
def _loop(code, x, value, slope):  # pragma: no cover: compiled
    for i in range(x.shape[0]):
        y, d = _one(code, np.float64(x[i]))
        value[i] = np.float32(y)
        slope[i] = np.float32(d)


@numba.njit(nogil=True, cache=True, fastmath=False, error_model="numpy")
def unary(code, x, value, slope):  # pragma: no cover: compiled
    """``value[i], slope[i]`` (float32) of function ``code`` (:data:`CODES`) at ``x[i]`` (float32), computed
    in float64 and rounded once. One loop per function (``code`` a constant in each, so the loop has no
    branch on it and the compiler vectorises it: the same operations on each element)."""
    if code == 0:
        _loop(0, x, value, slope)
    elif code == 1:
        _loop(1, x, value, slope)
    elif code == 2:
        _loop(2, x, value, slope)
    elif code == 3:
        _loop(3, x, value, slope)
    elif code == 4:
        _loop(4, x, value, slope)
    elif code == 5:
        _loop(5, x, value, slope)
    else:
        _loop(6, x, value, slope)


#: The functions :func:`unary` computes, by name (training/exact_ops.py's ``UNARY``).
CODES = {"exp": 0, "log": 1, "tanh": 2, "sigmoid": 3, "silu": 4, "gelu_tanh": 5, "rsqrt": 6}


# ----------------------------------------------------------------------------- tree sums


@numba.njit(nogil=True, cache=True, fastmath=False)
def tree_sum(x, out):  # pragma: no cover: compiled
    """``out[o, :] = `` the tree sum of ``x[o, :, :]`` over its middle axis, training/exact_math.py's
    ``tree_sum`` pair for pair: each level adds the second half of the rows to the first half, row by row,
    an odd last row carried behind them to the next level."""
    rows, inner = x.shape[1], x.shape[2]
    buf = np.empty(rows * inner, dtype=x.dtype)
    for o in range(x.shape[0]):
        for r in range(rows):
            for c in range(inner):
                buf[r * inner + c] = x[o, r, c]
        count = rows
        while count > 1:
            half = count // 2
            for r in range(half * inner):
                buf[r] = buf[r] + buf[half * inner + r]
            if count % 2:
                for c in range(inner):
                    buf[half * inner + c] = buf[2 * half * inner + c]
            count = half + count % 2
        for c in range(inner):
            out[o, c] = buf[c]


@numba.njit(nogil=True, cache=True, fastmath=False)
def square_sum(x):  # pragma: no cover: compiled
    """The tree sum (as :func:`tree_sum`, one dimension) of the float64 squares of ``x`` (1-D): each square
    one float64 multiply (exact for float32 entries)."""
    rows = x.shape[0]
    if rows == 0:
        return 0.0
    buf = np.empty(rows, dtype=np.float64)
    for r in range(rows):
        value = np.float64(x[r])
        buf[r] = value * value
    count = rows
    while count > 1:
        half = count // 2
        for r in range(half):
            buf[r] = buf[r] + buf[half + r]
        if count % 2:
            buf[half] = buf[2 * half]
        count = half + count % 2
    return buf[0]


@numba.njit(nogil=True, cache=True, fastmath=False, error_model="numpy")
def adamw_moments(p, g, m, v, decay, beta1, keep1, beta2, keep2):  # pragma: no cover: compiled
    """:class:`training.exact_optim.ExactAdamW`'s weight decay and moments on float32 ``p``, ``g``, ``m``,
    ``v`` (1-D), each torch operation one float32 operation here, the Python scalars rounded to float32 as
    torch rounds a scalar operand of a float32 tensor (``decay`` 1: no multiply)."""
    d32, b1, k1 = np.float32(decay), np.float32(beta1), np.float32(keep1)
    b2, k2 = np.float32(beta2), np.float32(keep2)
    apply_decay = decay != 1.0
    for i in range(p.shape[0]):
        if apply_decay:
            p[i] = p[i] * d32
        grad = g[i]
        m[i] = m[i] * b1 + grad * k1
        v[i] = v[i] * b2 + (grad * grad) * k2


@numba.njit(nogil=True, cache=True, fastmath=False, error_model="numpy")
def adamw_apply(p, m, root, bias2_sqrt, eps, step_size):  # pragma: no cover: compiled
    """The update ``p - (m / (root / bias2_sqrt + eps)) step_size`` (``root``: torch's ``sqrt`` of ``v``,
    whose rounding is torch's; float32 operations, scalars rounded to float32)."""
    bc2, e32, s32 = np.float32(bias2_sqrt), np.float32(eps), np.float32(step_size)
    for i in range(p.shape[0]):
        p[i] = p[i] - (m[i] / (root[i] / bc2 + e32)) * s32


@numba.njit(nogil=True, cache=True, fastmath=False)
def embedding_backward(ids, rows, out):  # pragma: no cover: compiled
    """``out[ids[i]] += rows[i]`` for each position ``i`` in increasing order (``out`` zeros on entry): each
    token's row takes its positions' gradients one add at a time, in position order."""
    for i in range(ids.shape[0]):
        token = ids[i]
        for c in range(rows.shape[1]):
            out[token, c] = out[token, c] + rows[i, c]
