"""An inbound connection's handler ends with the connection (p2p.inbound; docs/P2P.md, "What a surviving node
keeps per churn event").

Real py-libp2p hosts on 127.0.0.1: peers connect to a host and go away, again and again, as a member that
restarts (same identity) and ``dlx-node join``'s fetch hosts (a new identity each time) do. py-libp2p 0.8.1
kept each accepted connection's handler, with its TCP stream and receive buffer and a slot of the swarm's
inbound limiter, until the host closed: the held slots counted the connections ever accepted.
"""

import gc

import pytest
from libp2p.network.connection.raw_connection import RawConnection
from waiting import wait_until

from p2p import inbound
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(240)

CYCLES = 6




def raw_connections() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is RawConnection)


def test_a_host_keeps_nothing_of_the_inbound_connections_of_peers_gone(tmp_path):
    assert inbound.applied == ["inbound handler ends with its connection"]
    survivor = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(),
                             data_dir=tmp_path / "a")
    limiter = survivor._libp2p.get_network()._inbound_limiter
    try:
        before = raw_connections()
        restarting = Identity.generate()
        for cycle in range(CYCLES):
            identity = restarting if cycle % 2 else Identity.generate()
            peer = P2PHost.start(P2PConfig(listen=False, gossip_resync_interval=0), identity,
                                 data_dir=tmp_path / f"peer{cycle}")
            try:
                peer.connect(survivor.listen_addrs[0], timeout=30)
                wait_until(lambda: identity.peer_id in survivor.peers(), 30, "the survivor to see the peer")
                assert limiter.borrowed_tokens >= 1
            finally:
                peer.close()
            wait_until(lambda: identity.peer_id not in survivor.peers(), 60, "the survivor to see it gone")
        # Every peer is gone: no inbound connection is open, so none holds a limiter slot (before: CYCLES).
        wait_until(lambda: limiter.borrowed_tokens == 0, 60, "the inbound handlers to end")
        assert survivor.peers() == []
        # Each handler held its RawConnection (before: CYCLES more); a peer's own may linger until collected,
        # and the last peers' teardown may still be running on
        # a loaded machine (once 2 here, beside a full suite).
        wait_until(lambda: raw_connections() - before <= 1, 60,
                   "the inbound connections' RawConnections to go")
    finally:
        survivor.close()
