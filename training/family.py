"""What a model family is: the protocol every architecture implements, and the layers they share.

A family (GPT-2 in :mod:`training.gpt2`, Llama in :mod:`training.llama`) is a
decoder-only transformer cut the same way::

    <root>.<embeddings...>          first stage
    <root>.<blocks>.{i}.*           block i (any stage)
    <root>.<final_norm>.*, lm_head  last stage

with Hugging Face's parameter names, so that export is a copy. The family says
which modules sit at each place, their parameter shapes in canonical
(``state_dict``) order, how each tensor is initialised, and what every block
needs besides the hidden states (Llama: the rotary cos/sin of the positions;
GPT-2: nothing). :class:`training.model.TransformerSlice` assembles any
contiguous range of blocks from these pieces, so a pipeline stage and the whole
model run the same code for every family.

The registry (:data:`training.model.FAMILIES`) maps ``model.family`` to the
family object; callers never test which family they hold.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig, RandomSource
from training.portable_rng import normal_tensor

INIT_STD = 0.02


class Embedding(nn.Module):
    """A lookup table; unlike ``nn.Embedding`` it does not touch the global RNG."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """Bias-free ``nn.Linear`` layout (weight (out, in)); no initialisation (see ``init_state_dict``)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ModelFamily:
    """One architecture: module tree, parameter shapes, initialisation and HF config.

    Subclasses set the three names below and implement the abstract methods.
    """

    name: str = ""
    root: str = ""  # module that holds embeddings, blocks and final norm: "transformer", "model"
    blocks: str = ""  # the block list under root: "h", "layers"
    final_norm: str = ""  # the last norm under root: "ln_f", "norm"
    embeddings: tuple[str, ...] = ()  # the embedding modules under root

    # ------------------------------------------------------------------ shapes
    def embedding_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Full names and shapes of the embedding parameters (the first stage's)."""
        raise NotImplementedError

    def block_param_shapes(self, cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
        """Full names and shapes of block ``layer``'s parameters, in HF order."""
        raise NotImplementedError

    def head_param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Full names and shapes of the final norm and the LM head (the last stage's)."""
        raise NotImplementedError

    def param_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every parameter of the full model, in canonical (state_dict) order."""
        shapes = dict(self.embedding_param_shapes(cfg))
        for layer in range(cfg.n_layer):
            shapes.update(self.block_param_shapes(cfg, layer))
        shapes.update(self.head_param_shapes(cfg))
        return shapes

    def param_location(self, name: str) -> str | int | None:
        """Where parameter ``name`` lives: "embeddings", "head", a block index, or None (not ours)."""
        parts = name.split(".")
        if parts[0] == "lm_head":
            return "head"
        if parts[0] != self.root or len(parts) < 3:
            return None
        if parts[1] == self.final_norm:
            return "head"
        if parts[1] in self.embeddings:
            return "embeddings"
        if parts[1] == self.blocks and parts[2].isdigit():
            return int(parts[2])
        return None

    # ------------------------------------------------------------------ initialisation
    def init_rule(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> tuple[str, float]:
        """How parameter ``name`` starts: ``("normal", std)`` (mean 0) or ``("fill", value)``."""
        raise NotImplementedError

    def init_state_dict(self, cfg: ModelConfig, seed: int,
                        names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """Initial weights of the full model, a pure function of (cfg, seed); the global RNG is neither read
        nor advanced. ``names``: only these parameters (a stage's), the same bits as the full model's; with
        ``"philox"`` the others are not drawn at all (issue 75: a node of one stage of S drew the whole model,
        S times its own work and a full model's transient memory), with ``"torch"`` they are drawn (its one
        generator runs in canonical order) and dropped.

        ``cfg.init`` (:class:`training.config.RandomSource`) says where the normal draws come from:

        * ``"philox"``: each tensor from its own stream of :mod:`training.portable_rng`, named by the seed and
          the parameter's name (``dlx-init/<seed>/<name>``): the same bits on every machine.
        * ``"torch"`` (runs made before ``model.init`` existed): one local CPU ``torch.Generator`` seeded with
          ``seed``, drawn by ``Tensor.normal_`` in canonical order; its float32 kernel differs by instruction
          set, so only machines with the run's kernel derive these weights.
        """
        legacy = cfg.init == RandomSource.TORCH
        generator = torch.Generator(device="cpu").manual_seed(int(seed)) if legacy else None
        state: dict[str, torch.Tensor] = {}
        wanted = None if names is None else set(names)
        for name, shape in self.param_shapes(cfg).items():
            if wanted is not None and name not in wanted and not legacy:
                continue
            kind, value = self.init_rule(cfg, name, shape)
            if kind == "fill":
                tensor = torch.full(shape, value, dtype=torch.float32)
            elif legacy:
                tensor = torch.empty(shape, dtype=torch.float32).normal_(0.0, value, generator=generator)
            else:
                tensor = normal_tensor(f"dlx-init/{int(seed)}/{name}".encode(), shape, value)
            state[name] = tensor
        if wanted is not None:
            unknown = wanted - set(self.param_shapes(cfg))
            if unknown:
                raise KeyError(f"init_state_dict: no parameters {sorted(unknown)} in this model")
            state = {name: tensor for name, tensor in state.items() if name in wanted}
        return state

    @staticmethod
    def residual_std(cfg: ModelConfig) -> float:
        """GPT-2's scaled init of the projections that write into the residual stream."""
        return INIT_STD / math.sqrt(2 * cfg.n_layer)

    # ------------------------------------------------------------------ modules
    def embedding_modules(self, cfg: ModelConfig) -> dict[str, nn.Module]:
        """The first stage's modules under ``root``, by name."""
        raise NotImplementedError

    def embed(self, modules: nn.ModuleDict, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> hidden states (B, T, C) with the modules of :meth:`embedding_modules`."""
        raise NotImplementedError

    def make_block(self, cfg: ModelConfig) -> nn.Module:
        """One block; its forward is ``block(x, context)`` with ``context`` from :meth:`block_context`."""
        raise NotImplementedError

    def make_final_norm(self, cfg: ModelConfig) -> nn.Module:
        raise NotImplementedError

    def block_context(self, cfg: ModelConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> Any:
        """What every block needs besides the hidden states (None unless the family says otherwise)."""
        return None

    # ------------------------------------------------------------------ export
    def hf_config(self, cfg: ModelConfig, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
        """``config.json`` of the equal ``transformers`` model."""
        raise NotImplementedError
