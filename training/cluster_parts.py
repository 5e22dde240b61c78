"""The exchange's parts of a contribution: the cut every node agrees on (issue 75; docs/SCALE.md, "The
per-shard exchange of a node that is a cluster").

A run with ``diloco.exchange_parts = P > 1`` moves each contribution as P parts. The cut is
:func:`exchange_plan`: :func:`training.cluster_plan.plan_shards` of the stage's shapes into ``min(P,
tensors)`` runs of whole tensors in chunk order, a pure function of the shapes and the run document, so every
node, whatever its number of processes, and every auditor cut alike. A part is a byte range of the
contribution (codec_wire's message ``{"v", "st", "rd"[, "ns"], "t": [entry, ...]}``, ``"t"`` last, one entry
per tensor in chunk order): part 0 runs from the message's start to the end of its tensors' entries, part j
holds exactly its tensors' entries (:func:`blob_cuts`), so the parts' concatenation is the contribution, byte
for byte, and the envelope's parts root (p2p/parts.py) binds them.

The entries of a run of tensors, with the message's *prefix* (its bytes up to the entries' array) and an
array header of their count, are a message of its own: :func:`shard_message` gives exactly
``split_contribution``'s message for those tensors. A cluster node of N ranks holds its outer state by its own
plan (``plan_shards(shapes, N)``); both cuts are by whole tensors in the same order, so a part's tensors
belong to one rank or a few consecutive ones (:func:`part_routes`), and rank 0 cuts an arriving part's entries
at the ranks' boundaries (:func:`cut_entries`) and forwards each piece (:mod:`training.cluster_exchange`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from training.cluster_plan import ShardPlan, plan_shards
from training.codec_wire import MSGPACK_ERRORS
from training.errors import ContributionDecodeError, EngineStateError

_LIMITS = dict(raw=False, strict_map_key=True, max_str_len=4096, max_map_len=16, max_ext_len=0)


def exchange_plan(shapes: Mapping[str, Sequence[int]], parts: int) -> ShardPlan:
    """The parts' cut of a stage of ``shapes``: ``plan_shards(shapes, min(parts, tensors))``."""
    if type(parts) is not int or parts < 1:
        raise EngineStateError(f"exchange_parts={parts!r}: must be a whole number >= 1")
    return plan_shards(shapes, min(parts, len(shapes)))


@dataclass(frozen=True)
class BlobLayout:
    """Where a contribution's entries lie: ``prefix`` (the bytes up to the entries' array header), the offset
    of the first entry and each entry's end."""

    prefix: bytes
    entries_at: int
    ends: tuple[int, ...]


def blob_layout(blob: bytes) -> BlobLayout:
    """The layout of a codec_wire message (``"t"`` its last key); ContributionDecodeError otherwise."""
    # read as a stream (a BytesIO shares a bytes object): the unpacker buffers about one entry, not the blob
    stream = io.BytesIO(blob if type(blob) is bytes else bytes(blob))
    unpacker = msgpack.Unpacker(stream, read_size=min(1 << 16, len(blob) + 1), max_buffer_size=len(blob) + 1,
                                **_LIMITS)
    array_at = None
    try:
        keys = unpacker.read_map_header()
        for index in range(keys):
            key = unpacker.unpack()
            if key == "t" and index == keys - 1:
                array_at = unpacker.tell()
                count = unpacker.read_array_header()
                entries_at = unpacker.tell()
                ends = []
                for _ in range(count):
                    unpacker.skip()
                    ends.append(unpacker.tell())
                break
            unpacker.skip()
    except MSGPACK_ERRORS + (msgpack.OutOfData,) as exc:
        raise ContributionDecodeError(f"contribution is not a codec message: {type(exc).__name__}") from None
    if array_at is None:
        raise ContributionDecodeError("contribution has no entries array as its last field")
    if (ends[-1] if ends else entries_at) != len(blob):
        raise ContributionDecodeError("bytes after the contribution's entries")
    return BlobLayout(bytes(blob[:array_at]), entries_at, tuple(ends))


def blob_cuts(blob: bytes, plan: ShardPlan) -> list[int]:
    """The sizes of ``blob``'s parts along ``plan`` (module docstring); they sum to ``len(blob)``."""
    layout = blob_layout(blob)
    if len(layout.ends) != len(plan.shapes):
        raise ContributionDecodeError(f"contribution has {len(layout.ends)} tensors, the stage has "
                                      f"{len(plan.shapes)}")
    sizes, start, used = [], 0, 0
    for shard in plan.names:
        used += len(shard)
        end = layout.ends[used - 1]
        sizes.append(end - start)
        start = end
    return sizes


def array_header(count: int) -> bytes:
    return msgpack.Packer().pack_array_header(count)


def shard_message(prefix: bytes, entries: bytes, count: int) -> bytes:
    """The message of ``count`` consecutive entries (their raw bytes) under a contribution's ``prefix``."""
    return bytes(prefix) + array_header(count) + bytes(entries)


def first_part(part: bytes) -> tuple[bytes, bytes]:
    """Part 0 of a contribution (its start, as far as its own entries) as (the prefix, its entries' bytes)."""
    unpacker = msgpack.Unpacker(None, max_buffer_size=len(part) + 1, **_LIMITS)
    unpacker.feed(bytes(part))
    try:
        keys = unpacker.read_map_header()
        for _ in range(keys - 1):
            unpacker.skip()
            unpacker.skip()
        last = unpacker.unpack()
        array_at = unpacker.tell()
        unpacker.read_array_header()
        entries_at = unpacker.tell()
    except MSGPACK_ERRORS + (msgpack.OutOfData,) as exc:
        raise ContributionDecodeError(f"part 0 is not a contribution's start: {type(exc).__name__}") from None
    if last != "t":
        raise ContributionDecodeError("contribution's last field is not its entries")
    return bytes(part[:array_at]), bytes(part[entries_at:])


def cut_entries(entries: bytes, counts: Sequence[int]) -> list[bytes]:
    """Raw consecutive entries cut into runs of ``counts`` entries (all of them used, nothing left)."""
    unpacker = msgpack.Unpacker(None, max_buffer_size=len(entries) + 1, **_LIMITS)
    unpacker.feed(bytes(entries))
    pieces, start = [], 0
    try:
        for count in counts:
            for _ in range(count):
                unpacker.skip()
            pieces.append(bytes(entries[start:unpacker.tell()]))
            start = unpacker.tell()
    except MSGPACK_ERRORS + (msgpack.OutOfData,) as exc:
        raise ContributionDecodeError(f"a part's entries do not cut: {type(exc).__name__}") from None
    if start != len(entries):
        raise ContributionDecodeError("a part holds more entries than its tensors")
    return pieces


def part_routes(parts_plan: ShardPlan, ranks_plan: ShardPlan) -> list[list[tuple[int, int]]]:
    """Per part, ``[(rank, how many of the part's tensors that rank holds), ...]`` in order: where rank 0
    forwards its pieces. Both plans cut the same tensors in the same order (refused otherwise)."""
    if parts_plan.order != ranks_plan.order or parts_plan.shapes != ranks_plan.shapes:
        raise EngineStateError("the parts' cut and the ranks' cut are of different stages")
    owner = {name: rank for rank, shard in enumerate(ranks_plan.names) for name in shard}
    routes = []
    for names in parts_plan.names:
        route: list[list[int]] = []
        for name in names:
            if route and route[-1][0] == owner[name]:
                route[-1][1] += 1
            else:
                route.append([owner[name], 1])
        routes.append([(rank, count) for rank, count in route])
    return routes
