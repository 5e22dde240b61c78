"""The round's parts, built from the node's base and their collaborators (node/live/assembly.py calls these).

The coordinator, lifecycle, run end and commit pace run from before the node is placed; recovery,
finisher and entry are the round machinery of a placed worker, built from the :class:`~node.live.base.Rooms`.
"""

from __future__ import annotations

from node.live.base import NodeBase, Rooms
from node.live.chain.onchain import NodeChain
from node.live.exchange.protocol import Exchange
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.round.coordination import RoundCoordinator
from node.live.round.ending import RunEnd
from node.live.round.entry import RunEntry
from node.live.round.finisher import RoundFinisher
from node.live.round.lifecycle import Lifecycle
from node.live.round.pacing import CommitPace
from node.live.round.resume import RestartRecovery
from node.live.work.contributor import Contributor
from node.live.work.replica import ReplicaWorker


def build_coordinator(
    base: NodeBase,
    *,
    kind: type[RoundCoordinator],
    messenger: Messenger,
    membership: Membership,
    exchange: Exchange,
) -> RoundCoordinator:
    """``previous_life_finished``: rounds this node finished in an earlier life; it never signs a second,
    different close or attestation for them (peers would hold both as equivocation evidence)."""
    cfg = base.cfg
    return kind(
        peer_id=base.peer_id,
        quorum=cfg.quorum,
        round_timeout=cfg.round_timeout,
        book=base.book,
        membership=membership,
        contributions=exchange.pool,
        contributed=base.rounds.contributed,
        gossip=messenger.gossip,
        resync=messenger.resync,
        previous_life_finished=base.state.get("last_finished", -1),
        transfer_timeout=cfg.p2p.transfer_timeout,
        stop=base.stop,
        station=base.station,
        steps_range=cfg.diloco.steps_range,
    )


def build_lifecycle(base: NodeBase, *, membership: Membership) -> Lifecycle:
    return Lifecycle(
        run_id=base.run_id, peer_id=base.peer_id, state=base.state, membership=membership, stop=base.stop
    )


def build_ending(base: NodeBase, *, chain: NodeChain, membership: Membership) -> RunEnd:
    return RunEnd(
        cfg=base.cfg,
        chain=chain,
        membership=membership,
        reporter=base.reporter,
        peer_id=base.peer_id,
        stop=base.stop,
    )


def build_pace(base: NodeBase, *, chain: NodeChain) -> CommitPace:
    return CommitPace(
        cfg=base.cfg,
        chain=chain,
        progress=base.progress,
        reporter=base.reporter,
        clock=base.clock,
        stop=base.stop,
    )


def build_recovery(base: NodeBase, rooms: Rooms, worker: ReplicaWorker) -> RestartRecovery:
    cfg = base.cfg
    return RestartRecovery(
        archive=base.archive,
        contributions=rooms.exchange.pool,
        host=rooms.host,
        book=base.book,
        peer_id=base.peer_id,
        replica=worker.replica,
        stages=worker.stages,
        max_bytes=cfg.p2p.max_blob_bytes,
        gossip=rooms.messenger.gossip,
        previous_life_finished=rooms.coordinator.previous_life_finished,
        steps_range=cfg.diloco.steps_range,
    )


def build_finisher(
    base: NodeBase,
    rooms: Rooms,
    *,
    kind: type[RoundFinisher],
    worker: ReplicaWorker,
    recovery: RestartRecovery,
    contributor: Contributor,
) -> RoundFinisher:
    return kind(
        cfg=base.cfg,
        worker=worker,
        rounds=base.rounds,
        exchange=rooms.exchange,
        coordinator=rooms.coordinator,
        recovery=recovery,
        contributor=contributor,
        committer=rooms.committer,
        forks=rooms.forks,
        archive=base.archive,
        host=rooms.host,
        book=base.book,
        messenger=rooms.messenger,
        validator=base.validator,
        state=base.state,
        clock=base.clock,
        progress=base.progress,
        reporter=base.reporter,
        layout=base.layout,
        config_hash=base.config_hash,
        checkpoint_dir=base.checkpoint_dir,
        peer_id=base.peer_id,
        lane=base.lane,
        stop=base.stop,
        chunked=rooms.chunked,
    )


def build_entry(
    base: NodeBase, rooms: Rooms, *, worker: ReplicaWorker, contributor: Contributor, finisher: RoundFinisher
) -> RunEntry:
    return RunEntry(
        cfg=base.cfg,
        chain=rooms.chain,
        host=rooms.host,
        membership=rooms.membership,
        book=base.book,
        coordinator=rooms.coordinator,
        worker=worker,
        contributor=contributor,
        finisher=finisher,
        station=base.station,
        state=base.state,
        layout=base.layout,
        progress=base.progress,
        reporter=base.reporter,
        checkpoint_dir=base.checkpoint_dir,
        incoming_dir=base.incoming_dir,
        stop=base.stop,
    )
