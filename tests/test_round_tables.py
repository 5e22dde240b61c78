"""What a long-running node adds to with every round or message stays bounded (docs/P2P.md, soak section,
"What grows with the rounds"): each structure is driven through more rounds or messages than its bound and
must hold at most its bound while keeping what the node still reads.
"""

from p2p import gossip
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity


def test_gossipsub_delivery_times_keep_the_last_minute_only(tmp_path):
    """py-libp2p appends a time per message routed and trims only in the adaptive gossip we turn off."""
    config = P2PConfig(gossip_resync_interval=0, gossip_max_msgs_per_sec=1e6)
    topic = "dlx/test/rounds"
    with P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "host") as host:
        times = host._gossipsub.recent_message_deliveries[topic]
        for index in range(2 * gossip.DELIVERY_TIMES_KEPT):
            assert host.publish(topic, b"message %d" % index)
        assert len(times) == gossip.DELIVERY_TIMES_KEPT
        # A minute on: what was routed before it is gone, the message routed now kept.
        times[:] = [t - gossip.DELIVERY_TIMES_S - 1 for t in times]
        assert host.publish(topic, b"a minute later")
        assert len(times) == 1
