"""The commitments a fraud proof opens, and the proof itself, as bytes (issue 43; docs/FRAUD_PROOF.md).

In a run with chunked commitments (run document ``diloco.commitments = "chunked"``) the record's
``weightsRoot`` is not :func:`training.hashing.weights_root` but the Merkle root
(:func:`ledger.merkle.merkle_root`) over one *stage leaf* per stage, in stage order::

    stage leaf = abi.encode(uint32 stage, uint32 numChunks, bytes32 weightsRoot, bytes32 momentumRoot,
                            bytes32 factorsHash)

``weightsRoot`` and ``momentumRoot`` are Merkle roots over the stage's tensor leaves (chunk ``i`` at
position ``i``; training/chunks.py makes the leaves), ``factorsHash = sha256(factors)`` with::

    factors = abi.encode(uint32 lrBits, uint32 muBits, bool nesterov, bytes32[] envelopes,
                         bytes32[] payloadRoots, uint64[] scaleBits)

the round's outer learning rate and momentum as float32 bit patterns, whether the step is Nesterov, and
for each contribution the aggregation *accepted*, in the order it summed them: its envelope digest (a leaf
of the record's ``contributionsRoot``), the Merkle root over its payload pieces (chunk ``i`` at position
``i``), and the float64 bit pattern of its clip scale. The contributions of the round's close that are not
listed are the set left out (screened or refused). A round whose every contribution was left out lists
none: its weights and momentum are the previous ones.

Every tree is :mod:`ledger.merkle`'s (sha256, domain-separated, odd nodes promoted); a proof names its leaf
by index and the tree's leaf count, from which the contract derives the path's shape, so a leaf cannot be
passed off at another position.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from eth_abi import decode, encode

from ledger.abidecode import ABI_DECODE_ERRORS
from ledger.contribution_binding import checked_address, compact, expand
from ledger.errors import LedgerInputError
from ledger.merkle import merkle_proof, merkle_root
from ledger.packed import PackedBytes
from ledger.records import check_bytes32, check_uint

STAGE_LEAF_TYPES = ("uint32", "uint32", "bytes32", "bytes32", "bytes32")
FACTORS_TYPES = ("uint32", "uint32", "bool", "bytes32[]", "bytes32[]", "uint64[]")
#: Version 3 (node/commitments/normed.py): the norm commitment follows (ledger/normproof.py), then the binding
#: (ledger/contribution_binding.py): each contribution's member account and its signature (r, vs: two words).
NORMED_FACTORS_TYPES = (*FACTORS_TYPES, "uint64", "uint32[]", "bytes32[]", "uint256[]", "address[]",
                        "bytes32[]")
#: Where version 3's first list starts: after its twelve head words (version 2: six, the first list at 192).
NORMED_HEAD = 32 * len(NORMED_FACTORS_TYPES)
#: The float64 bit pattern of 1.0: a contribution the norm rule left untouched.
SCALE_ONE = 0x3FF0000000000000


def tree_root(leaves: list[bytes]) -> bytes:
    """The root over chunk leaves (:func:`ledger.merkle.merkle_root`)."""
    return merkle_root(leaves)


def tree_path(leaves: list[bytes], index: int) -> list[bytes]:
    """The sibling hashes from leaf ``index`` up (the sides follow from the index and the leaf count)."""
    return [sibling for sibling, _left in merkle_proof(leaves, index)]


@dataclass(frozen=True)
class Norms:
    """A version-3 round's norm commitment of one stage (ledger/normproof.py): the run's ``norm_clip``
    (float64 bits), each accepted contribution's declared inner steps (a run bounded by time; else empty), the
    root of its sum tree and its exact sum of squares (units of 2**-298); and its binding (issue 62,
    ledger/contribution_binding.py): each one's contributor (a member account) and that account's 65-byte
    signature of its ``Contribution`` message. Factors without the binding (empty ``contributors`` and
    ``signatures``) encode, but the contract holds every such round of a normed run wrong."""

    clip_bits: int
    steps: tuple[int, ...]
    roots: tuple[bytes, ...]
    sums: tuple[int, ...]
    contributors: tuple[str, ...] = ()
    signatures: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        check_uint("clip_bits", self.clip_bits, 2**64 - 1)
        if len(self.roots) != len(self.sums) or len(self.steps) not in (0, len(self.roots)):
            raise LedgerInputError("norms: roots, sums and steps differ in length")
        bound = len(self.contributors)
        if bound != len(self.signatures) or bound not in (0, len(self.roots)):
            raise LedgerInputError("norms: contributors and signatures differ in length from the roots")
        for root in self.roots:
            check_bytes32("norm root", root)
        for step in self.steps:
            check_uint("steps", step, 2**32 - 1)
        for total in self.sums:
            check_uint("sum of squares", total, 2**768 - 1)
        object.__setattr__(self, "contributors", tuple(checked_address(a) for a in self.contributors))
        for signature in self.signatures:
            compact(signature)  # a 65-byte low-s signature, or LedgerInputError

    @property
    def bound(self) -> bool:
        """Whether every listed contribution carries its contributor's signature (none listed: vacuously)."""
        return len(self.contributors) == len(self.roots)

    def fields(self) -> list:
        words = []
        for total in self.sums:
            words += [total >> 512, (total >> 256) & (2**256 - 1), total & (2**256 - 1)]
        signature_words = [word for signature in self.signatures for word in compact(signature)]
        return [self.clip_bits, list(self.steps), list(self.roots), words, list(self.contributors),
                signature_words]


