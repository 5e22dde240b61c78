"""The faster codec and norm paths (issue 16 item 3) against the slow reference implementations they replaced.

Every fast path must give the same bits as before: the same contribution
bytes from the encoder, the same float32 values from the decoder (including
the sign of zero: the weights hash sees it), the same norm. The references
below are the previous implementations, kept here verbatim.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from training import codec_exact, codec_wire
from training.codec import base
from training.codec.coding import Coded, Option, TensorOptions, candidates, rel_error
from training.codec.factorize import factorize_range
from training.codec.v1 import V1Encoder
from training.codec_wire import MAX_WEIGHT, decode_contribution, pack_contribution
from training.codec_exact import pack_ints, qmax, reconstruct_lowrank, unpack_ints
from training.compression import encode_contribution, encode_within_bandwidth
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.diloco import average_contributions, outer_step
from training.errors import ContributionDecodeError
from training.robust import contribution_norm

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/torch_fixtures.py


# ----------------------------------------------------------------------------- references (the old code)


def reference_reconstruct_lowrank(p_int, q_int, weights, scale):
    product = torch.matmul(torch.mul(p_int, weights.reshape(1, -1)), q_int.t())
    return torch.mul(product.to(torch.float64), scale.to(torch.float64)).to(torch.float32)


def reference_unpack_ints(data: bytes, bits: int, count: int, where: str) -> torch.Tensor:
    expected = (count * bits + 7) // 8
    if len(data) != expected:
        raise ContributionDecodeError(f"{where}: {len(data)} payload bytes, expected {expected}")
    if bits == 16:
        array = np.frombuffer(data, dtype="<u2").astype(np.int64)
    elif bits == 8:
        array = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    else:
        per_byte = 8 // bits
        raw = np.frombuffer(data, dtype=np.uint8)
        mask = (1 << bits) - 1
        array = np.stack([(raw >> (bits * j)) & mask for j in range(per_byte)], axis=1).reshape(-1)
        array = array.astype(np.int64)
        if np.any(array[count:]):
            raise ContributionDecodeError(f"{where}: non-zero padding bits")
        array = array[:count]
    if array.size and int(array.max()) > 2 * qmax(bits):
        raise ContributionDecodeError(f"{where}: value out of the {bits}-bit symmetric range")
    return torch.from_numpy(array - qmax(bits))


def reference_pack_ints(values: torch.Tensor, bits: int) -> bytes:
    offset = values.reshape(-1).to(torch.int64) + qmax(bits)
    array = offset.numpy()
    if bits == 16:
        return array.astype("<u2").tobytes()
    if bits == 8:
        return array.astype(np.uint8).tobytes()
    per_byte = 8 // bits
    pad = (-array.size) % per_byte
    array = np.concatenate([array.astype(np.uint8), np.zeros(pad, dtype=np.uint8)]).reshape(-1, per_byte)
    packed = np.zeros(array.shape[0], dtype=np.uint8)
    for j in range(per_byte):
        packed |= (array[:, j] << (bits * j)).astype(np.uint8)
    return packed.tobytes()


def reference_outer_step(global_weights, momentum, pseudo_gradient, mu, lr, nesterov):
    mu, lr = torch.tensor(mu, dtype=torch.float32), torch.tensor(lr, dtype=torch.float32)
    new_weights, new_momentum = {}, {}
    for name in sorted(global_weights):
        delta = pseudo_gradient[name]
        buffer = torch.add(torch.mul(momentum[name], mu), delta)
        update = torch.add(delta, torch.mul(buffer, mu)) if nesterov else buffer
        new_weights[name] = torch.sub(global_weights[name], torch.mul(update, lr))
        new_momentum[name] = buffer
    return new_weights, new_momentum


def reference_norm(tensors) -> float:
    squares = [v * v for name in sorted(tensors)
               for v in tensors[name].to(torch.float64).reshape(-1).tolist()]
    return math.sqrt(math.fsum(squares))


def reference_quantize_columns(matrix, bits):
    limit = qmax(bits)
    scales = matrix.abs().amax(dim=0) / limit
    safe = scales.clamp_min(torch.finfo(torch.float32).tiny)
    q_int = torch.clamp(torch.round(matrix / safe), -limit, limit).to(torch.int64)
    return q_int, scales.to(torch.float32)


def reference_code_quant(matrix, bits, candidate, norm):
    q_int, scales = reference_quantize_columns(matrix, bits)
    decoded = torch.mul(q_int.to(torch.float32), scales.reshape(1, -1))
    return Coded(candidate, (q_int,), scales, rel_error(matrix, decoded, norm))


def reference_code_lowrank(matrix, factors, candidate, norm):
    u, sigma, v = factors
    rank, bits = candidate.rank, candidate.bits
    root = torch.sqrt(sigma[:rank])
    p_int, p_scales = reference_quantize_columns(u[:, :rank] * root, bits)
    q_int, q_scales = reference_quantize_columns(v[:, :rank] * root, bits)
    products = (p_scales.to(torch.float64) * q_scales.to(torch.float64)).to(torch.float32)
    scale = (products.max() / MAX_WEIGHT).to(torch.float32).reshape(())
    if scale > 0:
        weights = torch.clamp(torch.round(products / scale), 0, MAX_WEIGHT).to(torch.int64)
    else:
        weights = torch.zeros(rank, dtype=torch.int64)
    return Coded(candidate, (p_int, q_int, weights), scale, 0.0)


def reference_lowrank_estimates(matrix, factors, ranks, bits, norm):
    u, sigma, v = factors
    top = max(ranks)
    root = torch.sqrt(sigma[:top])
    p_int, p_scales = reference_quantize_columns(u[:, :top] * root, bits)
    q_int, q_scales = reference_quantize_columns(v[:, :top] * root, bits)
    products = (p_scales.to(torch.float64) * q_scales.to(torch.float64)).to(torch.float32)
    p_float, q_float = p_int.to(torch.float32), q_int.to(torch.float32)
    column_cross = torch.sum((matrix @ q_float).to(torch.float64) * p_float.to(torch.float64), dim=0)
    gram = (p_float.t() @ p_float).to(torch.float64) * (q_float.t() @ q_float).to(torch.float64)
    estimates = {}
    for rank in ranks:
        head = products[:rank]
        scale = (head.max() / MAX_WEIGHT).to(torch.float32)
        if scale > 0:
            weights = torch.clamp(torch.round(head / scale), 0, MAX_WEIGHT)
        else:
            weights = torch.zeros(rank)
        d = (weights * scale).to(torch.float64)
        if norm == 0.0:
            empty = not torch.any(d) or not torch.any(p_int[:, :rank]) or not torch.any(q_int[:, :rank])
            estimates[rank] = 0.0 if empty else float("inf")
            continue
        cross = float(torch.dot(column_cross[:rank], d))
        square = float(d @ gram[:rank, :rank] @ d)
        estimates[rank] = math.sqrt(max(norm * norm - 2 * cross + square, 0.0)) / norm
    return estimates


def reference_all_codings(matrix, shape, cfg, norm):
    tensor_candidates = candidates(shape, cfg)
    lowrank = [c for c in tensor_candidates if c.codec == "lowrank"]
    factors = factorize_range(matrix, max(c.rank for c in lowrank)) if lowrank else None
    estimates = {}
    for bits in sorted({c.bits for c in lowrank}):
        ranks = sorted({c.rank for c in lowrank if c.bits == bits})
        for rank, estimate in reference_lowrank_estimates(matrix, factors, ranks, bits, norm).items():
            estimates[(rank, bits)] = estimate
    options = []
    for candidate in tensor_candidates:
        if candidate.codec == "quant":
            coded = reference_code_quant(matrix, candidate.bits, candidate, norm)
            options.append(Option(candidate, coded.estimate, lambda coded=coded: coded))
        else:
            options.append(Option(
                candidate, estimates[(candidate.rank, candidate.bits)],
                lambda candidate=candidate: reference_code_lowrank(matrix, factors, candidate, norm),
            ))
    return options


class ReferenceV1Encoder(V1Encoder):
    """Encoder "v1" choosing from the previous implementation's estimates (:func:`reference_all_codings`)."""

    def tensor_options(self, matrix, shape, norm):
        return TensorOptions(reference_all_codings(matrix, shape, self.cfg, norm), None)


