"""The inner optimizers by name (``training.optimizer``; docs/DILOCOX.md section 14).

One :class:`InnerOptimizer` per kind, a registry keyed by the config's spelling
(:data:`INNER_OPTIMIZER_KINDS`) and :func:`make_optimizer`, which builds the kind a run names for one
stage's module. The optimizers themselves are :mod:`training.muon`'s (Muon, and the AdamW both use).
"""

from __future__ import annotations

from torch import nn

from training.config import INNER_OPTIMIZERS, TrainingConfig
from training.muon import MuonAdamW, adamw


class InnerOptimizer:
    """One inner optimizer kind: builds a stage's optimizer (torch's optimizer interface)."""

    #: The name ``training.optimizer`` gives it.
    name = ""

    def build(self, module: nn.Module, training_cfg: TrainingConfig):
        raise NotImplementedError


class AdamWInner(InnerOptimizer):
    """AdamW with weight decay on matrices only (not biases, LayerNorms), as GPT-2."""

    name = "adamw"

    def build(self, module, training_cfg):
        return adamw(list(module.parameters()), training_cfg)


class MuonInner(InnerOptimizer):
    """Muon for the hidden matrices and that AdamW for the rest (MuLoCo, arXiv 2505.23725)."""

    name = "muon"

    def build(self, module, training_cfg):
        return MuonAdamW(module, training_cfg)


#: Every inner optimizer a run can name, by ``training.optimizer`` (the config checks the name against
#: :data:`training.config.INNER_OPTIMIZERS`, the same names, at load).
INNER_OPTIMIZER_KINDS: dict[str, InnerOptimizer] = {kind.name: kind for kind in (AdamWInner(), MuonInner())}
assert tuple(INNER_OPTIMIZER_KINDS) == INNER_OPTIMIZERS, "training.config.INNER_OPTIMIZERS names every kind"


def make_optimizer(module: nn.Module, training_cfg: TrainingConfig):
    """The inner optimizer ``training.optimizer`` names for one stage's ``module``."""
    return INNER_OPTIMIZER_KINDS[training_cfg.optimizer].build(module, training_cfg)


def begin_round(optimizers, training_cfg: TrainingConfig) -> bool:
    """An outer round's start, before its start state is captured and its first inner step: under
    ``training.inner_state = "fresh"`` each of ``optimizers`` is as new (its state cleared: AdamW's moments
    and step count, Muon's momentum; its parameter groups are kept, the inner lr is set every step), so the
    round's program is its inner steps from the round's start weights alone; under "carry" nothing changes.
    True when it cleared them."""
    if not training_cfg.fresh_inner_state:
        return False
    for optimizer in optimizers:
        optimizer.state.clear()
    return True
