"""Kernel version 2 of the reproducible mode on a GPU: Triton kernels with version 2's order
(docs/REPRODUCIBLE.md, "On a GPU: Triton kernels").

Version 2's float32 matrix product (:func:`training.exact_kernel.ordered_matmul`) sums each output over ``k``
in increasing order, ``((0 + a_0 b_0) + a_1 b_1) + ...``, one float32 multiply and one float32 add at a time.
:func:`ordered_matmul` here computes the same sum on the GPU: each program owns a tile of the output (rows
``i``, columns ``j``) and runs ``for k in range(K)``: ``acc = acc + a[i, k] * b[k, j]``, the product a tensor
of its own and the add another. No ``tl.dot`` (tensor cores sum in their own order and precision), and the
kernel is compiled with ``enable_fp_fusion=False``: LLVM gets neither the contraction flag nor ptxas
``--fmad=true``, so no multiply and add are fused into an FMA. Each output is one thread's sum, so the
tiling, the launch grid and the GPU model change which thread computes it, never its order.

:func:`tree_sum` is version 2's tree sum (training/exact_math.py's pairs in its order) the same way: one
program per column block, the levels unrolled over the shape's constant level sizes.

On a CPU tensor the same kernels run under Triton's interpreter (numpy's float32 operations, one IEEE
operation each): what the tests compare with the Numba loops bit for bit where no GPU is lent
(tests/test_exact_triton.py); on a CUDA tensor they are compiled for the device. Needs ``triton``
(pyproject.toml's ``gpu`` extra; a CUDA build of torch ships it).
"""

from __future__ import annotations

import math

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
        _KERNELS[key] = InterpretedFunction(fn) if interpreted else triton.jit(fn)
    return _KERNELS[key]


def _launch(fn, grid, device: torch.device, *args, **constants) -> None:
    interpreted = device.type != "cuda"
    options = {} if interpreted else dict(EXACT_OPTIONS)
    _kernel(fn, interpreted)[grid](*args, **constants, **options)


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
            grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n), count)
            _launch(_ordered_tile, grid, a.device, left, right, out, rows, cols, inner, *left.stride(),
                    *right.stride(), BLOCK_M=block_m, BLOCK_N=block_n)
    return out.reshape(*batch, rows, cols)