# ----------------------------------------------------------------------------- helpers


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (so -0.0 != 0.0, unlike torch.equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {torch.float32: torch.int32, torch.float64: torch.int64}.get(a.dtype)
    if width is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def _pseudo_gradients(seed: int, kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"attn.weight": (96, 160), "mlp.weight": (160, 48), "bias": (96,), "conv": (8, 6, 5),
              "small": (12, 12), "empty": (0, 5), "wide": (40, 300)}
    out = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g)
        if kind == "lowrank" and len(shape) == 2 and min(shape) > 0:
            x = 1e-3 * x + 1e-2 * (torch.randn(shape[0], 3, generator=g) @ torch.randn(3, shape[1],
                                                                                       generator=g))
        elif kind == "wide":
            x = x * torch.exp(4 * torch.randn(shape, generator=g))
        elif kind == "sparse":
            x = x * (torch.rand(shape, generator=g) < 0.05)  # mostly zeros: -0.0 and ties territory
        elif kind == "tiny":
            x = x * 1e-38
        out[name] = x.to(torch.float32)
    return out


KINDS = ("gaussian", "lowrank", "wide", "sparse", "tiny")


# ----------------------------------------------------------------------------- decode


def test_float64_lowrank_product_is_the_int64_product_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for bits, rank, m, n in ((2, 1, 5, 7), (4, 32, 128, 512), (8, 17, 40, 3), (16, 64, 64, 96)):
        limit = qmax(bits)
        for trial in range(3):
            p = torch.randint(-limit, limit + 1, (m, rank), generator=g)
            q = torch.randint(-limit, limit + 1, (n, rank), generator=g)
            w = torch.randint(0, MAX_WEIGHT + 1, (rank,), generator=g)
            if trial == 1:  # the largest magnitudes the wire allows: partial sums near 2**52
                p, q, w = torch.full_like(p, limit), torch.full_like(q, -limit), \
                    torch.full_like(w, MAX_WEIGHT)
            if trial == 2:  # zero rows: products 0 * negative = -0.0 in float64, +0 in int64
                p[::2] = 0
                q[1::3] = 0
            scale = torch.tensor(float(torch.rand((), generator=g)) * 1e-3, dtype=torch.float32)
            fast = reconstruct_lowrank(p, q, w, scale)
            assert _bits_equal(fast, reference_reconstruct_lowrank(p, q, w, scale)), (bits, rank, trial)
            as_floats = reconstruct_lowrank(p.to(torch.float64), q.to(torch.float32), w, scale)
            assert _bits_equal(as_floats, fast)
    # The bound the exact path relies on: the wire's extremes stay below 2**53.
    assert 64 * qmax(16) * MAX_WEIGHT * qmax(16) < 2**53


