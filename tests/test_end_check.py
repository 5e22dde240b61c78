"""The node's own end check before it claims (node/live/fraud/endcheck.py; docs/FRAUD_PROOF.md "The node
defends its contributions") against the reference end relation (training/end_relation.py, which the contract's
``endHolds`` refuses element for element: tests/test_end_relation_chain.py).

On random stages coded by the run's encoder, raw and quant at 2, 4 and 8 bits: from the honest end every
element holds under the bit width the node names from the pieces alone (the encoder's wherever an element is
clamped, and never above it); from an end moved at nine elements the node's broken set is exactly the
reference's under the encoder's width; a low-rank piece codes nothing.
"""

from __future__ import annotations

import pytest
import torch

from ledger.stepproof import origin_leaf
from node.live.fraud.endcheck import end_breaks, piece_bits
from tests.test_end_relation_chain import SHAPES, _coder, _moved, _stage
from training.chunks import payload_leaves, stage_layout
from training.config_compression import CompressionConfig
from training.compression import ErrorFeedbackCompressor
from training.end_relation import end_relation

NAMES = sorted(SHAPES, key=lambda n: n.encode())  # the stage's tensor order: state tensor q is tensor q


def _origins() -> list[bytes]:
    places = stage_layout(SHAPES)
    first = {p.tensor: p.index for p in reversed(places)}
    return [origin_leaf(q, torch.Size(SHAPES[n]).numel(), first[q], len(places)) for q, n in enumerate(NAMES)]


def _flat(tensors: dict) -> list[torch.Tensor]:
    return [tensors[n].reshape(-1) for n in NAMES]


@pytest.mark.parametrize("codec,bits", [("raw", 0), ("quant", 2), ("quant", 4), ("quant", 8)])
def test_the_nodes_check_is_the_reference_relation(codec, bits):
    start, end = _stage(30 + bits)
    blob = _coder(codec, bits).compress({n: torch.sub(start[n], end[n]) for n in SHAPES}, stage_index=0,
                                        outer_round=1)[0]
    pieces = payload_leaves(blob, SHAPES, stage_index=0, outer_round=1)
    origins = _origins()
    named = piece_bits(pieces, origins)
    assert all(0 < b <= bits for b in named) if bits else named == [0, 0, 0]
    assert end_breaks(_flat(start), _flat(end), pieces, origins, named, limit=10**6) == []
    moved = _moved(end, 40 + bits)
    reference = end_relation(start, moved, blob, limit=10**6)
    assert not reference.holds
    mine = end_breaks(_flat(start), _flat(moved), pieces, origins, [bits] * 3, limit=10**6)
    assert {(NAMES[q], elem) for q, elem, _why in mine} == {(n, elem) for n, elem, _ in reference.broken}


def test_a_low_rank_piece_codes_nothing():
    start, end = _stage(50)
    cfg = CompressionConfig(min_compress_numel=1, error_feedback=False, bit_choices=[8], error_budget=0.9)
    blob = ErrorFeedbackCompressor(SHAPES, cfg, exact=3).compress(
        {n: torch.sub(start[n], end[n]) for n in SHAPES}, stage_index=0, outer_round=1)[0]
    pieces = payload_leaves(blob, SHAPES, stage_index=0, outer_round=1)
    tags = {bytes(p)[0] for p in pieces}
    assert 2 in tags  # some tensor coded low-rank
    origins = _origins()
    broken = end_breaks(_flat(start), _flat(end), pieces, origins, piece_bits(pieces, origins), limit=10**6)
    assert any("codes no element" in why for _q, _e, why in broken)
