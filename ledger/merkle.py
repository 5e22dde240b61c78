"""The Merkle tree behind a round commit's ``contributionsRoot``; node and auditors must agree bit for bit.

Definition (SHA-256, domain-separated so a leaf can never pass for an inner node):

* leaf hash  = sha256(0x00 || leaf)            (a leaf is the byte encoding of one signed contribution)
* inner hash = sha256(0x01 || left || right)
* Leaves keep the order they are given in (the caller fixes a canonical order, e.g. by contributor peer id);
  they are not sorted here.
* A level with an odd number of nodes promotes its last node unchanged to the next level (no duplication,
  so a list and the same list with its last leaf repeated have different roots).
* The root of one leaf is its leaf hash; the root of no leaves is :data:`EMPTY_ROOT` = sha256(b"").

:func:`merkle_proof` and :func:`verify_proof` let an auditor check a single contribution against a root.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from ledger.errors import LedgerInputError

EMPTY_ROOT = hashlib.sha256(b"").digest()
_LEAF = b"\x00"
_INNER = b"\x01"


def leaf_hash(leaf: bytes) -> bytes:
    """sha256(0x00 || leaf)."""
    return hashlib.sha256(_LEAF + bytes(leaf)).digest()


def inner_hash(left: bytes, right: bytes) -> bytes:
    """sha256(0x01 || left || right)."""
    return hashlib.sha256(_INNER + left + right).digest()


def _levels(leaves: Iterable[bytes]) -> list[list[bytes]]:
    # leaf_hash and inner_hash inlined: a chunked stage's trees have ~10^4-10^6 leaves (issue 43).
    sha256 = hashlib.sha256
    level = [sha256(_LEAF + bytes(leaf)).digest() for leaf in leaves]
    levels = [level]
    while len(level) > 1:
        paired = [sha256(_INNER + left + right).digest() for left, right in zip(level[0::2], level[1::2])]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
        levels.append(level)
    return levels


def merkle_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree over ``leaves``, the leaf hashes first and the root's level last: node ``s`` of
    level ``k`` is the root over leaves ``[s 2^k, (s + 1) 2^k)`` (an odd node is promoted, keeping its
    span)."""
    if not leaves:
        raise LedgerInputError("a tree of no leaves has no levels")
    return _levels(leaves)


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """The 32-byte root over ``leaves`` in the given order (see the module docstring)."""
    if not leaves:
        return EMPTY_ROOT
    return _levels(leaves)[-1][0]  # read once, in order: a lazy sequence is never held whole


def merkle_proof(leaves: Sequence[bytes], index: int) -> list[tuple[bytes, bool]]:
    """The proof for ``leaves[index]``: (sibling hash, sibling is on the left) from the bottom up."""
    if not 0 <= index < len(leaves):
        raise LedgerInputError(f"merkle proof index {index}: must be in [0, {len(leaves)})")
    proof = []
    position = index
    for level in _levels(leaves)[:-1]:
        sibling = position ^ 1
        if sibling < len(level):  # else: the node was the odd one out and is promoted
            proof.append((level[sibling], sibling < position))
        position //= 2
    return proof


def verify_proof(leaf: bytes, proof: list[tuple[bytes, bool]], root: bytes) -> bool:
    """Whether ``leaf`` with ``proof`` (from :func:`merkle_proof`) hashes up to ``root``."""
    node = leaf_hash(leaf)
    for sibling, sibling_is_left in proof:
        node = inner_hash(sibling, node) if sibling_is_left else inner_hash(node, sibling)
    return node == root
