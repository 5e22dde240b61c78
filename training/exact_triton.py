"""Kernel version 2 of the reproducible mode on a GPU: Triton kernels with version 2's order and operations
(docs/REPRODUCIBLE.md, "On a GPU: Triton kernels"). :mod:`training.exact_kernel` sends CUDA tensors here.

* :func:`ordered_matmul`: version 2's float32 product, each output ``((0 + a_0 b_0) + a_1 b_1) + ...``,
  ``k`` increasing. Each program owns a tile of the output (rows ``i``, columns ``j``) and runs ``for k in
  range(K)``: ``acc = acc + a[i, k] * b[k, j]``, the product one float32 operation and the add another. No
  ``tl.dot`` (tensor cores sum in their own order and precision). Each output is one thread's sum, so the
  tile, the grid and the GPU model change which thread computes it, never its order.
* :func:`tree_sum`: version 2's tree sum (training/exact_math.py's pairs in its order), one column per
  thread, the levels in place.
* :func:`unary32`: version 2's elementwise functions (exp, log, tanh, sigmoid, SiLU, tanh-GELU, rsqrt; value
  and derivative), the float64 formulas of training/exact_kernel_numba.py operation for operation.

Every launch on a GPU passes ``enable_fp_fusion=False``: LLVM gets no contraction flag and ptxas
``--fmad=false``, so no multiply and add are fused into an FMA; a float64 division or square root is
``div.rn``/``sqrt.rn`` (correctly rounded), no kernel calls libdevice or an approximate instruction
(tests/test_exact_triton.py reads the PTX and the machine code compiled for sm_90, which needs no GPU).

On a CPU tensor the same kernels run under Triton's interpreter (numpy, one IEEE operation each): that is
how the tests compare them bit for bit with version 2's Numba loops where no GPU is lent. The kernels use
Triton's builtins only (``tl.zeros`` and the other ``triton.jit`` helpers of ``triton.language`` cannot
run under the interpreter unless ``TRITON_INTERPRET=1`` was set before triton was imported). Needs
``triton`` (pyproject.toml's ``gpu`` extra; a CUDA build of torch ships its own).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

#: The option every compiled launch passes: no fused multiply-add anywhere (neither LLVM's contraction nor
#: ptxas ``--fmad``). No kernel here calls libdevice (whose functions flush subnormals to zero by default).
EXACT_OPTIONS = {"enable_fp_fusion": False}

#: The output tile of one program of :func:`ordered_matmul` (rows, columns): it decides which thread
#: computes an output, never the order of its sum. Bigger under the interpreter: fewer programs in Python.
TILE_DEVICE = (32, 64)
TILE_INTERPRETED = (64, 128)
#: The most programs along a launch grid's second and third axes (CUDA's limit).
MAX_GRID = 65535


def _ordered_tile(a, b, c, rows, cols, inner, a_batch, a_row, a_inner, b_batch, b_inner, b_col,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # pragma: no cover: a Triton kernel
    """``c[p, i, j] = sum_k a[p, i, k] b[p, k, j]``, ``k`` increasing from 0, for one tile of ``c[p]``
    (``c`` contiguous, ``a`` and ``b`` by their strides)."""
    p = tl.program_id(2).to(tl.int64)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = i < rows, j < cols
    a_ptr = a + p * a_batch + i.to(tl.int64) * a_row
    b_ptr = b + p * b_batch + j.to(tl.int64) * b_col
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # builtins only: tl.zeros is a jit function
    for k in range(inner):
        a_k = tl.load(a_ptr + k * a_inner, mask=in_rows, other=0.0)
        b_k = tl.load(b_ptr + k * b_inner, mask=in_cols, other=0.0)
        term = a_k[:, None] * b_k[None, :]  # one float32 multiply per output
        acc = acc + term  # then one float32 add: never fused (EXACT_OPTIONS)
    out = c + p * rows * cols + i.to(tl.int64)[:, None] * cols + j[None, :]
    tl.store(out, acc, mask=in_rows[:, None] & in_cols[None, :])


_KERNELS: dict[tuple[str, bool], object] = {}


def _kernel(fn, interpreted: bool):
    """``fn`` as a Triton kernel: compiled for the GPU, or run by Triton's interpreter on CPU tensors."""
    key = (fn.__name__, interpreted)
    if key not in _KERNELS:
        # Sizes are not specialized on (one compiled kernel for every size; strides still are: a stride of
        # 1 makes contiguous loads).
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        sizes = [index for index, name in enumerate(names)
                 if name in ("rows", "cols", "inner", "count", "columns", "size")]
        _KERNELS[key] = InterpretedFunction(fn) if interpreted else triton.jit(fn, do_not_specialize=sizes)
    return _KERNELS[key]


