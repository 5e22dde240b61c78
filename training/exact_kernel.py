"""The reproducible mode's kernel versions (``training.reproducible_kernels``) and the fixed-order float32
matrix product of version 2 (docs/REPRODUCIBLE.md, "Kernel versions").

A reproducible run's bits depend on the arithmetic its kernels do, so the kernels are versioned and the
version is a run setting:

* **1** (a run document that names none: the runs made before the setting existed keep their bits):
  float32 matrix products by :func:`training.exact_math.exact_matmul`, Ozaki's splitting into two 21-bit
  integer slices per operand, three float64 BLAS products of exact integers (about 8x to 13x eager torch's
  step on this project's CPU);
* **2**: float32 matrix products by :func:`ordered_matmul`, compiled loops (Numba) in which every output
  is ``((0 + a_0 b_0) + a_1 b_1) + ...``, ``k`` increasing, each product and each sum one float32 IEEE
  operation (no fused multiply-add, no reassociation: Numba's default, without ``fastmath``): the plain
  loop (:func:`training.exact_kernel_numba.ordered`, the reference) runs ``i``, then ``k``, then ``j``
  innermost, vectorised across outputs ``j`` only; the one used holds tiles of outputs in vector registers
  for the whole of ``k`` (:mod:`training.exact_kernel_tile`), each lane one output, the same bits. One pass
  of float32 arithmetic where version 1 does three float64 BLAS products and the slicing (1.35x to 1.9x
  eager torch's step on this project's CPU, with the fused blocks of :mod:`training.exact_fused`).

Version 2 also computes the elementwise functions (exp, log, tanh, sigmoid, SiLU, tanh-GELU, rsqrt) in one
compiled pass each (:func:`unary32`) with version 1's float64 formulas, operation for operation: the same
bits, vectorised, and the tree sums of the forward pass and of the broadcasts' backward
(:func:`tree_sum`: version 1's pairs in its order, the same bits), and Muon's Newton-Schulz iteration in one
compiled call (:func:`newton_schulz`). Everything else the mode computes (AdamW, the clipping norm, whose
compiled passes give both versions their old bits, the codec's fixed-order linear algebra and its float64
products) is the same in both versions.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import math
import os

import numpy as np
import torch

from training.exact_math import exact_matmul
from training.exact_math import tree_sum as em_tree_sum

#: The versions a run may name; :data:`LEGACY` is the one of a run document without the setting.
VERSIONS = (1, 2, 3)
LEGACY = 1
#: The version docs/REPRODUCIBLE.md recommends to new runs: version 2's kernels with correctly rounded square
#: roots (:func:`sqrt`), so that its bits are the same on every CPU build and on a GPU.
LATEST = 3

#: The version the matrix products of the running forward pass use (set by ``ExactKernels``; each
#: :class:`~training.exact_ops.ExactMatmul` keeps the version of its forward pass for its backward pass).
CURRENT: contextvars.ContextVar[int] = contextvars.ContextVar("reproducible_kernels", default=LEGACY)

_KERNEL = None


class KernelVersionError(ValueError):
    """An unknown kernel version, or version 2 without Numba installed."""


def check_version(version: int) -> int:
    if type(version) is not int or version not in VERSIONS:
        raise KernelVersionError(
            f"training.reproducible_kernels={version!r}: must be one of {list(VERSIONS)}")
    return version


@contextlib.contextmanager
def using(version: int):
    """Within: the matrix products of the reproducible mode use kernel ``version``."""
    token = CURRENT.set(check_version(version))
    try:
        yield
    finally:
        CURRENT.reset(token)


def _compiled():
    """:mod:`training.exact_kernel_numba` (its loops compiled on first use, cached on disk beside it where
    they can be)."""
    global _KERNEL
    if _KERNEL is None:
        try:
            from training import exact_kernel_numba
        except ImportError as exc:  # numba is a dependency (pyproject.toml)
            raise KernelVersionError("training.reproducible_kernels = 2 or 3 needs Numba (pyproject.toml "
                                     "pins it)") from exc
        _KERNEL = exact_kernel_numba
    return _KERNEL


def _tiled():
    """:mod:`training.exact_kernel_tile` (imports Numba)."""
    _compiled()
    from training import exact_kernel_tile
    return exact_kernel_tile


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for float32 ``a`` (..., M, K) and ``b`` (..., K, N) (batch dimensions equal), each output
    summed over ``k`` in increasing order, one float32 multiply and one float32 add at a time (the first
    add to 0): the same bits on every CPU, instruction set and thread count. A float32 product of the
    usual accuracy (a sequential sum: error at most ``K`` units of roundoff of ``sum |a_k b_k|``)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"ordered_matmul: float32 operands, got {a.dtype} and {b.dtype}")
    if a.size(-1) != b.size(-2) or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"ordered_matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    if a.is_cuda:  # the same order in Triton kernels on the GPU (training/exact_triton.py)
        from training import exact_triton
        return exact_triton.ordered_matmul(a, b)
    batch, (m, k), n = a.shape[:-2], a.shape[-2:], b.size(-1)
    count = math.prod(batch)
    out = np.empty((count, m, n), dtype=np.float32)
    # The kernel copies its operands into panels, so strided (transposed) views need no copy here.
    _run_split(_tiled().ordered, array(a).reshape(count, m, k), array(b).reshape(count, k, n), out)
    return device_of(torch.from_numpy(out).view(*batch, m, n), a)


def sqrt(x: torch.Tensor, version: int | None = None) -> torch.Tensor:
    """``x``'s square roots: by kernel ``version`` 3 (default :data:`CURRENT`) the correctly rounded root of
    IEEE 754 on every device (NumPy's on a CPU tensor: the instruction set's square root; CUDA's ``sqrt.rn``,
    which torch's CUDA kernel compiles to), else torch's. torch's CPU kernel is not always the correctly
    rounded root, and how often not depends on its build and instruction set (docs/REPRODUCIBLE.md): 16.9%
    of float32 roots on this project's CPU build, 0.67% on another; versions 1 and 2 keep those bits."""
    version = CURRENT.get() if version is None else check_version(version)
    if version < 3 or x.is_cuda:
        return torch.sqrt(x)
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"sqrt: float32 or float64, got {x.dtype}")
    with np.errstate(invalid="ignore"):  # a negative's root is NaN, as on a GPU
        root = np.sqrt(array(x))
    return device_of(torch.from_numpy(np.asarray(root, dtype=root.dtype)).view(x.shape), x)


