"""Clipped low-bit scales (``compression.quant_scale = "mse"``, issue 66): an encoder choice only. The run
document keeps old hashes, the "max" scale codes the bits it always did, the clipped scale never codes a
column worse and decodes through the unchanged wire format, the reproducible codec runs it in fixed order,
and a contribution coded with it reruns bit-exactly while a cheat does not."""

from __future__ import annotations

import pytest
import torch
from test_muon import BEFORE_MUON_DEFAULT, HONEST, PERTURBED, ROUNDS, _records

from node.config import load_config
from node.errors import ConfigError
from node.runconfig import config_hash, node_config_from_run, run_document
from tests.rerun_fixtures import assert_honest_exact_and_cheat_caught, rerun_checker
from training.codec.coding import CLIP_FRACTIONS, ColumnQuantizer
from training.codec_exact import qmax, reconstruct_quant
from training.codec_wire import decode_contribution
from training.compression import ErrorFeedbackCompressor
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import TrainingConfigError
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica


@pytest.mark.parametrize("settings", list(BEFORE_MUON_DEFAULT))
def test_the_max_scale_keeps_every_older_hash_and_mse_is_named(settings):
    older = [*settings, "diloco.commitments=hashed"]
    plain = run_document(load_config(None, older))
    explicit = run_document(load_config(None, [*older, "compression.quant_scale=max"]))
    assert "quant_scale" not in plain["compression"]
    assert config_hash(explicit).hex() == config_hash(plain).hex() == BEFORE_MUON_DEFAULT[settings]
    clipped = run_document(load_config(None, [*older, "compression.quant_scale=mse"]))
    assert clipped["compression"]["quant_scale"] == "mse"
    again = node_config_from_run(clipped)
    assert again.compression.quant_scale == "mse"
    assert config_hash(run_document(again)) == config_hash(clipped) != config_hash(plain)
    # A document without the field (every run before it existed) is read as the "max" scale.
    assert node_config_from_run(plain).compression.quant_scale == "max"


@pytest.mark.parametrize("bad", ["MSE", "min", "", None, 1, True])
def test_an_unknown_scale_is_refused(bad):
    with pytest.raises(TrainingConfigError, match="quant_scale"):
        CompressionConfig(quant_scale=bad)
    if isinstance(bad, str) and bad:
        with pytest.raises((ConfigError, TrainingConfigError), match="quant_scale"):
            load_config(None, [f"compression.quant_scale={bad}"])


def _columns(seed: int) -> torch.Tensor:
    """A 256 x 24 matrix of Gaussian, heavy-tailed and all-zero columns."""
    g = torch.Generator().manual_seed(seed)
    gauss = torch.randn(256, 12, generator=g)
    heavy = torch.randn(256, 10, generator=g) ** 3
    return torch.cat([gauss, heavy, torch.zeros(256, 2)], dim=1)


def _column_errors(matrix, q_float, scales):
    residual = matrix - reconstruct_quant(q_float, scales)
    return torch.sum(residual.double() ** 2, dim=0)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_max_scale_is_the_old_formula_and_mse_never_codes_a_column_worse(bits):
    matrix = _columns(bits)
    limit = qmax(bits)
    plain_q, plain_scales = ColumnQuantizer(matrix).quantize(bits)
    # The rule before the setting: s = max|column| / qmax, q = clamp(round(x / s)).
    old_scales = matrix.abs().amax(dim=0) / limit
    old_q = torch.clamp(torch.round(matrix / old_scales.clamp_min(torch.finfo(torch.float32).tiny)), -limit,
                        limit)
    assert torch.equal(plain_scales, old_scales) and torch.equal(plain_q, old_q)
    clipped = ColumnQuantizer(matrix, clip=True)
    q_float, scales = clipped.quantize(bits)
    assert torch.equal(q_float, torch.round(q_float)) and bool((q_float.abs() <= limit).all())
    assert bool((scales >= 0).all()) and torch.equal(scales[-2:], torch.zeros(2))
    before, after = _column_errors(matrix, plain_q, plain_scales), _column_errors(matrix, q_float, scales)
    assert bool((after <= before).all())
    if bits == 8:  # wider widths keep the "max" scale
        assert torch.equal(scales, plain_scales) and clipped.column_errors(bits) is None
        return
    # The search's own errors are the decode's, and at 2 bits the Gaussian columns gain a lot.
    assert torch.allclose(clipped.column_errors(bits).double(), after, rtol=1e-4)
    if bits == 2:
        gain = after[:12].sum() / before[:12].sum()
        assert gain < 0.5, gain
    # Every scale is a searched fraction of its column's largest magnitude.
    fractions = {torch.mul(matrix.abs().amax(dim=0), f).div(limit)[j].item(): f for f in CLIP_FRACTIONS
                 for j in range(matrix.shape[1])}
    assert all(scales[j].item() in fractions or scales[j].item() == 0.0 for j in range(matrix.shape[1]))


