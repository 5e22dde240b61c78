"""Fused blocks of the reproducible mode (kernel versions 1 and 2): one autograd node where the composites of
:mod:`training.exact_ops` record several, computing **exactly** what those nodes compute, operation for
operation, forward and backward (docs/REPRODUCIBLE.md, "Cost"; tests/test_reproducible_golden.py holds the
bits recorded before these existed, tests/test_reproducible_kernels.py compares each block with its
composite).

Fewer nodes means less of autograd's and the mode's per-operation work, and no copies for the broadcasts
(a bias or a norm's statistics added to each row by torch's broadcasting: the same elementwise operations as
on the copy). Where a composite's input received several gradient contributions, the fused node hands them
back separately, in the order the composite's nodes delivered them (autograd adds a node's outputs to an
input's gradient one after another), so every accumulated gradient is summed in the same order.

* :class:`ExactAffine` (``linear``, ``addmm``): the composites' reshape, transpose, :class:`ExactMatmul`,
  :class:`ExactExpand` of the bias and add;
* :class:`ExactLayerNorm` (``layer_norm``): the composite's two tree sums, three broadcasts, ``rsqrt`` and
  elementwise operations (a dozen nodes).
"""

from __future__ import annotations

import math

import torch

from training import exact_kernel
from training.exact_ops import ExactKernelError, check_float, reduce_to, unary_values
from training.exact_ops import attention as composite_attention


