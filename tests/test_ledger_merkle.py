"""The contributions Merkle tree: fixed definition, order sensitivity, proofs."""

from __future__ import annotations

import hashlib

import pytest

from ledger.errors import LedgerInputError
from ledger.merkle import EMPTY_ROOT, inner_hash, leaf_hash, merkle_proof, merkle_root, verify_proof


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_definition_by_hand():
    a, b, c = b"alpha", b"beta", b"gamma"
    assert merkle_root([]) == EMPTY_ROOT == sha(b"")
    assert merkle_root([a]) == leaf_hash(a) == sha(b"\x00" + a)
    assert (
        merkle_root([a, b])
        == inner_hash(leaf_hash(a), leaf_hash(b))
        == sha(b"\x01" + sha(b"\x00" + a) + sha(b"\x00" + b))
    )
    # Three leaves: the odd last node is promoted unchanged, not paired with itself.
    assert merkle_root([a, b, c]) == inner_hash(inner_hash(leaf_hash(a), leaf_hash(b)), leaf_hash(c))
    assert merkle_root([a, b, c]) != merkle_root([a, b, c, c])


def test_order_matters_and_leaves_are_not_inner_nodes():
    leaves = [bytes([i]) * 8 for i in range(5)]
    assert merkle_root(leaves) != merkle_root(list(reversed(leaves)))
    two = [b"x", b"y"]
    # A leaf whose bytes equal an inner node's preimage does not collide thanks to the domain prefixes.
    assert merkle_root([leaf_hash(b"x") + leaf_hash(b"y")]) != merkle_root(two)


@pytest.mark.parametrize("count", range(1, 10))
def test_every_proof_verifies_and_tampering_fails(count):
    leaves = [f"contribution-{i}".encode() for i in range(count)]
    root = merkle_root(leaves)
    for index, leaf in enumerate(leaves):
        proof = merkle_proof(leaves, index)
        assert verify_proof(leaf, proof, root)
        assert not verify_proof(leaf + b"!", proof, root)
        if proof:
            sibling, is_left = proof[0]
            assert not verify_proof(leaf, [(sibling, not is_left), *proof[1:]], root) or sibling == leaf_hash(
                leaf
            )
    with pytest.raises(LedgerInputError):
        merkle_proof(leaves, count)