def _launch(fn, grid, device: torch.device, *args, stages: int | None = None, **constants) -> None:
    """``fn`` on ``grid`` (compiled with :data:`EXACT_OPTIONS` and, given ``stages``, that many software
    pipeline stages), or interpreted on a CPU tensor."""
    if device.type == "cuda":
        options = {**EXACT_OPTIONS, **({} if stages is None else {"num_stages": stages})}
        with torch.cuda.device(device):  # Triton launches on the current device: the operands' own
            _kernel(fn, False)[grid](*args, **constants, **options)
        return
    with np.errstate(all="ignore"):  # numpy's warnings on IEEE results (inf, nan), as a GPU gives them
        _kernel(fn, True)[grid](*args, **constants)


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for float32 ``a`` (..., M, K) and ``b`` (..., K, N) (batch dimensions equal), on their
    device, with :func:`training.exact_kernel.ordered_matmul`'s order and so its bits: each output summed
    over ``k`` in increasing order, one float32 multiply and one float32 add at a time."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"ordered_matmul: float32 operands, got {a.dtype} and {b.dtype}")
    if a.size(-1) != b.size(-2) or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    if a.device != b.device:
        raise ValueError(f"ordered_matmul: operands on {a.device} and {b.device}")
    batch, (rows, inner), cols = a.shape[:-2], a.shape[-2:], b.size(-1)
    count = math.prod(batch)
    out = torch.empty((count, rows, cols), dtype=torch.float32, device=a.device)
    if out.numel():
        if inner == 0:
            out.zero_()
        else:
            left, right = a.detach().reshape(count, rows, inner), b.detach().reshape(count, inner, cols)
            block_m, block_n = TILE_DEVICE if a.is_cuda else TILE_INTERPRETED
            for start in range(0, count, MAX_GRID):  # CUDA's grid: at most 65,535 along its z axis
                end = min(count, start + MAX_GRID)
                grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), end - start)
                part_a, part_b = left[start:end], right[start:end]
                _launch(_ordered_tile, grid, a.device, part_a, part_b, out[start:end], rows, cols, inner,
                        *part_a.stride(), *part_b.stride(), BLOCK_M=block_m, BLOCK_N=block_n)
    return out.reshape(*batch, rows, cols)


# ----------------------------------------------------------------------------- tree sums


