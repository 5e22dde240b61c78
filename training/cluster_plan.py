"""How a cluster node's stage is cut into shards, and a contribution with it (issue 75; docs/CLUSTER.md).

A node that is a cluster trains one stage with N processes (:mod:`training.cluster_engine`). Its outer
state (round-start and global weights, outer momentum, error-feedback residual) is cut into N shards, one
per rank, by :func:`plan_shards`: the stage's tensors in chunk order (names ascending by their UTF-8 bytes,
as :mod:`training.hashing` and :mod:`training.chunks` order them) split into N contiguous runs of whole
tensors, the largest run as small as possible. Whole tensors, because everything the record computes per
tensor then stays on one rank: a tensor's codec entry (low rank needs the whole matrix), its outer learning
rate group, its chunk leaves (every tensor starts a new chunk, so a shard is a contiguous range of chunk
indices). The plan is a pure function of the shapes and N: every rank, every replica and a verifier get
the same one.

A contribution (:mod:`training.codec_wire`'s message, one entry per tensor, names ascending) cuts along the
plan: :func:`split_contribution` gives each rank a message of the same header holding its tensors' entries,
:func:`join_contribution` puts the ranks' messages back into one, byte for byte the message the entries
make (``join(split(blob)) == blob`` for every well-formed blob).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from training.chunks import CHUNK_ELEMENTS
from training.codec_wire import MSGPACK_ERRORS, decode_declared, matrix_view_shape
from training.errors import ContributionDecodeError, ContributionShapeError, EngineStateError

#: The fingerprint's ``cluster`` field for a stage trained by N processes (training/fingerprint.py).
CLUSTER_KIND = "fsdp2"


def cluster_identity(world: int) -> str:
    """The fingerprint's ``cluster`` value of an N-process node ("" for one process: the field is left
    out)."""
    return "" if world == 1 else f"{CLUSTER_KIND};ranks={world}"


def _chunks_of(shape: tuple[int, ...]) -> int:
    m, n = matrix_view_shape(tuple(shape))
    return math.ceil(m * n / CHUNK_ELEMENTS)


@dataclass(frozen=True)
class ShardPlan:
    """The shards of one stage over ``world`` ranks: ``names[r]`` the tensors of rank r, in chunk order."""

    world: int
    shapes: dict[str, tuple[int, ...]]
    names: tuple[tuple[str, ...], ...]

    @property
    def order(self) -> list[str]:
        """Every tensor in chunk order."""
        return [name for shard in self.names for name in shard]

    def owner(self, name: str) -> int:
        for rank, shard in enumerate(self.names):
            if name in shard:
                return rank
        raise KeyError(name)

    def shard_shapes(self, rank: int) -> dict[str, tuple[int, ...]]:
        return {name: self.shapes[name] for name in self.names[rank]}

    def numel(self, rank: int | None = None) -> int:
        """Elements of rank ``rank``'s shard (None: of the whole stage)."""
        names = self.order if rank is None else self.names[rank]
        return sum(math.prod(self.shapes[name]) for name in names)

    def tensor_base(self, rank: int) -> int:
        """The stage-wide index of rank ``rank``'s first tensor (the tensor leaves' header counts from it)."""
        return sum(len(shard) for shard in self.names[:rank])

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """``[first, stop)``: the stage's chunk indices rank ``rank``'s tensors cover."""
        first = sum(_chunks_of(self.shapes[name]) for shard in self.names[:rank] for name in shard)
        return first, first + sum(_chunks_of(self.shapes[name]) for name in self.names[rank])

    @property
    def total_chunks(self) -> int:
        return sum(_chunks_of(shape) for shape in self.shapes.values())

    def shard_budget(self, stage_budget: int, rank: int) -> int:
        """Rank ``rank``'s share of a stage's byte budget per contribution, ``floor(B * n_r / n)`` (0: code
        to the error budget, as the stage would)."""
        if stage_budget <= 0:
            return 0
        return max(1, stage_budget * self.numel(rank) // max(1, self.numel()))


def plan_shards(shapes: Mapping[str, Sequence[int]], world: int) -> ShardPlan:
    """The :class:`ShardPlan` of a stage of ``shapes`` over ``world`` ranks (module docstring).

    The split minimises the largest shard's elements over every cut of the ordered tensors into ``world``
    non-empty runs (ties: the earliest cuts). Raises :class:`EngineStateError` for ``world < 1`` or more
    ranks than tensors.
    """
    if not isinstance(world, int) or world < 1:
        raise EngineStateError(f"cluster of {world!r} processes: must be at least 1")
    order = sorted(shapes, key=lambda n: n.encode("utf-8"))
    if world > len(order):
        raise EngineStateError(f"cluster of {world} processes for a stage of {len(order)} tensors: every "
                               "rank holds at least one whole tensor")
    sizes = [math.prod(tuple(shapes[name])) for name in order]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    count = len(order)
    # best[j][i]: the smallest largest run cutting the first i tensors into j runs; cut[j][i] its last cut.
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(world + 1)]
    cut = [[0] * (count + 1) for _ in range(world + 1)]
    best[0][0] = 0
    for j in range(1, world + 1):
        for i in range(j, count - (world - j) + 1):
            for k in range(j - 1, i):
                value = max(best[j - 1][k], prefix[i] - prefix[k])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, k
    bounds, i = [], count
    for j in range(world, 0, -1):
        bounds.append((cut[j][i], i))
        i = cut[j][i]
    names = tuple(tuple(order[a:b]) for a, b in reversed(bounds))
    return ShardPlan(world, {name: tuple(shapes[name]) for name in order}, names)


