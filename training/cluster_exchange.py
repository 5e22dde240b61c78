"""Rank 0 of a cluster node forwards each part of a contribution to the ranks that own its tensors as the part
arrives (issue 75; docs/SCALE.md, "The per-shard exchange of a node that is a cluster").

The exchange's parts (:mod:`training.cluster_parts`: P runs of whole tensors in chunk order, the cut every
node agrees on) and the cluster's shards (``plan_shards(shapes, N)``) are both whole-tensor cuts of the same
order, so a part's entries belong to one rank or a few consecutive ones. :class:`PartForwarder` on rank 0
takes a part (its bytes relative to the codec blob: part 0 without the contribution body's head), cuts its
entries at the ranks' boundaries (:func:`training.cluster_parts.cut_entries`) and sends each piece to its rank
with gloo point to point (a fixed header ``(contribution, part, bytes)`` as int64, then the bytes), keeping
its own pieces; part 0 also gives every rank the blob's *prefix* (the bytes before the entries). Rank 0 holds
one part at a time per caller (a fetch stream), never a whole contribution. :func:`receive_shards` on every
other rank takes exactly the pieces its tensors need, in whatever order the parts arrived, and both sides end
with each contribution's message of that rank's tensors: ``split_contribution(blob, ranks_plan)[rank]``, byte
for byte. A part whose entries do not cut is announced to its ranks as failed (bytes = -1): that
contribution's shard is None on every rank that owns some of it, with the reason, as a split that fails.

Sends are serialised by a lock (gloo's point-to-point order between two ranks is the order of the calls),
so parts may arrive on several threads. No libp2p here: the node hands the parts in.

A cluster node's apply (training/cluster_outer.py, the ``finish`` command) gets each rank its message of
every closed contribution with :func:`forward_to_ranks` in a run in parts (``diloco.exchange_parts`` > 1):
rank 0 checks each contribution as ``split_contribution`` does, then forwards it a part at a time from the
bytes the node holds; without parts, :func:`split_to_ranks` splits each whole and scatters the pieces. Both
give every rank the same messages and the same errors.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from training.cluster_parts import (array_header, blob_cuts, cut_entries, first_part, part_routes,
                                    shard_message)
from training.cluster_plan import ShardPlan, join_contribution, split_contribution
from training.codec_wire import decode_declared
from training.errors import ContributionDecodeError

logger = logging.getLogger(__name__)

_PREFIX = -1  # the part index of a blob prefix message
_FAILED = -1  # the byte count of a failed part


def _send(header: tuple[int, int, int], data: bytes, rank: int) -> None:
    dist.send(torch.tensor(header, dtype=torch.int64), dst=rank)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=rank)


def _expected(routes: Sequence[Sequence[tuple[int, int]]], rank: int) -> int:
    """Messages rank ``rank`` gets per contribution: one per part that holds some of its tensors, and the
    prefix."""
    return 1 + sum(1 for route in routes if any(r == rank for r, _ in route))


class _Shards:
    """One rank's pieces of each contribution, assembled in part order once all are here."""

    def __init__(self, ranks_plan: ShardPlan, rank: int, contributions: int) -> None:
        self.count = len(ranks_plan.names[rank])
        self.prefix: dict[int, bytes] = {}
        self.pieces: list[dict[int, bytes]] = [{} for _ in range(contributions)]
        self.failed: dict[int, str] = {}

    def take(self, contribution: int, part: int, data: bytes | None, why: str = "") -> None:
        if data is None:
            self.failed.setdefault(contribution, why or f"part {part} of contribution {contribution} failed")
        elif part == _PREFIX:
            self.prefix[contribution] = data
        else:
            self.pieces[contribution][part] = data

    def messages(self) -> tuple[list[bytes | None], dict[int, str]]:
        out: list[bytes | None] = []
        for index in range(len(self.pieces)):
            pieces, self.pieces[index] = self.pieces[index], {}  # dropped once joined
            if index in self.failed or index not in self.prefix:
                self.failed.setdefault(index, f"contribution {index}: its start never came")
                out.append(None)
                continue
            out.append(shard_message(self.prefix[index], b"".join(pieces[part] for part in sorted(pieces)),
                                     self.count))
            del pieces
        return out, dict(self.failed)


