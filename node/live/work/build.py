"""The contributor of a placed worker, built from the node's base and the rooms
(node/live/assembly.py calls this)."""

from __future__ import annotations

from node.live.base import NodeBase, Rooms
from node.live.work.contributor import Contributor
from node.live.work.replica import ReplicaWorker


def build_contributor(
    base: NodeBase, rooms: Rooms, *, kind: type[Contributor], worker: ReplicaWorker
) -> Contributor:
    return kind(
        cfg=base.cfg,
        worker=worker,
        rounds=base.rounds,
        lane=base.lane,
        clock=base.clock,
        progress=base.progress,
        reporter=base.reporter,
        spot_checks=rooms.spot_checks,
        exchange=rooms.exchange,
        archive=base.archive,
        book=base.book,
        messenger=rooms.messenger,
        state=base.state,
        forks=rooms.forks,
        peer_id=base.peer_id,
        stop=base.stop,
    )
