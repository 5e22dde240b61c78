"""The clip scales' commitment and their fraud proofs (issue 43, "Known gaps" 2 of docs/FRAUD_PROOF.md).

A version-3 round (run document ``diloco.commitments = "normed"``) commits, in each stage's factors, for every
accepted contribution ``j`` the exact sum of squares ``S_j`` of its decoded float32 values and the root of a
Merkle *sum tree* over the same chunks as its payload pieces:

* a sum of squares is an exact integer in the unit ``2**-298`` (the square of the smallest float32 subnormal):
  the square of a float32 ``m 2**(e - 150)`` is ``m**2 2**(2e - 2)`` units, below ``2**554``; a sum is held in
  96 bytes big-endian (768 bits; contracts/src/NormRule.sol adds them exactly);
* leaf ``i`` is the 96-byte sum of chunk ``i``'s squares, hashed ``sha256(0x00 || sum)``; an inner node is
  ``sha256(0x01 || left hash || left sum || right hash || right sum)`` and its sum is its children's (an odd
  node is promoted, as in :mod:`ledger.merkle`). So no inner node can disagree with its children: the only
  sums a committer states freely are the leaves and the total ``S_j`` in the factors;
* the factors (:class:`ledger.chunkproof.Factors`) gain ``normClip`` (the run's ``norm_clip``, float64 bits),
  ``steps`` (each contribution's declared inner steps in a run bounded by time, else none), ``normRoots`` and
  ``normSums`` (three words per contribution).

From these the contract (``AggregationProver.proveWrongNorm``) recomputes DiLoCoX's norm rule (docs/DILOCOX.md
section 10): ``n_j = sqrt(double(S_j))`` (``double`` correctly rounded: the one rounding of ``math.fsum``),
``p_j = n_j / k_j`` in a run bounded by time, the lower median, ``bound = norm_clip * med`` and ``s_j = 1`` or
``bound / p_j``, all binary64 and correctly rounded. A proof shows one of: the committed scales are not the
rule of the committed totals (:func:`scale_proof`); or one chunk of a contribution's sum tree holds another
sum than the squares of its committed piece, or the tree sums to another total than the committed one
(:func:`sum_proof`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ledger.chunkproof import hexed, unhexed
from ledger.errors import LedgerInputError
from rulebook.norm_clip import clip_scales as norm_rule_scales

#: log2 of the unit of a sum of squares.
UNIT_LOG2 = 298
SUM_BYTES = 96
#: Sums at or past this do not fit the contract's three words (none of a real stage: 2**64 squares < 2**618).
SUM_LIMIT = 1 << (8 * SUM_BYTES)
#: ``NormProof.contribution`` of a proof of the scales themselves (``AggregationProver.SCALES``).
SCALES = 2**256 - 1


def square_sum(values: bytes) -> int:
    """The exact sum of squares of the float32 ``values`` (little-endian bytes), in units of ``2**-298``.

    A float32 squared is exact in float64 (48 significant bits, ``2**-298 .. 2**256``), and scaling it by
    ``2**298`` is exact too, so each square is an integer as a float64. LedgerInputError for a non-finite
    value (no accepted contribution holds one)."""
    if len(values) % 4:
        raise LedgerInputError(f"{len(values)} bytes are not float32 values")
    total = 0
    for (value,) in struct.iter_unpack("<f", values):
        square = math.ldexp(value * value, UNIT_LOG2)
        if not math.isfinite(square):
            raise LedgerInputError(f"a non-finite value ({value!r}) has no sum of squares")
        total += int(square)
    return total


def sum_bytes(total: int) -> bytes:
    """A sum as the contract reads it: 96 bytes big-endian."""
    if not 0 <= total < SUM_LIMIT:
        raise LedgerInputError(f"a sum of squares must be in [0, 2**768), not {total}")
    return total.to_bytes(SUM_BYTES, "big")


def sum_words(total: int) -> tuple[int, int, int]:
    """``(hi, mid, lo)``: the sum as three 256-bit words."""
    data = sum_bytes(total)
    return tuple(int.from_bytes(data[i:i + 32], "big") for i in (0, 32, 64))


def _leaf_hash(total: int) -> bytes:
    return hashlib.sha256(b"\x00" + sum_bytes(total)).digest()


def _node_hash(left: tuple[bytes, int], right: tuple[bytes, int]) -> bytes:
    return hashlib.sha256(b"\x01" + left[0] + sum_bytes(left[1]) + right[0] + sum_bytes(right[1])).digest()


@dataclass(frozen=True, eq=False)
class SumTree:
    """The sum tree over one contribution's per-chunk sums of squares (module docstring).

    Held packed (as :mod:`ledger.packed` holds leaves): each level's hashes in one buffer and its sums in
    another (``SUM_BYTES`` each), not as a (hash, int) pair per node: a node keeps a tree per accepted
    contribution and stage for every round behind the commit lag (issue 45)."""

    # per level, the nodes' 32-byte hashes concatenated; the leaves' first, the root's last
    hashes: tuple[bytes, ...]
    sum_levels: tuple[bytes, ...]  # per level, the nodes' sums (SUM_BYTES each, big-endian) concatenated

    @classmethod
    def of(cls, sums: Sequence[int]) -> SumTree:
        if not sums:
            raise LedgerInputError("a sum tree needs at least one chunk")
        level = [(_leaf_hash(total), total) for total in sums]
        hashes, sum_levels = [], []
        while True:
            hashes.append(b"".join(digest for digest, _total in level))
            sum_levels.append(b"".join(sum_bytes(total) for _digest, total in level))
            if len(level) == 1:
                return cls(tuple(hashes), tuple(sum_levels))
            pairs = [_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                pairs.append(level[-1])  # an odd node is promoted
            level = pairs

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SumTree):
            return NotImplemented
        return self.hashes == other.hashes and self.sum_levels == other.sum_levels

    __hash__ = None  # type: ignore[assignment]

    def node(self, height: int, index: int) -> tuple[bytes, int]:
        """``(hash, sum)`` of node ``index`` of level ``height`` (0: the leaves)."""
        if not 0 <= index < self.width(height):
            raise LedgerInputError(f"node {index} outside the tree's level {height} of {self.width(height)}")
        sums = self.sum_levels[height]
        return (self.hashes[height][32 * index:32 * (index + 1)],
                int.from_bytes(sums[SUM_BYTES * index:SUM_BYTES * (index + 1)], "big"))

    def leaf(self, index: int) -> bytes:
        """Leaf ``index``'s sum as the contract reads it (96 bytes), straight from the packed leaf level."""
        if not 0 <= index < self.width(0):
            raise LedgerInputError(f"chunk {index} outside the tree's {self.width(0)} chunks")
        return self.sum_levels[0][SUM_BYTES * index:SUM_BYTES * (index + 1)]

    @property
    def sums(self) -> tuple[int, ...]:
        """The leaves' sums: the per-chunk sums of squares (built on each call)."""
        leaves = self.sum_levels[0]
        return tuple(int.from_bytes(leaves[i:i + SUM_BYTES], "big") for i in range(0, len(leaves), SUM_BYTES))

    def width(self, height: int) -> int:
        """How many nodes level ``height`` has."""
        return len(self.hashes[height]) // 32

    @property
    def levels(self) -> tuple[tuple[tuple[bytes, int], ...], ...]:
        """Every level's ``(hash, sum)`` nodes, the leaves' first, the root's last (built on each call)."""
        return tuple(tuple(self.node(height, i) for i in range(self.width(height)))
                     for height in range(len(self.hashes)))

    @property
    def root(self) -> bytes:
        return self.hashes[-1][:32]

    @property
    def total(self) -> int:
        return self.node(len(self.hashes) - 1, 0)[1]

    def path(self, index: int) -> list[bytes]:
        """The sibling hashes and sums from leaf ``index`` up: four 32-byte words per level with a sibling."""
        if not 0 <= index < self.width(0):
            raise LedgerInputError(f"chunk {index} outside the tree's {self.width(0)} chunks")
        words = []
        for height in range(len(self.hashes) - 1):
            sibling = index ^ 1
            if sibling < self.width(height):
                digest, total = self.node(height, sibling)
                words += [digest, *(word.to_bytes(32, "big") for word in sum_words(total))]
            index //= 2
        return words