def _header(message: dict) -> dict:
    return {key: value for key, value in message.items() if key != "t"}


def split_contribution(blob: bytes, plan: ShardPlan, *, stage_index: int | None = None,
                       outer_round: int | None = None) -> list[bytes]:
    """One message per rank: ``blob``'s header with the entries of that rank's tensors (module docstring).

    The message-level checks are :func:`training.codec_wire.decode_declared`'s (the same errors); the
    entries themselves are each rank's to decode. Raises :class:`ContributionDecodeError` (or a subclass)
    for a blob that does not split.
    """
    try:
        message = msgpack.unpackb(bytes(blob), raw=False, use_list=True, strict_map_key=True,
                                  max_str_len=4096, max_map_len=16, max_ext_len=0)
    except MSGPACK_ERRORS:  # a malformed blob: the stage's own decoder names the error
        message = None
    if not isinstance(message, dict) or not isinstance(message.get("t"), list):
        decode_declared(blob, plan.shapes, stage_index=stage_index, outer_round=outer_round)
        raise ContributionDecodeError("contribution does not split into the cluster's shards")
    header = msgpack.packb({**_header(message), "t": []}, use_bin_type=True)
    # the header's checks: version, keys, stage, round
    decode_declared(header, {}, stage_index=stage_index, outer_round=outer_round)
    entries = message["t"]
    if len(entries) != len(plan.shapes):
        raise ContributionShapeError(f"contribution has {len(entries)} tensors, the stage has "
                                     f"{len(plan.shapes)}")
    parts, start = [], 0
    for shard in plan.names:
        parts.append(msgpack.packb({**_header(message), "t": entries[start:start + len(shard)]},
                                   use_bin_type=True))
        start += len(shard)
    return parts


def join_contribution(parts: Sequence[bytes]) -> bytes:
    """The ranks' messages (same header, their entries) as one message, entries in rank order."""
    if not parts:
        raise ContributionDecodeError("no shard messages to join")
    messages = [msgpack.unpackb(bytes(part), raw=False) for part in parts]
    header = _header(messages[0])
    if any(_header(message) != header for message in messages[1:]):
        raise ContributionDecodeError("the shard messages' headers differ")
    return msgpack.packb({**header, "t": [entry for message in messages for entry in message["t"]]},
                         use_bin_type=True)
