"""The chunk commitments a fraud proof opens (training/chunks.py, ledger/chunkproof.py), without a chain."""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import numpy as np
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
        ("a", 0, 64, 1), ("a", 64, 64, 1), ("a", 128, 2, 1), ("b", 0, 64, 50), ("b", 64, 64, 50),
        ("b", 128, 22, 50)]
    assert all(p.count <= CHUNK_ELEMENTS for p in layout)


def test_tensor_leaves_hold_the_exact_bits_signed_zeros_included():
    values = {"a": torch.arange(130, dtype=torch.float32) - 64.5, "b": torch.zeros(3, 50),
              "e": torch.zeros(0)}
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


# Pinned leaves (issue 43 item 1: the leaves are built vectorised since; these digests were taken with the
# first, per-chunk implementation, so every root a chunked run ever committed stays the same). Shapes with a
# tensor shorter than a chunk, one whose columns do not divide 64 (pieces spanning rows), one whose row spans
# chunks (210 columns), an empty one and a one-element one.
PINNED_SHAPES = {"a": (130,), "b": (3, 50), "c": (2, 3, 70), "d": (64, 64), "e": (0,), "f": (5, 7), "g": (1,)}
PINNED = {  # what -> (sha256 of the length-prefixed leaves, tree root)
    "tensor": ("bf25e508fa2a35fd00ca7e79bca63914513e2f1237df6828486dc9b722fc16fa",
               "bc7bb8f8b2a91d42a6e17b5170784b41f543f09718ba05667cb9e1503ac80004"),
    ("raw", ()): ("a211d7cc61e699e6fbb08ad664df627313d76b3900e93a7faa3fd1a333536d4a",
                  "ae4385c78042f4a60b082273bedb30f378beb82e368428a66752590d5ccd45c2"),
    ("quant", (("bits", 8),)): ("b82eed59cca0ed3ec385593f45566944b9d0b5f7749f6ddda4b10c06efd369c7",
                                "f76668f19967a583ebcab65b317dbb97c3fde47ebc09e3f634427e661c202ace"),
    ("quant", (("bits", 2),)): ("6bb608191d32fa7e9bce2c165a5ee65bf45865e96be3b6b3f8c5bd0b37f0e451",
                                "86a3dec3981d14169c6b70a460440905679b4f61bb4269b5979a130aeb23cb08"),
    ("lowrank",
     (("bits", 8), ("rank", 8))): ("c4f8624d7cbce0f3731c8212ca6a70951752f2f15bb4e2908634201654d6de53",
                                   "852a80ace9ccd2d9657a20a86965808635a0b1e18baeebb3fcda4bfd7a4e538a"),
    ("lowrank",
     (("bits", 4), ("rank", 3))): ("987b03b6ea020691a43c0358a588cf256fb6b0a21d1ce6be12331df5502d60d2",
                                   "4ed8eda6ff5f72a218c16a25d0db88f8def5160b38a2e2fcc342ad3372c73f72"),
}


def _pinned_digest(leaves: list[bytes]) -> tuple[str, str]:
    joined = b"".join(len(leaf).to_bytes(4, "big") + leaf for leaf in leaves)
    return hashlib.sha256(joined).hexdigest(), tree_root(leaves).hex()


def test_tensor_leaves_and_their_root_are_pinned():
    rng = np.random.default_rng(7)
    values = {}
    for name, shape in PINNED_SHAPES.items():  # every bit pattern: NaNs, infinities, subnormals, signed zeros
        bits = rng.integers(0, 2**32, int(np.prod(shape)), dtype=np.uint64).astype(np.uint32)
        values[name] = torch.from_numpy(bits.view(np.float32).copy()).reshape(shape)
    assert _pinned_digest(tensor_leaves(values)) == PINNED["tensor"]


@pytest.mark.parametrize("what", [key for key in PINNED if key != "tensor"], ids=str)
def test_payload_pieces_and_their_root_are_pinned(what):
    codec, options = what
    blob = contribution(PINNED_SHAPES, codec, 11, **dict(options))
    assert _pinned_digest(payload_leaves(blob, PINNED_SHAPES)) == PINNED[what]


@pytest.mark.parametrize("cut", [1, 3, 2048])
@pytest.mark.parametrize("what", [key for key in PINNED if key != "tensor"], ids=str)
def test_payload_pieces_cut_a_few_chunks_at_a_time_are_the_pinned_pieces(what, cut, monkeypatch):
    """training.chunks.CutPayload read in order cuts ``_CUT_CHUNKS`` chunks at a time (2048 since issue 75,
    16384 before): every block size gives the pinned pieces, in order, and the same one by index."""
    from training.chunks import payload_pieces

    monkeypatch.setattr("training.chunks._CUT_CHUNKS", cut)
    codec, options = what
    blob = contribution(PINNED_SHAPES, codec, 11, **dict(options))
    pieces = payload_pieces(blob, PINNED_SHAPES)
    assert _pinned_digest(list(pieces)) == PINNED[what]
    assert [pieces[i] for i in range(len(pieces))] == list(pieces)


@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("seed", range(4))
def test_the_vectorized_chunk_square_sums_are_square_sums_chunk_by_chunk(seed, block, monkeypatch):
    """node.fraudproof.chunk_square_sums (numpy, a block of chunks at a time) gives
    ledger.normproof.square_sum's exact integers for every chunk: values of every exponent, subnormals,
    signed zeros, the largest finite, short last chunks, tensors in name order, each tensor in one block or
    (block = 128 elements) in many; a non-finite value is refused as square_sum refuses it."""
    from ledger.normproof import square_sum
    from node.fraudproof import chunk_square_sums

    if block is not None:
        monkeypatch.setattr("node.fraudproof._BLOCK_ELEMENTS", block)

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    values = raw[(raw >> 23 & 0xFF) != 0xFF][:3000].view(np.float32).copy()  # every finite bit pattern
    values[:12] = [0.0, -0.0, 2**-149, -(2**-149), 2**-126, 1.1754942e-38, 3.4028235e38, -3.4028235e38, 1.0,
                   -2.5, 1e-40, 65504.0]
    values[100:164] = 3.4028235e38  # a whole chunk at the largest square
    tensors = {"b": torch.from_numpy(values[:1000].reshape(10, 100)),
               "a": torch.from_numpy(values[1000:2930]), "c": torch.from_numpy(values[2930:2931]),
               "e": torch.zeros(0)}
    places = stage_layout({name: tuple(t.shape) for name, t in tensors.items()})
    expected = [square_sum(tensors[p.name].reshape(-1)[p.offset:p.offset + p.count].numpy().astype(
        "<f4").tobytes())
                for p in places]
    assert chunk_square_sums(tensors) == expected and len(expected) == 31 + 16 + 1
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(LedgerInputError, match="non-finite"):
            chunk_square_sums({"a": torch.tensor([1.0, bad])})