class PartForwarder:
    """Rank 0's side (module docstring): :meth:`forward` each part as it arrives, then :meth:`shards`."""

    def __init__(self, parts_plan: ShardPlan, ranks_plan: ShardPlan, contributions: int) -> None:
        self.routes = part_routes(parts_plan, ranks_plan)
        self.world = ranks_plan.world
        self._own = _Shards(ranks_plan, 0, contributions)
        self._lock = threading.Lock()
        self.sent_bytes = 0

    def forward(self, contribution: int, index: int, part: bytes) -> None:
        """Part ``index`` of contribution ``contribution`` (bytes relative to the codec blob) to its ranks."""
        route = self.routes[index]
        try:
            prefix, entries = first_part(part) if index == 0 else (None, part)
            pieces = cut_entries(entries, [count for _, count in route])
        except ContributionDecodeError as exc:
            self._fail(contribution, index, f"part {index}: {exc}", route)
            return
        with self._lock:
            if prefix is not None:
                self._own.take(contribution, _PREFIX, prefix)
                for rank in range(1, self.world):
                    _send((contribution, _PREFIX, len(prefix)), prefix, rank)
            for (rank, _), piece in zip(route, pieces):
                if rank == 0:
                    self._own.take(contribution, index, piece)
                else:
                    _send((contribution, index, len(piece)), piece, rank)
                    self.sent_bytes += len(piece)

    def _fail(self, contribution: int, index: int, why: str, route) -> None:
        with self._lock:
            if any(r == 0 for r, _ in route):
                self._own.take(contribution, index, None, why)
            for rank in {r for r, _ in route if r != 0}:
                _send((contribution, index, _FAILED), b"", rank)
            if index == 0:  # the prefix message every rank waits for
                self._own.take(contribution, _PREFIX, None, why)
                for rank in range(1, self.world):
                    _send((contribution, _PREFIX, _FAILED), b"", rank)

    def missing(self, contribution: int, count: int) -> None:
        """Contribution ``contribution`` will not come (``count`` parts): every rank is told, part by part."""
        for index in range(count):
            self._fail(contribution, index, f"contribution {contribution} did not come", self.routes[index])

    def shards(self) -> tuple[list[bytes | None], dict[int, str]]:
        """Rank 0's message of each contribution (None where it failed) and the failures' reasons."""
        return self._own.messages()


def receive_shards(parts_plan: ShardPlan, ranks_plan: ShardPlan, rank: int,
                   contributions: int) -> tuple[list[bytes | None], dict[int, str]]:
    """A worker's side (module docstring): its message of each contribution (None where one failed)."""
    routes = part_routes(parts_plan, ranks_plan)
    shards = _Shards(ranks_plan, rank, contributions)
    for _ in range(_expected(routes, rank) * contributions):
        header = torch.zeros(3, dtype=torch.int64)
        dist.recv(header, src=0)
        contribution, part, size = (int(v) for v in header)
        if size == _FAILED:
            shards.take(contribution, part, None,
                        f"part {part} of contribution {contribution} failed on rank 0")
            continue
        data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.recv(data, src=0)
        shards.take(contribution, part, data.numpy().tobytes())
    return shards.messages()


