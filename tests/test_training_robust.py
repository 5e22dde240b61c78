"""Byzantine tolerance: exclusion with reasons, the norm rule, bit-exact replay, screening, straggler
feedback."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from fractions import Fraction

import msgpack
import numpy as np
import pytest
import torch

from training.codec_wire import pack_contribution
from training.codec_exact import pack_ints
from training.compression import ErrorFeedbackCompressor, encode_contribution
from training.config import DilocoConfig, ModelConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.diloco import aggregate, aggregate_with_report
from training.errors import TrainingConfigError
from training.model import init_state_dict
from training.robust import contribution_norm, lower_median
from training.screening import (
    judge,
    model_loss_fn,
    screen_contributions,
    screening_batch,
    screening_exclusions,
)
from training.stage_engine import StageEngine

RAW = CompressionConfig(enabled=False)
COMPRESSED = CompressionConfig(error_budget=0.3, bit_choices=[4, 8], min_compress_numel=256,
                               bandwidth_budget=0)
SHAPES = {"a.weight": (24, 32), "b.bias": (24,)}


def _state(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return weights, {n: torch.zeros(s) for n, s in SHAPES.items()}


def _honest(count: int, cfg: CompressionConfig = COMPRESSED, seed: int = 1, scale=None, outer_round: int = 0):
    """``count`` pseudo-gradients of similar norm (a shared direction plus per-replica noise), encoded."""
    g = torch.Generator().manual_seed(seed)
    shared = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    blobs = []
    for replica in range(count):
        factor = 0.01 * (scale[replica] if scale else 1.0)
        tensors = {n: factor * (shared[n] + 0.5 * torch.randn(s, generator=g)) for n, s in SHAPES.items()}
        blobs.append(encode_contribution(tensors, cfg, stage_index=0, outer_round=outer_round)[0])
    return blobs


def _raw_entry(name: str, values: np.ndarray) -> dict:
    return {"n": name, "s": list(values.shape), "c": "raw", "d": values.astype("<f4").tobytes()}


def test_honest_contributions_of_similar_norm_are_untouched_bit_for_bit():
    weights, momentum = _state()
    blobs = _honest(4)
    result = aggregate_with_report(weights, momentum, blobs, DilocoConfig(), stage_index=0, outer_round=0,
                                   compression_cfg=COMPRESSED)
    assert [(r.accepted, r.scale, r.reason) for r in result.contributions] == [(True, 1.0, "")] * 4
    plain = aggregate(weights, momentum, blobs, DilocoConfig(norm_clip=0), stage_index=0, outer_round=0)
    assert result.weights_hash == plain[2]
    assert all(r.norm is not None and r.norm > 0 for r in result.contributions)


@pytest.mark.parametrize("factor", [1e3, 1e6, 1e30])
def test_a_huge_contribution_is_clipped_to_the_bound(factor):
    weights, momentum = _state()
    honest = _honest(3, RAW)
    g = torch.Generator().manual_seed(9)
    huge = {n: factor * 0.01 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    blobs = honest + [encode_contribution(huge, RAW, stage_index=0, outer_round=0)[0]]
    cfg = DilocoConfig(outer_lr=1.0, outer_momentum=0.0)
    result = aggregate_with_report(weights, momentum, blobs, cfg, stage_index=0, outer_round=0)
    norms = [r.norm for r in result.contributions]
    bound = 2.0 * lower_median(norms)
    report = result.contributions[3]
    assert report.accepted and report.scale == pytest.approx(bound / norms[3], rel=1e-12) \
        and report.scale < 1e-2
    # The step can move the weights by at most the mean of the clipped norms.
    step = math.sqrt(sum(float(torch.sum((result.new_global[n] - weights[n]).double() ** 2)) for n in SHAPES))
    assert step <= (sum(norms[:3]) + bound) / 4 * (1 + 1e-5)
    assert all(bool(torch.isfinite(v).all()) for v in result.new_global.values())


def test_values_near_float32_max_are_bounded_not_nan():
    weights, momentum = _state()
    entries = [_raw_entry("a.weight", np.full((24, 32), 3e38)), _raw_entry("b.bias", np.full(24, -3e38))]
    attack = pack_contribution(0, 0, entries)
    result = aggregate_with_report(weights, momentum, _honest(3, RAW) + [attack], DilocoConfig(),
                                   outer_round=0)
    assert result.contributions[3].accepted and math.isfinite(result.contributions[3].norm)
    assert all(bool(torch.isfinite(v).all()) and float(v.abs().max()) < 100
               for v in result.new_global.values())


def test_bad_contributions_are_excluded_with_their_reasons():
    weights, momentum = _state()
    honest = _honest(3)
    a_weight = encode_contribution({"a.weight": torch.ones(24, 32)}, COMPRESSED, stage_index=0,
                                   outer_round=0)[0]
    quant_inf = {"n": "b.bias", "s": [24], "c": "quant", "b": 8, "q": pack_ints(torch.zeros(24), 8),
                 "x": np.array([np.inf]).astype("<f4").tobytes()}
    non_finite = pack_contribution(0, 0, [msgpack.unpackb(a_weight)["t"][0], quant_inf])
    wrong_shape = encode_contribution({"a.weight": torch.zeros(24, 31), "b.bias": torch.zeros(24)},
                                      COMPRESSED, stage_index=0, outer_round=0)[0]
    raw = _honest(1, RAW)[0]
    blobs = honest + [non_finite, wrong_shape, raw, b"\x93junk", _honest(1, outer_round=1)[0]]
    result = aggregate_with_report(weights, momentum, blobs, DilocoConfig(), stage_index=0, outer_round=0,
                                   compression_cfg=COMPRESSED, excluded={1: "screened: worse alone"})
    assert [(r.index, r.reason) for r in result.contributions if not r.accepted] == [
        (1, "screened"), (3, "non_finite"), (4, "wrong_shape"), (5, "raw_in_compressed"), (6, "undecodable"),
        (7, "undecodable"),
    ]
    assert result.accepted == [0, 2] and result.contributions[1].detail == "screened: worse alone"
    assert all(r.scale == 0.0 for r in result.contributions if not r.accepted)
    alone = aggregate(weights, momentum, [honest[0], honest[2]], DilocoConfig(), stage_index=0, outer_round=0)
    assert result.weights_hash == alone[2]
    # Without a compressed run's config the raw codec is accepted (synchronous DiLoCo sends raw).
    assert aggregate_with_report(weights, momentum, [raw], DilocoConfig(), outer_round=0).accepted == [0]


def test_contribution_norm_is_the_correctly_rounded_exact_norm():
    g = torch.Generator().manual_seed(3)
    tensors = {"x": torch.randn(1000, generator=g) * 1e20, "y": torch.randn(7, 3, generator=g)}
    exact = sum(Fraction(float(v)) ** 2 for t in tensors.values() for v in t.reshape(-1).tolist())
    assert contribution_norm(tensors) == math.sqrt(float(exact))
    shuffled = {"x": tensors["x"].flip(0), "y": tensors["y"].t()}
    assert contribution_norm(shuffled) == contribution_norm(tensors)
    assert lower_median([3.0, 1.0, 2.0, 4.0]) == 2.0 and lower_median([5.0]) == 5.0


def test_contribution_norm_of_millions_of_values_is_decided_in_one_pass(monkeypatch):
    # The one-pass bound is taken block by block: at 2**22 values (a llama-124m contribution has 2**27) it
    # still decides the rounding, and the levels (several more passes over the whole contribution) never run.
    from training import robust

    def levels(*_):
        raise AssertionError("fell back to _levels_norm")

    g = torch.Generator().manual_seed(11)
    tensors = {"w": torch.randn(1 << 21, generator=g) * 3e-3, "b": torch.randn(1 << 21, generator=g)}
    monkeypatch.setattr(robust, "_levels_norm", levels)
    norm = contribution_norm(tensors)
    squares = np.concatenate([t.numpy().astype(np.float64) ** 2 for t in tensors.values()])
    assert norm == math.sqrt(math.fsum(squares.tolist()))


def test_contribution_norm_equals_fsum_of_exact_squares_over_every_float32_range():
    # The vectorized exact sum must give the very double math.fsum gives (the audit's
    # earlier definition): subnormals, zeros, huge values, mixed exponents, empty tensors.
    def fsum_norm(tensors):
        squares = [v * v for name in sorted(tensors)
                   for v in tensors[name].to(torch.float64).reshape(-1).tolist()]
        return math.sqrt(math.fsum(squares))

    g = torch.Generator().manual_seed(5)
    wide = torch.randn(20_000, generator=g) * torch.exp(torch.randn(20_000, generator=g) * 25).clamp(max=1e30)
    cases = [
        {"w": wide.to(torch.float32)},
        {"a": torch.randn(64, 33, generator=g) * 1e-3, "b": torch.randn(9, generator=g) * 1e-40},
        {"s": torch.tensor([1e-45, -1.4e-45, 3e-39, 0.0, -0.0, 1.0])},
        {"z": torch.zeros(5), "e": torch.zeros(0)},
        {"big": torch.full((500,), 3.0e38)},
    ]
    for tensors in cases:
        assert contribution_norm(tensors) == fsum_norm(tensors)
    assert contribution_norm({"z": torch.zeros(3)}) == 0.0


def test_norm_clip_validation_says_how_to_fix():
    with pytest.raises(TrainingConfigError, match="norm_clip=0.5"):
        DilocoConfig(norm_clip=0.5)
    with pytest.raises(TrainingConfigError, match="screen_rel_tol"):
        DilocoConfig(screen_rel_tol=-1)


REPLAY = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(int(sys.argv[2]))
    from training.config import DilocoConfig
    from training.config_compression import CompressionConfig
    from training.diloco import aggregate_with_report
    case = torch.load(sys.argv[1])
    result = aggregate_with_report(case["weights"], case["momentum"], case["blobs"], DilocoConfig(),
                                   stage_index=0, outer_round=0, compression_cfg=CompressionConfig(),
                                   excluded={1: "x"})
    print(result.weights_hash.hex(), [(r.reason, r.norm.hex() if r.norm else None, r.scale.hex())
                                      for r in result.contributions])
    """
)