def _tree_sum_columns(x, count, inner, columns, BLOCK: tl.constexpr):  # pragma: no cover: a Triton kernel
    """In place, over ``x`` (outer, count, inner) contiguous: for each of the ``outer * inner`` columns, the
    tree sum over ``count`` into row 0, training/exact_math.py's pairs in its order: each level adds the
    second half of the rows to the first, row by row, an odd last row carried behind them."""
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = q < columns
    base = x + (q // inner).to(tl.int64) * count * inner + q % inner
    n = count
    while n > 1:
        half = n // 2
        for r in range(half):  # no level reads a row another step of the same level writes
            low = tl.load(base + r * inner, mask=live)
            high = tl.load(base + (half + r) * inner, mask=live)
            tl.store(base + r * inner, low + high, mask=live)
        tl.debug_barrier()  # the level's stores seen by the program's threads before the next reads
        if n % 2:
            tl.store(base + half * inner, tl.load(base + 2 * half * inner, mask=live), mask=live)
            tl.debug_barrier()
        n = half + n % 2


#: Columns per program of :func:`tree_sum` (on the GPU; under the interpreter, fewer bigger programs).
SUM_BLOCK_DEVICE, SUM_BLOCK_INTERPRETED = 128, 4096


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """:func:`training.exact_kernel.tree_sum` of float32 or float64 ``x`` over ``dim`` (kept, size 1; at
    least 2 elements) on ``x``'s device: the same pairs added in the same order, so the same bits."""
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"tree_sum: float32 or float64, got {x.dtype}")
    dim %= max(x.dim(), 1)
    count = x.size(dim)
    if count < 2:
        raise ValueError(f"tree_sum: {count} elements along dim {dim}: at least 2")
    outer, inner = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    work = torch.empty((outer, count, inner), dtype=x.dtype, device=x.device)
    work.copy_(x.detach().reshape(outer, count, inner))
    if work.numel():
        block = SUM_BLOCK_DEVICE if x.is_cuda else SUM_BLOCK_INTERPRETED
        _launch(_tree_sum_columns, (triton.cdiv(outer * inner, block),), x.device, work, count, inner,
                outer * inner, stages=1, BLOCK=block)  # no loads prefetched past the stores they follow
    shape = list(x.shape)
    shape[dim] = 1
    return work[:, :1].reshape(shape).clone()


# ----------------------------------------------------------------------------- elementwise functions
# training/exact_kernel_numba.py's ``unary``: the same float64 operations in the same order (a Python float
# beside a float64 tensor is a float64 constant in Triton), the float32 value and derivative rounded once.

EXP_TERMS = tl.constexpr(tuple(1.0 / math.factorial(k) for k in range(12, -1, -1)))
LOG_TERMS = tl.constexpr(tuple(2.0 / k for k in (19, 17, 15, 13, 11, 9, 7, 5, 3, 1)))
LN2_HI = tl.constexpr(6.93147180369123816490e-01)
LN2_LO = tl.constexpr(1.90821492927058770002e-10)
INV_LN2 = tl.constexpr(1.44269504088896338700e00)
SQRT_HALF = tl.constexpr(0.70710678118654752440)
GELU_C = tl.constexpr(math.sqrt(2.0 / math.pi))
GELU_A = tl.constexpr(0.044715)
GELU_3A = tl.constexpr(3.0 * 0.044715)
#: 1.5 * 2^52: ``(v + ROUNDER) - ROUNDER`` is ``v`` rounded to the nearest integer, ties to even (numpy's
#: ``rint``) for ``|v| < 2^51``.
ROUNDER = tl.constexpr(6755399441055744.0)
INF = tl.constexpr(float("inf"))
#: ``unary``'s function codes (training/exact_kernel_numba.py's ``CODES``).
CODES = {"exp": 0, "log": 1, "tanh": 2, "sigmoid": 3, "silu": 4, "gelu_tanh": 5, "rsqrt": 6}


