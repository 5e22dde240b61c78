"""StageEngine's joining and catching-up methods: rebase, skip_to, absorb_round, finish_round."""

from __future__ import annotations

import pytest
import torch

from training.compression import encode_contribution
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate
from training.errors import RoundOrderError
from training.stage_engine import StageEngine

RAW = CompressionConfig(enabled=False)


def _engine(delay: bool = True, correction: str = "rebase", seed: int = 0) -> tuple[StageEngine,
                                                                                    torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    param = torch.nn.Parameter(torch.randn(4, 3, generator=g))
    cfg = DilocoConfig(one_step_delay=delay, delay_correction=correction, outer_lr=0.7, outer_momentum=0.9)
    return StageEngine(0, {"w": param}, cfg, RAW), param


def _train(param: torch.nn.Parameter, seed: int) -> None:
    with torch.no_grad():
        param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def _blob(value: float, outer_round: int) -> bytes:
    return encode_contribution({"w": torch.full((4, 3), value)}, RAW, stage_index=0,
                               outer_round=outer_round)[0]


def test_rebase_enters_after_a_round_from_global_state():
    engine, param = _engine()
    _train(param, 1)
    engine.encode_contribution(0)
    weights, momentum = {"w": torch.full((4, 3), 2.0)}, {"w": torch.full((4, 3), 0.5)}
    engine.rebase(weights, momentum, last_round=6)
    assert torch.equal(param.detach(), weights["w"]) and torch.equal(engine.global_weights["w"], weights["w"])
    assert torch.equal(engine.momentum["w"], momentum["w"])
    assert (engine.last_encoded, engine.last_applied) == (6, 6)
    weights["w"].add_(1.0)  # the engine keeps its own copy
    assert engine.global_weights["w"][0, 0].item() == 2.0
    _train(param, 2)
    # the next round is 7; its pseudo-gradient is from the rebased start
    blob, _ = engine.encode_contribution(7)
    with pytest.raises(RoundOrderError):
        engine.encode_contribution(9)
    assert blob


def test_skip_to_keeps_weights_and_local_progress():
    engine, param = _engine()
    start = param.detach().clone()
    _train(param, 3)
    engine.skip_to(4)
    engine.skip_to(2)  # never moves backwards
    assert (engine.last_encoded, engine.last_applied) == (3, 3)
    before = param.detach().clone()
    engine.encode_contribution(4)
    assert torch.equal(param.detach(), before)
    # The contribution holds the progress since the round start (nothing was lost by skipping).
    expected = encode_contribution({"w": start - before}, RAW, stage_index=0, outer_round=4)[0]
    assert engine.compressor.last_decoded["w"].equal((start - before).to(torch.float32))
    assert expected


def _absorb_by_state_dict(engine: StageEngine, outer_round: int, contributions: list[bytes]) -> bytes:
    """What node/replica.py did before absorb_round existed: edit state_dict() keys."""
    state = engine.state_dict()
    old = state["global_weights"]
    new_global, new_momentum, weights_hash = aggregate(
        old, state["momentum"], contributions, engine.diloco_cfg, stage_index=0, outer_round=outer_round
    )
    delta = {n: torch.sub(new_global[n], old[n]) for n in old}
    state["global_weights"], state["momentum"] = new_global, new_momentum
    state["round_start"] = {n: torch.add(t, delta[n]) for n, t in state["round_start"].items()}
    state["round_end"] = {r: {n: torch.add(t, delta[n]) for n, t in snap.items()}
                              for r, snap in state["round_end"].items()}
    state["last_applied"] = max(state["last_applied"], min(outer_round, state["last_encoded"]))
    engine.load_state_dict(state)
    with torch.no_grad():
        for name, param in engine.params.items():
            param.add_(delta[name])
    return weights_hash


@pytest.mark.parametrize("encoded_first", [False, True])
def test_absorb_round_equals_the_state_dict_edit_it_replaces(encoded_first):
    a, pa = _engine(seed=5)
    b, pb = _engine(seed=5)
    absorbed = 0
    for engine, param in ((a, pa), (b, pb)):
        _train(param, 7)
        if encoded_first:
            # A joiner's case: it skipped to round 3 and encoded it while round 2 (which it
            # sat out) was still being exchanged; round 3's snapshot must move with round 2.
            engine.skip_to(3)
            engine.encode_contribution(3)
            _train(param, 8)
            absorbed = 2
    assert not a.can_apply(absorbed) or not encoded_first
    contributions = [_blob(0.1, absorbed), _blob(-0.3, absorbed)]
    result = a.absorb_round(absorbed, contributions)
    digest = _absorb_by_state_dict(b, absorbed, contributions)
    assert result.weights_hash == digest
    sa, sb = a.state_dict(), b.state_dict()
    for key in ("global_weights", "momentum", "round_start"):
        assert torch.equal(sa[key]["w"], sb[key]["w"])
    assert sa["round_end"].keys() == sb["round_end"].keys()
    assert (sa["last_encoded"], sa["last_applied"]) == (sb["last_encoded"], sb["last_applied"])
    assert torch.equal(pa.detach(), pb.detach())


def test_finish_round_applies_what_it_encoded_and_absorbs_the_rest():
    engine, param = _engine(delay=False)
    _train(param, 1)
    blob, _ = engine.encode_contribution(0)
    assert engine.can_apply(0) and not engine.can_apply(1)
    engine.finish_round(0, [blob, _blob(0.2, 0)])
    assert torch.equal(param.detach(), engine.global_weights["w"])  # applied: local = global (no delay)
    _train(param, 2)
    local = param.detach().clone()
    old_global = engine.global_weights["w"].clone()
    engine.finish_round(1, [_blob(0.2, 1)])  # not encoded by this replica: absorbed, progress kept
    assert torch.allclose(param.detach() - local, engine.global_weights["w"] - old_global, atol=1e-6)
    assert engine.last_applied == 0  # nothing of its own was pending