def test_robust_aggregation_replays_bit_exactly_in_another_process(tmp_path):
    weights, momentum = _state()
    g = torch.Generator().manual_seed(5)
    huge = {n: 1e6 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
    blobs = _honest(4, scale=[1.0, 1.0, 1.3, 0.8]) + [encode_contribution(huge, COMPRESSED, stage_index=0,
                                                                          outer_round=0)[0]]
    blobs.append(_honest(1, RAW)[0])
    case = tmp_path / "case.pt"
    torch.save({"weights": weights, "momentum": momentum, "blobs": blobs}, case)
    outputs = {
        subprocess.run([sys.executable, "-c", REPLAY, str(case), threads], capture_output=True, text=True,
                       timeout=120, check=True).stdout.strip()
        for threads in ("1",)  # one thread there, torch's default (all cores) here
    }
    result = aggregate_with_report(weights, momentum, blobs, DilocoConfig(), stage_index=0, outer_round=0,
                                   compression_cfg=CompressionConfig(), excluded={1: "x"})
    assert result.contributions[4].scale < 1e-5 and result.contributions[5].reason == "raw_in_compressed"
    assert outputs == {f"{result.weights_hash.hex()} " + str(
        [(r.reason, r.norm.hex() if r.norm else None, r.scale.hex()) for r in result.contributions])}


# --------------------------------------------------------------------------- straggler error feedback


def test_a_dropped_contribution_goes_back_into_the_residual_and_is_sent_next_round():
    for cfg in (COMPRESSED, RAW, CompressionConfig(error_feedback=False, bit_choices=[8],
                                                   min_compress_numel=256, bandwidth_budget=0)):
        param = torch.zeros(24, 32)
        engine = StageEngine(0, {"a.weight": param}, DilocoConfig(one_step_delay=False), cfg)
        g = torch.Generator().manual_seed(2)
        progress = [0.01 * torch.randn(24, 32, generator=g) for _ in range(2)]
        param -= progress[0]
        engine.encode_contribution(0)
        sent0 = engine.compressor.last_decoded["a.weight"]
        residual0 = engine.compressor.residual["a.weight"].clone()
        assert engine.contribution_dropped(0)
        assert not engine.contribution_dropped(0)  # once only
        assert torch.equal(engine.compressor.residual["a.weight"], residual0 + sent0)
        other = encode_contribution({"a.weight": torch.zeros(24, 32)}, RAW, stage_index=0, outer_round=0)[0]
        engine.apply_round(0, [other])  # round 0 went on without this replica
        param -= progress[1]
        engine.encode_contribution(1)
        sent1 = engine.compressor.last_decoded["a.weight"]
        # What round 1 sent carries both rounds' progress (up to what the codec leaves in the residual).
        carried = sent1 + engine.compressor.residual["a.weight"]
        expected = progress[0] + progress[1]
        if cfg.error_feedback:  # the residual keeps what the codec left out
            assert torch.allclose(carried, expected, atol=1e-6), cfg
        # Without round 0's progress the error would be ~0.7 of the norm: above every budget here.
        budget = cfg.error_budget if cfg.enabled else 1e-6
        assert float((sent1 - expected).norm()) <= budget * float(expected.norm()), cfg


def test_restore_undelivered_checks_names():
    compressor = ErrorFeedbackCompressor({"w": (2,)}, COMPRESSED)
    with pytest.raises(ValueError):
        compressor.restore_undelivered({"v": torch.zeros(2)})


# --------------------------------------------------------------------------- screening

# The case was built on torch's initial weights (init="torch", what run documents before issue 42 use): its
# expected exclusions are those of that model.
TINY = ModelConfig(preset="tiny", init="torch")


def _screening_case():
    corpus = generated_corpus(0, n_bytes=40_000)
    x, y = screening_batch(corpus, run_seed=7, outer_round=3, batch_size=8, block_size=TINY.block_size)
    weights = init_state_dict(TINY, 0)
    loss_fn = model_loss_fn(TINY, x, y)
    # An "honest" step: a few SGD steps' worth of gradient on that text.
    from training.model import GPT
    model = GPT(TINY, seed=0)
    _, loss = model(x, y)
    loss.backward()
    gradient = {n: 0.5 * p.grad.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    honest = [{n: v * (1 + 0.1 * k) for n, v in gradient.items()} for k in range(3)]
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in gradient.values()))
    noise = {n: torch.randn(v.shape, generator=g) for n, v in gradient.items()}
    noise_norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in noise.values()))
    attacks = [
        {n: -v for n, v in gradient.items()},  # sign flip
        {n: v * (norm / noise_norm) for n, v in noise.items()},  # noise of the honest norm
        {n: 1e6 * v for n, v in gradient.items()},  # huge
    ]
    return corpus, loss_fn, weights, honest + attacks + [None]