def split_to_ranks(contributions: Sequence[bytes] | None, ranks_plan: ShardPlan, rank: int, *,
                   stage_index: int, outer_round: int):
    """Whole contributions cut on rank 0 (``split_contribution``) and scattered (``scatter_object_list``):
    ``(this rank's message of each contribution, {index: the error of one that does not split})``. The path
    of a run without parts (``diloco.exchange_parts = 1``)."""
    bundles = None
    if rank == 0:
        world = ranks_plan.world
        per_rank: list[list[bytes | None]] = [[] for _ in range(world)]
        errors: dict[int, ContributionDecodeError] = {}
        for index, blob in enumerate(contributions):
            try:
                parts = split_contribution(blob, ranks_plan, stage_index=stage_index, outer_round=outer_round)
            except ContributionDecodeError as exc:
                parts, errors[index] = [None] * world, exc
            for r in range(world):
                per_rank[r].append(parts[r])
        bundles = [(per_rank[r], errors) for r in range(world)]
    received: list = [None]
    dist.scatter_object_list(received, bundles, src=0)
    return received[0]


def _checked_cut(blob: bytes, parts_plan: ShardPlan, ranks_plan: ShardPlan, stage_index: int,
                 outer_round: int) -> tuple[bytes, list[int]]:
    """``(the blob to forward, its parts' sizes)``: the blob itself when it is laid out as a contribution
    (entries last) and its header passes ``split_contribution``'s checks; otherwise ``split_contribution``
    decides (its error raised, or the message re-encoded as the join of its pieces, which cuts alike)."""
    try:
        sizes = blob_cuts(blob, parts_plan)
        prefix, _entries = first_part(bytes(blob[:sizes[0]]))
        decode_declared(prefix + array_header(0), {}, stage_index=stage_index, outer_round=outer_round)
        return blob, sizes
    except ContributionDecodeError:
        pass  # the split's own verdict below: the same error, or a message it takes in another layout
    pieces = split_contribution(blob, ranks_plan, stage_index=stage_index, outer_round=outer_round)
    joined = join_contribution(pieces)
    return joined, blob_cuts(joined, parts_plan)


def forward_to_ranks(contributions: Sequence[bytes] | None, parts_plan: ShardPlan, ranks_plan: ShardPlan,
                     rank: int, count: int, *, stage_index: int, outer_round: int):
    """:func:`split_to_ranks`'s result, the same on every rank, without the scatter (a run in parts): rank 0
    checks each contribution as the split does (the errors broadcast: a few objects), then cuts each along
    ``parts_plan`` and hands its parts one at a time to a :class:`PartForwarder`; the other ranks take their
    pieces (:func:`receive_shards`). Rank 0 holds one part and its own pieces, never a copy of every
    contribution nor every rank's pieces at once."""
    errors: dict[int, ContributionDecodeError] = {}
    cuts: dict[int, tuple[bytes | None, list[int]]] = {}  # a re-encoded blob kept only where it differs
    if rank == 0:
        for index, blob in enumerate(contributions):
            try:
                checked, sizes = _checked_cut(blob, parts_plan, ranks_plan, stage_index, outer_round)
            except ContributionDecodeError as exc:
                errors[index] = exc
                continue
            cuts[index] = (None if checked is blob else checked, sizes)
            del checked
    shared: list = [errors]
    dist.broadcast_object_list(shared, src=0)
    errors = shared[0]
    if rank == 0:
        forwarder = PartForwarder(parts_plan, ranks_plan, count)
        for index, blob in enumerate(contributions):
            if index in errors:
                forwarder.missing(index, len(parts_plan.names))
                continue
            joined, sizes = cuts.pop(index)
            view, start = memoryview(blob if joined is None else joined), 0
            for part, size in enumerate(sizes):
                forwarder.forward(index, part, bytes(view[start:start + size]))
                start += size
            del view, joined
        messages, failed = forwarder.shards()
        logger.info("round %d stage %d: %d contributions forwarded to %d ranks in %d parts (%d bytes sent)",
                    outer_round, stage_index, count, ranks_plan.world, len(parts_plan.names),
                    forwarder.sent_bytes)
    else:
        messages, failed = receive_shards(parts_plan, ranks_plan, rank, count)
    for index, message in enumerate(messages):  # checked above: a part that does not cut is not expected
        if message is None and index not in errors:
            errors[index] = ContributionDecodeError(failed.get(index, f"contribution {index} did not come"))
    return messages, errors
