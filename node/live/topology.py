"""Who holds what, and who commits: pure functions over public data.

Every peer computes the same answers from the same inputs: the registry (which
accounts and keys are registered) and the signed cluster declarations gossiped
on the run topic. Nothing here touches the network, torch or the chain.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from node.errors import NodeError


@dataclass(frozen=True)
class Declaration:
    """A node's public claim: "I am ``peer_id``, in ``cluster`` of ``cluster_size`` nodes".

    ``joined`` is where on chain the node's account joined the run ((block, log index) of its
    MemberJoined event): public, fixed, and later for anyone who comes later.
    """

    peer_id: str
    cluster: str
    cluster_size: int
    joined: tuple[int, int] = (0, 0)


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

    Clusters are numbered in the order their members joined the run on chain
    (the earliest member's join; the name breaks ties), so a cluster that comes
    later always takes the next replica index and never shifts anyone's: the
    index seeds each replica's data shard. A cluster's seats go to the
    ``cluster_size`` earliest-joined nodes declaring it (with the size the
    earliest one declared), so a newcomer cannot squat on a formed cluster.
    Inside a cluster of one node, that node holds every stage; in a cluster of
    ``num_stages`` nodes, members sorted by peer id take stages 0..S-1. A
    cluster not yet complete gets no replica slot.
    """
    if num_stages < 1:
        raise NodeError(f"num_stages={num_stages}: must be >= 1")
    by_cluster: dict[str, list[Declaration]] = {}
    for decl in declarations:
        by_cluster.setdefault(decl.cluster, []).append(decl)
    complete: dict[str, tuple[tuple[int, int], list[str]]] = {}
    for name, members in by_cluster.items():
        members = sorted({m.peer_id: m for m in members}.values(), key=lambda m: (m.joined, m.peer_id))
        size = members[0].cluster_size
        if size not in (1, num_stages):
            continue
        seated = [m for m in members if m.cluster_size == size][:size]
        if len(seated) != size:
            continue
        complete[name] = (seated[0].joined, sorted(m.peer_id for m in seated))
    placements: dict[str, Placement] = {}
    for replica, name in enumerate(sorted(complete, key=lambda n: (complete[n][0], n))):
        peers = complete[name][1]
        for rank, peer in enumerate(peers):
            stages = tuple(range(num_stages)) if len(peers) == 1 else (rank,)
            placements[peer] = Placement(peer, name, replica, stages, rank)
    return placements


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