def test_screening_batch_is_seeded_and_held_out():
    corpus = generated_corpus(0, n_bytes=40_000)
    a = screening_batch(corpus, 7, 3, 8, 32)
    assert torch.equal(a[0], screening_batch(corpus, 7, 3, 8, 32)[0])
    assert not torch.equal(a[0], screening_batch(corpus, 7, 4, 8, 32)[0])
    assert torch.equal(a[0][:, 1:], a[1][:, :-1])
    held_out = bytes(corpus.eval.tolist())
    assert all(bytes(row.tolist()) in held_out for row in a[0])


def test_screening_excludes_what_makes_the_model_worse_alone():
    _, loss_fn, weights, contributions = _screening_case()
    reports = screen_contributions(loss_fn, weights, contributions, DilocoConfig(outer_lr=1.0))
    assert [r.excluded for r in reports] == [False, False, False, True, True, True, False]
    assert reports[6].loss_after is None and reports[5].loss_after > 1e3
    assert all(r.loss_after < r.loss_before for r in reports[:3])
    assert set(screening_exclusions(reports)) == {3, 4, 5} and "alone" in screening_exclusions(reports)[3]
    # The rule is a pure function of the recorded losses.
    after = {r.index: r.loss_after for r in reports if r.loss_after is not None}
    assert judge(reports[0].loss_before, after, len(reports), DilocoConfig(outer_lr=1.0)) == reports