def _pair(left: tuple[bytes, int], right: tuple[bytes, int]) -> tuple[bytes, int]:
    total = left[1] + right[1]
    sum_bytes(total)  # an honest tree never passes 2**768
    return _node_hash(left, right), total


def sum_to_double(total: int) -> float:
    """The double nearest ``total * 2**-298`` (Python's int division is correctly rounded)."""
    return total / (1 << UNIT_LOG2)


def norm_of(total: int) -> float:
    """``n_j = sqrt(double(S_j))``: what training/robust.py's ``contribution_norm`` returns for the same
    values."""
    return math.sqrt(sum_to_double(total))


def clip_scales(totals: Sequence[int], norm_clip: float, steps: Sequence[int] = ()) -> list[float]:
    """The norm rule's scale of each accepted contribution (docs/DILOCOX.md section 10), from the exact sums
    of
    squares: :func:`rulebook.norm_clip.clip_scales` (the rule training/robust.py applies) on their norms, what
    the contract recomputes."""
    return norm_rule_scales([norm_of(total) for total in totals], norm_clip, steps)


@dataclass(frozen=True)
class NormProof:
    """The argument of ``AggregationProver.proveWrongNorm`` (contracts/src/AggregationProver.sol)."""

    record: tuple  # RoundRecord.fields() of round t
    stage: int
    stage_leaf: bytes
    stage_path: list[bytes]
    factors: bytes
    contribution: int  # SCALES, or j
    chunk: int
    weights: bytes
    weights_path: list[bytes]
    piece: bytes
    piece_path: list[bytes]
    sum_leaf: bytes
    sum_path: list[bytes]

    def args(self, attesters: Sequence[str]) -> tuple:
        """The single struct argument, with the round's ``attesters`` (checksummed addresses)."""
        return ((self.record, self.stage, self.stage_leaf, self.stage_path, self.factors, self.contribution,
                 self.chunk, (self.weights, self.weights_path), (self.piece, self.piece_path), self.sum_leaf,
                 self.sum_path, list(attesters)),)

    def to_json(self) -> dict:
        """A printable form (hex strings) of the proof, as a node keeps it and ``audit`` shows it."""
        return {"kind": "norm", **{name: hexed(getattr(self, name)) for name in self.__dataclass_fields__}}

    @classmethod
    def from_json(cls, data: dict) -> NormProof:
        """The proof of its :meth:`to_json` form (a file's: LedgerInputError for anything else)."""
        try:
            if not isinstance(data, dict) or data.get("kind") != "norm" or set(data) != {"kind",
                                                                                       *cls.__dataclass_fields__}:
                raise ValueError("not the norm proof's fields")
            fields = {name: unhexed(value) for name, value in data.items() if name != "kind"}
            fields["record"] = tuple(fields["record"])
            for name in ("stage", "chunk", "contribution"):
                if not isinstance(fields[name], int):
                    raise ValueError(f"{name} is not a number")
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise LedgerInputError(f"not a norm proof: {exc}"[:200]) from None


