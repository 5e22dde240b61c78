"""A peer that refuses /meshsub, /dlx/sync or Kademlia is asked again only after a backoff, and logged
once."""

import logging

import multiaddr
import pytest
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr

from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from p2p.refusals import RefusedProtocols
from p2p.transport import build_libp2p_host

MESHSUB = ("/meshsub/1.0.0", "/meshsub/1.1.0")
SYNC = ("/dlx/sync/1.0.0",)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_backoff_doubles_per_connection_and_a_new_connection_starts_afresh(caplog):
    clock = Clock()
    refusals = RefusedProtocols(initial_backoff=30, max_backoff=100, clock=clock)
    first, second = object(), object()
    assert not refusals.blocked("peer", MESHSUB, first)
    with caplog.at_level(logging.DEBUG, logger="p2p.refusals"):
        refusals.refused("peer", MESHSUB, first)
        assert refusals.blocked("peer", MESHSUB, first)
        assert not refusals.blocked("peer", SYNC, first)  # another protocol set
        assert not refusals.blocked("other", MESHSUB, first)  # another peer
        assert not refusals.blocked("peer", MESHSUB, second)  # a new connection
        clock.now += 30
        assert not refusals.blocked("peer", MESHSUB, first)
        refusals.refused("peer", MESHSUB, first)  # refused again: 60 s
        clock.now += 59
        assert refusals.blocked("peer", MESHSUB, first)
        clock.now += 1
        refusals.refused("peer", MESHSUB, first)  # 120 s, capped at 100
        clock.now += 99
        assert refusals.blocked("peer", MESHSUB, first)
        clock.now += 1
        assert not refusals.blocked("peer", MESHSUB, first)
    levels = [r.levelno for r in caplog.records if r.name == "p2p.refusals"]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG]  # once at INFO per connection


def test_an_accepted_stream_clears_the_refusal():
    refusals = RefusedProtocols(clock=Clock())
    connection = object()
    refusals.refused("peer", SYNC, connection)
    refusals.accepted("peer", SYNC)
    assert not refusals.blocked("peer", SYNC, connection)


@pytest.mark.timeout(60)
def test_a_peer_without_our_protocols_is_not_asked_every_few_seconds(tmp_path):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.INFO)
    watched = [logging.getLogger("p2p.refusals"), logging.getLogger("libp2p.host.basic_host")]
    old_levels = [logger.level for logger in watched]
    for logger in watched:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    config = P2PConfig(gossip_resync_interval=1.0)
    try:
        with P2PHost.start(config, Identity.generate(), data_dir=tmp_path) as host:
            host.subscribe("/dlx/run/1/v1", lambda data, sender: True)
            plain = build_libp2p_host(Identity.generate())  # speaks no meshsub, sync or kad

            async def stay_connected():
                async with plain.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                    await plain.connect(info_from_p2p_addr(multiaddr.Multiaddr(host.listen_addrs[0])))
                    await trio.sleep(9)  # 4 pubsub repairs, 8 resyncs, several DHT lookups

            trio.run(stay_connected)
    finally:
        for logger, level in zip(watched, old_levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
    errors = [r.getMessage() for r in records if r.name == "libp2p.host.basic_host"
              and r.levelno >= logging.ERROR]
    # Before: one ERROR per attempt (about 4 for /meshsub and 8 for /dlx/sync in 9 s). Now at
    # most the attempts already under way when the first refusal came back.
    assert sum("/meshsub/1.1.0" in e for e in errors) <= 2, errors
    assert sum("/dlx/sync/1.0.0" in e for e in errors) <= 1, errors
    mine = [r.getMessage() for r in records if r.name == "p2p.refusals"]
    assert sum("/meshsub/1.1.0" in m for m in mine) == 1, mine
    assert sum("/dlx/sync/1.0.0" in m for m in mine) == 1, mine
