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

from p2p.config import P2PConfig
from p2p.dialbook import MAX_FORGOTTEN, DialBook
from p2p.errors import P2PConfigError
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(180)


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


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
    config = dict(gossip_resync_interval=0, discovery_interval=1.0, forget_after_failures=3, forget_after_s=15.0)
    a = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, **config), Identity.generate(), data_dir=tmp_path / "b")
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
        time.sleep(8)
        assert counter.count == forgotten_at, f"dialled {counter.count - forgotten_at} more time(s) once forgotten"
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
