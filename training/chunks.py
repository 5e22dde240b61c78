"""Chunk leaves of a stage's tensors and of a contribution's payload: what a fraud proof opens (issue 43).

A fraud proof (docs/FRAUD_PROOF.md) recomputes one chunk of one stage's outer step on chain. For that,
the weights, the outer momentum and every aggregated contribution are committed as Merkle trees whose
leaf ``i`` holds what chunk ``i`` needs, and nothing more. This module makes the leaves (bytes; the trees
and roots are ``ledger.chunkproof``'s, which knows no torch).

**Chunks.** A stage's tensors, names ascending (their UTF-8 bytes, as :mod:`training.hashing`), each seen
as the ``(m, n)`` matrix the codecs code it as (:func:`training.codec_wire.matrix_view_shape`) and
flattened row-major, are cut into chunks of :data:`CHUNK_ELEMENTS` consecutive elements (the last chunk
of a tensor may be shorter; an empty tensor has none). Chunk ``i`` is the ``i``-th over all tensors in
that order. 64 elements: a proof's gas is dominated by the soft-float operations of its elements (about
``M + 10`` per element for ``M`` contributions), so a small chunk keeps a proof at 16 contributions far
under 10M gas, while the tree over a 100M-element stage is only 21 levels deep (a few hundred bytes of
path per opened leaf).

**Tensor leaf** (weights or momentum), all integers big-endian::

    u32 tensor index   u64 element offset in the tensor   u64 n (columns of the matrix view)
    u32 count          count x u32: the float32 values' bit patterns

**Payload piece** of a contribution for a chunk, by codec (codec_wire's tags)::

    u8 codec   u32 count   then
    raw (0):      count x u32 float32 bits
    quant (1):    count x i16 q, count x u32 float32 bits of the scale of each element's column
    lowrank (2):  u8 rank r, u32 float32 bits of S, r x u16 w, u32 rows, rows x r x i16 P (the rows
                  from offset // n to (offset + count - 1) // n), count x r x i16 Q (the row of Q of
                  each element's column)

Each decodes exactly as :mod:`training.codec_wire` does: ``raw`` is the value, ``quant`` the float32
product ``float32(q) * s``, ``lowrank`` ``float32(float64(sum_k P_ik w_k Q_jk) * float64(S))``.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from training.codec_exact import unpack_ints
from training.codec_wire import decode_declared, matrix_view_shape
from training.errors import ContributionDecodeError
from training.spilled import shapes_of

CHUNK_ELEMENTS = 64
CODEC_TAGS = {"raw": 0, "quant": 1, "lowrank": 2}
_HEADER = struct.Struct(">IQQI")


@dataclass(frozen=True)
class ChunkPlace:
    """Where chunk ``index`` lies: ``count`` elements from ``offset`` of tensor ``tensor`` (``cols`` columns).
    """

    index: int
    tensor: int
    name: str
    offset: int
    cols: int
    count: int


def stage_layout(shapes: Mapping[str, tuple[int, ...]]) -> list[ChunkPlace]:
    """The chunks of a stage whose tensors have ``shapes`` (module docstring), in chunk order."""
    places = []
    for tensor, name, numel, cols in _tensor_order(shapes):
        for offset in range(0, numel, CHUNK_ELEMENTS):
            places.append(
                ChunkPlace(len(places), tensor, name, offset, cols, min(CHUNK_ELEMENTS, numel - offset))
            )
    return places


def _tensor_order(shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[int, str, int, int]]:
    """``(tensor index, name, elements, columns)`` of each tensor, in chunk order (names' UTF-8 bytes
    ascending)."""
    order = []
    for tensor, name in enumerate(sorted(shapes, key=lambda n: n.encode("utf-8"))):
        m, n = matrix_view_shape(tuple(shapes[name]))
        order.append((tensor, name, m * n, n))
    return order


# The leaves are built a tensor at a time, not a chunk at a time (issue 43: a chunk at a time, a stage of
# `mini` took longer than its aggregation): every chunk's bytes are a fixed-width row of one numpy array (the
# chunks of a tensor are all CHUNK_ELEMENTS long but its last), or a slice of a few contiguous buffers (a
# low-rank piece, whose rows of P vary), cut out of one bytes object. The bytes are the layout of the module
# docstring, pinned by tests/test_chunk_commitments.py.


def _rows(table: np.ndarray) -> list[bytes]:
    """One bytes per row of ``table`` (``(chunks, width)`` uint8): the leaves of a tensor's full chunks (a
    last chunk shorter than CHUNK_ELEMENTS is made by the caller)."""
    width = table.shape[1]
    data = np.ascontiguousarray(table).tobytes()
    return [data[i:i + width] for i in range(0, len(data), width)]


def _u8(array: np.ndarray, chunks: int) -> np.ndarray:
    """``array`` (big-endian, ``chunks * k`` items) as ``(chunks, k * itemsize)`` bytes."""
    return np.ascontiguousarray(array).view(np.uint8).reshape(chunks, -1)


def _chunk_counts(numel: int) -> tuple[int, int]:
    """``(full chunks, elements of the short last chunk)`` of a tensor of ``numel`` elements."""
    return numel // CHUNK_ELEMENTS, numel % CHUNK_ELEMENTS


def _bits_be(tensor: torch.Tensor) -> np.ndarray:
    """The float32 bit patterns of ``tensor``'s elements, row-major, as big-endian u32."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype != torch.float32:
        raise ContributionDecodeError(f"chunk leaves need float32 tensors, not {flat.dtype}")
    return flat.view(torch.int32).numpy().view(np.uint32).astype(">u4")