def as_divisor(x: torch.Tensor, number: float) -> torch.Tensor | float:
    """``number`` as the divisor of ``x / number`` with one correctly rounded division per element on every
    device: a CPU tensor divides by the number itself (torch rounds it to ``x``'s dtype, then divides); on a
    GPU it is a 0-dim tensor of ``x``'s dtype there, since CUDA's kernel multiplies by a number's reciprocal
    (two roundings: a third of float32 quotients by 3 differ). The same bits as the CPU's either way."""
    if x.is_cpu:
        return number
    return torch.tensor(number, dtype=x.dtype, device=x.device)


def array(x: torch.Tensor) -> np.ndarray:
    """``x``'s values as a NumPy array (a view of a CPU tensor's memory, without a copy)."""
    return (x if x.is_cpu else x.cpu()).detach().numpy()


def device_of(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``out`` (a CPU result of the compiled loops) on ``like``'s device."""
    return out if like.is_cpu else out.to(like.device)


#: Below this many multiply-adds a product runs on one thread (a thread's hand-off costs more).
SPLIT_WORK = 1 << 22
_POOL: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}


def _run_split(kernel, left: np.ndarray, right: np.ndarray, out: np.ndarray) -> None:
    """``kernel(left, right, out)`` on torch's intra-op thread count: the batch (or, for one matrix, the
    rows) cut into that many parts, each on its own thread (the loop releases the GIL). Every output is
    still one thread's sum in the one order, so the bits do not depend on the thread count."""
    threads = torch.get_num_threads()
    count, m, k = left.shape
    if threads <= 1 or count * m * k * right.shape[2] < SPLIT_WORK or (count == 1 and m < 2 * threads):
        kernel(left, right, out)
        return
    key = (os.getpid(), threads)  # a forked child has none of its parent's pool threads: its own pool
    pool = _POOL.get(key) or _POOL.setdefault(key, concurrent.futures.ThreadPoolExecutor(threads))
    if count >= threads:
        cuts = np.linspace(0, count, threads + 1).astype(int)
        parts = [(left[s:e], right[s:e], out[s:e]) for s, e in zip(cuts[:-1], cuts[1:])]
    else:  # each matrix cut into blocks of rows (a block of rows of a C-contiguous array is one too)
        cuts = np.linspace(0, m, threads + 1).astype(int)
        parts = [(left[p:p + 1, s:e], right[p:p + 1], out[p:p + 1, s:e])
                 for p in range(count) for s, e in zip(cuts[:-1], cuts[1:])]
    for done in [pool.submit(kernel, *part) for part in parts]:
        done.result()


