"""A peer whose host is gone is forgotten, not dialled for ever (p2p.dialbook; docs/P2P.md).

Real py-libp2p hosts on 127.0.0.1. A host that connects and goes away leaves its address in the
others' peerstores and routing tables; a plain TCP listener then takes its port and counts every
dial the remaining hosts still make to it.
"""

import hashlib
import socket
import threading
import time

import pytest
from waiting import wait_until

from p2p.config import P2PConfig
from p2p.dialbook import MAX_FORGOTTEN, MAX_TRACKED, DialBook
from p2p.errors import P2PConfigError
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(180)




# ---------------------------------------------------------------------- the rule alone
def test_a_peer_is_forgotten_after_failed_dials_in_a_row_and_remembered_when_it_connects():
    book = DialBook(forget_after_failures=3, forget_after_s=100.0, clock=lambda: 0.0)
    assert not book.dial_failed("a") and not book.dial_failed("a")
    book.dial_succeeded("a")  # a success starts the count again
    assert [book.dial_failed("a") for _ in range(3)] == [False, False, True]
    assert book.forgotten("a") and book.forgotten_peers() == ["a"]
    assert not book.dial_failed("a")  # already forgotten: counted as a dial, nothing more
    assert book.failed_dials == 6
    book.sweep(known=[], connected=["a"])  # it connected to us: dialled again when it goes
    assert not book.forgotten("a")


def test_a_peer_without_a_connection_for_forget_after_s_is_forgotten():
    now = [0.0]
    book = DialBook(forget_after_failures=3, forget_after_s=60.0, clock=lambda: now[0])
    assert book.sweep(known=["gone", "live"], connected=["live"]) == []
    now[0] = 59.0
    assert book.sweep(known=["gone", "live"], connected=["live"]) == []
    now[0] = 61.0
    assert book.sweep(known=["gone", "live"], connected=["live"]) == ["gone"]
    assert not book.forgotten("live")
    now[0] = 500.0  # a peer connected at every look is never forgotten
    assert book.sweep(known=["gone", "live"], connected=["live"]) == []


def test_the_book_stays_bounded_under_a_flood_of_peer_ids():
    book = DialBook(forget_after_failures=1, forget_after_s=1.0, clock=lambda: 0.0)
    for index in range(MAX_FORGOTTEN + 10):
        book.dial_failed(f"p{index}")
    assert len(book.forgotten_peers()) == MAX_FORGOTTEN
    assert not book.forgotten("p0") and book.forgotten(f"p{MAX_FORGOTTEN + 9}")


@pytest.mark.parametrize("field, value", [("forget_after_failures", 0), ("forget_after_s", 0.0)])
def test_forgetting_settings_are_checked(field, value):
    with pytest.raises(P2PConfigError, match=f"p2p.{field}"):
        P2PConfig(**{field: value})


