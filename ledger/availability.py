"""The data-availability challenge's targets and answers, and the proof built from leaves it opened (issue
43; docs/FRAUD_PROOF.md, "The data-availability challenge"): which committed tree a challenge names, the
leaf and path that answer it, and the walk down a withheld tree."""

from __future__ import annotations

import dataclasses

from ledger.chunkproof import AggregationProof, Factors, StageLeaf, StageState, build_proof, tree_path
from ledger.errors import LedgerInputError
from ledger.merkle import merkle_levels

#: ``which`` of a data-availability challenge: the new weights, the new momentum, or ``PAYLOAD + j``; in a
#: version-3 round also ``sums_which(M, j)``, contribution ``j``'s sum tree; the factors themselves
#: (``FACTORS``, chunk 0: the stage leaf's preimage of ``factorsHash``, answered with their bytes and no
#: path); or the stage leaf itself (``AggregationProver.STAGE_LEAF``: a record whose root has no stage leaves
#: behind it).
WEIGHTS, MOMENTUM, PAYLOAD = 0, 1, 2
FACTORS = 2**256 - 2
STAGE_LEAF = 2**256 - 1


def sums_which(accepted: int, contribution: int) -> int:
    """``which`` of accepted contribution ``contribution``'s sum tree in a version-3 round that accepted
    ``accepted`` contributions (ledger/normproof.py): ``PAYLOAD + accepted + contribution``."""
    if not 0 <= contribution < accepted:
        raise LedgerInputError(f"contribution {contribution} is not one of the round's {accepted} accepted")
    return PAYLOAD + accepted + contribution


def availability_target(record, stage_leaves: list[StageLeaf], factors: Factors, stage: int, which: int,
                        chunk: int) -> tuple:
    """The ``Target`` argument of ``AggregationProver.challengeAvailability``: leaf ``chunk`` of tree
    ``which`` (:data:`WEIGHTS`, :data:`MOMENTUM`, ``PAYLOAD + j``) of ``stage`` in the committed
    ``record``."""
    leaves = [leaf.encode() for leaf in stage_leaves]
    return (record.fields(), stage, leaves[stage], tree_path(leaves, stage), factors.encode(), which, chunk)


def stage_leaf_target(record, stage: int) -> tuple:
    """The ``Target`` of a challenge of stage ``stage``'s leaf under the committed ``record``'s weights
    root (one whose preimage nobody showed: the challenger knows no stage leaf, path or factors)."""
    return (record.fields(), stage, b"", [], b"", STAGE_LEAF, stage)


def stage_leaf_answer(stage_leaves: list[StageLeaf], stage: int) -> tuple[bytes, list[bytes]]:
    """``(leaf, path)`` that answers a challenge of stage ``stage``'s leaf: the committed stage leaves'
    own."""
    leaves = [leaf.encode() for leaf in stage_leaves]
    return leaves[stage], tree_path(leaves, stage)


def availability_answer(state: StageState, which: int, chunk: int) -> tuple[bytes, list[bytes]]:
    """``(leaf, path)`` that answers a challenge of leaf ``chunk`` of tree ``which`` of ``state`` (a sum
    tree's: the chunk's 96-byte sum and its sum path). IndexError for a tree or a leaf the state does not
    hold."""
    accepted = len(state.payload_leaves)
    if which == FACTORS:
        if chunk != 0:
            raise IndexError(f"the factors are one leaf, not chunk {chunk}")
        return state.factors.encode(), []
    if which == WEIGHTS:
        leaves = state.weight_leaves
    elif which == MOMENTUM:
        leaves = state.momentum_leaves
    elif which < PAYLOAD + accepted:
        leaves = state.payload_leaves[which - PAYLOAD]
    else:
        if not state.sum_trees or which >= PAYLOAD + 2 * accepted:
            raise IndexError(f"tree {which} is not one of the state's")
        tree = state.sum_trees[which - PAYLOAD - accepted]
        if not 0 <= chunk < tree.width(0):  # (IndexError, as for the other trees' leaves below)
            raise IndexError(f"chunk {chunk} outside the sum tree's {tree.width(0)} chunks")
        return tree.leaf(chunk), tree.path(chunk)
    return leaves[chunk], tree_path(leaves, chunk)


def differing_subtree(own_leaves: list[bytes], chunk: int, path: list[bytes]) -> int | None:
    """Where to look next for a committed leaf that differs from ``own_leaves``, given the committed leaf
    ``chunk`` (equal to this node's) and its ``path`` (an answered availability challenge's): the first
    leaf of the smallest subtree whose committed hash (a sibling on ``path``) differs from this node's node
    there. Opening that leaf next, its path shows smaller subtrees of the differing one, so a differing
    leaf is found in at most ``log2(leaves)`` openings (a bisection over the tree, one challenge each).
    None: every sibling is this node's (then the committed root is not this tree's: the path is not of this
    tree's shape)."""
    levels = merkle_levels(own_leaves)
    siblings = []
    position = chunk
    for height, level in enumerate(levels[:-1]):
        sibling = position ^ 1
        if sibling < len(level):
            siblings.append((height, sibling, level[sibling]))
        position //= 2
    if len(siblings) != len(path):
        return None
    for (height, sibling, mine), committed in zip(siblings, path, strict=True):
        if bytes(committed) != mine:
            return sibling << height
    return None


def opened_proof(prev_record, record, prev_stages: list[StageLeaf], committed_stages: list[StageLeaf],
                 prev: StageState, own: StageState, chunk: int, weights: tuple[bytes, list[bytes]],
                 momentum: tuple[bytes, list[bytes]]) -> AggregationProof:
    """The proof of chunk ``chunk`` from committed leaves opened one at a time (answered availability
    challenges): ``weights`` and ``momentum`` are the committed new leaves of the chunk with their paths; the
    factors and payload pieces are ``own``'s (whose factors must be the committed ones)."""
    proof = build_proof(prev_record, record, prev_stages, committed_stages, prev, own, chunk)
    return dataclasses.replace(proof, new_weights=weights[0], new_weights_path=list(weights[1]),
                               new_momentum=momentum[0], new_momentum_path=list(momentum[1]))
