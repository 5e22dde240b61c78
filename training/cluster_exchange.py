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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from training.cluster_parts import cut_entries, first_part, part_routes, shard_message
from training.cluster_plan import ShardPlan
from training.errors import ContributionDecodeError

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
