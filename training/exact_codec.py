"""The codec of a reproducible run in fixed order: the same payload bytes under every CPU instruction set,
thread count and math library.

The encoders (training/codec/) factorize and measure the pseudo-gradient with torch's reductions, BLAS
matrix products and LAPACK's QR, ``eigh`` and SVD, whose bits follow the CPU, the thread count and
``MKL_CBWR``. Under ``training.reproducible`` the stage's compressor encodes inside :class:`ExactCodec`, a
``TorchFunctionMode`` that replaces each of them (:data:`HANDLERS`): matrix products by exact-split products
(float32: :func:`training.exact_math.exact_matmul`; float64: three slices, or BLAS itself where both
operands are integers whose every partial sum is exact, as the decoder's), sums, means, dot products and
norms by fixed trees (float64 squares for a norm), ``cumsum`` by a left-to-right loop, and QR, ``eigh``
and SVD by :mod:`training.exact_linalg`. Elementwise operations (one IEEE operation each, no fused
multiply-add: ``alpha`` is refused), comparisons, views and casts pass (:data:`NEUTRAL`); any other torch
function raises :class:`training.exact_ops.ExactKernelError`. A run without the mode never enters it: its
bytes are unchanged.
"""

from __future__ import annotations

import contextvars
import math

import torch
from torch.overrides import TorchFunctionMode

from training import exact_kernel
from training import exact_linalg as linalg
from training.exact_math import SLICES, exact_matmul, tree_sum
from training.exact_mode import NEUTRAL as MODEL_NEUTRAL
from training.exact_ops import ExactKernelError

_EXACT_FLOAT64_INTEGER = 2.0 ** 53

#: One IEEE operation per element (broadcasting adds no arithmetic without autograd), or no arithmetic.
NEUTRAL = MODEL_NEUTRAL | frozenset({
    "__getitem__", "__setitem__", "__rsub__", "__sub__", "__add__", "__radd__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "add", "sub", "mul", "div", "where", "maximum", "minimum", "add_", "sub_",
    "mul_", "div_", "__iadd__", "__isub__", "__imul__", "__itruediv__", "clamp_min", "clamp_max", "max",
    "min", "cummax", "flip", "diagonal", "diag", "eye", "sort", "argsort", "topk", "__xor__", "gather",
    "index_select", "masked_fill", "from_numpy", "square", "equal",
})