def scale_proof(record, stage_leaves: Sequence[bytes], stage: int, factors: bytes) -> NormProof:
    """The proof that the committed scales of ``stage`` in ``record`` are not the norm rule of the committed
    sums
    (``stage_leaves``: every committed stage leaf of the record, encoded; ``factors``: the stage's,
    encoded)."""
    from ledger.chunkproof import tree_path

    return NormProof(record.fields(), stage, stage_leaves[stage], tree_path(list(stage_leaves), stage),
                     factors, SCALES, 0, b"", [], b"", [], b"", [])


def sum_proof(record, stage_leaves: Sequence[bytes], stage: int, factors: bytes,
              weight_leaves: Sequence[bytes], payload_leaves: Sequence[bytes], tree: SumTree,
              contribution: int, chunk: int) -> NormProof:
    """The proof that chunk ``chunk`` of contribution ``contribution``'s committed sum tree (``tree``, as the
    committers built it) is not the squares of its committed piece (``payload_leaves``, the contribution's),
    or that the tree does not sum to the committed total; ``weight_leaves``: the round's committed weights."""
    from ledger.chunkproof import tree_path

    if not 0 <= chunk < len(weight_leaves):
        raise LedgerInputError(f"chunk {chunk} outside the stage's {len(weight_leaves)} chunks")
    return NormProof(record.fields(), stage, stage_leaves[stage], tree_path(list(stage_leaves), stage),
                     factors, contribution, chunk, weight_leaves[chunk],
                     tree_path(weight_leaves, chunk), payload_leaves[chunk],
                     tree_path(payload_leaves, chunk), tree.leaf(chunk), tree.path(chunk))


def opened_sum_proof(record, stage_leaves: Sequence[bytes], stage: int, factors: bytes, contribution: int,
                     chunk: int, weights: tuple[bytes, Sequence[bytes]], piece: tuple[bytes, Sequence[bytes]],
                     opened: tuple[bytes, Sequence[bytes]]) -> NormProof:
    """:func:`sum_proof` from leaves opened one at a time (answered availability challenges): ``weights`` the
    round's committed weights leaf of ``chunk`` with its path, ``piece`` contribution ``contribution``'s piece
    of it with its path, ``opened`` the committed sum leaf (96 bytes) with its sum path, as the committers
    published it."""
    from ledger.chunkproof import tree_path

    return NormProof(record.fields(), stage, stage_leaves[stage], tree_path(list(stage_leaves), stage),
                     factors, contribution, chunk, weights[0], list(weights[1]), piece[0], list(piece[1]),
                     bytes(opened[0]), list(opened[1]))


