"""The chain side's parts, built from the node's base and their collaborators
(node/live/assembly.py calls these)."""

from __future__ import annotations

from node.live.state.base import NodeBase
from node.live.record.committer import Committer, CommitterContext
from node.live.record.forkrepair import ForkRepair
from node.live.chain.onchain import NodeChain
from node.live.checks.verifier import SpotChecker
from node.live.fraud.prover import FraudProver
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.exchange.coordination import RoundCoordinator
from p2p.host import P2PHost


def build_committer(
    base: NodeBase,
    *,
    kind: type[Committer],
    chain: NodeChain,
    host: P2PHost,
    coordinator: RoundCoordinator,
    membership: Membership,
    messenger: Messenger,
    spot_checks: SpotChecker,
    forks: ForkRepair,
    fraud: FraudProver | None,
) -> Committer:
    return kind(
        CommitterContext(
            cfg=base.cfg,
            run_id=base.run_id,
            peer_id=base.peer_id,
            book=base.book,
            chain=chain,
            host=host,
            coordinator=coordinator,
            membership=membership,
            checkpoint_dir=base.checkpoint_dir,
            incoming_dir=base.incoming_dir,
            stop_event=base.stop,
            state=base.state,
            gossip=messenger.gossip,
            layout=base.layout,
            progress=base.progress,
            spot_checks=spot_checks,
            forks=forks,
            fraud=fraud,
        )
    )
