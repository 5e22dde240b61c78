"""Compression under a bandwidth budget: the allocation rule and the codec that uses it."""

from __future__ import annotations

import itertools

import pytest
import torch

from training.codec.allocation import allocate, lower_hull
from training.codec_wire import decode_contribution
from training.compression import ErrorFeedbackCompressor, encode_within_bandwidth
from training.config import DilocoConfig
from training.config_compression import AUTO_MAX_ROUND_RATIO, CompressionConfig
from training.stage_engine import StageEngine


def test_lower_hull_drops_dominated_and_concave_points():
    points = [(10, 100.0), (20, 40.0), (30, 35.0), (40, 5.0), (25, 90.0), (50, 6.0)]
    # (25, 90) is dominated by (20, 40); (30, 35) lies above the
    # segment (20, 40)-(40, 5); (50, 6) is worse than (40, 5).
    assert lower_hull(points) == [0, 1, 3]


def test_allocate_matches_brute_force_on_convex_options():
    options = {
        "a": [(10, 100.0), (20, 50.0), (40, 20.0), (80, 5.0)],
        "b": [(5, 30.0), (15, 10.0), (45, 2.0)],
        "c": [(8, 60.0), (16, 20.0), (32, 4.0)],
    }
    for budget in (23, 40, 60, 90, 130, 200):
        choice = allocate(options, budget)
        cost = sum(options[n][i][0] for n, i in choice.items())
        error = sum(options[n][i][1] for n, i in choice.items())
        assert cost <= budget
        feasible = [
            sum(options[n][i][1] for n, i in zip("abc", combo))
            for combo in itertools.product(*(range(len(options[n])) for n in "abc"))
            if sum(options[n][i][0] for n, i in zip("abc", combo)) <= budget
        ]
        # Greedy on convex hulls is within one upgrade of the optimum; on these options it is exact.
        assert error == pytest.approx(min(feasible))


def test_allocate_sends_the_cheapest_codings_when_nothing_fits():
    options = {"a": [(10, 1.0), (20, 0.5)], "b": [(10, 1.0)]}
    assert allocate(options, 5) == {"a": 0, "b": 0}


def _pseudo_gradient(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "h.attn.weight": torch.randn(128, 8, generator=g) @ torch.randn(8, 384, generator=g) * 0.01,
        "h.mlp.weight": torch.randn(256, 128, generator=g),
        "h.ln.bias": torch.randn(128, generator=g) * 0.1,
    }


def test_more_bandwidth_buys_less_error_and_the_budget_holds():
    tensors = _pseudo_gradient()
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    cfg = CompressionConfig()
    errors = []
    for budget in (3_000, 10_000, 40_000):
        blob, decoded, stats = encode_within_bandwidth(tensors, cfg, budget, stage_index=1, outer_round=2)
        assert len(blob) <= budget
        exact = decode_contribution(blob, shapes, stage_index=1, outer_round=2)
        assert all(torch.equal(exact[n], decoded[n]) for n in tensors)
        errors.append(sum(float((tensors[n] - decoded[n]).pow(2).sum()) for n in tensors))
    assert errors[0] > errors[1] > errors[2]


def test_error_feedback_compressor_uses_the_bandwidth_budget():
    tensors = _pseudo_gradient(1)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    compressor = ErrorFeedbackCompressor(shapes, CompressionConfig(bandwidth_budget=6_000))
    sizes = []
    for outer_round in range(3):
        blob, stats = compressor.compress(tensors, stage_index=0, outer_round=outer_round)
        sizes.append(len(blob))
        assert stats.encoded_bytes == len(blob)
    assert max(sizes) <= 6_000
    with pytest.raises(ValueError):
        CompressionConfig(bandwidth_budget=-1)


def test_auto_budget_sends_the_target_reduction_of_an_allreduce_and_the_engine_uses_it():
    cfg = CompressionConfig()  # bandwidth_budget = "auto", target_reduction = 1000
    assert cfg.bandwidth_budget == "auto"
    # mini's first stage at H = 50, M = 2: 4 bytes x 437,504 params x 50 steps x 2(M-1)/M / 1000.
    assert cfg.stage_bandwidth_budget(437_504, 50, 2) == 87_500
    assert cfg.stage_bandwidth_budget(437_504, 50, 4) == int(4 * 437_504 * 50 * 1.5 / 1000)
    assert cfg.stage_bandwidth_budget(437_504, 50, 1) == 87_500  # M = 1 counts as the smallest group, 2
    # Short rounds: never more than AUTO_MAX_ROUND_RATIO x smaller than float32.
    assert cfg.stage_bandwidth_budget(10_000, 3, 2) == int(40_000 / AUTO_MAX_ROUND_RATIO)
    assert CompressionConfig(bandwidth_budget="12000").stage_bandwidth_budget(10**6, 50, 2) == 12_000
    assert CompressionConfig(bandwidth_budget=0).stage_bandwidth_budget(10**6, 50, 2) == 0
    with pytest.raises(ValueError, match="bandwidth_budget"):
        CompressionConfig(bandwidth_budget="lots")
    with pytest.raises(ValueError, match="target_reduction"):
        CompressionConfig(target_reduction=0.5)

    tensors = _pseudo_gradient(1)
    numel = sum(t.numel() for t in tensors.values())
    params = {name: torch.zeros_like(t) for name, t in tensors.items()}
    diloco = DilocoConfig(inner_steps=40, one_step_delay=False)
    engine = StageEngine(0, params, diloco, cfg)
    budget = cfg.stage_bandwidth_budget(numel, 40, 2)
    assert engine.compressor.bandwidth_budget == budget == int(4 * numel * 40 / 1000)
    with torch.no_grad():
        for name, param in params.items():
            param.sub_(tensors[name])
    blob, stats = engine.encode_contribution(0)
    assert len(blob) <= budget < stats.raw_bytes
    # Without the round's length (a bare compressor) "auto" codes to the error budget.
    assert ErrorFeedbackCompressor({n: tuple(t.shape) for n, t in tensors.items()}, cfg).bandwidth_budget == 0


def test_every_ranks_estimate_from_one_quantization_matches_coding_each_rank():
    from training.codec.coding import Candidate, code_lowrank
    from training.codec.factorize import factorize_range
    from training.codec.v1 import lowrank_estimates

    g = torch.Generator().manual_seed(4)
    for matrix in (torch.randn(128, 6, generator=g) @ torch.randn(6, 512, generator=g) + 0.1
                   * torch.randn(128, 512, generator=g),
                   torch.randn(96, 40, generator=g)):
        norm = float(torch.linalg.vector_norm(matrix))
        ranks = [1, 2, 4, 8, 16, 32]
        factors = factorize_range(matrix, max(ranks))
        for bits in (2, 4, 8):
            fast = lowrank_estimates(matrix, factors, ranks, bits, norm)
            for rank in ranks:
                coded = code_lowrank(matrix, factors, Candidate("lowrank", rank, bits, 0), norm)
                assert fast[rank] == pytest.approx(coded.estimate, rel=1e-4, abs=1e-6), (bits, rank)
                # and the estimate is the exact decode's error, to float32 accuracy
                exact = float(torch.linalg.vector_norm(matrix - coded.decode())) / norm
                assert fast[rank] == pytest.approx(exact, rel=1e-3, abs=1e-5)