def test_the_product_made_a_block_of_rows_at_a_time_has_the_whole_products_bits(monkeypatch):
    """reconstruct_lowrank holds a block of rows of the float64 product at a time (issue 75): blocks of one
    row, of a few rows with a remainder, and one block give the reference's bits, on both paths."""
    g = torch.Generator().manual_seed(3)
    limit = qmax(16)
    p = torch.randint(-limit, limit + 1, (37, 5), generator=g)
    q = torch.randint(-limit, limit + 1, (11, 5), generator=g)
    w = torch.randint(0, MAX_WEIGHT + 1, (5,), generator=g)
    p[::4] = 0  # -0.0 in float64 where a zero row meets a negative factor
    scale = torch.tensor(3.7e-4, dtype=torch.float32)
    big_p = torch.full((9, 2), 2**20, dtype=torch.int64)  # beyond 2**53: the int64 path
    big_q = torch.tensor([[2**20 + 1, -(2**20)], [1, 1], [0, 0]], dtype=torch.int64)
    big_w = torch.tensor([2**14, 3], dtype=torch.int64)
    for elements in (1, 11 * 3, 50, 1 << 20):
        monkeypatch.setattr(codec_exact, "RECONSTRUCT_BLOCK_ELEMENTS", elements)
        assert _bits_equal(reconstruct_lowrank(p, q, w, scale), reference_reconstruct_lowrank(p, q, w, scale))
        big = (big_p, big_q, big_w, scale)
        assert _bits_equal(reconstruct_lowrank(*big), reference_reconstruct_lowrank(*big))


