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

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack
import numpy as np
import torch

from training.codec_wire import decode_declared, matrix_view_shape, unpack_ints
from training.errors import ContributionDecodeError

CHUNK_ELEMENTS = 64
CODEC_TAGS = {"raw": 0, "quant": 1, "lowrank": 2}
_HEADER = struct.Struct(">IQQI")


@dataclass(frozen=True)
class ChunkPlace:
    """Where chunk ``index`` lies: ``count`` elements from ``offset`` of tensor ``tensor`` (``cols`` columns)."""

    index: int
    tensor: int
    name: str
    offset: int
    cols: int
    count: int


def stage_layout(shapes: Mapping[str, tuple[int, ...]]) -> list[ChunkPlace]:
    """The chunks of a stage whose tensors have ``shapes`` (module docstring), in chunk order."""
    places = []
    for tensor, name in enumerate(sorted(shapes, key=lambda n: n.encode("utf-8"))):
        m, n = matrix_view_shape(tuple(shapes[name]))
        numel = m * n
        for offset in range(0, numel, CHUNK_ELEMENTS):
            places.append(ChunkPlace(len(places), tensor, name, offset, n, min(CHUNK_ELEMENTS, numel - offset)))
    return places


def _bits_be(tensor: torch.Tensor) -> np.ndarray:
    """The float32 bit patterns of ``tensor``'s elements, row-major, as big-endian u32."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.dtype != torch.float32:
        raise ContributionDecodeError(f"chunk leaves need float32 tensors, not {flat.dtype}")
    return flat.view(torch.int32).numpy().view(np.uint32).astype(">u4")


def tensor_leaves(tensors: Mapping[str, torch.Tensor]) -> list[bytes]:
    """The tensor leaves (module docstring) of a stage's weights or momentum, in chunk order."""
    layout = stage_layout({name: tuple(value.shape) for name, value in tensors.items()})
    bits = {name: _bits_be(value) for name, value in tensors.items()}
    return [_HEADER.pack(p.tensor, p.offset, p.cols, p.count) + bits[p.name][p.offset:p.offset + p.count].tobytes()
            for p in layout]


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
    entries = {entry["n"]: entry for entry in msgpack.unpackb(bytes(blob), raw=False)["t"]}
    fields = {name: _fields(entries[name], tuple(shape), name) for name, shape in shapes.items()}
    return [_piece(fields[place.name], place) for place in stage_layout(shapes)]


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
        fields["p"] = unpack_ints(entry["p"], entry["b"], m * rank, name).numpy().reshape(m, rank).astype(">i2")
        fields["q"] = unpack_ints(entry["q"], entry["b"], n * rank, name).numpy().reshape(n, rank).astype(">i2")
    return fields


def _piece(fields: dict, place: ChunkPlace) -> bytes:
    codec, n = fields["codec"], fields["cols"]
    head = struct.pack(">BI", CODEC_TAGS[codec], place.count)
    start, stop = place.offset, place.offset + place.count
    if codec == "raw":
        return head + fields["values"][start:stop].tobytes()
    if codec == "quant":
        return head + fields["q"][start:stop].tobytes() + fields["scales"][np.arange(start, stop) % n].tobytes()
    rows = fields["p"][start // n:(stop - 1) // n + 1]
    cols = fields["q"][np.arange(start, stop) % n]
    return head + fields["head"] + struct.pack(">I", rows.shape[0]) + rows.tobytes() + cols.tobytes()


def float32_bits(value: float) -> int:
    """The bit pattern of ``value`` rounded to float32 (how the outer step's scalars are committed)."""
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


def float64_bits(value: float) -> int:
    """The bit pattern of the double ``value`` (a clip scale)."""
    if not isinstance(value, float) or math.isnan(value):
        raise ValueError(f"clip scale {value!r} is not a number")
    return struct.unpack(">Q", struct.pack(">d", value))[0]
