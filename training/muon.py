"""Muon as DiLoCo's inner optimizer (``training.optimizer = "muon"``; MuLoCo, arXiv 2505.23725).

Muon (Keller Jordan et al. 2024, https://kellerjordan.github.io/posts/muon) steps a hidden weight
matrix ``W`` (``m x n``) along its orthogonalized momentum; everything else (embeddings, the head,
norms, biases) keeps AdamW, as Muon's reference and MuLoCo do. Per inner step, with ``g`` the clipped
gradient and ``lr`` the scheduled inner learning rate (training/schedule.py)::

    b  <- beta * b + (1 - beta) * g                  momentum (``lerp``, the reference's form)
    u  <- (1 - beta) * g + beta * b                  Nesterov
    O  <- NS5(u)                                     ~ U V^T of u = U S V^T (below)
    W  <- W * (1 - lr * wd)                          decoupled weight decay (training.weight_decay)
    W  <- W - lr * muon_lr_scale * 0.2 * sqrt(max(m, n)) * O

``0.2 sqrt(max(m, n))`` gives the update the RMS of a typical AdamW update (Moonlight, arXiv
2502.16982: an orthogonal ``m x n`` matrix has entries of RMS ``1 / sqrt(max(m, n))``),
so one inner learning rate and schedule serve both parts. ``NS5`` is the reference's quintic
Newton-Schulz iteration, five steps, in float32 here (the reference uses bfloat16 on GPUs)::

    X <- u / (||u||_F + 1e-7)          (transposed first when m > n, back after)
    5 times:  A = X X^T;  B = b A + c A A;  X = a X + B X        (a, b, c) = (3.4445, -4.7750, 2.0315)

Bit-exactness: only matrix products, elementwise ops and one Frobenius norm, in a fixed order on
fixed shapes, so a rerun with the claimant's thread count and kernels gives the same bits
(re-execution, docs/DILOCOX.md section 11). The state of a hidden matrix is its momentum buffer
(``muon.momentum_buffer/<name>`` in the replica's start state); the AdamW part's is AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from training.config import TrainingConfig
from training.exact_optim import ExactAdamW, exact_momentum, exact_orthogonalize

#: The per-parameter state of each part, as torch names it.
ADAM_FIELDS = ("exp_avg", "exp_avg_sq", "step")
MUON_FIELDS = ("momentum_buffer",)
#: Parameter-name components of the matrices Muon leaves to AdamW: token and position embeddings and the head
#: (GPT-2's ``transformer.wte``, ``transformer.wpe``, ``lm_head``; Llama's ``model.embed_tokens``,
#: ``lm_head``).
EMBEDDING_NAMES = frozenset({"wte", "wpe", "embed_tokens", "lm_head"})
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
#: Moonlight's factor: the orthogonalized update scaled to AdamW's typical update RMS.
RMS_MATCH = 0.2


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon steps ``name``: a 2-D weight that is not an embedding or the head."""
    return param.dim() == 2 and not EMBEDDING_NAMES.intersection(name.split("."))


def orthogonalize(update: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """``NS5(update)`` of the module docstring: float32, a fresh tensor of ``update``'s shape."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(torch.float32)
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return (x.T if transposed else x).contiguous()


class MuonAdamW:
    """One stage's inner optimizer under ``training.optimizer = "muon"``: Muon for the hidden matrices, AdamW
    (:func:`adamw`, the optimizer of an AdamW run) for the rest.

    Looks like a torch optimizer to its callers: ``param_groups`` (the Muon group first; the inner-lr
    schedule sets ``lr`` on every group), ``state`` (one mapping, parameter -> its state, shared with the
    AdamW part: the start-state capture and restore read and write it), ``step()``, ``zero_grad()``.
    """

    def __init__(self, module: nn.Module, training_cfg: TrainingConfig) -> None:
        named = list(module.named_parameters())
        hidden = [param for name, param in named if is_hidden_matrix(name, param)]
        self._hidden = {id(param) for param in hidden}
        self.adamw = adamw(
            [param for param in module.parameters() if id(param) not in self._hidden], training_cfg
        )
        self.state = self.adamw.state
        self.muon_group = {
            "params": hidden, "lr": training_cfg.inner_lr, "momentum": training_cfg.muon_momentum,
            "weight_decay": training_cfg.weight_decay, "lr_scale": training_cfg.muon_lr_scale,
        }
        self.param_groups = [self.muon_group, *self.adamw.param_groups]
        #: ``training.reproducible``: the fixed-order arithmetic of training/exact_optim.py.
        self.reproducible = training_cfg.reproducible
        self.kernels = training_cfg.reproducible_kernels

    def steps_with_muon(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is in the Muon part (its state is :data:`MUON_FIELDS`), else AdamW's."""
        return id(param) in self._hidden

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.muon_group["params"]:
            param.grad = None
        self.adamw.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        group = self.muon_group
        beta, lr = group["momentum"], group["lr"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(param)
            buffer = state["momentum_buffer"]
            if self.reproducible:
                nesterov = exact_momentum(buffer, param.grad, beta)
                update = exact_orthogonalize(nesterov, NS_COEFFICIENTS, NS_STEPS, self.kernels)
            else:
                buffer.lerp_(param.grad, 1 - beta)
                update = orthogonalize(param.grad.lerp(buffer, beta))
            scale = group["lr_scale"] * RMS_MATCH * math.sqrt(max(param.shape))
            param.mul_(1 - lr * group["weight_decay"])
            if self.reproducible:  # add with alpha is a fused multiply-add where the CPU has one
                param.sub_(update * (lr * scale))
            else:
                param.add_(update, alpha=-lr * scale)
        self.adamw.step()


def adamw(params: list[torch.Tensor], training_cfg: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (lr, betas, weight decay of ``training_cfg``); weight decay on matrices only (not
    biases, norms), as GPT-2. Groups without parameters are left out (torch keeps one empty group only when
    there is nothing at all, which no stage has)."""
    groups = [group for group in (
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": training_cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ) if group["params"]] or [{"params": [], "weight_decay": 0.0}]
    betas = (training_cfg.beta1, training_cfg.beta2)
    if training_cfg.reproducible:
        return ExactAdamW(groups, lr=training_cfg.inner_lr, betas=betas,
                          kernels=training_cfg.reproducible_kernels)
    return torch.optim.AdamW(groups, lr=training_cfg.inner_lr, betas=betas)


def state_kind(optimizer, param: torch.Tensor) -> tuple[str, tuple[str, ...]]:
    """``(group prefix, fields)`` of ``param``'s state in the replica's start state: ``("muon",
    MUON_FIELDS)`` for a Muon-stepped matrix, else ``("adam", ADAM_FIELDS)``."""
    if isinstance(optimizer, MuonAdamW) and optimizer.steps_with_muon(param):
        return "muon", MUON_FIELDS
    return "adam", ADAM_FIELDS


def optimizer_prefixes() -> Iterable[str]:
    """The start-state group prefixes that hold inner-optimizer state (a restart holds none of them)."""
    return ("adam.", "muon.")