def test_a_product_beyond_2_53_takes_the_int64_path():
    p = torch.full((3, 2), 2**20, dtype=torch.int64)
    q = torch.tensor([[2**20 + 1, -(2**20)], [1, 1], [0, 0]], dtype=torch.int64)
    w = torch.tensor([2**14, 3], dtype=torch.int64)  # 2**20 * 2**14 * 2**20 = 2**54: float64 would round
    scale = torch.tensor(1.0)
    assert _bits_equal(reconstruct_lowrank(p, q, w, scale), reference_reconstruct_lowrank(p, q, w, scale))


def test_packing_matches_the_int64_reference_for_int_and_float_inputs():
    rng = np.random.default_rng(7)
    for bits in (2, 4, 8, 16):
        for count in (0, 1, 2, 3, 5, 8, 33, 1000):
            values = torch.from_numpy(rng.integers(-qmax(bits), qmax(bits) + 1, count))
            if count:
                values[0], values[-1] = -qmax(bits), qmax(bits)
            expected = reference_pack_ints(values, bits)
            assert pack_ints(values, bits) == expected
            as_float = values.to(torch.float32)
            as_float[as_float == 0] = -0.0  # round() of small negatives: packs as 0
            assert pack_ints(as_float, bits) == expected
            assert pack_ints(as_float.reshape(-1, 1), bits) == expected


def test_table_unpacking_matches_the_shift_and_mask_reference_on_any_bytes():
    rng = np.random.default_rng(1)
    for bits in (2, 4, 8, 16):
        for count in (0, 1, 2, 3, 5, 8, 33, 1000):
            size = (count * bits + 7) // 8
            for trial in range(6):
                data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                if trial == 0 and count:  # a valid payload
                    values = torch.from_numpy(rng.integers(-qmax(bits), qmax(bits) + 1, count))
                    data = pack_ints(values, bits)
                for where in ("t",):
                    try:
                        expected = reference_unpack_ints(data, bits, count, where)
                    except ContributionDecodeError as exc:
                        with pytest.raises(ContributionDecodeError) as caught:
                            unpack_ints(data, bits, count, where)
                        assert str(caught.value) == str(exc)
                        continue
                    got = unpack_ints(data, bits, count, where)
                    assert got.dtype == torch.int64 and torch.equal(got, expected)
                    for dtype, torch_dtype in ((np.float32, torch.float32), (np.float64, torch.float64)):
                        as_float = torch.from_numpy(codec_exact.unpack_array(data, bits, count, where, dtype))
                        assert _bits_equal(as_float, expected.to(torch_dtype))
        with pytest.raises(ContributionDecodeError, match="payload bytes"):
            unpack_ints(b"\x00" * 3, bits, 100, "t")


@pytest.mark.parametrize("kind", KINDS)
def test_decoder_output_matches_the_reference_decoder(kind, monkeypatch):
    x = _pseudo_gradients(11, kind)
    shapes = {name: tuple(t.shape) for name, t in x.items()}
    cfg = CompressionConfig(error_budget=0.2, bit_choices=[2, 4, 8, 16], max_rank=64, min_compress_numel=64)
    for blob in (encode_contribution(x, cfg, stage_index=0, outer_round=0)[0],
                 encode_within_bandwidth(x, cfg, 20_000, stage_index=0, outer_round=0)[0]):
        fast = decode_contribution(blob, shapes)
        with monkeypatch.context() as patched:
            patched.setattr(codec_wire, "reconstruct_lowrank",
                            lambda p, q, w, s, bound=None: reference_reconstruct_lowrank(
                                p.to(torch.int64), q.to(torch.int64), w, s))
            slow = decode_contribution(blob, shapes)
        assert all(_bits_equal(fast[name], slow[name]) for name in shapes)


