"""The heartbeat: this node's hellos, its view of who is connected, and its live figures, once a second.

A hello declares the node's cluster, its account, its addresses, the round it
trains and the first round it contributes to (docs/PROTOCOL.md, "Messages").
"""

from __future__ import annotations

import logging
import math
import threading
import time

from node import protocol as msg
from node.config import NodeConfig
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.state.station import Station
from node.live.state.status import Progress, Reporter
from p2p.errors import P2PError
from p2p.host import P2PHost

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
#: Hellos published per second by the whole run, about: a node says hello every
#: ``max(HEARTBEAT_S, (peers + 1) / HELLOS_PER_S)`` seconds, at most every ``MAX_HELLO_EVERY_S``.
#: Every hello reaches every node (gossip, each copy with a signature to check), so at one a
#: second per node a node's share of the run's hellos grew with the peers: at 16 nodes on 2
#: cores they were the largest part of an idle node's CPU.
HELLOS_PER_S = 4.0
#: Well inside the liveness window (roundbook.PEER_TTL_S = 20 s), so a live peer never lapses.
MAX_HELLO_EVERY_S = 5.0


def hello_every(peers: int) -> float:
    """Seconds between a node's hellos when it is connected to ``peers`` others."""
    return min(MAX_HELLO_EVERY_S, max(HEARTBEAT_S, (peers + 1) / HELLOS_PER_S))


class Heartbeat:
    """Runs on its own thread until ``stop`` (see module docstring)."""

    def __init__(self, *, cfg: NodeConfig, account: bytes, host: P2PHost, messenger: Messenger,
                 membership: Membership, station: Station, progress: Progress, spot_checks,
                 reporter: Reporter, stop: threading.Event) -> None:
        self.cfg = cfg
        self.account = account
        self.host = host
        self.messenger = messenger
        self.membership = membership
        self.station = station
        self.progress = progress
        self.spot_checks = spot_checks  # node.live.checks.verifier.SpotChecker: its counters
        self.reporter = reporter
        self.stop = stop

    def hello(self) -> msg.Hello:
        """What this node declares now."""
        return msg.Hello(self.cfg.cluster, self.cfg.cluster_size, self.account, self.host.listen_addrs,
                         self.progress.round, self.station.first_round)

    def run(self) -> None:
        last_hello, every = -math.inf, HEARTBEAT_S
        while not self.stop.wait(HEARTBEAT_S):
            try:
                if time.monotonic() - last_hello >= every - 0.05:
                    last_hello = time.monotonic()
                    self.messenger.hello(self.hello())
                connected = self.host.peers()
                every = hello_every(len(connected))
                self.membership.set_connected(connected)
                self._count(len(connected))
                self.reporter.report(throttle=True)
            except P2PError as exc:
                logger.debug("heartbeat: %s", exc)
            except Exception:  # thread boundary: the heartbeat beats on after one failed beat
                logger.exception("heartbeat failed")

    def _count(self, peers: int) -> None:
        progress = self.progress
        progress.peers = peers
        progress.traffic = self.host.transfer_stats()
        progress.paths = self.host.connection_paths()
        self.reporter.listening(self.host.listen_addrs)  # a relay reservation may come (or go) later
        stats = progress.traffic.values()
        progress.bytes_sent = sum(s.get("sent", 0) for s in stats)
        progress.bytes_received = sum(s.get("received", 0) for s in stats)
        progress.gossip_messages_sent = sum(s.get("messages_sent", 0) for s in stats)
        progress.gossip_messages_received = sum(s.get("messages_received", 0) for s in stats)
        progress.spot_checks = self.spot_checks.checks_run
        progress.spot_check_mismatches = self.spot_checks.mismatches
        progress.chain_checks = self.spot_checks.chain_checks
        progress.spot_check_seconds = self.spot_checks.check_seconds
        progress.spot_check_state_bytes = self.spot_checks.state_bytes_fetched
        progress.spot_check_state_fetches = self.spot_checks.state_fetches
        progress.spot_checks_not_done = self.spot_checks.not_done
