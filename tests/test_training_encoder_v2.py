"""Encoder "v2" (compression.encoder; issue 16 item 3) and the apply path's reuse of a replica's own decode.

v2 changes which bytes the encoder picks, never the wire format or the
decoder: its contributions must decode, bit for bit, to what the encoder
returned, stay deterministic, fit the byte budget, and a run document that
names no encoder must keep v1's bytes. Reusing the own contribution's
decoding in ``StageEngine.apply_round`` must give the same weights hash as the
pure aggregation of the bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from codec_fixtures import encoder_sim, rerun_replica0, same_bits, shape_map

from training.codec.factorize import factorize_gram
from training.codec.registry import encoder_for
from training.codec_wire import decode_contribution
from training.compression import encode_contribution, encode_within_bandwidth
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import aggregate
from training.reexec import EXACT
from training.reexec_sim import SimReplica, run_with_states
from training.robust import contribution_norm, robust_contributions
from training.stage_engine import StageEngine

V1 = CompressionConfig(encoder="v1")
V2 = CompressionConfig(encoder="v2")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/torch_fixtures.py


def _stage_like(seed: int) -> dict[str, torch.Tensor]:
    """Pseudo-gradient-like tensors: decaying spectra plus noise, a zero column, biases, an all-zero
    tensor."""
    generator = torch.Generator().manual_seed(seed)

    def lowrank(m: int, n: int) -> torch.Tensor:
        spectrum = torch.logspace(0, -2, min(m, n))
        u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=generator))
        v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=generator))
        return (u * spectrum) @ v.t() * 0.05 + 1e-4 * torch.randn(m, n, generator=generator)

    tensors = {
        "a.weight": lowrank(128, 384),
        "b.weight": lowrank(512, 128),
        "c.weight": lowrank(128, 128),
        "d.weight": lowrank(64, 128),
        "e.bias": 0.01 * torch.randn(384, generator=generator),
        "f.bias": torch.zeros(128),
        "g.small": 0.01 * torch.randn(16, 8, generator=generator),
    }
    tensors["c.weight"][:, 3] = 0.0
    tensors["a.weight"][7] = -0.0
    return tensors


@pytest.mark.parametrize("budget", [6_000, 40_000, 200_000])
@pytest.mark.parametrize("seed", [0, 1])
def test_v2_decodes_bit_exactly_fits_and_is_deterministic(budget, seed):
    tensors = _stage_like(seed)
    blob, decoded, stats = encode_within_bandwidth(tensors, V2, budget, stage_index=1, outer_round=4)
    again, _, _ = encode_within_bandwidth(tensors, V2, budget, stage_index=1, outer_round=4)
    assert blob == again
    received = decode_contribution(blob, shape_map(tensors), stage_index=1, outer_round=4, refuse_raw=True)
    assert set(received) == set(decoded)
    for name in tensors:
        assert same_bits(received[name], decoded[name]), name
    if budget >= 40_000:  # the cheapest codings fit; then the whole contribution must
        assert len(blob) <= budget
    assert stats.encoded_bytes == len(blob)


def test_v2_error_budget_path_decodes_bit_exactly():
    tensors = _stage_like(2)
    cfg = dataclasses.replace(V2, bandwidth_budget=0, error_budget=0.3)
    blob, decoded, stats = encode_contribution(tensors, cfg, stage_index=0, outer_round=0)
    received = decode_contribution(blob, shape_map(tensors), stage_index=0, outer_round=0)
    for name in tensors:
        assert same_bits(received[name], decoded[name]), name
    assert all(t.met_budget for t in stats.tensors)


def test_a_run_document_without_encoder_keeps_v1_and_v2_is_validated():
    from node.config import load_config
    from node.runconfig import node_config_from_run, run_document

    document = run_document(load_config(None))
    del document["compression"]["encoder"]  # a run made before compression.encoder existed
    named = node_config_from_run(document).compression
    assert V1.encoder == named.encoder == "v1"
    tensors = _stage_like(3)
    old, _, _ = encode_within_bandwidth(tensors, V1, 40_000, stage_index=0, outer_round=1)
    assert encode_within_bandwidth(tensors, named, 40_000, stage_index=0, outer_round=1)[0] == old
    with pytest.raises(ValueError, match="compression.encoder"):
        CompressionConfig(encoder="v9")


def test_gram_factorization_finds_the_top_singular_triplets():
    generator = torch.Generator().manual_seed(5)
    for m, n in ((128, 384), (512, 128), (64, 128), (40, 30)):
        u, _ = torch.linalg.qr(torch.randn(m, min(m, n), generator=generator, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(n, min(m, n), generator=generator, dtype=torch.float64))
        spectrum = torch.logspace(0, -3, min(m, n), dtype=torch.float64)
        matrix = ((u * spectrum) @ v.t()).to(torch.float32)
        rank = min(32, m, n)
        left, sigma, right = factorize_gram(matrix, rank)
        # A randomized subspace of the squared spectrum: the leading triplets to float32 accuracy, the
        # others above 1% of the largest within 1% (below, float32 squares lose digits: they matter
        # little), and the truncation error within 2% of the optimal (exact SVD's) one.
        assert torch.allclose(sigma[: rank // 2].double(), spectrum[: rank // 2], rtol=1e-4)
        large = spectrum[:rank] > 1e-2
        assert torch.allclose(sigma.double()[large], spectrum[:rank][large], rtol=1e-2)
        optimal = float(torch.sum(spectrum[rank:] ** 2))
        approx = ((left * sigma) @ right.t()).double()
        assert float(torch.sum((matrix.double() - approx) ** 2)) <= 1.02 * optimal + 1e-9
    left, sigma, right = factorize_gram(torch.zeros(64, 96), 16)  # no division by a zero sigma
    assert not torch.any(sigma) and not torch.any(left @ right.t()) and torch.isfinite(right).all()


def test_v2_estimates_track_the_exact_error():
    """The analytic estimates choose; they must be close to the decoded error of the coding they describe."""
    tensors = _stage_like(4)
    for name in ("a.weight", "b.weight", "c.weight"):
        matrix = tensors[name]
        norm = float(torch.linalg.vector_norm(matrix))
        for option in encoder_for(V2).tensor_options(matrix, tuple(matrix.shape), norm).options:
            if option.candidate.bits == 2:
                continue  # ternary factors: rounding is far from the uniform noise the cross terms assume
            exact = float(torch.linalg.vector_norm(matrix - option.coded().decode().reshape(matrix.shape))) \
                / norm
            assert abs(option.estimate - exact) <= 0.1 * exact + 0.01, \
                (name, option.candidate, option.estimate, exact)


def test_robust_contributions_with_a_known_decoding_is_the_same():
    tensors = [_stage_like(seed) for seed in (6, 7)]
    blobs, decodings = [], []
    for value in tensors:
        blob, decoded, _ = encode_within_bandwidth(value, V2, 30_000, stage_index=0, outer_round=2)
        blobs.append(blob)
        decodings.append(decoded)
    shapes = shape_map(tensors[0])
    plain = robust_contributions(blobs, shapes, norm_clip=2.0, stage_index=0, outer_round=2, refuse_raw=True)
    known = robust_contributions(blobs, shapes, norm_clip=2.0, stage_index=0, outer_round=2, refuse_raw=True,
                                 known=[(blobs[1], decodings[1])])
    assert plain[1] == known[1]
    for a, b in zip(plain[0], known[0]):
        assert all(same_bits(a[name], b[name]) for name in shapes)
    assert known[1][1].norm == contribution_norm(decodings[1])
    # Bytes that differ from the known ones are decoded (and a bad one is still refused).
    broken = robust_contributions([blobs[0], b"junk"], shapes, norm_clip=2.0, stage_index=0, outer_round=2,
                                  refuse_raw=True, known=[(blobs[1], decodings[1])])
    assert [r.accepted for r in broken[1]] == [True, False]


@pytest.mark.parametrize("cfg", [V2, CompressionConfig(enabled=False)], ids=["v2", "raw"])
def test_engine_reusing_its_own_decode_matches_the_pure_aggregate(cfg):
    """Two engines of one stage; each applies both contributions: same weights as aggregate() of the bytes."""
    diloco_cfg = DilocoConfig(inner_steps=2, num_replicas=2, one_step_delay=False)
    start = _stage_like(8)
    engines = [StageEngine(0, {n: v.clone() for n, v in start.items()}, diloco_cfg, cfg) for _ in range(2)]
    for outer_round in range(2):
        blobs = []
        for index, engine in enumerate(engines):
            with torch.no_grad():
                for name, param in engine.params.items():
                    param.sub_(_stage_like(10 + 2 * outer_round + index)[name])
            blobs.append(engine.encode_contribution(outer_round)[0])
        expected = aggregate(engines[0].global_weights, engines[0].momentum, blobs, diloco_cfg, stage_index=0,
                             outer_round=outer_round, compression_cfg=cfg)[2]
        assert [engine.apply_round(outer_round, blobs).weights_hash for engine in engines] == [expected] * 2


def test_v2_contributions_reexecute_bit_exactly():
    """A spot check reruns a v2 round from its start state and gets the same bytes (v2 carries no state)."""
    sim = encoder_sim("v2", rounds=2)
    records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    for outer_round in range(2):
        check = rerun_replica0(sim, records, outer_round)
        assert check.verdict == EXACT, check.reason
