"""What this node says on the run topic: signed envelopes of its messages, and pulling what it missed.

Every room that speaks (the coordinator's closes, the committer's record
signatures, the spot checks' accusations and verdicts, the exchange's partials,
the round's announces and attestations) signs through one :class:`Messenger`,
so every envelope names this node's replica the same way (-1 before it is placed).
"""

from __future__ import annotations

import logging
import threading

from node import protocol as msg
from node.fsutil import retry_on_full_disk
from node.live.state.saidlog import SaidLog
from node.live.state.station import Station
from node.protocol import run_topic
from p2p.envelope import Envelope
from p2p.errors import P2PError
from p2p.host import P2PHost
from p2p.identity import Identity

logger = logging.getLogger(__name__)


class Messenger:
    """Signs and publishes this node's run messages (see module docstring)."""

    def __init__(self, *, identity: Identity, run_id: int, host: P2PHost, station: Station, said: SaidLog,
                 stop: threading.Event | None = None) -> None:
        self.identity = identity
        self.run_id = run_id
        self.host = host
        self.station = station
        self.said = said  # what earlier lives signed: said again identically, or not at all
        self.stop = stop if stop is not None else threading.Event()  # ends a wait for disk space (DiskFull)

    def sign(self, outer_round: int, kind: str, payload: bytes, stage: int = -1) -> bytes:
        """The signed envelope bytes of ``payload`` (not published)."""
        return Envelope.create(self.identity, self.run_id, outer_round, kind, payload, stage=stage,
                               replica=self.station.replica()).to_bytes()

    def gossip(self, outer_round: int, kind: str, message, stage: int = -1) -> bytes:
        """Sign ``message`` and publish it on the run topic; return the envelope bytes (published or not).

        A slot (round, kind, stage) an earlier life signed with another payload is not signed again
        (node/live/state/saidlog.py): the earlier envelope is returned, and nothing is published."""
        payload = msg.encode_payload(message)
        if self.said.conflicts(outer_round, kind, stage, payload):
            earlier = self.said.earlier(outer_round, kind, stage)
            logger.warning(
                "round %d: this node signed another %s of stage %d in an earlier life; it does not sign "
                "a second one", outer_round, kind, stage)
            if earlier is not None:
                return earlier
            return self.sign(outer_round, kind, payload, stage)  # kept here only, never published
        envelope = Envelope.create(self.identity, self.run_id, outer_round, kind, payload, stage=stage,
                                   replica=self.station.replica())
        data = envelope.to_bytes()
        # Kept before it is published, or never published: a message waits for a full disk to have space again
        # (a later life must know what this one said; DiskFull, a NodeError, if the node stops meanwhile).
        retry_on_full_disk(lambda: self.said.write(envelope, data),
                           what=f"round {outer_round}'s {kind} message "
                           "(kept before it is sent)", kind="signed messages", stop=self.stop)
        try:
            self.host.publish(run_topic(self.run_id), data)
        except P2PError as exc:
            # Peers still get it: the host serves recent topic messages over /dlx/sync.
            logger.warning("publish %s for round %d failed: %s", kind, outer_round, exc)
        return data

    def hello(self, hello: msg.Hello) -> None:
        """Publish a hello (round 0, no stage or replica); raises P2PError (the heartbeat tries again)."""
        env = Envelope.create(self.identity, self.run_id, 0, msg.HELLO, msg.encode_payload(hello))
        self.host.publish(run_topic(self.run_id), env.to_bytes())

    def resync(self) -> None:
        """Pull recent run messages from every peer: gossip is best effort."""
        try:
            self.host.resync(run_topic(self.run_id), timeout=10)
        except P2PError as exc:
            logger.debug("resync failed: %s", exc)
