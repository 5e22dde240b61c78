"""Roots and norms over a stage cut into shards, without gathering it (issue 75; docs/CLUSTER.md).

**Merkle roots.** The chunk trees of a fraud-provable run (ledger/merkle.py: sha256, leaf ``0x00 || leaf``,
inner ``0x01 || left || right``, an odd node promoted with its span) have node ``(k, s)`` over leaves
``[s 2^k, min((s + 1) 2^k, n))``. A rank holding leaves ``[a, b)`` computes every node whose span lies in
``[a, b)`` and hands on only the maximal ones (:func:`shard_frontier`: at most about ``2 log2 n`` hashes);
:func:`root_from_frontiers` rebuilds the root from the ranks' frontiers, the same bits as the root over all
leaves (tests/test_cluster_engine.py checks it against :func:`ledger.merkle.merkle_root`). No rank ever
holds another's leaves.

**Norms.** The norm rule (training/robust.py) takes ``sqrt(float64(exact sum of float32 squares))``: the sum
is exact, so it splits over shards exactly. :func:`exact_square_sum` returns a shard's exact sum as a
Fraction; the ranks' Fractions add exactly, and :func:`norm_of` rounds once and takes the root: the same
double :func:`training.robust.contribution_norm` computes over the whole contribution.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from fractions import Fraction

import numpy as np
import torch

_LEAF = b"\x00"
_INNER = b"\x01"


def _count_at(n: int, level: int) -> int:
    """Nodes at ``level`` of a tree of ``n`` leaves."""
    return -(-n // (1 << level))


def _span(n: int, level: int, index: int) -> tuple[int, int]:
    return index << level, min((index + 1) << level, n)


def shard_frontier(leaves: list[bytes], first: int, total: int) -> dict[tuple[int, int], bytes]:
    """The maximal nodes ``{(level, index): hash}`` whose spans lie within leaves ``[first, first +
    len(leaves))`` of a tree of ``total`` leaves (module docstring)."""
    if not leaves:
        return {}
    stop = first + len(leaves)
    if first < 0 or stop > total:
        raise ValueError(f"leaves [{first}, {stop}) outside a tree of {total}")
    sha256 = hashlib.sha256
    level = {first + i: sha256(_LEAF + bytes(leaf)).digest() for i, leaf in enumerate(leaves)}
    frontier: dict[tuple[int, int], bytes] = {}
    k = 0
    while level:
        count = _count_at(total, k)
        if count == 1:  # the root
            frontier[(k, 0)] = level[0]
            break
        upper: dict[int, bytes] = {}
        for index in sorted(level):
            parent = index >> 1
            low, high = _span(total, k + 1, parent)
            if low < first or high > stop:
                frontier[(k, index)] = level[index]
                continue
            if index & 1:
                continue  # joined with its left sibling
            right = index + 1
            upper[parent] = (sha256(_INNER + level[index] + level[right]).digest() if right < count
                             else level[index])  # an odd last node is promoted
        level = upper
        k += 1
    return frontier


def root_from_frontiers(frontiers: Iterable[Mapping[tuple[int, int], bytes]], total: int) -> bytes:
    """The root of a tree of ``total`` leaves from frontiers that together cover every leaf."""
    if total == 0:
        return hashlib.sha256(b"").digest()  # ledger.merkle.EMPTY_ROOT
    known: dict[tuple[int, int], bytes] = {}
    for frontier in frontiers:
        known.update(frontier)
    top = max(0, (total - 1).bit_length())

    def node(level: int, index: int) -> bytes:
        found = known.get((level, index))
        if found is not None:
            return found
        if level == 0:
            raise ValueError(f"leaf {index} is in no shard's frontier")
        left = node(level - 1, 2 * index)
        if 2 * index + 1 >= _count_at(total, level - 1):
            return left
        return hashlib.sha256(_INNER + left + node(level - 1, 2 * index + 1)).digest()

    return node(top, 0)


def exact_square_sum(tensors: Mapping[str, torch.Tensor]) -> Fraction | None:
    """The exact sum of the float64 squares of every float32 element of ``tensors`` (None: a non-finite one).

    Level by level as :func:`training.robust._levels_norm` (Rump, Ogita, Oishi 2008): each level's sum
    of the parts that are multiples of its unit is exact in float64 in any order, the remainders go to
    the next level, until nothing remains.
    """
    arrays = [value.detach().to(torch.float32).contiguous().reshape(-1).numpy() for value in tensors.values()]
    count = sum(array.size for array in arrays)
    if count == 0:
        return Fraction(0)
    remainder = np.empty(count, dtype=np.float64)
    offset = 0
    for array in arrays:
        np.multiply(array, array, out=remainder[offset:offset + array.size], dtype=np.float64)  # exact
        offset += array.size
    largest = float(remainder.max())
    if not math.isfinite(largest):
        return None
    scratch = np.empty_like(remainder)
    spread = count.bit_length() + 1
    total = Fraction(0)
    while largest != 0.0:
        sigma = math.ldexp(1.0, math.frexp(largest)[1] + spread)
        np.add(remainder, sigma, out=scratch)
        np.subtract(scratch, sigma, out=scratch)  # a multiple of the level's unit: exact
        total += Fraction(float(scratch.sum()))  # exact in any order
        np.subtract(remainder, scratch, out=remainder)  # exact
        np.abs(remainder, out=scratch)
        largest = float(scratch.max())
    return total


def norm_of(total: Fraction | None) -> float:
    """``sqrt`` of the exact sum rounded once to a double (inf for a non-finite shard)."""
    return math.inf if total is None else math.sqrt(float(total))
