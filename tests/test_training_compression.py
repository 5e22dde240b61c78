"""Codec of pseudo-gradients: error budget, bit-exact decode, error feedback, strict decoding."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from training.codec_wire import decode_contribution
from training.codec_exact import pack_ints, qmax, unpack_ints
from training.compression import ErrorFeedbackCompressor, encode_contribution
from training.config_compression import CompressionConfig
from training.errors import ContributionDecodeError, ContributionEncodeError


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    low_rank = torch.randn(96, 3, generator=g) @ torch.randn(3, 80, generator=g)
    return {
        "h.0.attn.weight": low_rank + 0.05 * torch.randn(96, 80, generator=g),  # lowrank-eligible
        "h.0.mlp.weight": torch.randn(64, 128, generator=g),  # full rank noise
        "h.0.ln.bias": torch.randn(80, generator=g),  # 1-D: quantized only
        "h.0.small.weight": torch.randn(8, 12, generator=g),  # below min_compress_numel
        "h.0.conv.weight": torch.randn(16, 4, 8, generator=g),  # 3-D: viewed as 16 x 32
    }


def _shapes(tensors):
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(a.double()))


@pytest.mark.parametrize("budget", [0.05, 0.2, 0.5])
def test_error_budget_is_honoured_and_decode_is_bit_exact(budget):
    tensors = _tensors()
    cfg = CompressionConfig(error_budget=budget, bit_choices=[2, 4, 8], max_rank=16, min_compress_numel=1024)
    blob, decoded, stats = encode_contribution(tensors, cfg, stage_index=1, outer_round=7)
    again = decode_contribution(blob, _shapes(tensors), stage_index=1, outer_round=7)
    for name, tensor in tensors.items():
        assert again[name].dtype == torch.float32
        assert torch.equal(again[name], decoded[name]), name  # decoder == encoder's reconstruction
        assert _rel(tensor, again[name]) <= budget + 1e-9, name
    by_name = {t.name: t for t in stats.tensors}
    assert all(t.met_budget for t in stats.tensors)
    assert by_name["h.0.ln.bias"].codec == "quant"
    assert by_name["h.0.small.weight"].codec == "quant"
    assert stats.encoded_bytes == len(blob)
    assert stats.raw_bytes == 4 * sum(t.numel() for t in tensors.values())
    assert stats.ratio > 1


def test_low_rank_is_chosen_for_a_low_rank_tensor():
    g = torch.Generator().manual_seed(3)
    tensor = torch.randn(128, 2, generator=g) @ torch.randn(2, 96, generator=g)
    cfg = CompressionConfig(error_budget=0.1, bit_choices=[2, 4, 8], max_rank=16)
    _, decoded, stats = encode_contribution({"w": tensor}, cfg, stage_index=0, outer_round=0)
    (chosen,) = stats.tensors
    assert chosen.codec == "lowrank" and chosen.rank <= 2
    assert _rel(tensor, decoded["w"]) <= 0.1
    assert stats.ratio > 20


def test_cheapest_candidate_meeting_the_budget_wins():
    # A loose budget must never cost more bytes than a tight one.
    tensors = _tensors(1)
    sizes = []
    for budget in (0.05, 0.2, 0.6):
        cfg = CompressionConfig(error_budget=budget, min_compress_numel=1024)
        sizes.append(encode_contribution(tensors, cfg, stage_index=0, outer_round=0)[2].encoded_bytes)
    assert sizes[0] > sizes[1] >= sizes[2]


def test_unreachable_budget_falls_back_to_the_most_accurate_option():
    tensor = torch.randn(40, 40, generator=torch.Generator().manual_seed(5))
    cfg = CompressionConfig(error_budget=0.001, bit_choices=[2, 4], min_compress_numel=1)
    _, decoded, stats = encode_contribution({"w": tensor}, cfg, stage_index=0, outer_round=0)
    (chosen,) = stats.tensors
    assert not chosen.met_budget
    assert (chosen.codec, chosen.bits) == ("quant", 4)  # full-resolution 4-bit beats every low-rank option
    assert math.isclose(chosen.rel_error, _rel(tensor, decoded["w"]), rel_tol=1e-6)


def test_encoding_is_deterministic_and_handles_zero_tensors():
    tensors = dict(_tensors(2), zero=torch.zeros(64, 64))
    cfg = CompressionConfig(min_compress_numel=1024)
    first = encode_contribution(tensors, cfg, stage_index=0, outer_round=3)[0]
    second = encode_contribution(tensors, cfg, stage_index=0, outer_round=3)[0]
    assert first == second
    assert torch.equal(decode_contribution(first, _shapes(tensors))["zero"], torch.zeros(64, 64))


def test_disabled_compression_is_lossless():
    tensors = _tensors(4)
    cfg = CompressionConfig(enabled=False)
    blob, _, stats = encode_contribution(tensors, cfg, stage_index=0, outer_round=0)
    decoded = decode_contribution(blob, _shapes(tensors))
    assert all(torch.equal(decoded[n], t) for n, t in tensors.items())
    assert {t.codec for t in stats.tensors} == {"raw"}


def test_non_finite_pseudo_gradient_is_refused():
    with pytest.raises(ContributionEncodeError):
        encode_contribution({"w": torch.tensor([1.0, float("nan")])}, CompressionConfig(), stage_index=0,
                            outer_round=0)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_bit_packing_round_trips(bits):
    limit = qmax(bits)
    values = torch.randint(-limit, limit + 1, (37,), generator=torch.Generator().manual_seed(bits))
    packed = pack_ints(values, bits)
    assert len(packed) == (37 * bits + 7) // 8
    assert torch.equal(unpack_ints(packed, bits, 37, "t"), values)


def test_error_feedback_makes_decoded_sum_track_the_input_sum():
    shapes = {"w": (64, 48), "b": (48,)}
    cfg = CompressionConfig(error_budget=0.6, bit_choices=[2], max_rank=1, min_compress_numel=1)
    with_feedback = ErrorFeedbackCompressor(shapes, cfg)
    without = ErrorFeedbackCompressor(shapes, CompressionConfig(**{**cfg.__dict__, "error_feedback": False}))
    g = torch.Generator().manual_seed(11)
    # A persistent signal plus noise, as pseudo-gradients of consecutive rounds are.
    signal = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    total_in = {n: torch.zeros(s) for n, s in shapes.items()}
    total_fb = {n: torch.zeros(s) for n, s in shapes.items()}
    total_nofb = {n: torch.zeros(s) for n, s in shapes.items()}
    for outer_round in range(30):
        grads = {n: signal[n] + 0.5 * torch.randn(s, generator=g) for n, s in shapes.items()}
        for compressor, total in ((with_feedback, total_fb), (without, total_nofb)):
            blob, _ = compressor.compress(grads, stage_index=0, outer_round=outer_round)
            decoded = decode_contribution(blob, shapes)
            for n in shapes:
                total[n] += decoded[n]
        for n in shapes:
            total_in[n] += grads[n]
    for n in shapes:
        # Telescoping: sum of decoded = sum of inputs - last residual.
        assert torch.allclose(total_fb[n] + with_feedback.residual[n], total_in[n], atol=1e-3)
        assert _rel(total_in[n], total_fb[n]) < 0.1
        assert _rel(total_in[n], total_fb[n]) < 0.5 * _rel(total_in[n], total_nofb[n])


# --------------------------------------------------------------------------- strict decoding


def _valid():
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(48, 2, generator=g) @ torch.randn(2, 40, generator=g),
               "b": torch.randn(5, generator=g)}
    cfg = CompressionConfig(error_budget=0.3, min_compress_numel=1)
    blob, _, stats = encode_contribution(tensors, cfg, stage_index=2, outer_round=4)
    assert [t.codec for t in stats.tensors] == ["lowrank", "quant"]
    return blob, _shapes(tensors)


def _mutate(blob: bytes, change) -> bytes:
    message = msgpack.unpackb(blob, raw=False)
    change(message)
    return msgpack.packb(message, use_bin_type=True)


def _lowrank_entry(message):
    return next(e for e in message["t"] if e["c"] == "lowrank")


def _set_max_value(message):
    entry = _lowrank_entry(message)
    entry["b"] = 2
    count = len(entry["p"])
    entry["p"] = bytes([0xFF]) * count  # every 2-bit value is 3, one above 2 * qmax(2)


MUTATIONS = {
    "version": lambda m: m.update(v=2),
    "stage": lambda m: m.update(st=3),
    "round": lambda m: m.update(rd=5),
    "bool_round": lambda m: m.update(rd=True),
    "extra_key": lambda m: m.update(zz=1),
    "missing_tensor": lambda m: m["t"].pop(),
    "extra_tensor": lambda m: m["t"].append(m["t"][-1]),
    "swapped_order": lambda m: m["t"].reverse(),
    "wrong_shape": lambda m: m["t"][0].update(s=[40, 48]),
    "unknown_codec": lambda m: m["t"][0].update(c="zip"),
    "bad_bits": lambda m: m["t"][0].update(b=3),
    "truncated_payload": lambda m: _lowrank_entry(m).update(p=_lowrank_entry(m)["p"][:-1]),
    "rank_too_big": lambda m: _lowrank_entry(m).update(r=1000),
    "weights_length": lambda m: _lowrank_entry(m).update(w=b"\x00"),
    "nan_scale": lambda m: m["t"][1].update(x=b"\x00\x00\xc0\x7f" * 5),
    "negative_scale": lambda m: m["t"][1].update(x=b"\x00\x00\x80\xbf" * 5),
    "out_of_range_ints": _set_max_value,
    "overflowing_scale": lambda m: m["t"][1].update(x=b"\xff\xff\x7f\x7f" * 5),  # 3.4e38 * q -> inf
    "entry_not_map": lambda m: m["t"].__setitem__(0, [1, 2]),
    "name_type": lambda m: m["t"][0].update(n=7),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_malformed_contributions_raise_decode_error(mutation):
    blob, shapes = _valid()
    decode_contribution(blob, shapes, stage_index=2, outer_round=4)  # the unmutated one is fine
    bad = _mutate(blob, MUTATIONS[mutation])
    with pytest.raises(ContributionDecodeError):
        decode_contribution(bad, shapes, stage_index=2, outer_round=4)


@pytest.mark.parametrize(
    "bad",
    [b"", b"\xc1", b"\x92\x01", b"garbage" * 10, msgpack.packb([1, 2, 3]), "not bytes", None],
)
def test_garbage_raises_decode_error(bad):
    _, shapes = _valid()
    with pytest.raises(ContributionDecodeError):
        decode_contribution(bad, shapes)


def test_truncated_and_oversized_input_raise_decode_error():
    blob, shapes = _valid()
    for cut in (1, len(blob) // 2, len(blob) - 1):
        with pytest.raises(ContributionDecodeError):
            decode_contribution(blob[:cut], shapes)
    with pytest.raises(ContributionDecodeError):
        decode_contribution(blob + b"\x00", shapes)  # trailing bytes
    with pytest.raises(ContributionDecodeError):
        decode_contribution(b"\x00" * 10_000_000, shapes)
