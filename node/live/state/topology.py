"""Who holds what, and who commits: pure functions over public data.

Every peer computes the same answers from the same inputs: the chain's seats
(which accounts joined the run, in which order, and which still hold a seat) and
the signed cluster declarations gossiped on the run topic. Nothing here touches
the network, torch or the chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from node.errors import NodeError


@dataclass(frozen=True)
class Seat:
    """Where an account sits in the run on chain: facts every member reads alike.

    ``joined`` is the (block, log index) of its MemberJoined event; ``index`` its ordinal among
    every seat the run has had (the n-th MemberJoined of the run, ended seats included: it never
    changes once taken); ``current``: the seat is still held (False once the member left or was
    slashed).
    """

    joined: tuple[int, int]
    index: int
    current: bool = True


@dataclass(frozen=True)
class Declaration:
    """A node's public claim, "I am ``peer_id``, in ``cluster`` of ``cluster_size`` nodes", with its seat."""

    peer_id: str
    cluster: str
    cluster_size: int
    seat: Seat


@dataclass(frozen=True)
class Placement:
    """Where one node sits: its replica (cluster index) and the stages it holds."""

    peer_id: str
    cluster: str
    replica: int
    stages: tuple[int, ...]
    rank: int  # rank inside the cluster's torch.distributed group (= pipeline position)


def assign_stages(declarations: list[Declaration], num_stages: int) -> dict[str, Placement]:
    """Place every declared node on a (replica, stages) slot.

    A cluster's replica index is the seat index (:class:`Seat`) of its first-seated member:
    fixed on chain, so it depends on no other cluster, and nothing another cluster does (leave,
    restart, join, or a view that never heard of it) can shift it; the index seeds each replica's
    data shard. A cluster's seats go to the ``cluster_size`` earliest-seated nodes declaring it
    (with the size the earliest one declared), so a newcomer cannot squat on a formed cluster.
    Inside a cluster of one node, that node holds every stage; in a cluster of ``num_stages``
    nodes, members sorted by peer id take stages 0..S-1. A cluster not yet complete gets no
    replica slot.
    """
    if num_stages < 1:
        raise NodeError(f"num_stages={num_stages}: must be >= 1")
    by_cluster: dict[str, list[Declaration]] = {}
    for decl in declarations:
        by_cluster.setdefault(decl.cluster, []).append(decl)
    placements: dict[str, Placement] = {}
    taken: set[int] = set()
    for name in sorted(by_cluster):
        members = sorted({m.peer_id: m for m in by_cluster[name]}.values(),
                         key=lambda m: (m.seat.index, m.peer_id))
        size = members[0].cluster_size
        if size not in (1, num_stages):
            continue
        seated = [m for m in members if m.cluster_size == size][:size]
        replica = seated[0].seat.index
        if len(seated) != size or replica in taken:  # one seat, one index: a duplicate is no chain's
            continue
        taken.add(replica)
        for rank, peer in enumerate(sorted(m.peer_id for m in seated)):
            stages = tuple(range(num_stages)) if size == 1 else (rank,)
            placements[peer] = Placement(peer, name, replica, stages, rank)
    return placements


def place_members(declarations: list[Declaration], num_stages: int) -> dict[str, Placement]:
    """Placement of the run's members: the current ones among themselves, the others as they sat.

    Current seats (:attr:`Seat.current`) are placed by :func:`assign_stages` over current seats
    only, so a member that left can neither keep a seat of its cluster from a newcomer nor, heard
    by one view and not by another, make the two views differ over a current member. A peer that
    placement leaves out that way (a departed member; the partner of a split cluster's departed
    member, until a newcomer completes the cluster again) keeps the placement it had among everyone
    declared: its late closes and attestations still check, as before the departure. None of that
    can shift an index, since an index is a seat's own.
    """
    current = assign_stages([d for d in declarations if d.seat.current], num_stages)
    return {**assign_stages(declarations, num_stages), **current}


def committer_order(round_index: int, peer_ids: list[str]) -> list[str]:
    """Deterministic rotation of who commits round ``round_index``.

    The first peer commits; if its commit has not landed after a grace period,
    the second does, and so on. The order is a seeded shuffle so that the
    same peer is not always the fallback of the same other peer.
    """
    if not peer_ids:
        return []
    return sorted(
        set(peer_ids),
        key=lambda p: hashlib.sha256(f"{round_index}:{p}".encode()).digest(),
    )


def canonical_order(contributions: list[tuple[int, int, str, bytes]]) -> list[tuple[int, int, str, bytes]]:
    """Sort (stage, replica, sender_peer_id, envelope_hash) into the canonical aggregation order."""
    return sorted(contributions, key=lambda c: (c[0], c[1], c[2], c[3]))