def _exact_float64_ints(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both float64 integer matrices whose every partial sum of products is an integer below 2^53: BLAS
    computes their product exactly in any order (training.codec_exact.reconstruct_lowrank's case)."""
    if not (a.dtype == b.dtype == torch.float64 and a.numel() and b.numel()):
        return False
    if not (bool(torch.equal(a, torch.round(a))) and bool(torch.equal(b, torch.round(b)))):
        return False
    return float(a.abs().max()) * float(b.abs().max()) * a.shape[-1] <= _EXACT_FLOAT64_INTEGER


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (1-D or 2-D operands) in fixed order: the same bits on any BLAS."""
    if a.dim() > 2 or b.dim() > 2 or a.dim() == 0 or b.dim() == 0:
        raise ExactKernelError(f"matmul of shapes {tuple(a.shape)}, {tuple(b.shape)}: not in the exact codec")
    left, right = (a.unsqueeze(0) if a.dim() == 1 else a), (b.unsqueeze(1) if b.dim() == 1 else b)
    if left.dtype != right.dtype or not left.is_floating_point():
        raise ExactKernelError(f"matmul of {left.dtype} and {right.dtype}: not in the exact codec")
    if _exact_float64_ints(left, right):
        out = torch.mm(left, right)
    else:
        out = exact_matmul(left, right, linalg.F64_SLICES if left.dtype == torch.float64 else SLICES)
    if a.dim() == 1:
        out = out.squeeze(0)
    return out.squeeze(-1) if b.dim() == 1 else out


def _dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None:
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(x.dim(), 1) for d in dims})


def total(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    """``torch.sum``: a fixed tree per reduced dimension, the last first."""
    if dtype is not None:
        x = x.to(dtype)
    if x.dim() == 0:
        return x.clone()
    if not x.is_floating_point():
        return torch.sum(x, dim=dim, keepdim=keepdim) if dim is not None else torch.sum(x)
    dims = _dims(x, dim)
    for d in reversed(dims):
        x = tree_sum(x, d)
    if not keepdim:
        for d in reversed(dims):
            x = x.squeeze(d)
    return x


def mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    count = math.prod(x.shape[d] for d in _dims(x, dim)) if x.dim() else 1
    return total(x, dim, keepdim, dtype=dtype) / count


def vector_norm(x: torch.Tensor, ord=2, dim=None, keepdim: bool = False, *, dtype=None) -> torch.Tensor:
    """The 2-norm: float64 squares (exact for float32) tree-summed, the square root rounded to the dtype."""
    if ord != 2:
        raise ExactKernelError(f"vector_norm of order {ord}: not in the exact codec")
    wide = x.to(torch.float64)
    return linalg.root(total(wide * wide, dim, keepdim)).to(dtype or x.dtype)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return total(a * b)


def cumsum(x: torch.Tensor, dim: int, *, dtype=None) -> torch.Tensor:
    """Left to right, one addition per element."""
    x = x.to(dtype) if dtype is not None else x
    parts = list(torch.unbind(x, dim))
    for i in range(1, len(parts)):
        parts[i] = parts[i - 1] + parts[i]
    return torch.stack(parts, dim) if parts else x.clone()


def power(base, exponent):
    if not (isinstance(base, torch.Tensor) and exponent == 2):
        raise ExactKernelError(f"pow with exponent {exponent!r}: not in the exact codec")
    return base * base


def qr(a: torch.Tensor, mode: str = "reduced"):
    if mode != "reduced":
        raise ExactKernelError(f"qr mode {mode!r}: not in the exact codec")
    return linalg.householder_qr(a)


def eigh(a: torch.Tensor, UPLO: str = "L"):  # noqa: N803 (torch's keyword)
    if UPLO != "L":
        raise ExactKernelError(f"eigh with UPLO={UPLO!r}: not in the exact codec")
    return linalg.jacobi_eigh(a)


def svd(a: torch.Tensor, full_matrices: bool = True, **kwargs):
    if full_matrices and a.shape[0] != a.shape[1]:
        raise ExactKernelError("a full SVD: not in the exact codec (full_matrices=False)")
    return linalg.gram_svd(a)


def _no_alpha(func, args, kwargs):
    if kwargs.get("alpha", 1) != 1:
        raise ExactKernelError(f"{func.__name__} with alpha (a fused multiply-add): not in the exact codec")
    return func(*args, **kwargs)


def _call(target):
    return lambda func, args, kwargs: target(*args, **kwargs)


#: Operator name -> its fixed-order substitute ``(func, args, kwargs) -> result``.
HANDLERS = {
    **dict.fromkeys(("add", "sub", "add_", "sub_"), _no_alpha),
    "matmul": _call(matmul), "__matmul__": _call(matmul), "__rmatmul__": _call(lambda b, a: matmul(a, b)),
    "sqrt": _call(linalg.root),
    "mm": _call(matmul), "mv": _call(matmul), "dot": _call(dot), "sum": _call(total), "mean": _call(mean),
    "linalg_vector_norm": _call(vector_norm), "cumsum": _call(cumsum), "pow": _call(power),
    "__pow__": _call(power), "linalg_qr": _call(qr), "linalg_eigh": _call(eigh),
    "linalg_svd": _call(svd),
}


class ExactCodec(TorchFunctionMode):
    """While active, the codec's torch calls are :data:`HANDLERS`' fixed-order ones or :data:`NEUTRAL`; any
    other raises :class:`ExactKernelError`. ``kernels``: the run's kernel version, whose square root the
    codec takes (training.exact_linalg.ROOT_KERNELS: the correctly rounded root from version 3)."""

    def __init__(self, kernels: int = 1) -> None:
        super().__init__()
        self.kernels = exact_kernel.check_version(int(kernels))
        self._tokens: list[contextvars.Token] = []

    def __enter__(self):
        self._tokens.append(linalg.ROOT_KERNELS.set(self.kernels))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            linalg.ROOT_KERNELS.reset(self._tokens.pop())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        handler = HANDLERS.get(name)
        if handler is not None:
            return handler(func, args, kwargs)
        if name in NEUTRAL:
            return func(*args, **kwargs)
        raise ExactKernelError(f"{name or func!r}: the reproducible codec has no fixed-order kernel for it "
                               "(docs/REPRODUCIBLE.md lists what it covers)")