def _unary(x, value, slope, size, CODE: tl.constexpr, BLOCK: tl.constexpr):  # pragma: no cover: Triton
    """``value, slope`` (float32) of function ``CODE`` at ``x`` (float32), computed in float64."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offsets < size
    v = tl.load(x + offsets, mask=live, other=1.0).to(tl.float64)
    if CODE == 0:
        arg = v
    elif CODE == 2:
        arg = tl.abs(v) * -2.0
    elif CODE == 5:
        u = (v + v * v * v * GELU_A) * GELU_C
        arg = tl.abs(u) * -2.0
    else:
        arg = -v
    if CODE != 1 and CODE != 6:  # e^arg: exact_kernel_numba._exp64
        arg = tl.where(arg < -745.0, -745.0, tl.where(arg > 709.0, 709.0, arg))
        n = (arg * INV_LN2 + ROUNDER) - ROUNDER
        r = (arg - n * LN2_HI) - n * LN2_LO
        half = tl.floor(n * 0.5)
        acc = r * 0.0 + EXP_TERMS[0]
        for index in tl.static_range(1, 13):
            acc = acc * r + EXP_TERMS[index]
        scale_1 = ((half.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        scale_2 = (((n - half).to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
        e = acc * scale_1 * scale_2
    if CODE == 2 or CODE == 5:  # tanh: (1 - t) / (1 + t), signed like its argument
        magnitude = (1.0 - e) / (1.0 + e)
        t = tl.where((v if CODE == 2 else u) < 0, -magnitude, magnitude)
    if CODE == 0:
        y = e
        d = e
    elif CODE == 1:  # ln: frexp from the exponent bits (v is normal: a float32 in float64), the odd series
        bits = v.to(tl.int64, bitcast=True)
        finite = v != INF
        mantissa = tl.where(finite, ((bits & 0xFFFFFFFFFFFFF) | (1022 << 52)).to(tl.float64, bitcast=True), v)
        exponent = tl.where(finite, ((bits >> 52) & 0x7FF) - 1022, 0).to(tl.float64)
        small = mantissa < SQRT_HALF
        mantissa = tl.where(small, mantissa * 2.0, mantissa)
        exponent = tl.where(small, exponent - 1.0, exponent)
        f = mantissa - 1.0
        s = f / (f + 2.0)
        z = s * s
        acc = z * 0.0 + LOG_TERMS[0]
        for index in tl.static_range(1, 10):
            acc = acc * z + LOG_TERMS[index]
        y = tl.where(v > 0, exponent * LN2_HI + (exponent * LN2_LO + s * acc), -INF)
        d = 1.0 / v
    elif CODE == 2:
        y = t
        d = 1.0 - t * t
    elif CODE == 3:
        y = 1.0 / (e + 1.0)
        d = y * (1.0 - y)
    elif CODE == 4:
        s = 1.0 / (e + 1.0)
        y = v * s
        d = s * (v * (1.0 - s) + 1.0)
    elif CODE == 5:
        y = v * (t + 1.0) * 0.5
        d = (t + 1.0) * 0.5 + v * ((1.0 - t * t) * GELU_C * (v * v * GELU_3A + 1.0)) * 0.5
    else:
        y = 1.0 / tl.sqrt(v)
        d = y * y * y * -0.5
    tl.store(value + offsets, y.to(tl.float32), mask=live)
    tl.store(slope + offsets, d.to(tl.float32), mask=live)


#: Elements per program of :func:`unary32` (on the GPU; under the interpreter, fewer bigger programs).
UNARY_BLOCK_DEVICE, UNARY_BLOCK_INTERPRETED = 512, 1 << 16


def unary32(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`training.exact_kernel.unary32` on ``x``'s device: ``(value, derivative)`` of the elementwise
    function ``name`` at float32 ``x``, both float32, with version 2's float64 operations (the same bits)."""
    if name not in CODES:
        raise ValueError(f"unary32: unknown function {name!r}: one of {sorted(CODES)}")
    if x.dtype != torch.float32:
        raise TypeError(f"unary32: float32, got {x.dtype}")
    flat = x.detach().contiguous().reshape(-1)
    value, slope = torch.empty_like(flat), torch.empty_like(flat)
    if flat.numel():
        block = UNARY_BLOCK_DEVICE if x.is_cuda else UNARY_BLOCK_INTERPRETED
        _launch(_unary, (triton.cdiv(flat.numel(), block),), x.device, flat, value, slope, flat.numel(),
                CODE=CODES[name], BLOCK=block)
    return value.reshape(x.shape), slope.reshape(x.shape)