def test_overflowing_scales_are_still_refused_and_large_finite_ones_accepted():
    from training.errors import ContributionNonFiniteError

    m, n, rank, bits = 4, 6, 2, 8
    entry = {"n": "w", "s": [m, n], "c": "lowrank", "b": bits, "r": rank,
             "p": pack_ints(torch.full((m, rank), 127), bits),
             "q": pack_ints(torch.full((n, rank), 127), bits),
             "w": np.array([65535, 1], dtype="<u2").tobytes()}
    for scale, finite in ((3.0e38, False), (1.0e28, True)):
        blob = pack_contribution(0, 0, [{**entry, "x": np.array([scale], dtype="<f4").tobytes()}])
        if finite:
            assert bool(torch.isfinite(decode_contribution(blob, {"w": (m, n)})["w"]).all())
        else:
            with pytest.raises(ContributionNonFiniteError, match="decodes to non-finite"):
                decode_contribution(blob, {"w": (m, n)})
    quant = {"n": "b", "s": [3], "c": "quant", "b": 8, "q": pack_ints(torch.tensor([127, 0, -3]), 8)}
    with pytest.raises(ContributionNonFiniteError, match="decodes to non-finite"):
        decode_contribution(pack_contribution(0, 0, [{**quant, "x": np.array([3e37], "<f4").tobytes()}]),
                            {"b": (3,)})
    ok = decode_contribution(pack_contribution(0, 0, [{**quant, "x": np.array([2e36], "<f4").tobytes()}]),
                             {"b": (3,)})
    assert float(ok["b"][0]) == float(np.float32(127) * np.float32(2e36))


# ----------------------------------------------------------------------------- norm


def test_norm_matches_fsum_on_varied_inputs_and_thread_counts():
    threads = torch.get_num_threads()
    try:
        for seed, kind in enumerate(KINDS):
            x = _pseudo_gradients(seed, kind)
            expected = reference_norm(x)
            for count in (1, 3):
                torch.set_num_threads(count)
                assert contribution_norm(x) == expected, kind
    finally:
        torch.set_num_threads(threads)


def test_norm_rounding_that_needs_more_than_one_level():
    # 1 + 2**-54 + 2**-54 = 1 + 2**-53: exactly half-way between 1 and the next double, so the first
    # level's remainder bound straddles the rounding boundary and the exact fallback must decide.
    tensors = {"a": torch.tensor([1.0, 2.0**-27, 2.0**-27])}
    assert contribution_norm(tensors) == reference_norm(tensors) == 1.0
    # Just above the half-way point: rounds up.
    tensors = {"a": torch.tensor([1.0, 2.0**-27, 2.0**-27, 2.0**-60])}
    assert contribution_norm(tensors) == reference_norm(tensors) == math.sqrt(1 + 2.0**-52)
    g = torch.Generator().manual_seed(9)
    for trial in range(40):
        # Many values around 2**-27 next to a 1: the total sits near the boundaries of 1's ulp.
        count = int(torch.randint(1, 200, (1,), generator=g))
        small = torch.ldexp(torch.ones(count), torch.randint(-40, -26, (count,), generator=g).to(torch.int32))
        tensors = {"a": torch.cat([torch.ones(1 + trial % 3), small]).to(torch.float32)}
        assert contribution_norm(tensors) == reference_norm(tensors), trial


def test_blocked_norm_matches_the_level_norm_across_blocks_and_tensors(monkeypatch):
    """The one-pass norm (cache-sized blocks filled across tensor boundaries) gives the level routine's
    double."""
    from training import robust

    g = torch.Generator().manual_seed(17)
    for trial in range(6):
        sizes = [int(s) for s in torch.randint(1, 3000, (int(torch.randint(1, 40, (1,), generator=g)),),
                                               generator=g)]
        scales = torch.logspace(-30, 10, 9)[torch.randint(0, 9, (len(sizes),), generator=g)]
        tensors = {f"t{i:02d}": torch.randn(size, generator=g) * float(scale)
                   for i, (size, scale) in enumerate(zip(sizes, scales))}
        tensors["zero"] = torch.zeros(5)
        arrays = [tensors[n].reshape(-1).numpy() for n in sorted(tensors)]
        count = sum(a.size for a in arrays)
        expected = robust._levels_norm(arrays, count)
        assert expected == reference_norm(tensors)
        for block in (7, 1000, 1 << 15):  # blocks far smaller than, around and larger than the tensors
            monkeypatch.setattr(robust, "_CHUNK", block)
            assert contribution_norm(tensors) == expected, (trial, block)
    assert math.isnan(contribution_norm({"a": torch.tensor([1.0, float("nan")]), "b": torch.ones(3)}))
    assert contribution_norm({"a": torch.tensor([1.0, float("-inf")])}) == math.inf
    assert contribution_norm({"a": torch.tensor([-0.0, 0.0])}) == 0.0


# ----------------------------------------------------------------------------- encode


