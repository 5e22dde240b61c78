"""Splitting a model (of any family) into pipeline stages, as plain data.

:func:`split_stages` is a pure function: it decides which contiguous blocks each
of ``num_stages`` stages holds, with the embeddings in the first stage and the
final norm plus LM head in the last. Blocks are balanced: every stage gets
``n_layer // num_stages`` blocks and the first ``n_layer % num_stages`` stages
one more.

:class:`StageModule` materialises one stage. Its parameters keep their
full-model names, so the state dicts of the stages are disjoint subsets of the
full model's state dict and :func:`merge_state_dicts` is a plain dict union.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from training.config import ModelConfig
from training.errors import StageSplitError, StateDictError
from training.model import (
    FAMILIES,
    TransformerSlice,
    block_param_shapes,
    embedding_param_shapes,
    head_param_shapes,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageSpec:
    """Stage ``index`` of ``num_stages``: blocks ``[layer_start, layer_end)``."""

    index: int
    num_stages: int
    layer_start: int
    layer_end: int
    has_embeddings: bool  # first stage: wte, wpe (GPT-2); embed_tokens (Llama)
    has_head: bool  # last stage: final norm, lm_head

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def split_stages(n_layer: int, num_stages: int) -> list[StageSpec]:
    """Balanced split of ``n_layer`` blocks into ``num_stages`` contiguous stages.

    Every stage holds at least one block, so ``1 <= num_stages <= n_layer``.
    """
    if n_layer < 1:
        raise StageSplitError(f"n_layer={n_layer}: must be >= 1")
    if num_stages < 1:
        raise StageSplitError(f"num_stages={num_stages}: must be >= 1")
    if num_stages > n_layer:
        raise StageSplitError(
            f"num_stages={num_stages} > n_layer={n_layer}: every stage needs at least one block; "
            f"use at most {n_layer} stages or a deeper model"
        )
    base, extra = divmod(n_layer, num_stages)
    specs = []
    start = 0
    for index in range(num_stages):
        end = start + base + (1 if index < extra else 0)
        specs.append(
            StageSpec(
                index=index,
                num_stages=num_stages,
                layer_start=start,
                layer_end=end,
                has_embeddings=index == 0,
                has_head=index == num_stages - 1,
            )
        )
        start = end
    return specs


def stage_param_shapes(cfg: ModelConfig, spec: StageSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the stage's parameters, in canonical order."""
    _check_spec(cfg, spec)
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.has_embeddings:
        shapes.update(embedding_param_shapes(cfg))
    for layer in range(spec.layer_start, spec.layer_end):
        shapes.update(block_param_shapes(cfg, layer))
    if spec.has_head:
        shapes.update(head_param_shapes(cfg))
    return shapes


def stage_param_names(cfg: ModelConfig, spec: StageSpec) -> list[str]:
    """The stage's full-model parameter names, in the full model's state_dict order."""
    return list(stage_param_shapes(cfg, spec))


def _check_spec(cfg: ModelConfig, spec: StageSpec) -> None:
    if not (0 <= spec.layer_start < spec.layer_end <= cfg.n_layer):
        raise StageSplitError(
            f"stage {spec.index}: layers [{spec.layer_start}, {spec.layer_end}) "
            f"outside the model's n_layer={cfg.n_layer}"
        )
    if spec.has_embeddings != (spec.index == 0) or spec.has_head != (spec.index == spec.num_stages - 1):
        raise StageSplitError(f"stage {spec.index}/{spec.num_stages}: embeddings must be first, head last")


class StageModule(TransformerSlice):
    """One pipeline stage of a model.

    Forward: the first stage maps token ids (B, T) to hidden states (B, T, C),
    a middle stage hidden -> hidden, the last hidden -> logits (B, T, vocab),
    and a single stage ids -> logits. ``state_dict()`` keys are exactly
    ``stage_param_names(cfg, spec)``. Weights start as the stage's part of
    ``init_state_dict(cfg, seed)`` (``seed=None``: uninitialised).
    """

    def __init__(self, cfg: ModelConfig, spec: StageSpec, seed: int | None = 0) -> None:
        _check_spec(cfg, spec)
        super().__init__(
            cfg,
            spec.layer_start,
            spec.layer_end,
            has_embeddings=spec.has_embeddings,
            has_head=spec.has_head,
            seed=seed,
        )
        self.spec = spec


def split_state_dict(
    full_state_dict: dict[str, torch.Tensor], specs: list[StageSpec], cfg: ModelConfig | None = None
) -> list[dict[str, torch.Tensor]]:
    """The full model's state dict cut into one dict per stage (tensors shared, not copied).

    Without ``cfg`` the split goes by name only; with it, shapes are checked too.
    Every name of the full dict must land in exactly one stage.
    """
    parts: list[dict[str, torch.Tensor]] = []
    used: set[str] = set()
    for spec in specs:
        if cfg is not None:
            shapes = stage_param_shapes(cfg, spec)
        else:
            shapes = {name: None for name in full_state_dict if _name_in_stage(name, spec)}
        part = {}
        for name, shape in shapes.items():
            if name not in full_state_dict:
                raise StateDictError(f"stage {spec.index}: parameter {name} missing from the state dict")
            tensor = full_state_dict[name]
            if shape is not None and tuple(tensor.shape) != shape:
                raise StateDictError(f"{name}: shape {tuple(tensor.shape)} != expected {shape}")
            part[name] = tensor
        used.update(part)
        parts.append(part)
    unused = sorted(set(full_state_dict) - used)
    if unused:
        raise StateDictError(f"state dict names belong to no stage: {unused[:5]}")
    return parts


def _name_in_stage(name: str, spec: StageSpec) -> bool:
    # Families name their trunks apart ("transformer." / "model."), so the name alone says where it goes.
    for family in FAMILIES.values():
        location = family.param_location(name)
        if location == "embeddings":
            return spec.has_embeddings
        if location == "head":
            return spec.has_head
        if isinstance(location, int):
            return spec.layer_start <= location < spec.layer_end
    return False


def merge_state_dicts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Union of disjoint stage state dicts; overlapping names are an error."""
    merged: dict[str, torch.Tensor] = {}
    for index, part in enumerate(parts):
        overlap = sorted(set(merged) & set(part))
        if overlap:
            raise StateDictError(f"stage state dict {index} repeats names: {overlap[:5]}")
        merged.update(part)
    return merged