@dataclass(frozen=True)
class Factors:
    """The per-round values of one stage's outer step that are not per element (module docstring); ``norms``
    is version 3's norm commitment (None: version 2, whose bytes are unchanged)."""

    lr_bits: int
    mu_bits: int
    nesterov: bool
    envelopes: tuple[bytes, ...]
    payload_roots: tuple[bytes, ...]
    scale_bits: tuple[int, ...]
    norms: Norms | None = None

    def __post_init__(self) -> None:
        check_uint("lr_bits", self.lr_bits, 2**32 - 1)
        check_uint("mu_bits", self.mu_bits, 2**32 - 1)
        if not len(self.envelopes) == len(self.payload_roots) == len(self.scale_bits):
            raise LedgerInputError("factors: envelopes, payload roots and scales differ in length")
        for value in (*self.envelopes, *self.payload_roots):
            check_bytes32("factors root", value)
        for bits in self.scale_bits:
            check_uint("scale_bits", bits, 2**64 - 1)
        if self.norms is not None and len(self.norms.roots) != len(self.scale_bits):
            raise LedgerInputError("factors: the norm commitment lists another number of contributions")

    def encode(self) -> bytes:
        values = [self.lr_bits, self.mu_bits, self.nesterov, list(self.envelopes), list(self.payload_roots),
                  list(self.scale_bits)]
        if self.norms is None:
            return encode(FACTORS_TYPES, values)
        return encode(NORMED_FACTORS_TYPES, values + self.norms.fields())

    @classmethod
    def decode(cls, data: bytes) -> Factors:
        """The factors of their encoding, version 2 or 3 (the first list's offset tells: six fields or 12);
        LedgerInputError for bytes that are not a canonical encoding."""
        data = bytes(data)
        try:
            if data[96:128] == NORMED_HEAD.to_bytes(32, "big"):
                *head, clip, steps, roots, words, contributors, signature_words = decode(
                    NORMED_FACTORS_TYPES, data)
                if len(words) % 3 or len(signature_words) % 2:
                    raise ValueError("norm sums are not three words each, or signatures two")
                sums = tuple((words[i] << 512) | (words[i + 1] << 256) | words[i + 2]
                             for i in range(0, len(words), 3))
                signatures = tuple(expand(signature_words[i], signature_words[i + 1])
                                   for i in range(0, len(signature_words), 2))
                norms = Norms(clip, tuple(steps), tuple(roots), sums, tuple(contributors), signatures)
            else:
                head, norms = decode(FACTORS_TYPES, data), None
            lr, mu, nesterov, envelopes, roots, scales = head
            factors = cls(lr, mu, nesterov, tuple(envelopes), tuple(roots), tuple(scales), norms)
        except LedgerInputError:
            raise
        except ABI_DECODE_ERRORS as exc:
            raise LedgerInputError(f"factors do not decode: {type(exc).__name__}") from None
        if factors.encode() != data:
            raise LedgerInputError("factors are not canonically encoded")
        return factors

    def digest(self) -> bytes:
        return hashlib.sha256(self.encode()).digest()


@dataclass(frozen=True)
class StageLeaf:
    """One stage's commitment after a round: its chunk roots and the round's factors' hash."""

    stage: int
    num_chunks: int
    weights_root: bytes
    momentum_root: bytes
    factors_hash: bytes

    def encode(self) -> bytes:
        return encode(STAGE_LEAF_TYPES, [self.stage, self.num_chunks, self.weights_root, self.momentum_root,
                                         self.factors_hash])

    @classmethod
    def decode(cls, data: bytes) -> StageLeaf:
        return cls(*decode(STAGE_LEAF_TYPES, data))


