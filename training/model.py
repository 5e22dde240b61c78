"""Decoder-only language models of every family, built from one slice class.

``model.family`` picks the architecture from :data:`FAMILIES`: GPT-2
(:mod:`training.gpt2`) or Llama (:mod:`training.llama`). Both use Hugging
Face's parameter names, so an export (:mod:`training.export`) is a copy.

The module tree is built by :class:`TransformerSlice`, which can hold any
contiguous range of blocks with or without the embeddings and the head.
:class:`GPT` is the slice holding everything (of any family; the name is
historical); :class:`training.stages.StageModule` is a partial slice. Because
both run the very same code, chaining the stages reproduces the full model's
forward bit for bit, and every parameter keeps its full-model name so stage
state dicts are disjoint subsets of the full one.

:func:`init_state_dict` draws the initial weights from the generator
``model.init`` names (the portable Philox streams of
:mod:`training.portable_rng`, or an older run's local ``torch.Generator``), so
they depend on (config, seed) only and never on the global RNG.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig
from training.errors import ModelInputError, StateDictError
from training.family import INIT_STD, Embedding, Linear, ModelFamily
from training.gpt2 import GPT2, LAYER_NORM_EPS
from training.llama import LLAMA

logger = logging.getLogger(__name__)

#: ``model.family`` -> the family's definition.
FAMILIES: dict[str, ModelFamily] = {GPT2.name: GPT2, LLAMA.name: LLAMA}

__all__ = [
    "FAMILIES", "GPT", "INIT_STD", "LAYER_NORM_EPS", "Embedding", "Linear", "TransformerSlice",
    "block_param_shapes", "count_params", "embedding_param_shapes", "family_of", "head_param_shapes",
    "init_state_dict", "lm_loss", "param_shapes",
]


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family definition of ``cfg.family``."""
    return FAMILIES[cfg.family]


def embedding_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the embedding parameters (held by the first stage)."""
    return family_of(cfg).embedding_param_shapes(cfg)


def block_param_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Shapes of block ``layer``'s parameters, in HF order."""
    return family_of(cfg).block_param_shapes(cfg, layer)


def head_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the final norm and the LM head (held by the last stage)."""
    return family_of(cfg).head_param_shapes(cfg)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model, in canonical (state_dict) order."""
    return family_of(cfg).param_shapes(cfg)


