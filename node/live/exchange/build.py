"""The exchange, built from the node's base and its collaborators (node/live/assembly.py calls this)."""

from __future__ import annotations

from queue import Queue

from node.live.base import NodeBase
from node.live.exchange.protocol import Exchange
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from p2p.host import P2PHost


def build_exchange(
    base: NodeBase,
    *,
    kind: type[Exchange],
    messenger: Messenger,
    host: P2PHost,
    membership: Membership,
    charges: Queue,
) -> Exchange:
    """The run's exchange (``kind``: the registry's class for ``diloco.exchange``); ``charges``: the
    accusations it raises, opened by the spot checker."""
    return kind(
        station=base.station,
        messenger=messenger,
        host=host,
        book=base.book,
        archive=base.archive,
        run_id=base.run_id,
        p2p=base.cfg.p2p,
        incoming=base.incoming_dir,
        evidence_dir=base.evidence_dir,
        fallback_providers=membership.live_providers,
        charges=charges,
        stop=base.stop,
    )