class ExactAffine(torch.autograd.Function):
    """``x W^T + b`` (``transposed``: ``nn.Linear``'s weight (out, in)) or ``x W + b`` (``Conv1D``'s
    (in, out)), ``x`` (..., in), ``b`` (out,) or None: one node for what was a reshape, a transpose, an
    :class:`ExactMatmul` of the 2-D rows, an :class:`ExactExpand` of the bias and an add, computing what
    they computed: the product by the forward's kernel version, the bias added to each row (the same
    elementwise adds as to the expanded copy); backward ``g W'^T`` and ``rows^T g`` (``W'`` the (in, out)
    matrix) by the same version, the bias's gradient the tree sum of ``g``'s rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed):
        rows = x.reshape(-1, x.size(-1))
        matrix = weight.transpose(0, 1) if transposed else weight
        ctx.save_for_backward(rows, matrix)
        ctx.version, ctx.transposed, ctx.shape = exact_kernel.CURRENT.get(), transposed, x.shape
        out = exact_kernel.product(rows, matrix, ctx.version)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], matrix.size(1))

    @staticmethod
    def backward(ctx, grad):
        rows, matrix = ctx.saved_tensors
        grad = grad.reshape(-1, matrix.size(1))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = exact_kernel.product(grad, matrix.transpose(-1, -2), ctx.version).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = exact_kernel.product(rows.transpose(-1, -2), grad, ctx.version)
            grad_w = grad_w.transpose(0, 1) if ctx.transposed else grad_w
        if ctx.needs_input_grad[2]:
            grad_b = reduce_to(grad, grad[0].shape, ctx.version)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` (``nn.Linear``'s layout): :func:`training.exact_ops.linear`'s arithmetic, one node."""
    check_float(x, "linear")
    if x.dim() < 1 or weight.dim() != 2 or x.size(-1) != weight.size(1):
        raise ExactKernelError(f"linear of shapes {tuple(x.shape)}, {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.size(0),):
        raise ExactKernelError(f"linear with a bias of shape {tuple(bias.shape)}")
    return ExactAffine.apply(x, weight, bias, True)


def addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``bias + x @ W`` (GPT-2's ``Conv1D`` layout): :func:`training.exact_ops.addmm`'s arithmetic, one
    node."""
    if beta != 1 or alpha != 1:
        raise ExactKernelError("addmm with beta or alpha other than 1: no fixed-order kernel")
    check_float(x, "addmm")
    if x.dim() != 2 or weight.dim() != 2 or x.size(1) != weight.size(0) or bias.shape != (weight.size(1),):
        raise ExactKernelError(
            f"addmm of shapes {tuple(bias.shape)}, {tuple(x.shape)}, {tuple(weight.shape)}")
    return ExactAffine.apply(x, weight, bias, False)


class ExactLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dimension as :func:`training.exact_ops.layer_norm` computes it. ``x`` is
    passed twice: its gradient comes back in the composite's two contributions, the centring's (``x -
    mean``) first, the mean's tree sum's second."""

    @staticmethod
    def forward(ctx, x, x_again, weight, bias, eps):
        version, count = exact_kernel.CURRENT.get(), x.size(-1)
        centred = x - exact_kernel.tree_sum(x, -1, version) / exact_kernel.as_divisor(x, count)
        variance = exact_kernel.tree_sum(centred * centred, -1, version) / exact_kernel.as_divisor(x, count)
        rstd, slope = unary_values("rsqrt", variance + eps)
        normed = centred * rstd
        out = normed * weight if weight is not None else normed
        ctx.save_for_backward(centred, rstd, slope, normed, weight)
        ctx.version, ctx.count, ctx.has_bias = version, count, bias is not None
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        centred, rstd, slope, normed, weight = ctx.saved_tensors
        version, count = ctx.version, ctx.count
        grad_bias = reduce_to(grad, (count,), version) if ctx.has_bias else None
        grad_weight = None
        if weight is not None:
            grad_weight = reduce_to(grad * normed, weight.shape, version)
            grad = grad * weight
        # centred * rstd: the centred's first contribution; the variance's path its next two (x * x's).
        first = grad * rstd
        grad_rstd = exact_kernel.tree_sum(grad * centred, -1, version)
        grad_square = (grad_rstd * slope) / exact_kernel.as_divisor(grad, count)
        second = grad_square * centred
        grad_centred = (first + second) + second
        grad_mean = exact_kernel.tree_sum(-grad_centred, -1, version) / exact_kernel.as_divisor(grad, count)
        return grad_centred, grad_mean.expand(centred.shape), grad_weight, grad_bias, None


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension (:class:`ExactLayerNorm`)."""
    if len(normalized_shape) != 1:
        raise ExactKernelError(f"layer_norm over {tuple(normalized_shape)}: only the last dimension")
    check_float(x, "layer_norm")
    return ExactLayerNorm.apply(x, x, weight, bias, eps)


class ExactCrossEntropy(torch.autograd.Function):
    """:func:`training.exact_ops.cross_entropy`'s mean cross-entropy of logits (N, V) and targets (N,) as one
    node: ``z`` the logits less their row maximum (a constant), ``log`` of the tree sum of ``e^z`` less the
    tree sum of ``z`` times the one-hot targets, tree-summed over the rows and divided by ``N``. Backward: the
    composite's, ``z``'s two contributions (the exponential's and the one-hot product's) added."""

    @staticmethod
    def forward(ctx, logits, targets):
        version, count = exact_kernel.CURRENT.get(), targets.numel()
        z = logits - logits.amax(-1, keepdim=True)
        exps, exp_slope = unary_values("exp", z)
        log_total, log_slope = unary_values("log", exact_kernel.tree_sum(exps, -1, version))
        chosen = torch.nn.functional.one_hot(targets, logits.size(-1)).to(z.dtype)
        picked = exact_kernel.tree_sum(z * chosen, -1, version)
        ctx.save_for_backward(exp_slope, log_slope, chosen)
        ctx.count = count
        total = exact_kernel.tree_sum(log_total - picked, 0, version).reshape(())
        return total / exact_kernel.as_divisor(z, count)

    @staticmethod
    def backward(ctx, grad):
        exp_slope, log_slope, chosen = ctx.saved_tensors
        rows = (grad / exact_kernel.as_divisor(grad, ctx.count)).reshape(1, 1).expand(chosen.size(0), 1)
        from_exp = (rows * log_slope) * exp_slope
        from_pick = -rows * chosen
        return from_exp + from_pick, None


def cross_entropy(logits, targets, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0) -> torch.Tensor:
    """Mean cross-entropy (:class:`ExactCrossEntropy`; the arguments of ``F.cross_entropy``)."""
    if weight is not None or reduction != "mean" or label_smoothing or logits.dim() != 2:
        raise ExactKernelError("cross_entropy: only the mean over (N, V) logits without weights or smoothing")
    if targets.numel() and int(targets.min()) < 0:
        raise ExactKernelError("cross_entropy: ignored targets are not supported by the reproducible mode")
    check_float(logits, "cross_entropy")
    return ExactCrossEntropy.apply(logits, targets)


class ExactAttention(torch.autograd.Function):
    """:func:`training.exact_ops.attention` (``q k^T`` scaled, the causal mask, the softmax, the product with
    ``v``; equal batch dimensions) as one node, with the backward its nine nodes computed: ``g v^T`` and
    ``p^T g``; the division's ``g / s`` and ``-g ((e / s) / s)`` (torch's formulas for ``e / s``), the
    latter tree-summed; the exponential's derivative, the mask's zeros, the scale; ``g k`` and ``q^T g``."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal):
        version = exact_kernel.CURRENT.get()
        scores = exact_kernel.product(q, k.transpose(-1, -2), version) * scale
        allowed = None
        if causal:
            allowed = torch.ones(*scores.shape[-2:], dtype=torch.bool, device=q.device).tril(0)
            scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
        exps, slope = unary_values("exp", scores - scores.amax(-1, keepdim=True))
        total = exact_kernel.tree_sum(exps, -1, version)
        probs = exps / total
        ctx.save_for_backward(q, k, v, exps, slope, total, probs, allowed)
        ctx.version, ctx.scale = version, scale
        return exact_kernel.product(probs, v, version)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, exps, slope, total, probs, allowed = ctx.saved_tensors
        version = ctx.version
        grad_probs = exact_kernel.product(grad, v.transpose(-1, -2), version)
        grad_v = exact_kernel.product(probs.transpose(-1, -2), grad, version)
        grad_total = exact_kernel.tree_sum(-grad_probs * ((exps / total) / total), -1, version)
        grad_scores = (grad_probs / total + grad_total) * slope
        if allowed is not None:
            grad_scores = torch.where(allowed, grad_scores, 0.0)
        grad_scores = grad_scores * ctx.scale
        grad_q = exact_kernel.product(grad_scores, k, version)
        grad_k = exact_kernel.product(q.transpose(-1, -2), grad_scores, version).transpose(-1, -2)
        return grad_q, grad_k, grad_v, None, None


def attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
              enable_gqa: bool = False) -> torch.Tensor:
    """Scaled dot-product attention (:class:`ExactAttention`; ``F.scaled_dot_product_attention``'s
    arguments, :func:`training.exact_ops.attention`'s limits); batch dimensions that differ (broadcast):
    the composite."""
    if attn_mask is not None or dropout_p or enable_gqa:
        raise ExactKernelError("attention with a mask, dropout or grouped heads: no fixed-order kernel")
    for tensor in (q, k, v):
        check_float(tensor, "attention")
    if not (q.dim() >= 2 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        return composite_attention(q, k, v, is_causal=is_causal, scale=scale)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return ExactAttention.apply(q, k, v, scale, is_causal)
