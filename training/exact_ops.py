"""The reproducible mode's operators, with forward and backward passes of fixed order (docs/REPRODUCIBLE.md).

Every operator here is made of :mod:`training.exact_math`'s arithmetic and single elementwise IEEE
operations on tensors of one shape, so its forward and backward passes give the same bits on every
platform. Autograd's own backward formulas are used only where they are single elementwise operations on
same-shape tensors (add, subtract, multiply, divide, casts, views, ``where``); everything whose backward
reduces is an :class:`torch.autograd.Function` with its backward written out:

* :class:`ExactExpand` (broadcasting: its backward is a :func:`~training.exact_math.tree_sum` over the
  broadcast dimensions, where torch's would call ``sum_to_size``, a reduction of the machine's order);
* :class:`ExactSum` (a tree sum; backward: the gradient expanded);
* :class:`ExactMatmul` (:func:`~training.exact_kernel.product`, the run's kernel version; backward: two more);
* :class:`ExactEmbedding` (a lookup; backward: each position's gradient added to its token's row, positions
  in increasing order, where torch's ``embedding_dense_backward`` adds duplicates in any order);
* :class:`ExactUnary` (exp, log, tanh, sigmoid, SiLU, tanh-GELU, rsqrt: computed in float64 by
  :mod:`training.exact_math`, rounded once to the input's dtype; backward from the saved result).

The composites (:func:`linear`, :func:`layer_norm`, :func:`softmax`, :func:`attention`,
:func:`cross_entropy`, ...) are what :mod:`training.exact_mode` substitutes for torch's operators.
"""

from __future__ import annotations

import math

import torch

from training import exact_kernel
from training import exact_math as em
from training.errors import TrainingError

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


class ExactKernelError(TrainingError):
    """An operation the reproducible mode has no fixed-order kernel for (or arguments it does not take)."""


# ----------------------------------------------------------------------------- autograd functions


def reduce_to(grad: torch.Tensor, shape: torch.Size, version: int = exact_kernel.LEGACY) -> torch.Tensor:
    """``grad`` summed (tree sums, dimensions in increasing order) down to the broadcastable ``shape``
    (``version``: the kernel version, :func:`training.exact_kernel.tree_sum`; the same bits in each)."""
    extra = grad.dim() - len(shape)
    for dim in range(extra):
        grad = exact_kernel.tree_sum(grad, 0, version).squeeze(0)
    for dim, size in enumerate(shape):
        if size == 1 and grad.size(dim) != 1:
            grad = exact_kernel.tree_sum(grad, dim, version)
    return grad.reshape(shape)


