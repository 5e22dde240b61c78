"""The peers' parts, built from the node's base and their collaborators
(node/live/assembly.py calls these)."""

from __future__ import annotations

from collections.abc import Callable

from node.live.state.base import NodeBase
from node.live.chain.onchain import NodeChain
from node.live.chain.readback import RecordSigners
from node.live.checks.verifier import SpotChecker
from node.live.exchange.protocol import Exchange
from node.live.peers.heartbeat import Heartbeat
from node.live.inbox import GossipInbox
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.state.topology import Seat
from p2p.host import P2PHost


def build_messenger(base: NodeBase, *, host: P2PHost) -> Messenger:
    return Messenger(
        identity=base.identity,
        run_id=base.run_id,
        host=host,
        station=base.station,
        said=base.said,
        stop=base.stop,
    )


def build_membership(
    base: NodeBase, *, seat: Callable[[bytes, bytes], Seat | None], own_seat: Seat
) -> Membership:
    cfg = base.cfg
    return Membership(
        peer_id=base.peer_id,
        cluster=cfg.cluster,
        cluster_size=cfg.cluster_size,
        num_stages=cfg.pipeline.num_stages,
        book=base.book,
        seat=seat,
        own_seat=own_seat,
    )


def build_inbox(
    base: NodeBase, *, chain: NodeChain, membership: Membership, exchange: Exchange, spot_checks: SpotChecker
) -> GossipInbox:
    return GossipInbox(
        run_id=base.run_id,
        validator=base.validator,
        book=base.book,
        membership=membership,
        contributions=exchange.pool,
        held_stages=base.station.held_stages,
        record_signer=RecordSigners(chain=chain, run_id=base.run_id).signer,
        spot_checks=spot_checks,
        handlers=exchange.gossip_handlers(),
    )


def build_heartbeat(
    base: NodeBase,
    *,
    kind: type[Heartbeat],
    chain: NodeChain,
    host: P2PHost,
    messenger: Messenger,
    membership: Membership,
    spot_checks: SpotChecker,
) -> Heartbeat:
    return kind(
        cfg=base.cfg,
        account=chain.account_bytes,
        host=host,
        messenger=messenger,
        membership=membership,
        station=base.station,
        progress=base.progress,
        spot_checks=spot_checks,
        reporter=base.reporter,
        stop=base.stop,
    )
