"""Stage splitting (pure) and stage modules (chained == full model, exactly)."""

import pytest
import torch

from training.config import ModelConfig
from training.errors import StageSplitError, StateDictError
from training.model import GPT, param_shapes
from training.stages import (
    StageModule,
    StageSpec,
    merge_state_dicts,
    split_stages,
    split_state_dict,
    stage_param_names,
)


def test_split_is_balanced_and_contiguous():
    specs = split_stages(7, 3)
    assert [(s.layer_start, s.layer_end) for s in specs] == [(0, 3), (3, 5), (5, 7)]
    assert [s.has_embeddings for s in specs] == [True, False, False]
    assert [s.has_head for s in specs] == [False, False, True]
    for n_layer in range(1, 9):
        for num_stages in range(1, n_layer + 1):
            specs = split_stages(n_layer, num_stages)
            sizes = [s.num_layers for s in specs]
            assert sum(sizes) == n_layer and max(sizes) - min(sizes) <= 1
            assert specs[0].layer_start == 0 and specs[-1].layer_end == n_layer
            assert all(a.layer_end == b.layer_start for a, b in zip(specs, specs[1:]))
    single = split_stages(4, 1)[0]
    assert single == StageSpec(0, 1, 0, 4, True, True)


def test_split_errors_name_the_numbers():
    with pytest.raises(StageSplitError, match=r"num_stages=5 > n_layer=4"):
        split_stages(4, 5)
    with pytest.raises(StageSplitError, match=r"num_stages=0"):
        split_stages(4, 0)
    with pytest.raises(StageSplitError, match=r"n_layer=0"):
        split_stages(0, 1)


@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_stage_modules_chain_to_full_model_exactly(num_stages):
    cfg = ModelConfig(preset="tiny", n_layer=3)
    full = GPT(cfg, seed=3)
    specs = split_stages(cfg.n_layer, num_stages)
    stages = [StageModule(cfg, spec, seed=3) for spec in specs]
    names = [list(stage.state_dict()) for stage in stages]
    assert names == [stage_param_names(cfg, spec) for spec in specs]
    assert sum(names, []) == list(param_shapes(cfg))  # disjoint, canonical order, complete
    idx = torch.randint(0, 256, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
    hidden = idx
    for stage in stages:
        hidden = stage(hidden)
        if not stage.spec.has_head:
            assert hidden.shape == (2, cfg.block_size, cfg.n_embd)
    assert torch.equal(hidden, full(idx)[0])


def test_split_and_merge_state_dicts_round_trip():
    cfg = ModelConfig(preset="tiny", n_layer=3)
    full_sd = GPT(cfg, seed=5).state_dict()
    specs = split_stages(cfg.n_layer, 3)
    parts = split_state_dict(full_sd, specs, cfg)
    assert [list(p) for p in parts] == [stage_param_names(cfg, s) for s in specs]
    assert list(split_state_dict(full_sd, specs)[1]) == list(parts[1])  # by name only
    merged = merge_state_dicts(parts)
    assert list(merged) == list(full_sd) and all(torch.equal(merged[k], full_sd[k]) for k in full_sd)
    stage = StageModule(cfg, specs[1], seed=None)
    stage.load_state_dict(parts[1])
    with pytest.raises(StateDictError, match="repeats"):
        merge_state_dicts([parts[0], parts[0]])
    with pytest.raises(StateDictError, match="no stage"):
        split_state_dict({**full_sd, "extra.weight": torch.zeros(1)}, specs)
    with pytest.raises(StateDictError, match="missing"):
        stage.load_state_dict(parts[0])
