"""A stage draws only its own initial weights, the same bits as the full model's (issue 75)."""

from __future__ import annotations

import pytest
import torch

from training.config import ModelConfig
from training.model import init_state_dict
from training.stages import StageModule, split_stages


@pytest.mark.parametrize("init", ["philox", "torch"])
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_stage_weights_are_the_full_models(preset, init):
    cfg = ModelConfig(preset=preset, init=init)
    full = init_state_dict(cfg, 7)
    for spec in split_stages(cfg.n_layer, 2):
        stage = StageModule(cfg, spec, seed=7)
        own = stage.state_dict()
        assert own and set(own) < set(full)
        for name, tensor in own.items():
            assert torch.equal(tensor, full[name]), name


def test_names_draw_only_those_and_refuse_unknown_ones():
    cfg = ModelConfig(preset="llama-tiny")
    full = init_state_dict(cfg, 3)
    some = sorted(full)[:3]
    part = init_state_dict(cfg, 3, names=some)
    assert sorted(part) == some
    assert all(torch.equal(part[n], full[n]) for n in some)
    with pytest.raises(KeyError, match="no parameters"):
        init_state_dict(cfg, 3, names=["not.a.parameter"])