def _check_encoders_against_references(kind, configs, budgets, monkeypatch):
    x = _pseudo_gradients(21, kind)
    for cfg in configs:
        for budget in budgets:
            fast_blob, fast_decoded, _ = encode_within_bandwidth(x, cfg, budget, stage_index=1, outer_round=3)
            slow_blob, slow_decoded, _ = ReferenceV1Encoder(cfg).encode_within(x, budget, stage_index=1,
                                                                              outer_round=3)
            assert fast_blob == slow_blob, (kind, cfg.error_budget, budget)
            assert all(_bits_equal(fast_decoded[n], slow_decoded[n]) for n in x)
        # The error-budget encoder shares the quantizer across bit widths now; its reference is the
        # one-quantization-per-candidate code path.
        fast_blob, fast_decoded, _ = encode_contribution(x, cfg, stage_index=0, outer_round=0)
        with monkeypatch.context() as patched:
            patched.setattr(base, "code_quant",
                            lambda matrix, bits, candidate, norm, quantizer=None: reference_code_quant(
                                matrix, bits, candidate, norm))
            slow_blob, slow_decoded, _ = encode_contribution(x, cfg, stage_index=0, outer_round=0)
        assert fast_blob == slow_blob
        assert all(_bits_equal(fast_decoded[n], slow_decoded[n]) for n in x)


# Encoder "v1": the references above are v1's previous estimates and error-budget coding.
_DEFAULT_CODEC = CompressionConfig(error_budget=0.4, bit_choices=[2, 4, 8], max_rank=32,
                                   min_compress_numel=256, encoder="v1")
_FINE_CODEC = CompressionConfig(error_budget=0.05, bit_choices=[4, 8, 16], max_rank=64, min_compress_numel=64,
                                encoder="v1")


@pytest.mark.parametrize("kind", KINDS)
def test_encoders_give_the_reference_bytes_and_decoded_values(kind, monkeypatch):
    _check_encoders_against_references(kind, (_DEFAULT_CODEC,), (2_000, 60_000), monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_encoders_give_the_reference_bytes_on_more_budgets_and_codecs(kind, monkeypatch):
    _check_encoders_against_references(kind, (_DEFAULT_CODEC, _FINE_CODEC), (2_000, 12_000, 60_000),
                                       monkeypatch)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_writing_into_its_temporaries_gives_the_reference_bits(nesterov):
    generator = torch.Generator().manual_seed(3)
    shapes = {"a": (64, 48), "b": (300,), "c": (7, 5, 3)}

    def tensors(scale):
        out = {name: scale * torch.randn(shape, generator=generator) for name, shape in shapes.items()}
        out["b"][:10] = -0.0  # signed zeros reach the hash
        out["c"][0] = 3.0e38  # overflow to inf in the products
        return out

    weights, momentum, delta = tensors(1.0), tensors(0.1), tensors(0.01)
    momentum["b"][10:20] = 0.0
    delta["b"][10:20] = -0.0
    cfg = DilocoConfig(outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    got_weights, got_momentum = outer_step(weights, momentum, delta, cfg)
    want_weights, want_momentum = reference_outer_step(weights, momentum, delta, 0.9, 0.7, nesterov)
    for name in shapes:
        assert _bits_equal(got_weights[name], want_weights[name]), name
        assert _bits_equal(got_momentum[name], want_momentum[name]), name
    assert got_momentum["a"] is not momentum["a"] and not torch.equal(weights["a"], got_weights["a"])


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_average_writing_into_its_sum_gives_the_reference_bits(count):
    generator = torch.Generator().manual_seed(count)
    decoded = [{"a": torch.randn(40, 30, generator=generator), "b": torch.randn(17, generator=generator)}
               for _ in range(count)]
    decoded[0]["b"][:4] = -0.0
    want = {}
    for name in decoded[0]:
        total = decoded[0][name]
        for contribution in decoded[1:]:
            total = torch.add(total, contribution[name])
        want[name] = torch.div(total, torch.tensor(float(count), dtype=torch.float32))
    before = [{name: value.clone() for name, value in contribution.items()} for contribution in decoded]
    got = average_contributions(decoded)
    for name in want:
        assert _bits_equal(got[name], want[name]), name
    for contribution, kept in zip(decoded, before):  # the inputs are not written
        assert all(_bits_equal(contribution[name], kept[name]) for name in kept)