def count_params(cfg: ModelConfig) -> int:
    """Number of scalar parameters of the full model."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def init_state_dict(cfg: ModelConfig, seed: int, names=None) -> dict[str, torch.Tensor]:
    """Initial weights of the full model, a pure function of (cfg, seed) (the family's initialisation), or the
    imported ones ``cfg.init_weights`` names (training/hf_import.py; then the seed draws nothing);
    ``names``: only those parameters, the same bits (ModelFamily.init_state_dict)."""
    if cfg.init_weights:
        from training.hf_import import load_init_weights

        return load_init_weights(cfg, names=names)
    return family_of(cfg).init_state_dict(cfg, seed, names)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class TransformerSlice(nn.Module):
    """Blocks ``[layer_start, layer_end)`` of a model, optionally with embeddings and head.

    Parameter names are those of the full model (block ``i`` keeps its global
    index). The forward maps token ids (if ``has_embeddings``) or hidden states
    to hidden states, or to logits if ``has_head``. Weights come from
    ``init_state_dict(cfg, seed)`` unless ``seed`` is None (then they are left
    uninitialised for a later ``load_state_dict``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        layer_start: int,
        layer_end: int,
        has_embeddings: bool,
        has_head: bool,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.family = family_of(cfg)
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.has_embeddings = has_embeddings
        self.has_head = has_head
        parts: dict[str, nn.Module] = {}
        if has_embeddings:
            parts.update(self.family.embedding_modules(cfg))
        # ModuleDict keyed by the global index: keys match the full model's ModuleList.
        parts[self.family.blocks] = nn.ModuleDict(
            {str(i): self.family.make_block(cfg) for i in range(layer_start, layer_end)}
        )
        if has_head:
            parts[self.family.final_norm] = self.family.make_final_norm(cfg)
        # "transformer" (GPT-2) or "model" (Llama), as Hugging Face names the trunk.
        setattr(self, self.family.root, nn.ModuleDict(parts))
        if has_head:
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size)
        if seed is not None:
            own = init_state_dict(cfg, seed, names=list(self.state_dict()))
            self.load_state_dict({name: own[name] for name in self.state_dict()})

    @property
    def trunk(self) -> nn.ModuleDict:
        """The module holding embeddings, blocks and final norm."""
        return getattr(self, self.family.root)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trunk = self.trunk
        if self.has_embeddings:
            check_token_ids(x, self.cfg)
            x = self.family.embed(trunk, x)
        else:
            _check_hidden(x, self.cfg)
        context = self.family.block_context(self.cfg, x.size(1), x.device, x.dtype)
        for block in trunk[self.family.blocks].values():
            x = block(x, context)
        if self.has_head:
            x = self.lm_head(trunk[self.family.final_norm](x))
        return x

    def load_state_dict(  # type: ignore[override]
        self, state_dict, strict: bool = True, assign: bool = False
    ):
        """``nn.Module.load_state_dict`` with a :class:`StateDictError` naming the mismatch."""
        own = {name: tuple(t.shape) for name, t in self.state_dict().items()}
        if strict:
            missing = sorted(set(own) - set(state_dict))
            extra = sorted(set(state_dict) - set(own))
            if missing or extra:
                raise StateDictError(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, tensor in state_dict.items():
            if name in own and tuple(tensor.shape) != own[name]:
                raise StateDictError(f"{name}: shape {tuple(tensor.shape)} != expected {own[name]}")
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


def check_token_ids(idx: torch.Tensor, cfg: ModelConfig) -> None:
    """Refuse token ids that are not a LongTensor (B, T) of at most ``block_size`` ids in ``[0, vocab_size)``.

    On the CPU the range is checked at once (one pass, one read of its two ends). On an accelerator reading
    the range back would stall the forward pass twice (a host synchronisation each), and in a compiled forward
    (``training.compile``, on any device) it would break the graph in three (``int()`` of a tensor), so there
    the check is queued (``torch._assert_async``, a RuntimeError when it fails): the trainers check a batch
    on the host before they move it (:func:`token_ids_to`), so a bad id from a data file is still refused
    with a ``ModelInputError`` before it reaches the device or the compiled graph.
    """
    if idx.dim() != 2 or idx.dtype != torch.long:
        raise ModelInputError(f"token ids must be a LongTensor (B, T), got {idx.dtype} {tuple(idx.shape)}")
    if idx.size(1) > cfg.block_size:
        raise ModelInputError(f"sequence length {idx.size(1)} > block_size={cfg.block_size}")
    if not idx.numel():
        return
    message = f"token ids must be in [0, {cfg.vocab_size})"
    if idx.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(((idx >= 0) & (idx < cfg.vocab_size)).all(), message)
        return
    low, high = torch.aminmax(idx)
    if int(low) < 0 or int(high) >= cfg.vocab_size:
        raise ModelInputError(message)


def token_ids_to(idx: torch.Tensor, device: torch.device, cfg: ModelConfig) -> torch.Tensor:
    """``idx`` on ``device``, checked on the host first (:func:`check_token_ids`): where the forward pass's
    own check is queued on the device, and where the forward pass is compiled (its check is then a queued
    assert too, on the CPU as well), a bad id is still a ``ModelInputError`` (on an eager CPU forward this
    checks twice: one read of a batch's ids)."""
    if idx.device.type == "cpu":
        check_token_ids(idx, cfg)
    return idx.to(device)


def _check_hidden(x: torch.Tensor, cfg: ModelConfig) -> None:
    if x.dim() != 3 or x.size(-1) != cfg.n_embd or not x.is_floating_point():
        raise ModelInputError(f"hidden states must be float (B, T, {cfg.n_embd}), got {tuple(x.shape)}")


class GPT(TransformerSlice):
    """The full decoder of ``cfg.family``: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig, seed: int | None = 0) -> None:
        super().__init__(cfg, 0, cfg.n_layer, has_embeddings=True, has_head=True, seed=seed)

    def forward(  # type: ignore[override]
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy if ``targets`` is given."""
        logits = super().forward(idx)
        loss = None if targets is None else lm_loss(logits, targets)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding of ``max_new_tokens`` tokens (context cropped to block_size)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return idx