class ExactExpand(torch.autograd.Function):
    """``x`` broadcast to ``shape`` (a copy); backward: the gradient tree-summed back to ``x``'s shape."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        ctx.version = exact_kernel.CURRENT.get()
        return x.expand(shape).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return reduce_to(grad, ctx.shape, ctx.version), None


class ExactSum(torch.autograd.Function):
    """The tree sum over ``dim`` (kept); backward: the gradient expanded along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim):
        ctx.shape = x.shape
        return exact_kernel.tree_sum(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.expand(ctx.shape).contiguous(), None


class ExactMatmul(torch.autograd.Function):
    """``a @ b`` (same batch dimensions) by the kernel version of the forward pass
    (:func:`training.exact_kernel.product`); backward ``g b^T`` and ``a^T g`` by the same version."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.version = exact_kernel.CURRENT.get()
        return exact_kernel.product(a, b, ctx.version)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a = exact_kernel.product(grad, b.transpose(-1, -2), ctx.version) if ctx.needs_input_grad[0] \
            else None
        grad_b = exact_kernel.product(a.transpose(-1, -2), grad, ctx.version) if ctx.needs_input_grad[1] \
            else None
        return grad_a, grad_b


class ExactEmbedding(torch.autograd.Function):
    """``weight[ids]``; backward: position by position (flattened, increasing), its gradient row added to
    its token's row."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.rows = weight.size(0)
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        rows = grad.reshape(flat.numel(), grad.size(-1))
        out = rows.new_zeros((ctx.rows, rows.size(1)))
        if exact_kernel.embedding_backward(flat, rows, out):  # the same adds in one compiled pass
            return None, out
        # Round k adds every token's k-th occurrence (positions increasing within a token): per token the
        # additions of the position-by-position loop, in its order, but one indexed add per round (the
        # indices of a round are distinct, so no two of its additions meet).
        order = torch.sort(flat, stable=True).indices
        tokens = flat[order]
        _, counts = torch.unique_consecutive(tokens, return_counts=True)
        starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        occurrence = torch.arange(flat.numel(), device=flat.device) - starts
        for k in range(int(counts.max()) if counts.numel() else 0):
            chosen = occurrence == k
            targets = tokens[chosen]
            out[targets] = out[targets] + rows[order[chosen]]
        return None, out


def _gelu_tanh(x):
    inner = (x + x * x * x * GELU_A) * GELU_C
    t = em.tanh64(inner)
    value = x * (t + 1.0) * 0.5
    slope = (t + 1.0) * 0.5 + x * ((1.0 - t * t) * GELU_C * (x * x * (3.0 * GELU_A) + 1.0)) * 0.5
    return value, slope


def _sigmoid(x):
    s = 1.0 / (em.exp64(-x) + 1.0)
    return s, s * (1.0 - s)


def _silu(x):
    s = 1.0 / (em.exp64(-x) + 1.0)
    return x * s, s * (x * (1.0 - s) + 1.0)


def _exp(x):
    y = em.exp64(x)
    return y, y


def _log(x):
    return em.log64(x), 1.0 / x


def _tanh(x):
    y = em.tanh64(x)
    return y, 1.0 - y * y


def _rsqrt(x):
    y = 1.0 / torch.sqrt(x)
    return y, y * y * y * -0.5


#: name -> float64 (value, derivative) of each elementwise function :class:`ExactUnary` computes.
UNARY = {"exp": _exp, "log": _log, "tanh": _tanh, "sigmoid": _sigmoid, "silu": _silu, "gelu_tanh": _gelu_tanh,
         "rsqrt": _rsqrt}


def unary_values(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value, derivative)`` of :data:`UNARY` ``name`` at ``x``, in float64, each rounded once to ``x``'s
    dtype (kernel version 2, float32: the same bits in one compiled pass)."""
    if x.dtype == torch.float32 and exact_kernel.CURRENT.get() >= 2:
        return exact_kernel.unary32(name, x)
    value, slope = UNARY[name](x.to(torch.float64))
    return value.to(x.dtype), slope.to(x.dtype)


class ExactUnary(torch.autograd.Function):
    """An elementwise function of :data:`UNARY`, in float64 and rounded once to ``x``'s dtype; backward:
    the gradient times its derivative (float64, rounded once too)."""

    @staticmethod
    def forward(ctx, x, name):
        value, slope = unary_values(name, x)
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    def backward(ctx, grad):
        (slope,) = ctx.saved_tensors
        return grad * slope, None


# ----------------------------------------------------------------------------- composites


def unary(name: str, x: torch.Tensor) -> torch.Tensor:
    """:class:`ExactUnary` ``name`` of ``x``."""
    check_float(x, name)
    return ExactUnary.apply(x, name)


def check_float(x: torch.Tensor, what: str) -> None:
    if x.dtype not in (torch.float32, torch.float64):
        raise ExactKernelError(f"{what}: the reproducible mode computes float32 (or float64), got {x.dtype}")


def expand(x: torch.Tensor, shape) -> torch.Tensor:
    """``x`` broadcast to ``shape`` with a fixed-order backward (itself when it has the shape already)."""
    shape = torch.Size(shape)
    if x.shape == shape:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):  # no backward: a view has the same values
        return x.expand(shape)
    return ExactExpand.apply(x, shape)


def broadcast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors broadcast to their common shape (:func:`expand`)."""
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return [expand(t, shape) for t in tensors]


def sum_dims(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """The tree sum of ``x`` over ``dims`` (all of them when None), one dimension at a time, increasing."""
    if dims is None:
        return ExactSum.apply(x.reshape(-1), 0).reshape(()) if not keepdim else \
            ExactSum.apply(x.reshape(-1), 0).reshape([1] * x.dim())
    dims = sorted({d % x.dim() for d in ((dims,) if isinstance(dims, int) else dims)})
    for dim in dims:
        x = ExactSum.apply(x, dim)
    return x if keepdim else x.squeeze(dims)


def mean_dims(x: torch.Tensor, dims=None, keepdim: bool = False) -> torch.Tensor:
    """:func:`sum_dims` divided by the count."""
    count = x.numel() if dims is None else math.prod(
        x.size(d) for d in ((dims,) if isinstance(dims, int) else dims))
    return sum_dims(x, dims, keepdim) / exact_kernel.as_divisor(x, count)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for operands of at least two dimensions, batch dimensions broadcast."""
    if a.dim() < 2 or b.dim() < 2:
        raise ExactKernelError(f"matmul of shapes {tuple(a.shape)}, {tuple(b.shape)}: 2 dimensions needed")
    check_float(a, "matmul")
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = expand(a, (*batch, *a.shape[-2:]))
    b = expand(b, (*batch, *b.shape[-2:]))
    return ExactMatmul.apply(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` (``nn.Linear``'s layout)."""
    flat = x.reshape(-1, x.size(-1))
    out = matmul(flat, weight.transpose(0, 1))
    if bias is not None:
        out = out + expand(bias, out.shape)
    return out.reshape(*x.shape[:-1], weight.size(0))


def addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``bias + x @ W`` (GPT-2's ``Conv1D`` layout)."""
    if beta != 1 or alpha != 1:
        raise ExactKernelError("addmm with beta or alpha other than 1: no fixed-order kernel")
    out = matmul(x, weight)
    return out + expand(bias, out.shape)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension: tree-summed mean and (biased) variance, ``1/sqrt(var + eps)``."""
    if len(normalized_shape) != 1:
        raise ExactKernelError(f"layer_norm over {tuple(normalized_shape)}: only the last dimension")
    count = x.size(-1)
    centred = x - expand(ExactSum.apply(x, -1) / exact_kernel.as_divisor(x, count), x.shape)
    variance = ExactSum.apply(centred * centred, -1) / exact_kernel.as_divisor(x, count)
    out = centred * expand(unary("rsqrt", variance + eps), x.shape)
    if weight is not None:
        out = out * expand(weight, x.shape)
    if bias is not None:
        out = out + expand(bias, x.shape)
    return out


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``e^(x - max) / sum``, the maximum as a constant (the result does not depend on it, mathematically)."""
    shifted = x - expand(x.detach().amax(dim, keepdim=True), x.shape)
    exps = unary("exp", shifted)
    return exps / expand(ExactSum.apply(exps, dim), x.shape)


def attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
              enable_gqa: bool = False) -> torch.Tensor:
    """Scaled dot-product attention (``F.scaled_dot_product_attention``'s arguments; no dropout, no explicit
    mask, no grouped heads: the model repeats them first)."""
    if attn_mask is not None or dropout_p or enable_gqa:
        raise ExactKernelError("attention with a mask, dropout or grouped heads: no fixed-order kernel")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        allowed = torch.ones(*scores.shape[-2:], dtype=torch.bool, device=q.device).tril(0)
        scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
    return matmul(softmax(scores, -1), v)


def cross_entropy(logits, targets, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) and targets (N,): ``log sum e^(z)`` - the target's ``z``, ``z`` the
    logits less their (constant) maximum; tree sums."""
    if weight is not None or reduction != "mean" or label_smoothing or logits.dim() != 2:
        raise ExactKernelError("cross_entropy: only the mean over (N, V) logits without weights or smoothing")
    if targets.numel() and int(targets.min()) < 0:
        raise ExactKernelError("cross_entropy: ignored targets are not supported by the reproducible mode")
    z = logits - expand(logits.detach().amax(-1, keepdim=True), logits.shape)
    log_total = unary("log", ExactSum.apply(unary("exp", z), -1))
    chosen = torch.nn.functional.one_hot(targets, logits.size(-1)).to(z.dtype)
    picked = ExactSum.apply(z * chosen, -1)
    return ExactSum.apply(log_total - picked, 0).reshape(()) / exact_kernel.as_divisor(z, targets.numel())


def embedding(ids: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``weight[ids]`` with the fixed-order backward of :class:`ExactEmbedding` (no padding index or max
    norm)."""
    if any(a not in (None, False, 2.0, -1) for a in args) or kwargs.get("padding_idx") is not None \
            or kwargs.get("max_norm") is not None:
        raise ExactKernelError("embedding with padding_idx or max_norm: no fixed-order kernel")
    return ExactEmbedding.apply(ids, weight)


def pow_(base, exponent) -> torch.Tensor:
    """``base ** exponent``: squares and cubes by multiplication, 0.5 by ``sqrt``, else ``e^(y ln x)``."""
    if isinstance(exponent, (int, float)) and isinstance(base, torch.Tensor):
        if exponent == 1:
            return base * 1.0
        if exponent in (2, 3):
            return base * base if exponent == 2 else base * base * base
        if exponent == 0.5:
            return 1.0 / unary("rsqrt", base)
    if isinstance(base, (int, float)) and base > 0:
        ln_base = float(em.log64(torch.tensor(float(base), dtype=torch.float64)))
        return unary("exp", exponent * ln_base)
    raise ExactKernelError(
        f"pow of {type(base).__name__} and {type(exponent).__name__}: no fixed-order kernel")


def sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin x, cos x)`` rounded from float64 (constants only: no gradient)."""
    if x.requires_grad:
        raise ExactKernelError("sin/cos of a tensor that requires grad: no backward in the reproducible mode")
    sin, cos = em.sin_cos64(x.to(torch.float64))
    return sin.to(x.dtype), cos.to(x.dtype)
