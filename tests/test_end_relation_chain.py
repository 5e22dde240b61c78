"""The contract's end check agrees with the reference (issue 78, docs/FRAUD_PROOF.md "The claim's end"):
StepProverMath.endHolds, what StepProver.proveEnd checks for one element (``v = fl(S - E)``; raw: the piece's
element is ``v``; quant: ``clamp(rne(fl(v / max(s, tiny))), -qmax(b), qmax(b))``), gives on every element of
random stages the verdict training/end_relation.py gives, for the run's own encoder's raw and quant codings
(2, 4 and 8 bits, "mse" scales), from the honest end and from ends moved at a few elements; and its rounding
(``rne``, ties to even, clamped) and its NaNs are torch's."""

from __future__ import annotations

import math

import pytest
import torch

from ledger.chain import connect_pyevm
from tests.ledger_fixtures import deploy_library, fresh_anvil_w3
from training.chunks import payload_leaves, stage_layout
from training.compression import ErrorFeedbackCompressor
from training.config_compression import NEW_RUN_COMPRESSION, CompressionConfig
from training.end_relation import end_relation

SHAPES = {"emb": (24, 16), "norm": (16,), "proj": (16, 12)}


def _math(w3):
    """StepProverMath deployed on ``w3`` (its pure functions are called directly)."""
    return deploy_library(w3, "StepProverMath")


def _bits(x: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in x.contiguous().view(torch.int32).reshape(-1).tolist()]


def _stage(seed: int) -> tuple[dict, dict]:
    """A start and an end whose differences span six orders of magnitude, some elements unchanged."""
    gen = torch.Generator().manual_seed(seed)
    start = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    end = {}
    for n, s in SHAPES.items():
        spread = torch.exp(torch.empty(s).uniform_(-7, 7, generator=gen))
        moved = start[n] - torch.randn(s, generator=gen) * spread * 1e-3
        end[n] = torch.where(torch.rand(s, generator=gen) < 0.05, start[n], moved)
    return start, end


def _coder(codec: str, bits: int = 0) -> ErrorFeedbackCompressor:
    if codec == "raw":
        return ErrorFeedbackCompressor(SHAPES, CompressionConfig(enabled=False), exact=3)
    cfg = CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30, bit_choices=[bits])
    return ErrorFeedbackCompressor(SHAPES, cfg, exact=3)


def _moved(end: dict, seed: int) -> dict:
    """``end`` with a few elements moved: one ulp, a thousandth, and far."""
    gen = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in end.items()}
    for n, t in out.items():
        flat = t.view(-1)
        for i, k in enumerate(torch.randint(0, flat.numel(), (3,), generator=gen).tolist()):
            x = flat[k]
            flat[k] = (torch.nextafter(x, torch.tensor(math.inf)), x * 1.001 + 1e-6, x - 10.0)[i]
    return out


def _chain_verdicts(math_lib, start: dict, end: dict, blob: bytes, bits: int) -> set[tuple[str, int]]:
    """The elements the contract's endHolds refuses."""
    pieces = payload_leaves(blob, SHAPES, stage_index=0, outer_round=1)
    first = {}
    for place in stage_layout(SHAPES):
        first.setdefault(place.name, place.index)
    asked = []
    for name in sorted(SHAPES, key=lambda n: n.encode()):
        s_bits, e_bits = _bits(start[name]), _bits(end[name])
        asked += [(name, elem, pieces[first[name] + elem // 64], s_bits[elem], e_bits[elem])
                  for elem in range(len(s_bits))]
    broken = set()
    w3 = math_lib.w3
    for at in range(0, len(asked), 256):  # one JSON-RPC batch of eth_calls
        part = asked[at:at + 256]
        with w3.batch_requests() as batch:
            for _name, elem, piece, s, e in part:
                batch.add(math_lib.functions.endHolds(piece, elem % 64, s, e, bits))
            answers = batch.execute()
        broken |= {(name, elem) for (name, elem, *_), holds in zip(part, answers) if not holds}
    return broken


@pytest.mark.parametrize("codec,bits", [("raw", 0), ("quant", 2),
                                        pytest.param("quant", 4, marks=pytest.mark.slow),
                                        pytest.param("quant", 8, marks=pytest.mark.slow)])
def test_the_contracts_end_check_agrees_with_the_reference_on_random_stages(request, codec, bits):
    w3 = fresh_anvil_w3(request, timeout=60.0)
    math_lib = _math(w3)
    start, end = _stage(10 + bits)
    blob = _coder(codec, bits).compress({n: torch.sub(start[n], end[n]) for n in SHAPES}, stage_index=0,
                                        outer_round=1)[0]
    total = sum(t.numel() for t in start.values())
    for label, ends in (("honest", end), ("moved", _moved(end, 20 + bits))):
        reference = end_relation(start, ends, blob, limit=total)
        assert reference.unchecked == 0
        expected = {(n, e) for n, e, _ in reference.broken}
        assert _chain_verdicts(math_lib, start, ends, blob, bits) == expected, label
        assert (label == "honest") == (not expected)


def test_rounding_clamping_and_nans_are_torchs(request):
    lib = _math(connect_pyevm())
    values = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 0.50000006, 126.5, 127.5, 128.0,
                           -1e30, math.inf, -math.inf, 2.0**23, 2.0**23 + 2, 1e-45, -0.0, 3.4e38],
                          dtype=torch.float32)
    for limit in (1, 7, 127, 32767):
        expected = torch.clamp(torch.round(values), -limit, limit).to(torch.int64).tolist()
        assert [lib.functions.rne(b, limit).call() for b in _bits(values)] == expected, limit
    nan, one, two = 0x7FC00000, 0x3F800000, 0x40000000
    raw = bytes([0]) + (2).to_bytes(4, "big")
    # raw: a NaN element agrees with a NaN target (any NaN, as the aggregation proof's same32), not a number
    assert lib.functions.endHolds(raw + (0x7FC00001).to_bytes(4, "big") * 2, 1, nan, one, 0).call()
    assert not lib.functions.endHolds(raw + one.to_bytes(4, "big") * 2, 1, nan, one, 0).call()
    assert not lib.functions.endHolds(raw + nan.to_bytes(4, "big") * 2, 1, two, one, 0).call()
    assert lib.functions.endHolds(raw + one.to_bytes(4, "big") * 2, 1, two, one, 0).call()
    # quant: a NaN target codes no integer (an honest encoder refuses a non-finite one); a zero scale: tiny
    quant = bytes([1]) + (1).to_bytes(4, "big") + (1).to_bytes(2, "big")
    assert not lib.functions.endHolds(quant + one.to_bytes(4, "big"), 0, nan, one, 8).call()
    assert lib.functions.endHolds(quant + one.to_bytes(4, "big"), 0, two, one, 8).call()
    assert lib.functions.endHolds(quant + bytes(4), 0, two, one, 2).call()  # 1 / tiny clamps to qmax(2) = 1
    assert not lib.functions.endHolds(quant + bytes(4), 0, two, one, 8).call()  # qmax(8) = 127, not 1
    # a low-rank piece, a position past the piece and a bit width past 16 code nothing
    assert not lib.functions.endHolds(bytes([2]) + (1).to_bytes(4, "big") + bytes(6), 0, two, one, 8).call()
    assert not lib.functions.endHolds(raw + one.to_bytes(4, "big") * 2, 2, two, one, 0).call()
    assert not lib.functions.endHolds(quant + one.to_bytes(4, "big"), 0, two, one, 17).call()