def product(a: torch.Tensor, b: torch.Tensor, version: int | None = None) -> torch.Tensor:
    """``a @ b`` by kernel ``version`` (:data:`CURRENT` when None): version 2's :func:`ordered_matmul` for
    float32, else (version 1, or float64 operands) :func:`training.exact_math.exact_matmul`."""
    version = CURRENT.get() if version is None else check_version(version)
    if version >= 2 and a.dtype == torch.float32:
        return ordered_matmul(a, b)
    return exact_matmul(a, b)


def unary32(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, derivative)`` of the elementwise function ``name`` (``training.exact_ops.UNARY``) at float32
    ``x``, both float32: version 2's one compiled pass, the same float64 operations in the same order as
    the torch formulas of version 1 (so the same bits: tests/test_reproducible_kernels.py)."""
    if x.is_cuda:  # the same operations in a Triton kernel on the GPU (training/exact_triton.py)
        from training import exact_triton
        return exact_triton.unary32(name, x)
    kernels = _compiled()
    flat = array(x).reshape(-1)
    value, slope = np.empty_like(flat), np.empty_like(flat)
    kernels.unary(kernels.CODES[name], flat, value, slope)
    return (device_of(torch.from_numpy(value).view(x.shape), x),
            device_of(torch.from_numpy(slope).view(x.shape), x))


def tree_sum(x: torch.Tensor, dim: int, version: int | None = None) -> torch.Tensor:
    """:func:`training.exact_math.tree_sum` (``dim`` kept, of size 1): by kernel ``version`` 2 (default
    :data:`CURRENT`) one compiled pass over float32 or float64 ``x`` adding the same pairs in the same
    order (the same bits), else torch's elementwise adds level by level."""
    version = CURRENT.get() if version is None else version
    dim %= max(x.dim(), 1)
    count = x.size(dim) if x.dim() else 1
    if version < 2 or x.dtype not in (torch.float32, torch.float64) or count < 2:
        return em_tree_sum(x, dim)
    if x.is_cuda:  # the same pairs in a Triton kernel on the GPU (training/exact_triton.py)
        from training import exact_triton
        return exact_triton.tree_sum(x, dim)
    outer, inner = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    shape = list(x.shape)
    shape[dim] = 1
    source = array(x).reshape(outer, count, inner)
    if inner == 1 < outer:  # the rows side by side: each level's adds run across rows (the same pairs)
        source = source.reshape(outer, count).T.reshape(1, count, outer)
        out = np.empty((1, outer), dtype=source.dtype)
    else:
        out = np.empty((outer, inner), dtype=source.dtype)
    _compiled().tree_sum(source, out)
    return device_of(torch.from_numpy(out).view(shape), x)


def square_sum(x: torch.Tensor) -> float:
    """The tree sum (:func:`training.exact_math.tree_sum`) of the float64 squares of ``x``'s entries
    (flattened) in one compiled pass: the same pairs in the same order as the torch version, the same
    bits (used by both kernel versions' gradient norm; the torch levels when Numba is missing)."""
    try:
        kernels = _compiled()
    except KernelVersionError:
        flat = x.detach().to(torch.float64).reshape(-1)
        return float(em_tree_sum(flat * flat, 0).reshape(()))
    return float(kernels.square_sum(array(x).reshape(-1)))


def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> None:
    """Muon's iteration on contiguous float32 CPU ``x`` (rows <= cols), in place, by version 2's products
    and float32 elementwise operations in one compiled call (:func:`training.exact_kernel_tile.newton_schulz`:
    the operations of :func:`training.exact_optim.exact_orthogonalize`'s torch loop, the same bits)."""
    _tiled().newton_schulz(x.detach().view(1, *x.shape).numpy(), *coefficients, steps)


def embedding_backward(ids: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> bool:
    """``out[ids[i]] += rows[i]``, positions ``i`` in increasing order, in one compiled pass over CPU tensors
    (:class:`training.exact_ops.ExactEmbedding`'s additions, in its order: the same bits); False where it
    does not apply (another device or dtype, Numba missing, an id out of range: the torch rounds then)."""
    if not (ids.is_cpu and rows.is_cpu and out.is_cpu and rows.dtype == out.dtype
            and rows.dtype in (torch.float32, torch.float64)):
        return False
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= out.size(0)):
        return False
    try:
        kernels = _compiled()
    except KernelVersionError:
        return False
    kernels.embedding_backward(array(ids), array(rows), out.numpy())
    return True