# ---------------------------------------------------------------------- real hosts
class DialCounter:
    """A plain TCP listener on a departed host's port: counts the connections made to it."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.count += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _port(host: P2PHost) -> int:
    return int(host.listen_addrs[0].split("/tcp/")[1].split("/")[0])


@pytest.fixture
def two_hosts(tmp_path):
    # Short intervals so that the test sees several discovery passes and sweeps.
    config = dict(gossip_resync_interval=0, discovery_interval=1.0, forget_after_failures=3,
                  forget_after_s=6.0)
    a = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, **config), Identity.generate(),
                      data_dir=tmp_path / "b")
    wait_until(lambda: b.peer_id in a.peers(), 60, "b connected to a")
    yield a, b
    b.close()
    a.close()


def test_a_host_that_connected_and_went_away_is_dialled_a_bounded_number_of_times(two_hosts, tmp_path):
    a, b = two_hosts
    gone = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "gone")
    for host in (a, b):
        gone.connect(host.listen_addrs[0])
    wait_until(lambda: all(host.known_addrs(gone.peer_id) for host in (a, b)), 30,
               "the departing host's address known to both")
    port = _port(gone)
    gone.close()
    counter = DialCounter(port)
    try:
        wait_until(lambda: all(gone.peer_id in host.forgotten_peers() for host in (a, b)), 90,
                   "both hosts forgetting the departed host")
        forgotten_at = counter.count
        assert all(host.known_addrs(gone.peer_id) == [] for host in (a, b))
        # Several discovery passes (1 s apart) and forget sweeps later: not one dial more.
        time.sleep(5)
        assert counter.count == forgotten_at, \
            f"dialled {counter.count - forgotten_at} more time(s) once forgotten"
        # Before it was forgotten, each host dialled it a few times at most (libp2p's auto-connector
        # and our discovery, each with backoff), not once a second.
        assert forgotten_at <= 2 * 8, forgotten_at
        # The live peers are not forgotten.
        assert b.peer_id in a.peers() and a.peer_id not in b.forgotten_peers()
    finally:
        counter.close()


def test_a_client_only_host_leaves_no_address_to_dial_back(two_hosts, tmp_path):
    a, _b = two_hosts
    client = P2PHost.start(P2PConfig(listen=False, gossip_resync_interval=0), Identity.generate(),
                           data_dir=tmp_path / "client")
    try:
        assert client.listen_addrs == []
        data = b"a run document"
        source = tmp_path / "doc.json"
        source.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        a.provide_blob(source, announce=False)
        client.connect(a.listen_addrs[0])
        fetched = client.fetch_blob(digest, tmp_path / "fetched", providers=[a.peer_id], timeout=30)
        assert fetched.read_bytes() == data
        assert client.peer_id in a.peers()
        assert a.known_addrs(client.peer_id) == []  # nothing a peer could dial once the client is gone
    finally:
        client.close()


def test_a_bootstrap_peer_not_reached_yet_is_never_forgotten_and_once_reached_it_can_be():
    book = DialBook(forget_after_failures=2, forget_after_s=10.0, clock=lambda: 100.0)
    book.protect(["boot"])
    for _ in range(5):
        assert not book.dial_failed("boot")  # it may start later than this node
    assert book.sweep(known=["boot"], connected=[]) == [] and not book.forgotten("boot")
    book.dial_succeeded("boot")
    assert [book.dial_failed("boot") for _ in range(2)] == [False, True]


# ---------------------------------------------------------------------- a flood of made-up peers
def test_a_flood_of_made_up_peers_stays_within_the_caps_and_spares_bootstrap_and_connected_peers():
    """Both ways made-up ids reach the book, failed dials and known addresses (DHT answers, identify),
    three times over each cap: the book stays bounded, and neither a bootstrap peer not reached yet nor
    a connected member is ever forgotten; a real peer that goes is still forgotten once the flood is."""
    now = [0.0]
    book = DialBook(forget_after_failures=3, forget_after_s=10.0, clock=lambda: now[0])
    book.protect(["boot"])
    flood = [f"fake{index}" for index in range(3 * MAX_TRACKED)]
    for start in range(0, len(flood), 512):
        batch = flood[start:start + 512]
        for peer in batch:
            book.dial_failed(peer)
        book.sweep(known=[*batch, "boot", "member"], connected=["member"])
        now[0] += 1.0
        sizes = book.sizes()
        assert sizes["forgotten"] <= MAX_FORGOTTEN and sizes["protected"] == 1, sizes
        assert sizes["failing"] <= MAX_TRACKED and sizes["unconnected"] <= MAX_TRACKED, sizes
        assert not book.forgotten("boot") and not book.forgotten("member")
    assert book.sizes()["failing"] == book.sizes()["unconnected"] == MAX_TRACKED  # the flood filled them
    for peer in flood:  # the made-up peers fail their dials and are forgotten, freeing their places
        for _ in range(3):
            book.dial_failed(peer)
        book.sweep(known=[peer, "boot", "member"], connected=["member"])
    sizes = book.sizes()
    assert sizes["failing"] == 0 and sizes["forgotten"] == MAX_FORGOTTEN, sizes  # the oldest went first
    assert book.forgotten(flood[-1]) and not book.forgotten(flood[0])
    for _ in range(5):
        assert not book.dial_failed("boot")
    assert not book.forgotten("member")
    book.dial_succeeded("member")
    assert [book.dial_failed("member") for _ in range(3)] == [False, False, True]


def test_a_host_flooded_with_made_up_peers_keeps_its_book_bounded_and_its_real_peers(tmp_path):
    """A real host whose peerstore is filled, as DHT answers fill it, with more made-up peers (each with an
    address nobody listens on) than py-libp2p's peerstore holds (1000): its bootstrap peer and a member stay
    in the peerstore and connected (before p2p.transport.spare_on_eviction the flood evicted them, and the
    next discovery pass stopped the host), the made-up peers are forgotten within the book's caps, and the
    host dials its bootstrap peer again after that connection drops."""
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

    config = dict(gossip_resync_interval=0, discovery_interval=1.0, forget_after_failures=1,
                  forget_after_s=2.0)
    boot = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "boot")
    host = P2PHost.start(P2PConfig(bootstrap=boot.listen_addrs, **config), Identity.generate(),
                         data_dir=tmp_path / "host")
    member = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "member")
    flood = [Identity.generate().peer_id for _ in range(1500)]
    try:
        wait_until(lambda: boot.peer_id in host.peers(), 60, "the host reaching its bootstrap peer")
        member.connect(host.listen_addrs[0])
        wait_until(lambda: host.known_addrs(member.peer_id), 30, "the member's address known to the host")
        closed = socket.socket()  # a port nobody listens on: every dial of a made-up peer fails at once
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
        closed.close()

        async def advertise() -> None:
            peerstore = host._libp2p.get_peerstore()
            for peer in flood:
                peerstore.add_addrs(ID.from_base58(peer), [Multiaddr(f"/ip4/127.0.0.1/tcp/{dead}")], 3600)

        host._call(advertise, timeout=60, what="advertise made-up peers")
        assert host.known_addrs(boot.peer_id) and host.known_addrs(member.peer_id)

        def book() -> dict:
            async def sizes() -> dict:
                return host.dialbook.sizes()
            return host._call(sizes, timeout=10, what="dial book sizes")

        wait_until(lambda: flood[-1] in host.forgotten_peers(), 60, "the made-up peers forgotten")
        sizes = book()
        assert sizes["forgotten"] <= MAX_FORGOTTEN and sizes["protected"] == 0, sizes
        assert sizes["failing"] <= MAX_TRACKED and sizes["unconnected"] <= MAX_TRACKED, sizes
        forgotten = set(host.forgotten_peers())
        assert forgotten <= set(flood) and boot.peer_id not in forgotten and member.peer_id not in forgotten
        assert host.known_addrs(flood[-1]) == []  # a forgotten made-up peer's address is dropped
        assert {boot.peer_id, member.peer_id} <= set(host.peers())
        assert host.known_addrs(boot.peer_id) and host.known_addrs(member.peer_id)
        host.disconnect(boot.peer_id)
        wait_until(lambda: boot.peer_id in host.peers(), 60, "the bootstrap peer connected again")
        assert boot.peer_id not in host.forgotten_peers() and member.peer_id in host.peers()
    finally:
        for h in (member, host, boot):
            h.close()