def chunked_weights_root(stage_leaves: list[StageLeaf]) -> bytes:
    """The record's ``weightsRoot`` of a chunked run: the Merkle root over the stage leaves."""
    for index, leaf in enumerate(stage_leaves):
        if leaf.stage != index:
            raise LedgerInputError(f"stage leaf {index} is for stage {leaf.stage}")
    return merkle_root([leaf.encode() for leaf in stage_leaves])


@dataclass(frozen=True)
class StageState:
    """What a party holds of one stage after a round: its leaves, the factors, each contribution's pieces."""

    stage: int
    weight_leaves: list[bytes]
    momentum_leaves: list[bytes]
    factors: Factors
    payload_leaves: list[list[bytes]]  # one list per accepted contribution, in the factors' order
    # version 3: each one's ledger.normproof.SumTree
    sum_trees: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        # Held packed (ledger.packed): a node keeps a state for every round behind the commit lag, and as
        # thousands of small objects they left the allocator's arenas at their high-water mark (issue 45).
        object.__setattr__(self, "weight_leaves", PackedBytes(self.weight_leaves))
        object.__setattr__(self, "momentum_leaves", PackedBytes(self.momentum_leaves))
        # a list packed; any other sequence kept as it is (training.chunks.CutPayload: pieces cut from their
        # codec blob as they are read, a thousand times smaller than the pieces of a low-rank contribution)
        object.__setattr__(self, "payload_leaves", [PackedBytes(leaves) if isinstance(leaves, (list, tuple))
                                                    else leaves for leaves in self.payload_leaves])

    def leaf(self) -> StageLeaf:
        """The stage leaf of this state (computed once: the leaves are not changed after construction; a
        changed state is a new one, ``dataclasses.replace``)."""
        cached = self.__dict__.get("_leaf")
        if cached is None:
            cached = StageLeaf(self.stage, len(self.weight_leaves), tree_root(self.weight_leaves),
                               tree_root(self.momentum_leaves), self.factors.digest())
            object.__setattr__(self, "_leaf", cached)
        return cached


def hexed(value):
    """A proof field in JSON form: bytes as 0x-hex, lists and tuples item by item, numbers as they are."""
    if isinstance(value, bytes):
        return "0x" + value.hex()
    if isinstance(value, (list, tuple)):
        return [hexed(item) for item in value]
    return value


def unhexed(value):
    """The inverse of :func:`hexed` for a file's JSON (ValueError for anything it could not have written)."""
    if isinstance(value, str):
        if not value.startswith("0x"):
            raise ValueError(f"{value[:20]!r} is not 0x-hex")
        return bytes.fromhex(value[2:])
    if isinstance(value, list):
        return [unhexed(item) for item in value]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"unexpected {type(value).__name__}")


@dataclass(frozen=True)
class AggregationProof:
    """The arguments of ``AggregationProver.proveWrongAggregation`` (contracts/src/AggregationProver.sol)."""

    prev_record: tuple  # RoundRecord.fields() of round t - 1
    record: tuple  # RoundRecord.fields() of round t
    stage: int
    chunk: int
    prev_stage_leaf: bytes
    prev_stage_path: list[bytes]
    stage_leaf: bytes
    stage_path: list[bytes]
    factors: bytes
    prev_weights: bytes
    prev_weights_path: list[bytes]
    prev_momentum: bytes
    prev_momentum_path: list[bytes]
    new_weights: bytes
    new_weights_path: list[bytes]
    new_momentum: bytes
    new_momentum_path: list[bytes]
    pieces: list[bytes]
    piece_paths: list[list[bytes]]
    # issue 62: the run's schedule leaf of the round and its path (ledger/runvalues.py); empty: a run without
    schedule_leaf: bytes = b""
    schedule_path: list[bytes] = dataclasses.field(default_factory=list)

    def args(self) -> tuple:
        """The single struct argument of the contract function, in ABI order."""
        return ((self.prev_record, self.record, self.stage, self.chunk, self.prev_stage_leaf,
                 self.prev_stage_path, self.stage_leaf, self.stage_path, self.factors,
                 (self.prev_weights, self.prev_weights_path), (self.prev_momentum, self.prev_momentum_path),
                 (self.new_weights, self.new_weights_path), (self.new_momentum, self.new_momentum_path),
                 [(piece, path) for piece, path in zip(self.pieces, self.piece_paths, strict=True)],
                 self.schedule_leaf, list(self.schedule_path)),)

    def to_json(self) -> dict:
        """A printable form (hex strings) of the proof, as ``audit`` shows it."""
        return {name: hexed(getattr(self, name)) for name in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict) -> AggregationProof:
        """The proof of its :meth:`to_json` form (a file's: LedgerInputError for anything else)."""
        try:
            optional = {"schedule_leaf", "schedule_path"}  # proofs kept before issue 62 have none
            if not isinstance(data, dict) or not set(cls.__dataclass_fields__) - optional <= set(data) <= set(
                    cls.__dataclass_fields__):
                raise ValueError("not the proof's fields")
            fields = {name: unhexed(value) for name, value in data.items()}
            for name in ("prev_record", "record"):
                fields[name] = tuple(fields[name])
            for name in ("stage", "chunk"):
                if not isinstance(fields[name], int):
                    raise ValueError(f"{name} is not a number")
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise LedgerInputError(f"not a fraud proof: {exc}"[:200]) from None


