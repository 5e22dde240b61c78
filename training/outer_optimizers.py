"""The outer optimizers by name (``diloco.outer_optimizer``; docs/DILOCOX.md section 14, "Outer Adam").

One :class:`OuterOptimizer` per kind and a registry keyed by the config's spelling
(:data:`OUTER_OPTIMIZER_KINDS`); :func:`training.diloco.outer_step` resolves the round's learning rates and
hands the step to the kind the run names (:func:`outer_optimizer_for`). The arithmetic of each kind is
written out in :mod:`training.diloco`'s module docstring: unfused float32 elementwise ops only, in a fixed
order, so every platform gets the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from training.config import OUTER_OPTIMIZERS, OUTER_STATE_TENSORS, DilocoConfig
from training.host_tensors import Weights, float32_scalar
from training.muon import is_hidden_matrix


class OuterOptimizer:
    """One outer optimizer: its state per weight and its step, the round's learning rates given."""

    #: The name ``diloco.outer_optimizer`` gives it.
    name = ""

    @property
    def moments(self) -> int:
        """Tensors of outer state per weight, stacked on a leading axis when more than one
        (:data:`training.config.OUTER_STATE_TENSORS`, which the config's checks read too)."""
        return OUTER_STATE_TENSORS[self.name]

    def state_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the outer state ("momentum") of a weight of ``shape``."""
        return (self.moments, *shape) if self.moments != 1 else tuple(shape)

    def step(self, global_weights: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
             pseudo_gradient: Mapping[str, torch.Tensor], diloco_cfg: DilocoConfig, momentum: torch.Tensor,
             lr: torch.Tensor, lr_other: torch.Tensor) -> tuple[Weights, Weights]:
        """``(new_weights, new_state)``; ``lr`` for the hidden matrices, ``lr_other`` for every other tensor,
        ``momentum`` the round's scheduled outer momentum (all float32 scalars)."""
        raise NotImplementedError


class NesterovOuter(OuterOptimizer):
    """SGD with (Nesterov) momentum, DiLoCo's outer step (the contract's fraud proof recomputes it)."""

    name = "nesterov"

    def step(self, global_weights, state, pseudo_gradient, diloco_cfg, momentum, lr, lr_other):
        new_weights, new_momentum = {}, {}
        for name in sorted(global_weights):
            delta = pseudo_gradient[name]
            lr_name = lr if is_hidden_matrix(name, delta) else lr_other
            # The same unfused ops with the same operands in the same order; each result is written
            # over a temporary this function just made (out=), which saves allocations, not roundings.
            buffer = torch.mul(state[name], momentum)
            torch.add(buffer, delta, out=buffer)
            if diloco_cfg.nesterov:
                step = torch.mul(buffer, momentum)
                torch.add(delta, step, out=step)
                torch.mul(step, lr_name, out=step)
            else:
                step = torch.mul(buffer, lr_name)
            new_weights[name] = torch.sub(global_weights[name], step, out=step)
            new_momentum[name] = buffer
        return new_weights, new_momentum


class AdamOuter(OuterOptimizer):
    """Outer Adam (FedAdam, arXiv 2003.00295, Algorithm 2, no bias correction): each state tensor ``[m, v]``
    stacked on a leading axis; the round's momentum is not used (the first moment decays by beta1)."""

    name = "adam"

    def step(self, global_weights, state, pseudo_gradient, diloco_cfg, momentum, lr, lr_other):
        beta1, beta2 = (
            float32_scalar(diloco_cfg.outer_adam_beta1),
            float32_scalar(diloco_cfg.outer_adam_beta2),
        )
        one_minus_beta1 = float32_scalar(1.0 - diloco_cfg.outer_adam_beta1)
        one_minus_beta2 = float32_scalar(1.0 - diloco_cfg.outer_adam_beta2)
        eps = float32_scalar(diloco_cfg.outer_adam_eps)
        new_weights, new_moments = {}, {}
        for name in sorted(global_weights):
            delta = pseudo_gradient[name]
            lr_name = lr if is_hidden_matrix(name, delta) else lr_other
            first, second = state[name][0], state[name][1]
            # Unfused float32 ops only (mul, add, sqrt, div are correctly rounded in IEEE 754 on every
            # platform); never addcmul / addcdiv, whose kernels may fuse a multiply-add.
            first_new = torch.mul(first, beta1)
            torch.add(first_new, torch.mul(delta, one_minus_beta1), out=first_new)
            second_new = torch.mul(second, beta2)
            square = torch.mul(delta, delta)
            torch.mul(square, one_minus_beta2, out=square)
            torch.add(second_new, square, out=second_new)
            step = torch.sqrt(second_new)
            torch.add(step, eps, out=step)
            torch.div(first_new, step, out=step)
            torch.mul(step, lr_name, out=step)
            new_weights[name] = torch.sub(global_weights[name], step, out=step)
            new_moments[name] = torch.stack((first_new, second_new))
        return new_weights, new_moments


#: Every outer optimizer a run can name, by ``diloco.outer_optimizer`` (the config checks the name against
#: :data:`training.config.OUTER_OPTIMIZERS`, the same names, at load).
OUTER_OPTIMIZER_KINDS: dict[str, OuterOptimizer] = {
    kind.name: kind for kind in (NesterovOuter(), AdamOuter())
}
assert tuple(OUTER_OPTIMIZER_KINDS) == OUTER_OPTIMIZERS, "training.config.OUTER_OPTIMIZERS names every kind"


def outer_optimizer_for(diloco_cfg: DilocoConfig) -> OuterOptimizer:
    """The outer optimizer ``diloco_cfg.outer_optimizer`` names."""
    return OUTER_OPTIMIZER_KINDS[diloco_cfg.outer_optimizer]
