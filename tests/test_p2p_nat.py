"""NAT traversal with real hosts: relayed addresses, the relay's guards, and two hosts behind real NATs.

The namespace test builds one public network and two sites behind nftables masquerade
(:mod:`tests.netns_lab`), runs a relay in the public namespace and one host in each site (each its
own process), and shows that the sites reach each other only through the relay or a punched hole.
It skips, with the reason, where namespaces or nft cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p.addrs import parse_relayed_addr, relayed_addr
from p2p.config import P2PConfig
from p2p.errors import DialError, P2PConfigError, RelayAddressError
from p2p.host import P2PHost
from p2p.identity import Identity

sys.path.insert(0, str(Path(__file__).parent))
from netns_lab import PUBLIC_IP, ROUTER_WAN_IPS, SITE_IPS, LabUnavailable, NatLab
from waiting import wait_until

pytestmark = pytest.mark.timeout(120)
AGENT = str(Path(__file__).parent / "p2p_agent.py")
RELAY_ID = "12D3KooWFhvohtgaaNRdphcg2YkWkoGuHRSSJLeRA3bKPtyZ5t9P"
PEER_ID = "12D3KooWEmLVXeBBjJGvJshBzMnAjBWPK5Efb9qioDCrNp7X1HaR"




# ---------------------------------------------------------------------------- addresses (no network)


def test_relayed_address_round_trip():
    addr = relayed_addr(f"/ip4/198.51.100.1/tcp/4001/p2p/{RELAY_ID}", PEER_ID)
    assert addr == f"/ip4/198.51.100.1/tcp/4001/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}"
    assert parse_relayed_addr(addr) == (f"/ip4/198.51.100.1/tcp/4001/p2p/{RELAY_ID}", RELAY_ID, PEER_ID)


@pytest.mark.parametrize("bogus, why", [
    (f"/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}", "expected /ip4"),
    (f"/ip4/1.2.3.999/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}", "bad host"),
    (f"/ip4/1.2.3.4/tcp/0/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}", "bad TCP port"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/{RELAY_ID}", "same"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}/p2p-circuit/p2p/{RELAY_ID}",
     "exactly once"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit", "must end in"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/notapeerid", "not a peer id"),
    (f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}0", "not a peer id"),
    (f"/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/{PEER_ID}", "expected /ip4"),
    ("/ip4/1.2.3.4/tcp/1/p2p/" + "x" * 600 + "/p2p-circuit/p2p/" + PEER_ID, "at most"),
])
def test_bogus_relayed_addresses_are_refused(bogus, why):
    with pytest.raises(RelayAddressError, match=why):
        parse_relayed_addr(bogus)


def test_relay_use_must_be_a_direct_relay_address():
    with pytest.raises(P2PConfigError, match="relay_use"):
        P2PConfig(relay_use=[f"/ip4/1.2.3.4/tcp/1/p2p/{RELAY_ID}/p2p-circuit/p2p/{PEER_ID}"])
    with pytest.raises(P2PConfigError, match="relay_hop_per_minute"):
        P2PConfig(relay_hop_per_minute=0)


# ---------------------------------------------------------------------------- loopback


def test_relayed_connection_and_guards_on_loopback(tmp_path):
    """Two hosts reserve on a relay; one dials the other by its relayed address only; a blob crosses;
    a bogus relayed address is refused before any dial; a HOP flood is cut by the relay's rate limit."""
    relay = P2PHost.start(P2PConfig(relay_serve=True, relay_hop_per_minute=5), Identity.generate(),
                          data_dir=tmp_path / "r")
    hosts = []
    try:
        relay_addr = relay.listen_addrs[0]
        for name in ("a", "b"):
            config = P2PConfig(relay_use=[relay_addr], hole_punch=False, autonat=False)
            hosts.append(P2PHost.start(config, Identity.generate(), data_dir=tmp_path / name))
        a, b = hosts
        relayed_b = relayed_addr(relay_addr, b.peer_id)
        # start() waits up to 8 s for the reservation; a loaded machine may need the retry after it.
        wait_until(lambda: relayed_b in b.listen_addrs, 60, "b's reservation on the relay")
        assert a.connect(relayed_b, timeout=30) == b.peer_id
        sha = b.provide_blob(os.urandom(1 << 20), announce=False)
        a.fetch_blob(sha, tmp_path / "got", providers=[b.peer_id], timeout=60)
        assert (tmp_path / "got").stat().st_size == 1 << 20

        with pytest.raises(RelayAddressError):
            a.connect(f"{relay_addr}/p2p-circuit/p2p/{relay.peer_id}", timeout=10)
        # A peer nobody reserved for: the relay says no, the dial fails with a DialError, nobody crashes.
        stranger = Identity.generate().peer_id
        with pytest.raises(DialError):
            a.connect(relayed_addr(relay_addr, stranger), timeout=30)
        for _ in range(8):  # 5 a minute allowed: the rest are refused without being read
            try:
                a.connect(relayed_addr(relay_addr, stranger), timeout=30)
            except DialError:
                pass
        assert relay.relay_refusals().get("hop_rate", 0) >= 1
        assert relay.peers()  # the relay still runs
    finally:
        for host in hosts + [relay]:
            host.close()


