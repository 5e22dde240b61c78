"""The shared schedules: inner learning rate per step, and the train / encode / apply order per delay
variant."""

from __future__ import annotations

import math

import pytest
import torch

from training.config import DilocoConfig, TrainingConfig
from training.schedule import (
    APPLY,
    ENCODE,
    TRAIN,
    inner_lr,
    pending_after_round,
    round_actions,
    set_lr,
    trainer_optimizers,
)


def _kinds(cfg: DilocoConfig, outer_round: int, last: bool = False) -> list[tuple[str, int]]:
    return [(a.kind, a.outer_round) for a in round_actions(cfg, outer_round, last=last)]


def test_round_order_of_every_delay_variant():
    sync = DilocoConfig(one_step_delay=False)
    assert _kinds(sync, 3) == [(TRAIN, 3), (ENCODE, 3), (APPLY, 3)]
    assert _kinds(sync, 3, last=True) == [(TRAIN, 3), (ENCODE, 3), (APPLY, 3)]
    for correction in ("rebase", "reset"):
        cfg = DilocoConfig(delay_correction=correction, overlap_steps=0)  # the whole-round delay
        assert _kinds(cfg, 0) == [(TRAIN, 0), (ENCODE, 0)]
        assert _kinds(cfg, 4) == [(TRAIN, 4), (ENCODE, 4), (APPLY, 3)]
        assert _kinds(cfg, 4, last=True) == [(TRAIN, 4), (ENCODE, 4), (APPLY, 3), (APPLY, 4)]
    lookahead = DilocoConfig(delay_correction="lookahead", overlap_steps=0)
    assert _kinds(lookahead, 0) == [(TRAIN, 0), (ENCODE, 0)]
    assert _kinds(lookahead, 4) == [(TRAIN, 4), (APPLY, 3), (ENCODE, 4)]
    assert _kinds(lookahead, 0, last=True) == [(TRAIN, 0), (ENCODE, 0), (APPLY, 0)]
    assert pending_after_round(sync) == 0 and pending_after_round(lookahead) == 1
    with pytest.raises(ValueError):
        round_actions(sync, -1)


def test_every_round_is_applied_exactly_once_in_order():
    for cfg in (DilocoConfig(one_step_delay=False), DilocoConfig(), DilocoConfig(overlap_steps=0),
                DilocoConfig(delay_correction="lookahead", overlap_steps=0)):
        applied = [a.outer_round for t in range(6) for a in round_actions(cfg, t, last=t == 5)
                   if a.kind == APPLY]
        assert applied == list(range(6))


def test_inner_lr_warmup_then_cosine_to_the_floor():
    cfg = TrainingConfig(inner_lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert inner_lr(cfg, 0, 110) == pytest.approx(1e-4)
    assert inner_lr(cfg, 9, 110) == pytest.approx(1e-3)
    assert inner_lr(cfg, 10, 110) == pytest.approx(1e-3)
    assert inner_lr(cfg, 60, 110) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert inner_lr(cfg, 110, 110) == pytest.approx(1e-4)
    assert inner_lr(cfg, 500, 110) == pytest.approx(1e-4)  # stays at the floor past the horizon
    rates = [inner_lr(cfg, s, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def test_inner_lr_constant_unknown_horizon_and_override():
    assert inner_lr(TrainingConfig(inner_lr=2e-3, lr_schedule="constant"), 700, 1000) == 2e-3
    assert inner_lr(TrainingConfig(inner_lr=2e-3), 700, None) == 2e-3  # no horizon: constant after warmup
    cfg = TrainingConfig(inner_lr=2e-3, warmup_steps=0, lr_decay_steps=100, min_lr_ratio=0.0)
    assert inner_lr(cfg, 100, 10_000) == pytest.approx(0.0)


def test_set_lr_reaches_every_group_of_every_trainer_kind():
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [layer.weight]}, {"params": [layer.bias]}], lr=1.0)

    class Local:
        optimizers = [optimizer]

    class Pipelined:
        pass

    piped = Pipelined()
    piped.optimizer = optimizer
    assert trainer_optimizers(Local()) == [optimizer] == trainer_optimizers(piped)
    set_lr(trainer_optimizers(piped), 0.25)
    assert [g["lr"] for g in optimizer.param_groups] == [0.25, 0.25]


def test_config_validates_the_schedule_fields():
    for bad in (dict(lr_schedule="linear"), dict(warmup_steps=-1), dict(min_lr_ratio=1.5),
                dict(lr_decay_steps=-2)):
        with pytest.raises(ValueError):  # the config error class is a ValueError
            TrainingConfig(**bad)


def test_partial_overlap_applies_the_previous_round_inside_the_next():
    cfg = DilocoConfig(inner_steps=10, overlap_steps=3)
    actions = round_actions(cfg, 2, last=True)
    assert [(a.kind, a.outer_round, a.first_step, a.end_step) for a in actions] == [
        (TRAIN, 2, 0, 3), (APPLY, 1, 0, 0), (TRAIN, 2, 3, 10), (ENCODE, 2, 0, 0), (APPLY, 2, 0, 0)
    ]
    assert [(a.kind, a.first_step, a.end_step) for a in round_actions(cfg, 0)] == [(TRAIN, 0, 10),
                                                                                   (ENCODE, 0, 0)]
    for bad in (dict(overlap_steps=10), dict(overlap_steps=-1),
                dict(overlap_steps=2, delay_correction="reset")):
        with pytest.raises(ValueError):
            DilocoConfig(inner_steps=10, **bad)


def test_auto_overlap_is_a_tenth_of_the_round_and_whole_round_when_that_is_under_one_step():
    # H = 50: the benchmark's best
    assert DilocoConfig().overlap_steps == "auto" and DilocoConfig().overlap == 5
    assert [DilocoConfig(inner_steps=h).overlap for h in (1, 9, 10, 20, 25, 99)] == [0, 0, 1, 2, 2, 9]
    assert DilocoConfig(delay_correction="reset").overlap == 0
    assert DilocoConfig(one_step_delay=False).overlap == 0
    assert DilocoConfig(overlap_steps="3").overlap == 3 == DilocoConfig(overlap_steps=" Auto ",
                                                                        inner_steps=30).overlap
    # "auto" schedules exactly what the explicit number does.
    for t in (0, 3):
        assert round_actions(DilocoConfig(), t) == round_actions(DilocoConfig(overlap_steps=5), t)
    for bad in ("five", 2.5, True):
        with pytest.raises(ValueError, match="overlap_steps"):
            DilocoConfig(overlap_steps=bad)