SCREEN = textwrap.dedent(
    """
    import sys
    import torch
    torch.set_num_threads(int(sys.argv[2]))
    from training.config import DilocoConfig, ModelConfig
    from training.data import generated_corpus
    from training.screening import model_loss_fn, screen_contributions, screening_batch
    case = torch.load(sys.argv[1])
    x, y = screening_batch(generated_corpus(0, n_bytes=40_000), 7, 3, 8, 32)
    loss_fn = model_loss_fn(ModelConfig(preset="tiny"), x, y)
    print([(r.loss_before.hex(), r.loss_after.hex() if r.loss_after is not None else None, r.excluded)
           for r in screen_contributions(loss_fn, case["weights"], case["contributions"],
                                         DilocoConfig(outer_lr=1.0))])
    """
)


def test_screening_is_the_same_in_another_process_with_another_thread_count(tmp_path):
    _, loss_fn, weights, contributions = _screening_case()
    case = tmp_path / "case.pt"
    torch.save({"weights": weights, "contributions": contributions}, case)
    outputs = {
        subprocess.run([sys.executable, "-c", SCREEN, str(case), threads], capture_output=True, text=True,
                       timeout=120, check=True).stdout.strip()
        for threads in ("1",)  # one thread there, torch's default (all cores) here
    }
    local = [(r.loss_before.hex(), r.loss_after.hex() if r.loss_after is not None else None, r.excluded)
             for r in screen_contributions(loss_fn, weights, contributions, DilocoConfig(outer_lr=1.0))]
    assert outputs == {str(local)}