@pytest.mark.parametrize("encoder", ["v1", "v2", "v3", "v4"])
def test_mse_contributions_decode_unchanged_and_lose_less(encoder):
    """Every encoder with the clipped scale: the bytes decode (the unchanged decoder) to what error feedback
    subtracted, within the same budget, with less error than the "max" scale over rounds."""
    shapes = {"w": (256, 48), "v": (64, 64), "b": (48,)}
    errors = {}
    for scale in ("max", "mse"):
        cfg = CompressionConfig(bandwidth_budget=4000, min_compress_numel=512, encoder=encoder,
                                quant_scale=scale)
        coder = ErrorFeedbackCompressor(shapes, cfg, bandwidth_budget=4000)
        total = 0.0
        for outer_round in range(5):
            grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(outer_round)) for n, s in
                     shapes.items()}
            blob, stats = coder.compress(grads, stage_index=0, outer_round=outer_round)
            assert len(blob) <= 4000
            decoded = decode_contribution(blob, shapes)
            assert all(torch.equal(decoded[n], coder.last_decoded[n]) for n in shapes)
            total += sum(float(torch.sum((grads[n] - decoded[n]) ** 2)) for n in shapes)
        errors[scale] = total
    assert errors["mse"] < errors["max"], errors


def test_the_reproducible_codec_runs_the_search_in_fixed_order():
    """Under training.reproducible the encoder runs in :class:`training.exact_codec.ExactCodec`: the search
    is made of its allowed operations, and the bytes do not depend on the thread count."""
    shapes = {"w": (256, 48), "v": (64, 64)}
    cfg = CompressionConfig(bandwidth_budget=3000, min_compress_numel=512, quant_scale="mse")
    grads = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in shapes.items()}
    threads = torch.get_num_threads()
    blobs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            coder = ErrorFeedbackCompressor(shapes, cfg, bandwidth_budget=3000, exact=True)
            blobs.append(coder.compress(grads, stage_index=0, outer_round=0)[0])
    finally:
        torch.set_num_threads(threads)
    assert blobs[0] == blobs[1]
    plain = ErrorFeedbackCompressor(shapes, CompressionConfig(bandwidth_budget=3000, min_compress_numel=512),
                                    bandwidth_budget=3000, exact=True)
    assert plain.compress(grads, stage_index=0, outer_round=0)[0] != blobs[0]


def test_an_mse_contribution_reruns_bit_exactly_and_a_cheat_does_not():
    """A Muon run with ``quant_scale = "mse"`` under the configuration rebuilt from its run document: the
    spot check's rerun gives the same bits, a 1% cheat is caught."""
    overrides = ["model.preset=tiny", "training.seed=3", "training.batch_size=4", "training.warmup_steps=2",
                 "training.optimizer=muon", "diloco.inner_steps=3", "diloco.num_replicas=2",
                 "compression.min_compress_numel=512", "compression.quant_scale=mse"]
    cfg = node_config_from_run(run_document(load_config(None, overrides)))
    assert cfg.compression.quant_scale == "mse"
    sim = SimConfig(corpus=generated_corpus(seed=0, n_bytes=30_000), model=cfg.model, training=cfg.training,
                    diloco=cfg.diloco, compression=cfg.compression, num_stages=2, rounds=ROUNDS)
    records = _records(sim, SimReplica, PerturbedReplica)
    check = rerun_checker(sim, records, {})
    assert_honest_exact_and_cheat_caught(check, records, HONEST, PERTURBED, ROUNDS)
