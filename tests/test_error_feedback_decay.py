"""Leaky error feedback (``compression.error_feedback_decay``, issue 66): the run document keeps old hashes,
the residual follows its formula bit for bit, and a contribution coded with it reruns bit-exactly (the
re-execution spot check replays the replica's residual) while a cheat does not."""

from __future__ import annotations

import pytest
import torch
from test_muon import BEFORE_MUON_DEFAULT, HONEST, PERTURBED, ROUNDS, _records

from node.config import load_config
from node.errors import ConfigError
from node.runconfig import config_hash, node_config_from_run, run_document
from tests.rerun_fixtures import assert_honest_exact_and_cheat_caught, rerun_checker
from training.butterfly import SlicedErrorFeedbackCompressor as SlicedCompressor
from training.codec_wire import decode_contribution
from training.compression import ErrorFeedbackCompressor
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import TrainingConfigError
from training.host_tensors import float32_scalar
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica
from training.slice_plan import plan_slices


@pytest.mark.parametrize("settings", list(BEFORE_MUON_DEFAULT))
def test_plain_error_feedback_keeps_every_older_hash_and_a_decay_is_named(settings):
    older = [*settings, "diloco.commitments=hashed"]
    plain = run_document(load_config(None, older))
    explicit = run_document(load_config(None, [*older, "compression.error_feedback_decay=1.0"]))
    assert "error_feedback_decay" not in plain["compression"]
    assert config_hash(explicit).hex() == config_hash(plain).hex() == BEFORE_MUON_DEFAULT[settings]
    leaky = run_document(load_config(None, [*older, "compression.error_feedback_decay=0.8"]))
    assert leaky["compression"]["error_feedback_decay"] == 0.8
    again = node_config_from_run(leaky)
    assert again.compression.error_feedback_decay == 0.8
    assert config_hash(run_document(again)) == config_hash(leaky) != config_hash(plain)
    # A document without the field (every run before it existed) is read as plain error feedback.
    assert node_config_from_run(plain).compression.error_feedback_decay == 1.0


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_a_decay_outside_zero_one_is_refused(bad):
    with pytest.raises(TrainingConfigError, match="error_feedback_decay"):
        CompressionConfig(error_feedback_decay=bad)
    if isinstance(bad, float):
        with pytest.raises((ConfigError, TrainingConfigError), match="error_feedback_decay"):
            load_config(None, [f"compression.error_feedback_decay={bad}"])


@pytest.mark.parametrize("compressor", [ErrorFeedbackCompressor, SlicedCompressor])
@pytest.mark.parametrize("beta", [1.0, 0.8, 0.5])
def test_the_residual_follows_its_formula_exactly(compressor, beta):
    """``e_t = (g_t + beta * e_{t-1}) - decoded_t`` in float32, the same bits with the full and the sliced
    coder; at beta = 1 the target is ``g_t + e_{t-1}`` (the rule before the setting)."""
    shapes = {"w": (64, 48), "b": (48,)}
    cfg = CompressionConfig(bandwidth_budget=2000, min_compress_numel=1, error_feedback_decay=beta)
    if compressor is SlicedCompressor:
        plan = plan_slices(shapes, 2, min_slice_numel=512)
        coder = SlicedCompressor(shapes, cfg, plan, bandwidth_budget=2000)
    else:
        coder = ErrorFeedbackCompressor(shapes, cfg, bandwidth_budget=2000)
    g = torch.Generator().manual_seed(5)
    signal = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    for outer_round in range(6):
        grads = {n: signal[n] + 0.5 * torch.randn(s, generator=g) for n, s in shapes.items()}
        before = {n: r.clone() for n, r in coder.residual.items()}
        if compressor is SlicedCompressor:
            coder.compress_slices(grads, stage_index=0, outer_round=outer_round)
        else:
            blob, _ = coder.compress(grads, stage_index=0, outer_round=outer_round)
            decoded = decode_contribution(blob, shapes)
            assert all(torch.equal(decoded[n], coder.last_decoded[n]) for n in shapes)
        for n in shapes:
            carried = before[n] if beta == 1.0 else torch.mul(before[n], float32_scalar(beta))
            expected = torch.sub(torch.add(grads[n], carried), coder.last_decoded[n])
            assert torch.equal(coder.residual[n], expected)
        assert outer_round == 0 or any(bool(torch.any(before[n])) for n in shapes)


def test_a_leaky_feedback_contribution_reruns_bit_exactly_and_a_cheat_does_not():
    """A Muon run with ``error_feedback_decay = 0.5`` under the configuration rebuilt from its run document:
    the spot check's rerun (which replays the residual from the start state) gives the same bits."""
    overrides = ["model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
                 "training.optimizer=muon", "diloco.inner_steps=3", "diloco.num_replicas=2",
                 "compression.min_compress_numel=512", "compression.error_feedback_decay=0.5"]
    cfg = node_config_from_run(run_document(load_config(None, overrides)))
    assert cfg.compression.error_feedback_decay == 0.5
    sim = SimConfig(corpus=generated_corpus(seed=0, n_bytes=30_000), model=cfg.model, training=cfg.training,
                    diloco=cfg.diloco, compression=cfg.compression, num_stages=2, rounds=ROUNDS)
    records = _records(sim, SimReplica, PerturbedReplica)
    check = rerun_checker(sim, records, {})
    assert_honest_exact_and_cheat_caught(check, records, HONEST, PERTURBED, ROUNDS)
