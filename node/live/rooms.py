"""The parts a node builds before it is placed (step 2 of node/live/assembly.py), handed together
to the round machinery of a placed worker: restart recovery, contributor, finisher and entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parts' own modules are imported by the assembly
    from node.live.record.committer import Committer
    from node.live.record.forkrepair import ForkRepair
    from node.live.chain.onchain import NodeChain
    from node.live.checks.verifier import SpotChecker
    from node.live.exchange.protocol import Exchange
    from node.live.fraud.chunkstate import ChunkedStates
    from node.live.fraud.contribution_binding import ContributionBinder
    from node.live.peers.membership import Membership
    from node.live.peers.messenger import Messenger
    from node.live.exchange.coordination import RoundCoordinator
    from node.live.peers.lifecycle import Lifecycle
    from p2p.host import P2PHost


@dataclass(frozen=True)
class Rooms:
    """The parts that run from before the node is placed (step 2 of the assembly)."""

    chain: NodeChain
    host: P2PHost
    messenger: Messenger
    membership: Membership
    exchange: Exchange
    coordinator: RoundCoordinator
    lifecycle: Lifecycle
    spot_checks: SpotChecker
    forks: ForkRepair
    committer: Committer
    chunked: ChunkedStates | None
    binder: ContributionBinder | None = None  # a version-3 run's contributions' binding (issue 62)
