"""The spot checks, built from the node's base and their collaborators (node/live/assembly.py calls this)."""

from __future__ import annotations

import dataclasses
import functools
from queue import Queue

from node.live.state.base import NodeBase
from node.live.chain.onchain import NodeChain
from node.live.checks.verifier import SpotChecker, VerifierContext
from node.live.exchange.protocol import Exchange
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.exchange.coordination import RoundCoordinator
from node.live.peers.lifecycle import Lifecycle
from p2p.host import P2PHost


def build_spot_checks(
    base: NodeBase,
    *,
    chain: NodeChain,
    host: P2PHost,
    messenger: Messenger,
    membership: Membership,
    exchange: Exchange,
    coordinator: RoundCoordinator,
    lifecycle: Lifecycle,
    charges: Queue,
    on_accused=None,
) -> SpotChecker:
    """The spot checker; none are drawn where the exchange's contributions cannot be re-executed. The
    exchange's evidence is judged against the ``coordinator``'s rule whether a close stands."""
    cfg = base.cfg
    return SpotChecker(
        VerifierContext(
            cfg=cfg if exchange.reexecutable else dataclasses.replace(cfg, spot_checks=0.0),
            run_id=base.run_id,
            peer_id=base.peer_id,
            chain=chain,
            host=host,
            archive=base.archive,
            membership=membership,
            gossip=messenger.gossip,
            sign_envelope=messenger.sign,
            stage_hashes=base.rounds.stage_hashes_of,
            own_replica=base.station.replica,
            current_round=base.progress.current_round,
            work_dir=base.data_dir / "spotchecks",
            evidence_dir=base.evidence_dir,
            stop=base.stop,
            on_ejected=lifecycle.member_ejected,
            closes=base.book.snapshot_closes,
            attestations=base.book.snapshot_attestations,
            evidence_judges=exchange.evidence_judges(coordinator.close_standing),
            charges=charges,
            rerun_inputs=exchange.rerun_inputs(),
            declared_platforms=functools.partial(chain.declared_platforms, base.run_id),
            on_accused=on_accused,
        )
    )
