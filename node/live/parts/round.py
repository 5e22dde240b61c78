"""The round's parts, built from the node's base and their collaborators (node/live/assembly.py calls these).

The coordinator, lifecycle, run end and commit pace run from before the node is placed; the round
machinery of a placed worker (recovery, finisher, entry) takes the base and the
:class:`~node.live.rooms.Rooms` itself.
"""

from __future__ import annotations

from node.live.state.base import NodeBase
from node.live.chain.onchain import NodeChain
from node.live.exchange.protocol import Exchange
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.exchange.coordination import RoundCoordinator
from node.live.round.ending import RunEnd
from node.live.peers.lifecycle import Lifecycle
from node.live.round.pacing import CommitPace


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
