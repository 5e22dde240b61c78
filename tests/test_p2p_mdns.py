"""mDNS discovery (opt-in) bound to the loopback interface: two hosts with no bootstrap find each other."""

import threading
import time

import pytest

from p2p.config import P2PConfig
from p2p.errors import P2PError
from p2p.host import P2PHost
from p2p.identity import Identity
from p2p.transport import interface_ipv4

pytestmark = pytest.mark.timeout(60)


def test_mdns_on_loopback_connects_hosts_without_bootstrap(tmp_path):
    baseline = set(threading.enumerate())
    config = P2PConfig(mdns=True, mdns_interface="lo")
    hosts = [P2PHost.start(config, Identity.generate(), data_dir=tmp_path / f"h{i}") for i in range(2)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(h.peers() for h in hosts):
            time.sleep(0.2)
        assert hosts[0].peers() == [hosts[1].peer_id]
        assert hosts[1].peers() == [hosts[0].peer_id]
    finally:
        for host in hosts:
            host.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(threading.enumerate()) != baseline:
        time.sleep(0.1)
    assert set(threading.enumerate()) == baseline  # zeroconf's threads are gone too


def test_interface_resolution():
    assert interface_ipv4("lo") == "127.0.0.1"
    assert interface_ipv4("127.0.0.1") == "127.0.0.1"
    with pytest.raises(P2PError, match="mdns_interface"):
        interface_ipv4("no-such-if0")
