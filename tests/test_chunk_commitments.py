"""The chunk commitments a fraud proof opens (training/chunks.py, ledger/chunkproof.py), without a chain."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from ledger.chunkproof import Factors, StageLeaf, chunked_weights_root, tree_path, tree_root
from ledger.errors import LedgerInputError
from ledger.merkle import merkle_proof, verify_proof
from tests.fraud_fixtures import contribution
from training.chunks import CHUNK_ELEMENTS, leaf_values, payload_leaves, stage_layout, tensor_leaves
from training.errors import ContributionDecodeError

SHAPES = {"b": (3, 50), "a": (130,), "e": (0,)}


def test_the_layout_cuts_each_tensor_in_name_order_and_skips_empty_ones():
    layout = stage_layout(SHAPES)
    assert [(p.name, p.offset, p.count, p.cols) for p in layout] == [
        ("a", 0, 64, 1), ("a", 64, 64, 1), ("a", 128, 2, 1), ("b", 0, 64, 50), ("b", 64, 64, 50), ("b", 128, 22, 50)]
    assert all(p.count <= CHUNK_ELEMENTS for p in layout)


def test_tensor_leaves_hold_the_exact_bits_signed_zeros_included():
    values = {"a": torch.arange(130, dtype=torch.float32) - 64.5, "b": torch.zeros(3, 50), "e": torch.zeros(0)}
    values["b"][0, 1] = -0.0
    leaves = tensor_leaves(values)
    header, bits = leaf_values(leaves[3])
    assert header == (1, 0, 50, 64)
    assert bits[1] == 0x80000000 and bits[0] == 0  # -0.0 and 0.0 are different leaves' bits
    assert struct.unpack(">f", struct.pack(">I", leaf_values(leaves[0])[1][0]))[0] == -64.5
    root = tree_root(leaves)
    for index, leaf in enumerate(leaves):  # the path is ledger/merkle.py's, its sides left to the index
        proof = merkle_proof(leaves, index)
        assert tree_path(leaves, index) == [sibling for sibling, _left in proof]
        assert verify_proof(leaf, proof, root) and not verify_proof(leaves[index - 1], proof, root)


def test_pieces_of_a_contribution_that_does_not_decode_are_refused():
    blob = contribution(SHAPES, "quant", 1)
    assert len(payload_leaves(blob, SHAPES)) == len(stage_layout(SHAPES))
    with pytest.raises(ContributionDecodeError):
        payload_leaves(blob[:-3], SHAPES)
    with pytest.raises(ContributionDecodeError):
        payload_leaves(blob, {**SHAPES, "b": (3, 51)})


def test_the_stage_leaves_must_come_in_stage_order():
    leaf = StageLeaf(1, 0, bytes(32), bytes(32), Factors(0, 0, True, (), (), ()).digest())
    with pytest.raises(LedgerInputError):
        chunked_weights_root([leaf])
    assert StageLeaf.decode(leaf.encode()) == leaf
    with pytest.raises(LedgerInputError):
        Factors(0, 0, True, (bytes(32),), (), ())


def test_a_node_finds_the_first_differing_chunk_and_builds_its_proof():
    from node.fraudproof import proof_of_difference
    from tests.fraud_fixtures import changed, honest_chain
    from tests.ledger_fixtures import make_record

    prev, mine = honest_chain(0), honest_chain(1)
    records = [make_record(1, 0, bytes(32)), make_record(1, 1, bytes(32))]
    assert proof_of_difference(*records, [prev.leaf()], [mine.leaf()], prev, mine, mine)[0] is None
    wrong = changed(mine, 1, 3)
    proof, why = proof_of_difference(*records, [prev.leaf()], [wrong.leaf()], prev, mine, wrong)
    assert why == "chunk 1" and proof.chunk == 1 and proof.new_weights == wrong.weight_leaves[1]
    other = Factors(mine.factors.lr_bits + 1, *dataclasses.astuple(mine.factors)[1:])
    proof, why = proof_of_difference(*records, [prev.leaf()], [wrong.leaf()], prev, mine,
                                     dataclasses.replace(wrong, factors=other))
    assert proof is None and "not provable" in why
