"""The end relation (training/end_relation.py; docs/FRAUD_PROOF.md "The claim's end", "The carried state"):
the run's own encoder (a new run's codec, the reproducible codec of kernel version 3) codes each raw and quant
element exactly as the end dispute recomputes it from the round start and the end weights; a
changed end element or a payload not coded from it breaks the relation at that element; with error feedback
the relation holds only with the carried residual (why the design signs the carried state first)."""

from __future__ import annotations

import msgpack
import torch

from training.compression import ErrorFeedbackCompressor
from training.config_compression import NEW_RUN_COMPRESSION, CompressionConfig
from training.end_relation import end_relation

SHAPES = {"emb": (96, 32), "norm": (32,), "proj": (32, 48)}


def _stage(seed: int) -> tuple[dict, dict]:
    """A round start and an end whose differences span six orders of magnitude."""
    gen = torch.Generator().manual_seed(seed)
    start = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    spread = {n: torch.exp(torch.empty(s).uniform_(-7, 7, generator=gen)) for n, s in SHAPES.items()}
    end = {n: start[n] - torch.randn(s, generator=gen) * spread[n] * 1e-3 for n, s in SHAPES.items()}
    return start, end


def _compress(compressor, start, end, outer_round: int = 0) -> bytes:
    g = {n: torch.sub(start[n], end[n]) for n in SHAPES}
    return compressor.compress(g, stage_index=0, outer_round=outer_round)[0]


def _codecs(blob: bytes) -> set[str]:
    return {e["c"] for e in msgpack.unpackb(blob, raw=False)["t"]}


def test_a_new_runs_codec_codes_every_raw_and_quant_element_by_the_relation():
    start, end = _stage(1)
    quant_only = CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30)  # no low-rank tensor
    for cfg in (CompressionConfig(**NEW_RUN_COMPRESSION), quant_only, CompressionConfig(enabled=False)):
        blob = _compress(ErrorFeedbackCompressor(SHAPES, cfg, exact=3), start, end)
        relation = end_relation(start, end, blob)
        assert relation.holds, relation.broken
        assert sum(relation.checked.values()) + relation.unchecked == sum(t.numel() for t in start.values())
    assert "quant" in relation.checked or "raw" in relation.checked
    quant = end_relation(start, end, _compress(ErrorFeedbackCompressor(
        SHAPES, CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30), exact=3), start, end))
    assert quant.checked.get("quant", 0) > 0 and quant.unchecked == 0, quant
    raw = end_relation(start, end, _compress(ErrorFeedbackCompressor(SHAPES, CompressionConfig(enabled=False),
                                                                      exact=3), start, end))
    assert raw.checked == {"raw": sum(t.numel() for t in start.values())}


def test_an_end_that_is_not_the_payloads_breaks_the_relation_at_that_element():
    start, end = _stage(2)
    raw_coder = ErrorFeedbackCompressor(SHAPES, CompressionConfig(enabled=False), exact=3)
    raw_blob = _compress(raw_coder, start, end)
    moved = {n: t.clone() for n, t in end.items()}
    moved["proj"].view(-1)[77] = torch.nextafter(moved["proj"].view(-1)[77], torch.tensor(float("inf")))
    broken = end_relation(start, moved, raw_blob).broken
    assert [(name, elem) for name, elem, _ in broken] == [("proj", 77)]
    cfg = CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30)
    quant_blob = _compress(ErrorFeedbackCompressor(SHAPES, cfg, exact=3), start, end)
    entry = next(e for e in msgpack.unpackb(quant_blob, raw=False)["t"] if e["n"] == "emb")
    assert entry["c"] == "quant"
    scale = float(torch.frombuffer(bytearray(entry["x"]), dtype=torch.float32)[5])
    far = {n: t.clone() for n, t in end.items()}
    far["emb"][3, 5] -= 4 * scale  # v = S - E grows by 4 scales: its q moves (or clamps), whatever it was
    assert [(n, e) for n, e, _ in end_relation(start, far, quant_blob).broken] == [("emb", 3 * 32 + 5)]


def test_with_error_feedback_the_relation_holds_only_with_the_carried_residual():
    start, end = _stage(3)
    cfg = CompressionConfig(encoder="v2", quant_scale="mse", error_feedback=True, min_compress_numel=1 << 30)
    compressor = ErrorFeedbackCompressor(SHAPES, cfg, exact=3)
    assert end_relation(start, end, _compress(compressor, start, end)).holds  # round 0: no residual yet
    carried = {n: t.clone() for n, t in compressor.residual.items()}
    assert any(bool(t.abs().sum() > 0) for t in carried.values())
    start2, end2 = _stage(4)
    blob = _compress(compressor, start2, end2, outer_round=1)
    assert end_relation(start2, end2, blob, residual=carried).holds
    assert not end_relation(start2, end2, blob).holds  # the carried state is part of the relation
