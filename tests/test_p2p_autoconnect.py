"""py-libp2p's auto-connector as the host configures it (p2p/transport.py): no connection floor, a slow poll.

With its defaults (a floor of 50 connections, a target of 200) a node of a run with a few peers was always
below both: it polled every 10 s and dialled every known peer it was not connected to (a member that left,
made-up peers from DHT answers) besides the host's own discovery, which dials with backoff and forgets
peers that are gone (p2p.dialbook).
"""

from __future__ import annotations

from p2p.identity import Identity
from p2p.transport import AUTO_CONNECT_INTERVAL_S, build_libp2p_host


def test_a_host_keeps_no_connection_floor_and_its_auto_connector_polls_slowly():
    swarm = build_libp2p_host(Identity.generate()).get_network()
    config = swarm.connection_config
    assert config.min_connections == 0  # never "critically below": no 10 s poll with a handful of peers
    assert swarm.get_total_connections() >= config.min_connections
    assert swarm.auto_connector.auto_connect_interval == AUTO_CONNECT_INTERVAL_S >= 60.0
    # Pruning and the connection cap keep py-libp2p's values (a large run's node keeps its connections).
    assert config.low_watermark <= config.high_watermark <= config.max_connections
    assert config.high_watermark >= 100
