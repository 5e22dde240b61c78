"""What a node has before any of its parts: configuration, identity, files and books.

:class:`NodeBase` is built once by the assembly (node/live/assembly.py) and handed to every
part (or its factory, ``build.py`` in a sub-package), which reads from it what it needs;
:class:`~node.live.rooms.Rooms` are the parts built before the node is placed. Both are
frozen: a part's collaborators are passed in, never set afterwards.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import NodeConfig

if TYPE_CHECKING:  # the parts' own modules import this one
    from node.live.state.saidlog import SaidLog
    from node.live.state.roundbook import RoundBook
    from node.live.state.roundclock import RoundClock
    from node.live.state.roundstate import RoundState
    from node.live.state.status import Progress, Reporter, StateFile
    from node.live.state.lane import RoundLane
    from node.live.state.station import Station
    from node.store.archive import Archive
    from node.store.checkpoint import RunLayout
    from p2p.envelope import EnvelopeValidator
    from p2p.identity import Identity


@dataclass(frozen=True)
class NodeBase:
    """The node's own things, built before any part (NodeParts' constructor)."""

    cfg: NodeConfig
    stop: threading.Event
    run_id: int
    identity: Identity
    peer_id: str
    document: dict[str, Any]
    config_hash: bytes
    layout: RunLayout
    data_dir: Path
    checkpoint_dir: Path
    incoming_dir: Path
    evidence_dir: Path
    archive: Archive
    state: StateFile
    progress: Progress
    clock: RoundClock
    book: RoundBook
    station: Station
    rounds: RoundState
    lane: RoundLane
    reporter: Reporter
    validator: EnvelopeValidator
    said: SaidLog
