"""ledger/packed.py: a round's stage state is held in a few buffers, not as one object per chunk (issue 45).

A node holds a chunked run's stage states for every round behind the commit lag. As one bytes object per chunk
leaf and a (hash, int) tuple per sum tree node they were thousands of small-object blocks a round, and a lag
of a few rounds left CPython's arenas at their high-water mark for good (the soak's RSS steps). These tests
count the blocks a state holds with ``sys.getallocatedblocks`` and check that what a state answers is what it
was given.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
import random
import sys

import pytest
import torch

from ledger.availability import PAYLOAD, availability_answer
from ledger.chunkproof import Factors, StageState, tree_path, tree_root
from ledger.normproof import SumTree, encode_norm_state, parse_norm_state
from ledger.packed import PackedBytes, _unpickle
from training.chunks import tensor_leaves


def _stage_tensors(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 160, generator=generator), "b": torch.randn(160, generator=generator)}


def _blocks_held_by(build) -> tuple[object, int]:
    """What ``build()`` returns, and how many more allocator blocks are live while it is held than before."""
    gc.collect()
    before = sys.getallocatedblocks()
    made = build()
    gc.collect()
    return made, sys.getallocatedblocks() - before


def test_a_stage_state_holds_a_few_buffers_whatever_its_chunk_count():
    pieces_of = [[f"piece {i} {j}".encode() * 4 for j in range(120)] for i in range(6)]

    def build():
        weights, momentum = tensor_leaves(_stage_tensors(1)), tensor_leaves(_stage_tensors(2))
        factors = Factors(0x3C23D70A, 0x3F666666, True, tuple(bytes([i]) * 32 for i in range(6)),
                          tuple(tree_root(p) for p in pieces_of), (0x3FF0000000000000,) * 6)
        return StageState(0, weights, momentum, factors, [list(p) for p in pieces_of])

    state, held = _blocks_held_by(build)
    chunks = len(state.weight_leaves) + len(state.momentum_leaves) + sum(len(p) for p in state.payload_leaves)
    assert chunks > 1000
    assert held < 100, f"{held} blocks for {chunks} leaves"  # one list of leaves was one block per leaf
    # It answers as the lists it was given did.
    weights = tensor_leaves(_stage_tensors(1))
    assert state.weight_leaves == weights and list(state.weight_leaves) == weights
    assert state.weight_leaves[-1] == weights[-1] and state.weight_leaves[3:6] == weights[3:6]
    assert tree_root(state.weight_leaves) == tree_root(weights)
    assert tree_path(state.weight_leaves, 7) == tree_path(weights, 7)
    assert [list(p) for p in state.payload_leaves] == pieces_of
    # The spill file's round trip (node/live/fraud/chunkstate.py pickles a state) keeps it packed and equal.
    again = pickle.loads(pickle.dumps(state))
    assert again == state and isinstance(again.weight_leaves, PackedBytes) and again.leaf() == state.leaf()


def test_a_sum_tree_holds_a_few_buffers_and_the_same_tree():
    rng = random.Random(7)
    sums = [rng.getrandbits(540) for _ in range(1001)]  # an odd count: promoted nodes on the way up
    tree, held = _blocks_held_by(lambda: SumTree.of(sums))
    assert held < 50, f"{held} blocks for a tree of {len(sums)} leaves"
    assert tree.sums == tuple(sums) and tree.total == sum(sums)
    levels = tree.levels
    assert [len(level) for level in levels][:3] == [1001, 501, 251] \
        and levels[-1] == ((tree.root, tree.total),)
    assert all(level[i][1] == level_below[2 * i][1] + (level_below[2 * i + 1][1]
                                                       if 2 * i + 1 < len(level_below)
                                                       else 0)
               for level_below, level in zip(levels, levels[1:]) for i in range(len(level)))
    assert len(tree.path(1000)) % 4 == 0 and tree.path(0)[0] == levels[0][1][0]
    with pytest.raises(Exception, match="outside the tree"):
        tree.path(1001)
    factors = Factors(0x3C23D70A, 0x3F666666, True, (b"\x01" * 32,), (b"\x02" * 32,), (0x3FF0000000000000,))
    assert SumTree.of(sums) == tree and SumTree.of(sums[:-1]) != tree
    assert encode_norm_state(factors.encode(), [tree]).endswith(b"".join(s.to_bytes(96, "big") for s in sums))
    assert callable(parse_norm_state)
    # An availability challenge of a sum leaf is answered
    # from the packed tree; one past it is refused as before.
    state = StageState(0, [b"w"], [b"m"], factors, [[b"p"] * len(sums)], [tree])
    leaf, path = availability_answer(state, PAYLOAD + 1, 1000)
    assert leaf == sums[1000].to_bytes(96, "big") and path == tree.path(1000)
    with pytest.raises(IndexError):
        availability_answer(state, PAYLOAD + 1, 1001)


def test_packed_bytes_reads_as_an_immutable_sequence_and_refuses_what_it_cannot_hold():
    items = [b"", b"a", hashlib.sha256(b"x").digest(), b"tail" * 100]
    held = PackedBytes(items)
    assert len(held) == 4 and list(held) == items and held == items and held == tuple(items)
    assert held[-1] == items[-1] and held[0] == b"" and held[::2] == items[::2] and held[5:] == []
    assert held != items[:3] and held != [b"", b"a", b"?" * 32, b"tail" * 100] and held != b"".join(items)
    assert PackedBytes(held) == held and PackedBytes() == [] and len(PackedBytes()) == 0
    with pytest.raises(IndexError):
        held[4]
    with pytest.raises(IndexError):
        held[-5]
    with pytest.raises(TypeError, match="holds bytes, not str"):
        PackedBytes([b"ok", "text"])
    with pytest.raises(TypeError):
        hash(held)
    assert pickle.loads(pickle.dumps(held)) == items
    with pytest.raises(TypeError, match="not a pickled PackedBytes"):
        _unpickle("not bytes", None)