def path_sums(path: Sequence[bytes]) -> list[tuple[bytes, int]]:
    """A sum path's siblings from the leaf up: ``(hash, sum)`` of each (four 32-byte words each: the hash,
    then the sum's three words). LedgerInputError for a path of another shape."""
    if len(path) % 4 or any(len(word) != 32 for word in path):
        raise LedgerInputError(f"a sum path is four 32-byte words a level, not {len(path)} words")
    return [(bytes(path[i]), int.from_bytes(b"".join(bytes(w) for w in path[i + 1:i + 4]), "big"))
            for i in range(0, len(path), 4)]


def path_total(leaf: bytes, path: Sequence[bytes]) -> int:
    """The total a committed sum tree's root holds, from one of its leaves (96 bytes) and that leaf's sum
    path: the leaf's sum and every sibling's (the contract adds them as it climbs)."""
    if len(leaf) != SUM_BYTES:
        raise LedgerInputError(f"a sum leaf is {SUM_BYTES} bytes, not {len(leaf)}")
    return int.from_bytes(leaf, "big") + sum(total for _hash, total in path_sums(path))


def differing_sum_subtree(own: SumTree, chunk: int, path: Sequence[bytes]) -> int | None:
    """Where to look next for a committed sum leaf that differs from this node's tree ``own``, given the
    committed leaf ``chunk`` (equal to this node's) and its sum ``path`` (an answered availability
    challenge's): the first leaf of the smallest subtree whose committed hash (a sibling on ``path``) differs
    from this node's node there, as :func:`ledger.availability.differing_subtree` over a weights tree. So a
    lied leaf is found in at most ``log2(chunks)`` openings. None: every sibling is this node's (the path is
    not of this tree's shape)."""
    siblings = []
    position = chunk
    for height in range(len(own.hashes) - 1):
        sibling = position ^ 1
        if sibling < own.width(height):
            siblings.append((height, sibling, own.node(height, sibling)[0]))
        position //= 2
    committed = path_sums(path)
    if len(siblings) != len(committed):
        return None
    for (height, sibling, mine), (theirs, _total) in zip(siblings, committed, strict=True):
        if theirs != mine:
            return sibling << height
    return None


def first_wrong_sum(own: Sequence[int], committed: SumTree) -> int | None:
    """The first chunk whose committed sum differs from this node's own (``own``: the true per-chunk sums), or
    None when every leaf agrees (then only the committed total can be wrong: any chunk proves it)."""
    for index, (mine, theirs) in enumerate(zip(own, committed.sums, strict=True)):
        if mine != theirs:
            return index
    return None


def encode_norm_state(factors: bytes, trees: Sequence[SumTree]) -> bytes:
    """What a committer serves of a version-3 stage beside its state: the factors' bytes and each accepted
    contribution's per-chunk sums (the leaves of its sum tree), for a prover to open
    (:func:`parse_norm_state`)."""
    parts = [struct.pack(">I", len(factors)), factors]
    for tree in trees:
        parts += [struct.pack(">I", tree.width(0)), tree.sum_levels[0]]
    return b"".join(parts)


def parse_norm_state(data: bytes, factors_hash: bytes, num_chunks: int):
    """``(factors, trees)`` of :func:`encode_norm_state`'s bytes, checked against the committed stage leaf:
    the factors hash to ``factors_hash``, are version 3, and each tree has ``num_chunks`` leaves and the
    committed root (its total may differ from the committed one: that is a fraud a proof shows).
    LedgerInputError otherwise."""
    from ledger.chunkproof import Factors

    view, at = memoryview(bytes(data)), 0

    def take(size: int) -> bytes:
        nonlocal at
        if size < 0 or at + size > len(view):
            raise LedgerInputError("norm state truncated")
        chunk = bytes(view[at:at + size])
        at += size
        return chunk

    factors_bytes = take(struct.unpack(">I", take(4))[0])
    if hashlib.sha256(factors_bytes).digest() != factors_hash:
        raise LedgerInputError("norm state: the factors are not the committed stage leaf's")
    factors = Factors.decode(factors_bytes)
    if factors.norms is None:
        return factors, []
    trees = []
    for root in factors.norms.roots:
        count = struct.unpack(">I", take(4))[0]
        if count != num_chunks:
            raise LedgerInputError(f"norm state: a sum tree of {count} chunks, not the stage's {num_chunks}")
        raw = take(SUM_BYTES * count)
        tree = SumTree.of([int.from_bytes(raw[i:i + SUM_BYTES], "big")
                           for i in range(0, len(raw), SUM_BYTES)])
        if tree.root != root:
            raise LedgerInputError("norm state: a sum tree is not the committed root's")
        trees.append(tree)
    if at != len(view):
        raise LedgerInputError("norm state: trailing bytes")
    return factors, trees
