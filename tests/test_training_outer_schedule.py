"""The outer schedule: outer lr warmup / decay and momentum decay per round, and its bit-exact replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.compression import encode_contribution
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate, outer_step
from training.errors import AggregationError, TrainingConfigError
from training.schedule import outer_lr, outer_momentum, outer_schedule_is_constant
from training.stage_engine import StageEngine

RAW = CompressionConfig(enabled=False)


def test_constant_by_default():
    cfg = DilocoConfig()
    assert outer_schedule_is_constant(cfg)
    assert [outer_lr(cfg, t) for t in (0, 7, 1000)] == [cfg.outer_lr] * 3
    assert [outer_momentum(cfg, t) for t in (0, 7, 1000)] == [cfg.outer_momentum] * 3


def test_warmup_then_linear_and_cosine_decay():
    warm = DilocoConfig(outer_lr=0.9, outer_warmup_rounds=3)
    assert [outer_lr(warm, t) for t in range(5)] == pytest.approx([0.3, 0.6, 0.9, 0.9, 0.9])
    assert not outer_schedule_is_constant(warm)
    linear = DilocoConfig(outer_decay="linear", outer_decay_rounds=10, outer_min_lr_ratio=0.5,
                          outer_momentum=0.5, outer_final_momentum=0.0)
    assert [outer_lr(linear, t) for t in (0, 5, 10, 20)] == pytest.approx([1.0, 0.75, 0.5, 0.5])
    assert [outer_momentum(linear, t) for t in (0, 5, 10)] == pytest.approx([0.5, 0.25, 0.0])
    cosine = dataclasses.replace(linear, outer_decay="cosine", outer_warmup_rounds=2)
    assert [outer_lr(cosine, t) for t in (0, 1, 2, 6, 10)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5])
    # A momentum that ramps up instead (outer_final_momentum above outer_momentum).
    ramp = DilocoConfig(outer_decay="linear", outer_decay_rounds=4, outer_momentum=0.0,
                        outer_final_momentum=0.8)
    assert [outer_momentum(ramp, t) for t in range(5)] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])


@pytest.mark.parametrize("fields, fix", [
    (dict(outer_decay="cosine"), "outer_decay_rounds"),
    (dict(outer_decay="step", outer_decay_rounds=5), "outer_decay"),
    (dict(outer_min_lr_ratio=1.5), "outer_min_lr_ratio"),
    (dict(outer_final_momentum=1.0), "outer_final_momentum"),
    (dict(outer_warmup_rounds=-1), "outer_warmup_rounds"),
])
def test_bad_schedules_are_refused_with_the_field(fields, fix):
    with pytest.raises(TrainingConfigError, match=fix):
        DilocoConfig(**fields)


def test_scheduled_step_is_the_constant_step_with_that_rounds_scalars():
    g = torch.Generator().manual_seed(1)
    weights, momentum, delta = ({"w": torch.randn(5, 3, generator=g)} for _ in range(3))
    cfg = DilocoConfig(outer_warmup_rounds=2, outer_decay="cosine", outer_decay_rounds=9,
                       outer_min_lr_ratio=0.3, outer_final_momentum=0.1)
    for t in (0, 1, 4, 8, 12):
        fixed = DilocoConfig(outer_lr=outer_lr(cfg, t), outer_momentum=outer_momentum(cfg, t))
        scheduled = outer_step(weights, momentum, delta, cfg, t)
        constant = outer_step(weights, momentum, delta, fixed)
        assert all(torch.equal(a["w"], b["w"]) for a, b in zip(scheduled, constant))
    with pytest.raises(AggregationError, match="outer round"):
        outer_step(weights, momentum, delta, cfg)


@pytest.mark.parametrize("delay, correction", [(False, "rebase"), (True, "rebase"), (True, "lookahead")])
def test_engine_rounds_replay_bit_exactly_with_a_schedule(delay, correction):
    """What the auditor does (aggregate from the committed state and blobs) gives the engines' hashes."""
    cfg = DilocoConfig(one_step_delay=delay, delay_correction=correction, overlap_steps=0,
                       outer_warmup_rounds=2, outer_decay="linear", outer_decay_rounds=5,
                       outer_min_lr_ratio=0.4, outer_final_momentum=0.0)
    params = [torch.nn.Parameter(torch.zeros(4, 3)) for _ in range(2)]
    engines = [StageEngine(0, {"w": p}, cfg, RAW) for p in params]
    replay_w, replay_m = {"w": torch.zeros(4, 3)}, {"w": torch.zeros(4, 3)}
    pending: list[tuple[int, list[bytes]]] = []
    hashes = []

    def apply(outer_round: int, blobs: list[bytes]) -> None:
        nonlocal replay_w, replay_m
        results = [engine.apply_round(outer_round, blobs) for engine in engines]
        replay_w, replay_m, digest = aggregate(replay_w, replay_m, blobs, cfg, stage_index=0,
                                               outer_round=outer_round)
        assert {r.weights_hash for r in results} == {digest}
        hashes.append(digest)

    for outer_round in range(5):
        for i, param in enumerate(params):
            with torch.no_grad():
                param.add_(torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * outer_round + i)))
        if delay and correction == "lookahead" and pending:
            apply(*pending.pop())
        blobs = [engine.encode_contribution(outer_round)[0] for engine in engines]
        if delay and pending:
            apply(*pending.pop())
        pending.append((outer_round, blobs))
        if not delay:
            apply(*pending.pop())
    while pending:
        apply(*pending.pop())
    assert len(set(hashes)) == 5
    # The same blobs under a constant outer step give other weights: the schedule did act.
    constant = dataclasses.replace(cfg, outer_warmup_rounds=0, outer_decay="constant")
    first = encode_contribution({"w": torch.ones(4, 3)}, RAW, stage_index=0, outer_round=0)[0]
    zeros = {"w": torch.zeros(4, 3)}
    assert aggregate(zeros, zeros, [first], cfg, outer_round=0)[2] != aggregate(zeros, zeros, [first],
                                                                                constant, outer_round=0)[2]