_HEADER_DTYPE = np.dtype([("tensor", ">u4"), ("offset", ">u8"), ("cols", ">u8"), ("count", ">u4")])


def tensor_leaves(tensors: Mapping[str, torch.Tensor], *, first_tensor: int = 0) -> list[bytes]:
    """The tensor leaves (module docstring) of a stage's weights or momentum, in chunk order.

    ``first_tensor``: the stage-wide index of the first of ``tensors`` (a cluster rank's shard of whole
    tensors, training/cluster_plan.py: its leaves are those of the whole stage's at its chunks)."""
    leaves: list[bytes] = []
    for tensor, name, numel, cols in _tensor_order(
        shapes_of(tensors)  # a state kept in a file: its shapes without reading it
    ):
        tensor += first_tensor
        bits = _bits_be(tensors[name])
        full, rest = _chunk_counts(numel)
        if full:
            headers = np.zeros(full, dtype=_HEADER_DTYPE)
            headers["tensor"], headers["cols"], headers["count"] = tensor, cols, CHUNK_ELEMENTS
            headers["offset"] = np.arange(full, dtype=np.uint64) * CHUNK_ELEMENTS
            leaves += _rows(np.hstack([headers.view(np.uint8).reshape(full, -1),
                                       _u8(bits[:full * CHUNK_ELEMENTS], full)]))
        if rest:
            offset = full * CHUNK_ELEMENTS
            leaves.append(_HEADER.pack(tensor, offset, cols, rest) + bits[offset:].tobytes())
    return leaves


def leaf_values(leaf: bytes) -> tuple[tuple[int, int, int, int], list[int]]:
    """``((tensor, offset, cols, count), bit patterns)`` of a tensor leaf (the inverse of its layout)."""
    header = _HEADER.unpack_from(leaf)
    return header, list(struct.unpack_from(f">{header[3]}I", leaf, _HEADER.size))


def payload_leaves(blob: bytes, shapes: Mapping[str, tuple[int, ...]], **decode_args) -> list[bytes]:
    """The payload pieces (module docstring) of one contribution, in chunk order.

    ``blob`` is first decoded strictly (:func:`training.codec_wire.decode_declared`, with
    ``decode_args``): a contribution that does not decode has no pieces (the error propagates).
    """
    decode_declared(blob, shapes, **decode_args)
    return cut_payload(blob, shapes)


def cut_payload(blob: bytes, shapes: Mapping[str, tuple[int, ...]]) -> list[bytes]:
    """The payload pieces of a contribution cut as :func:`payload_leaves` cuts them, without the strict
    decode: what a quorum that listed a contribution no honest decoder takes (a rank past the run's
    ``maxRank``) committed, for a proof that its piece does not decode on chain (node/live/fraud/values.py).
    Raises ValueError, KeyError, TypeError or IndexError for bytes whose entries cannot be cut at all."""
    entries = {entry["n"]: entry for entry in msgpack.unpackb(bytes(blob), raw=False)["t"]}
    leaves: list[bytes] = []
    for _tensor, name, numel, cols in _tensor_order(shapes):
        leaves += _pieces(_fields(entries[name], tuple(shapes[name]), name), numel, cols)
    return leaves


