"""Simulation mode on the tiny model: the three modes run, account bytes, and agree where they must."""

from __future__ import annotations

import pytest

from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import TrainingError
from training.model import count_params
from training.simulate import simulate

MODEL = ModelConfig(preset="tiny")
TRAINING = TrainingConfig(batch_size=4, eval_batches=2)
PIPELINE = PipelineConfig(num_stages=2)


@pytest.fixture(scope="module")
def corpus():
    return generated_corpus(seed=0, n_bytes=50_000)


def _run(corpus, mode, rounds=3, **diloco):
    cfg = DilocoConfig(**{"inner_steps": 3, "num_replicas": 2, **diloco})
    compression = CompressionConfig(error_budget=0.5, min_compress_numel=512)
    return simulate(mode, corpus, MODEL, TRAINING, cfg, compression, PIPELINE, rounds)


def test_diloco_x_without_delay_and_compression_is_diloco_exactly(corpus):
    cfg = DilocoConfig(inner_steps=3, num_replicas=2, one_step_delay=False)
    plain = simulate("diloco", corpus, MODEL, TRAINING, cfg, CompressionConfig(), PIPELINE, 3)
    switched_off = simulate(
        "diloco_x", corpus, MODEL, TRAINING, cfg, CompressionConfig(enabled=False), PIPELINE, 3
    )
    assert [r.weights_root for r in switched_off.rounds] == [r.weights_root for r in plain.rounds]
    assert switched_off.final_eval_loss == plain.final_eval_loss


def test_modes_report_bytes_ratio_and_losses(corpus):
    ddp, diloco, diloco_x = (_run(corpus, mode) for mode in ("ddp", "diloco", "diloco_x"))
    params = count_params(MODEL)
    tokens = 3 * 3 * TRAINING.batch_size * MODEL.block_size
    for result in (ddp, diloco, diloco_x):
        assert result.tokens_per_replica == tokens and len(result.rounds) == 3
        assert 0 < result.final_eval_loss < 6.0
    # Ring AllReduce of float32 gradients, every step: 2 (M-1)/M * 4 * params.
    assert ddp.bytes_per_replica == pytest.approx(3 * 3 * 4 * params)
    # Uncompressed DiLoCo: one float32 copy of the model per round, plus framing.
    assert 3 * 4 * params < diloco.bytes_per_replica < 1.01 * 3 * 4 * params
    assert all(r.compression_ratio > 3 for r in diloco_x.rounds)
    assert diloco_x.bytes_per_replica < diloco.bytes_per_replica / 3
    # One-step delay: nothing is applied by the end of round 0; the flush applies the last round.
    assert diloco_x.rounds[0].eval_loss is None and diloco_x.rounds[-1].eval_loss is not None
    assert all(r.tensors for r in diloco_x.rounds)


def test_unknown_mode_is_refused(corpus):
    with pytest.raises(TrainingError):
        _run(corpus, "allreduce")


@pytest.mark.parametrize("correction", ["lookahead", "eager"])
def test_one_replica_lossless_lookahead_variants_are_synchronous_diloco(corpus, correction):
    # One replica, no compression: its own estimate of theta^t is theta^t, so the delayed
    # schedule (apply before encode) reaches synchronous DiLoCo up to float rounding.
    cfg = DilocoConfig(inner_steps=3, num_replicas=1, delay_correction=correction)
    sync = simulate("diloco", corpus, MODEL, TRAINING, cfg, CompressionConfig(), PIPELINE, 3)
    delayed = simulate("diloco_x", corpus, MODEL, TRAINING, cfg, CompressionConfig(enabled=False), PIPELINE,
                       3)
    assert delayed.final_eval_loss == pytest.approx(sync.final_eval_loss, abs=1e-4)


def test_ddp_and_diloco_follow_the_inner_lr_schedule(corpus):
    # The cosine schedule over the run changes the result; a constant rate reproduces the old one.
    cfg = DilocoConfig(inner_steps=3, num_replicas=2)
    runs = {
        schedule: simulate(mode, corpus, MODEL,
                           TrainingConfig(batch_size=4, eval_batches=2, lr_schedule=schedule, warmup_steps=0),
                           cfg, CompressionConfig(), PIPELINE, 2)
        for schedule in ("cosine", "constant") for mode in ("ddp",)
    }
    assert runs["cosine"].final_eval_loss != runs["constant"].final_eval_loss


def test_centralized_reference_is_the_ddp_mode(corpus):
    from training.simulate import centralized_reference

    cfg = DilocoConfig(inner_steps=3, num_replicas=2)
    calls: list[tuple[int, int]] = []
    reference = centralized_reference(corpus, MODEL, TRAINING, cfg, PIPELINE, 2,
                                      progress=lambda *done: calls.append(done))
    ddp = simulate("ddp", corpus, MODEL, TRAINING, cfg, CompressionConfig(), PIPELINE, 2)
    assert reference == ddp.final_eval_loss
    assert calls == [(1, 2), (2, 2)]  # after each round (the demo's progress lines)


def test_partial_overlap_runs_and_differs_from_the_whole_round_delay(corpus):
    whole = _run(corpus, "diloco_x", rounds=3)
    partial = _run(corpus, "diloco_x", rounds=3, overlap_steps=1)
    assert partial.tokens_per_replica == whole.tokens_per_replica
    assert partial.final_weights_root != whole.final_weights_root
    assert 0 < partial.final_eval_loss < 6.0