def genesis_record(run_id: int) -> tuple:
    """What a proof of round 0 gives as round -1's record: only its run id is read (round 0's start is the
    run's ``genesisRoot``)."""
    zero = bytes(32)
    return (run_id, 0, zero, zero, zero, 0, 0, 0, 0, zero)


def build_proof(prev_record, record, prev_stages: list[StageLeaf], committed_stages: list[StageLeaf],
                prev: StageState, committed: StageState, chunk: int, schedule=None) -> AggregationProof:
    """The proof that chunk ``chunk`` of stage ``committed.stage`` in ``record`` is not the outer step of
    ``prev`` (the state after round t - 1) with the committed round's factors and pieces.

    ``prev_stages`` and ``committed_stages`` are every stage leaf of each record (for the paths);
    ``committed`` is the state as the round's committers published it (its factors, pieces and leaves).
    Round 0: ``prev_record`` None, ``prev_stages`` the run's genesis stage leaves (its ``genesisRoot``).
    ``schedule``: the run's :class:`ledger.runvalues.Schedule` (None: a run created without one).
    """
    stage = committed.stage
    schedule_leaf, schedule_path = schedule.opening(record.round) if schedule is not None else (b"", [])
    prev_fields = genesis_record(record.run_id) if prev_record is None else prev_record.fields()
    prev_leaves = [leaf.encode() for leaf in prev_stages]
    new_leaves = [leaf.encode() for leaf in committed_stages]
    if not 0 <= chunk < len(prev.weight_leaves):
        raise LedgerInputError(f"chunk {chunk} outside the stage's {len(prev.weight_leaves)} chunks")
    return AggregationProof(
        prev_record=prev_fields, record=record.fields(), stage=stage, chunk=chunk,
        prev_stage_leaf=prev_leaves[stage], prev_stage_path=tree_path(prev_leaves, stage),
        stage_leaf=new_leaves[stage], stage_path=tree_path(new_leaves, stage),
        factors=committed.factors.encode(),
        prev_weights=prev.weight_leaves[chunk], prev_weights_path=tree_path(prev.weight_leaves, chunk),
        prev_momentum=prev.momentum_leaves[chunk], prev_momentum_path=tree_path(prev.momentum_leaves, chunk),
        new_weights=committed.weight_leaves[chunk], new_weights_path=tree_path(committed.weight_leaves,
                                                                               chunk),
        new_momentum=committed.momentum_leaves[chunk],
        new_momentum_path=tree_path(committed.momentum_leaves, chunk),
        pieces=[leaves[chunk] for leaves in committed.payload_leaves],
        piece_paths=[tree_path(leaves, chunk) for leaves in committed.payload_leaves],
        schedule_leaf=schedule_leaf, schedule_path=schedule_path,
    )


def first_difference(mine: StageState, committed: StageState) -> int | None:
    """The first chunk whose weights or momentum leaf differs between two states of a stage (None: none)."""
    for index, (a, b, c, d) in enumerate(zip(mine.weight_leaves, committed.weight_leaves,
                                             mine.momentum_leaves, committed.momentum_leaves)):
        if a != b or c != d:
            return index
    if len(mine.weight_leaves) != len(committed.weight_leaves):
        return min(len(mine.weight_leaves), len(committed.weight_leaves))
    return None