def _f32_bits(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u4").astype(">u4")


def _fields(entry: dict, shape: tuple[int, ...], name: str) -> dict:
    """A tensor's codec fields, unpacked once: the codec, its integers and float bit patterns (big-endian)."""
    m, n = matrix_view_shape(shape)
    codec = entry["c"]
    fields = {"codec": codec, "cols": n}
    if codec == "raw":
        fields["values"] = _f32_bits(entry["d"])
    elif codec == "quant":
        fields["q"] = unpack_ints(entry["q"], entry["b"], m * n, name).numpy().astype(">i2")
        fields["scales"] = _f32_bits(entry["x"])
    else:
        rank = entry["r"]
        fields["head"] = (struct.pack(">B", rank) + _f32_bits(entry["x"]).tobytes()
                          + np.frombuffer(entry["w"], dtype="<u2").astype(">u2").tobytes())
        fields["p"] = (
            unpack_ints(entry["p"], entry["b"], m * rank, name).numpy().reshape(m, rank).astype(">i2")
        )
        fields["q"] = (
            unpack_ints(entry["q"], entry["b"], n * rank, name).numpy().reshape(n, rank).astype(">i2")
        )
    return fields


def _pieces(fields: dict, numel: int, n: int, first: int = 0, last: int | None = None) -> list[bytes]:
    """The pieces of one tensor's chunks ``first`` to ``last`` (default: all; module docstring), in chunk
    order."""
    codec = fields["codec"]
    tag = CODEC_TAGS[codec]
    full, rest = _chunk_counts(numel)
    last = full + bool(rest) if last is None else last
    if codec == "lowrank":  # the rows of P a chunk touches vary: slices of contiguous buffers, joined
        return _lowrank_pieces(fields, numel, n, tag, first, last)
    if codec == "raw":
        parts = [fields["values"]]
    else:  # quant: each element's q, then the scale of its column
        parts = [fields["q"], fields["scales"]]
    pieces: list[bytes] = []
    stop = min(last, full)
    if first < stop:
        head = np.frombuffer(struct.pack(">BI", tag, CHUNK_ELEMENTS), dtype=np.uint8)
        span = slice(first * CHUNK_ELEMENTS, stop * CHUNK_ELEMENTS)
        table = np.hstack([np.broadcast_to(head, (stop - first, head.size)),
                           *(_u8(part, stop - first) for part in _spans(parts, span, n))])
        pieces += _rows(table)
    if rest and last > full:
        span = slice(full * CHUNK_ELEMENTS, numel)
        tail = b"".join(part.tobytes() for part in _spans(parts, span, n))
        pieces.append(struct.pack(">BI", tag, rest) + tail)
    return pieces


def _spans(parts: list[np.ndarray], span: slice, n: int) -> list[np.ndarray]:
    """The elements ``span`` of each of a raw or quant tensor's ``parts``: its values (or q) as they are, the
    scales (a quant tensor's second part, one per column) repeated for each element's column."""
    out = [parts[0][span]]
    if len(parts) > 1:
        out.append(parts[1][np.arange(span.start, span.stop) % n])
    return out


def _lowrank_pieces(fields: dict, numel: int, n: int, tag: int, first: int, last: int) -> list[bytes]:
    rank = fields["p"].shape[1]
    stride = 2 * rank
    # row i: [stride i, stride (i+1))
    p_rows = memoryview(np.ascontiguousarray(fields["p"]).view(np.uint8)).cast("B")
    # a chunk spans at most two rows: its elements' rows of Q are one or two runs of Q
    if n >= CHUNK_ELEMENTS:
        q_rows = memoryview(np.ascontiguousarray(fields["q"]).view(np.uint8)).cast("B")

        def q_part(start: int, stop: int) -> list:
            first, last = start % n, (stop - 1) % n
            if first <= last:
                return [q_rows[first * stride:(last + 1) * stride]]
            return [q_rows[first * stride:], q_rows[:(last + 1) * stride]]
    else:  # many rows per chunk: each element's row of Q gathered for the chunks cut
        base = first * CHUNK_ELEMENTS
        q_cols = memoryview(np.ascontiguousarray(
            fields["q"][np.arange(base, min(numel, last * CHUNK_ELEMENTS)) % n]).view(np.uint8)).cast("B")

        def q_part(start: int, stop: int) -> list:
            return [q_cols[(start - base) * stride:(stop - base) * stride]]
    head = fields["head"]
    pieces = []
    for start in range(first * CHUNK_ELEMENTS, min(numel, last * CHUNK_ELEMENTS), CHUNK_ELEMENTS):
        stop = min(start + CHUNK_ELEMENTS, numel)
        row0, row1 = start // n, (stop - 1) // n + 1
        pieces.append(b"".join((struct.pack(">BI", tag, stop - start), head, struct.pack(">I", row1 - row0),
                                p_rows[row0 * stride:row1 * stride], *q_part(start, stop))))
    return pieces


#: Chunks a :class:`CutPayload` cuts at once while it is read in order (a low-rank piece is about 4 KB at rank
#: 32: 8 MB at most; 64 MB at 16384, on each thread that reads one, was a llama-20m node's peak, issue 75).
_CUT_CHUNKS = 2048


class CutPayload(Sequence[bytes]):
    """The payload pieces of one contribution, :func:`cut_payload`'s bytes in its order, cut from the codec
    blob as they are read instead of held: a low-rank piece carries a row of Q per element, so a
    contribution's pieces are about a thousand times its blob (a llama-20m stage's 1.15 MB blob: 1.2 GB of
    pieces), and a node holds a round's for every accepted contribution until the round's window closes.
    Read in order (a Merkle tree over them) it holds ``_CUT_CHUNKS`` pieces at a time; ``pieces[i]`` cuts the
    one chunk. The blob must cut (``ValueError``, ``KeyError``, ``TypeError``, ``IndexError`` as
    :func:`cut_payload`, raised here)."""

    __slots__ = ("blob", "shapes", "_order", "_starts")

    def __init__(self, blob: bytes, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.blob = bytes(blob)
        self.shapes = {name: tuple(shape) for name, shape in shapes.items()}
        self._order = _tensor_order(self.shapes)
        starts, total = [], 0
        for _tensor, _name, numel, _cols in self._order:
            starts.append(total)
            total += -(-numel // CHUNK_ELEMENTS)
        self._starts = starts + [total]
        for k in range(len(self._order)):  # every tensor's fields unpack, as cut_payload's would
            self._fields(self._entries(), k)

    def _entries(self) -> dict:
        return {entry["n"]: entry for entry in msgpack.unpackb(self.blob, raw=False)["t"]}

    def _fields(self, entries: dict, k: int) -> dict:
        _tensor, name, _numel, _cols = self._order[k]
        return _fields(entries[name], self.shapes[name], name)

    def __len__(self) -> int:
        return self._starts[-1]

    def __iter__(self) -> Iterator[bytes]:
        entries = self._entries()
        for k, (_tensor, _name, numel, cols) in enumerate(self._order):
            fields, count = self._fields(entries, k), self._starts[k + 1] - self._starts[k]
            for first in range(0, count, _CUT_CHUNKS):
                yield from _pieces(fields, numel, cols, first, min(count, first + _CUT_CHUNKS))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"piece {index} outside {len(self)} chunks")
        k = bisect.bisect_right(self._starts, index) - 1
        chunk = index - self._starts[k]
        _tensor, _name, numel, cols = self._order[k]
        return _pieces(self._fields(self._entries(), k), numel, cols, chunk, chunk + 1)[0]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes, bytearray)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list

    def __reduce__(self):
        return CutPayload, (self.blob, self.shapes)


def payload_pieces(blob: bytes, shapes: Mapping[str, tuple[int, ...]], **decode_args) -> CutPayload:
    """:func:`payload_leaves` as a :class:`CutPayload` (the same strict decode first, the same pieces)."""
    decode_declared(blob, shapes, **decode_args)
    return CutPayload(blob, shapes)


def float32_bits(value: float) -> int:
    """The bit pattern of ``value`` rounded to float32 (how the outer step's scalars are committed)."""
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def float64_bits(value: float) -> int:
    """The bit pattern of the double ``value`` (a clip scale)."""
    if not isinstance(value, float) or math.isnan(value):
        raise ValueError(f"clip scale {value!r} is not a number")
    return struct.unpack(">Q", struct.pack(">d", value))[0]
