"""The inner optimizers' arithmetic in the reproducible mode: single IEEE operations in a fixed order.

torch's AdamW steps with ``lerp``, ``addcmul`` and ``addcdiv``, whose vectorised kernels use a fused
multiply-add where the instruction set has one (AVX2, AVX-512, NEON) and two roundings where it does not,
and Muon's Newton-Schulz iteration and gradient clipping reduce in the machine's order. Here
(docs/REPRODUCIBLE.md):

* :class:`ExactAdamW`: torch's AdamW (its state, parameter groups, ``state_dict``) whose step is written out
  as separate multiplies, adds, divides and a square root (``m = beta1 m + (1 - beta1) g``,
  ``v = beta2 v + (1 - beta2) g^2``, ``p = p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)``);
  the bias corrections ``beta^t`` are products of ``t`` floats (not the C library's ``pow``);
* :func:`exact_orthogonalize`: Muon's quintic Newton-Schulz with the run's fixed-order products and a
  tree-summed Frobenius norm; :func:`exact_momentum` its momentum and Nesterov step without ``lerp``;
* :func:`exact_grad_sq_norm`: the squared gradient norm for clipping, tree-summed in float64.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from training import exact_kernel
from training.exact_kernel import LEGACY, newton_schulz, product, square_sum, tree_sum


def power(base: float, exponent: int) -> float:
    """``base ** exponent`` as ``exponent`` float64 products in order (the same bits on every C library)."""
    out = 1.0
    for _ in range(exponent):
        out *= base
    return out


class ExactAdamW(torch.optim.AdamW):
    """AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with a fixed-order step; state as torch's.
    ``kernels``: the run's kernel version (its square root: :func:`training.exact_kernel.sqrt`)."""

    def __init__(self, params, *args, kernels: int = LEGACY, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.kernels = exact_kernel.check_version(kernels)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        if closure is not None:
            raise ValueError("ExactAdamW.step: closures are not supported")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, param.grad, beta1, beta2, lr, eps, decay)

    def _step_one(self, param, grad, beta1, beta2, lr, eps, decay) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        step = int(state["step"])
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        hyper = (beta1, beta2, lr, eps, decay, step)
        if _compiled_step(param, grad, exp_avg, exp_avg_sq, hyper, self.kernels):
            return
        if decay:
            param.mul_(1.0 - lr * decay)
        exp_avg.mul_(beta1)
        exp_avg.add_(grad * (1.0 - beta1))
        exp_avg_sq.mul_(beta2)
        exp_avg_sq.add_((grad * grad) * (1.0 - beta2))
        bias_correction1 = 1.0 - power(beta1, step)
        bias_correction2_sqrt = math.sqrt(1.0 - power(beta2, step))
        root = exact_kernel.sqrt(exp_avg_sq, self.kernels)
        denom = root / exact_kernel.as_divisor(root, bias_correction2_sqrt) + eps
        param.sub_((exp_avg / denom) * (lr / bias_correction1))


def _compiled_step(param, grad, exp_avg, exp_avg_sq, hyper, kernels: int) -> bool:
    """The step below in one compiled pass (:func:`training.exact_kernel_numba.adamw`: the same float32
    operations, the same bits) where the tensors allow it (float32, CPU, contiguous state) and Numba is
    installed; False otherwise (the torch operations then)."""
    beta1, beta2, lr, eps, decay, step = hyper
    tensors = (param, exp_avg, exp_avg_sq)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors) \
            or grad.dtype != torch.float32 or grad.device.type != "cpu" or grad.shape != param.shape:
        return False
    try:
        compiled = exact_kernel._compiled()
    except exact_kernel.KernelVersionError:
        return False
    if decay and 1.0 - lr * decay == 1.0:  # torch's path multiplies by 1 then: the same bits as not at all
        decay = 0.0
    flat_param, flat_avg = param.detach().view(-1).numpy(), exp_avg.view(-1).numpy()
    compiled.adamw_moments(flat_param, grad.detach().reshape(-1).numpy(), flat_avg,
                          exp_avg_sq.view(-1).numpy(), 1.0 - lr * decay if decay else 1.0, beta1, 1.0 - beta1,
                          beta2, 1.0 - beta2)
    # The run's sqrt (torch's before version 3: on this project's CPU it is not always the correctly rounded
    # root, docs/REPRODUCIBLE.md), not the compiled loop's: the step's bits are the torch path's.
    compiled.adamw_apply(flat_param, flat_avg, exact_kernel.sqrt(exp_avg_sq, kernels).view(-1).numpy(),
                        math.sqrt(1.0 - power(beta2, step)), eps, lr / (1.0 - power(beta1, step)))
    return True


def exact_momentum(buffer: torch.Tensor, grad: torch.Tensor, beta: float) -> torch.Tensor:
    """Muon's momentum and Nesterov step: ``b <- beta b + (1 - beta) g`` (in place), returns
    ``(1 - beta) g + beta b``."""
    buffer.mul_(beta)
    buffer.add_(grad * (1.0 - beta))
    return grad * (1.0 - beta) + buffer * beta


def exact_orthogonalize(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, kernels: int = LEGACY
) -> torch.Tensor:
    """Muon's NS5 (training/muon.py's :func:`~training.muon.orthogonalize`) in fixed order, its products by
    kernel version ``kernels`` (:func:`training.exact_kernel.product`)."""
    a, b, c = coefficients
    x = update.to(torch.float32)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T.contiguous()
    norm = exact_kernel.sqrt(tree_sum((x * x).reshape(-1), 0, kernels), kernels) + 1e-7
    x = x / norm
    if kernels >= 2 and x.dtype == torch.float32 and x.device.type == "cpu":  # one compiled pass, same bits
        x = x.contiguous()
        newton_schulz(x, coefficients, steps)
        return (x.T if transposed else x).contiguous()
    for _ in range(steps):
        gram = product(x, x.T, kernels)
        poly = gram * b + product(gram, gram, kernels) * c
        x = x * a + product(poly, x, kernels)
    return (x.T if transposed else x).contiguous()


def exact_grad_sq_norm(module: nn.Module) -> torch.Tensor:
    """Sum of squared gradient entries of ``module`` (float64 scalar on the CPU): each gradient's squares
    (exact in float64) tree-summed, the parameters' sums added in parameter order."""
    total = 0.0  # float64 additions in parameter order, as a float64 tensor's
    for param in module.parameters():
        if param.grad is not None:
            total = total + square_sum(param.grad)
    return torch.tensor(total, dtype=torch.float64)