# ---------------------------------------------------------------------------- namespaces with real NAT


class Agent:
    """A tests/p2p_agent.py process inside a namespace."""

    def __init__(self, lab: NatLab, namespace: str, config: dict, data_dir: str) -> None:
        self.proc = subprocess.Popen(
            lab.cmd(namespace, sys.executable, AGENT, json.dumps(config), data_dir),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
        )
        hello = self._read()
        self.peer_id, self.listen_addrs = hello["peer_id"], hello["listen_addrs"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"agent exited with {self.proc.wait(10)}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(20)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


def tcp_reachable(lab: NatLab, namespace: str, ip: str, port: int) -> bool:
    """Whether a plain TCP connect from ``namespace`` to ``ip:port`` succeeds within 3 s."""
    probe = f"import socket; socket.create_connection(({ip!r}, {port}), timeout=3).close()"
    return subprocess.run(lab.cmd(namespace, sys.executable, "-c", probe), capture_output=True,
                          timeout=30).returncode == 0


@pytest.fixture
def lab():
    try:
        made = NatLab()
    except LabUnavailable as exc:
        pytest.skip(f"cannot build network namespaces with NAT here: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.mark.timeout(300)  # ~40 s on a quiet machine; generous for a loaded one
def test_two_sites_behind_nat_reach_each_other(lab, capsys, tmp_path):
    """Site hosts cannot be dialled from outside; through the relay they connect, then DCUtR tries to punch
    a direct hole. Whichever path they end on, a blob crosses it; the table says which (on this lab's
    port-preserving NATs DCUtR punches through: "hole_punched")."""
    root = str(tmp_path)
    agents: list[Agent] = []
    try:
        relay = Agent(lab, lab.public, {"listen_host": PUBLIC_IP, "listen_port": 4001, "relay_serve": True},
                      f"{root}/relay")
        agents.append(relay)
        relay_addr = relay.listen_addrs[0]
        sites = []
        for namespace, ip in zip(lab.sites, SITE_IPS):
            config = {"listen_host": ip, "listen_port": 4001, "relay_use": [relay_addr]}
            sites.append(Agent(lab, namespace, config, f"{root}/{namespace}"))
            agents.append(sites[-1])
        one, two = sites
        wait_until(lambda: any("/p2p-circuit" in a for a in two.ask(cmd="status")["listen_addrs"]), 60,
                   "site 2's reservation on the relay")
        relayed_two = [a for a in two.ask(cmd="status")["listen_addrs"] if "/p2p-circuit" in a]
        assert relayed_two == [relayed_addr(relay_addr, two.peer_id)]

        # The NAT is real: nothing outside site 2 opens a TCP connection to its host, while site 2
        # reaches the public network (it holds a reservation on the relay).
        assert tcp_reachable(lab, lab.sites[1], SITE_IPS[1], 4001)
        assert not tcp_reachable(lab, lab.public, SITE_IPS[1], 4001)
        assert not tcp_reachable(lab, lab.sites[0], SITE_IPS[1], 4001)
        assert not tcp_reachable(lab, lab.public, ROUTER_WAN_IPS[1], 4001)
        assert tcp_reachable(lab, lab.sites[0], PUBLIC_IP, 4001)

        connected = one.ask(cmd="connect", addr=relayed_two[0], timeout=60)
        assert connected["ok"], connected
        path = one.ask(cmd="wait_path", peer=two.peer_id, path="hole_punched", timeout=40)["path"]
        assert path in ("hole_punched", "relayed")  # never "direct": site 2 cannot be dialled from outside
        sha = two.ask(cmd="provide", size=4 << 20)["sha256"]
        fetched = one.ask(cmd="fetch", sha256=sha, provider=two.peer_id, timeout=90)
        assert fetched["ok"], fetched
        paths_one = one.ask(cmd="paths")["paths"]
        assert paths_one[relay.peer_id] == "direct"
        table = [("site1", "relay", paths_one[relay.peer_id]),
                 ("site2", "relay", two.ask(cmd="paths")["paths"][relay.peer_id]),
                 ("site1", "site2", paths_one[two.peer_id])]
        with capsys.disabled():
            print("\nNAT test (p2p): pair -> path; 4 MiB blob site2 -> site1 fetched and verified")
            for left, right, how in table:
                print(f"  {left:6} <-> {right:6} {how}")
            print(f"  site1 reachability (AutoNAT): {one.ask(cmd='status')['reachability']}; "
                  f"routers' public IPs {', '.join(ROUTER_WAN_IPS)}")
    finally:
        for agent in agents:
            agent.stop()


def test_relay_caps_reservations_per_ip_and_refuses_reserving_for_another_peer(tmp_path):
    """A flood of reservations from one address stops at the per-IP cap (the others keep working); a
    RESERVE naming another peer's id (squatting its slot) is refused with PERMISSION_DENIED."""
    import multiaddr
    import trio
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
    from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    from p2p.transport import build_libp2p_host

    relay = P2PHost.start(P2PConfig(relay_serve=True, relay_reservations_per_ip=2), Identity.generate(),
                          data_dir=tmp_path / "r")
    hosts = []
    try:
        relay_addr = relay.listen_addrs[0]
        for index in range(3):
            config = P2PConfig(relay_use=[relay_addr], hole_punch=False, autonat=False)
            hosts.append(P2PHost.start(config, Identity.generate(), data_dir=tmp_path / f"h{index}"))
        def reserved():
            return [any("/p2p-circuit" in a for a in h.listen_addrs) for h in hosts]

        wait_until(lambda: sum(reserved()) == 2, 60, "two reservations")
        time.sleep(1)
        assert sorted(reserved()) == [False, True, True]  # which two: whoever the relay answered first
        assert relay.relay_refusals().get("reserve_per_ip", 0) >= 1

        async def squat() -> int:
            squatter = build_libp2p_host(Identity.generate())
            async with squatter.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
                await squatter.connect(info)
                stream = await squatter.new_stream(info.peer_id, [PROTOCOL_ID])
                victim = info_from_p2p_addr(multiaddr.Multiaddr(hosts[2].listen_addrs[0])).peer_id
                await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE,
                                                             peer=CircuitPeerId(id=victim.to_bytes())))
                with trio.fail_after(20):
                    reply = await read_delimited_msg(stream, HopMessage)
                # Then a flood of requests on that one stream: py-libp2p would serve them all.
                with trio.move_on_after(20):
                    try:
                        for _ in range(100):
                            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                            await read_delimited_msg(stream, HopMessage)
                    except Exception:  # the relay reset the stream: what the flood should come to
                        pass
                return reply.status

        status = trio.run(squat)
        assert status == StatusCode.PERMISSION_DENIED
        assert relay.relay_refusals().get("reserve_for_other", 0) == 1
        assert relay.relay_refusals().get("hop_rate", 0) >= 1  # 60 a minute, then the stream is reset
        assert relay.peers()  # still serving
    finally:
        for host in hosts + [relay]:
            host.close()
