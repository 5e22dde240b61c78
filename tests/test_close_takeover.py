"""Taking over a round's close from a live leader (docs/PROTOCOL.md, "Closing a round").

A lower-ranked coordinator whose own deadline comes first must not close (and aggregate its own close)
while the leader is alive: it asks the coordinators ranked above it with a signed takeover and closes only
once each of them yielded, is gone, or stayed silent for the answer limit. Three in-process nodes, each
with its own real libp2p host, gossip inbox, round book, membership and coordinator; only the
contribution pool (which blobs a node holds) is a stand-in.
"""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from node import protocol as msg
from node.live.exchange import coordination
from node.live.exchange.coordination import RoundCoordinator
from node.live.inbox import GossipInbox
from node.live.peers.membership import Membership
from node.live.peers.messenger import Messenger
from node.live.state.roundbook import Announced, RoundBook
from node.live.state.saidlog import SaidLog
from node.live.state.station import Station
from node.live.state.topology import Seat
from node.protocol import run_topic
from p2p.config import P2PConfig
from p2p.envelope import EnvelopeValidator
from p2p.host import P2PHost
from p2p.identity import Identity

RUN = 7
ROUND = 3


def digest(peer: str) -> bytes:
    return hashlib.sha256(peer.encode()).digest()


class Pool:
    """Stand-in for the contribution pool: which contributions (peer ids) this node holds."""

    lazy = False

    def __init__(self, held: set[str]) -> None:
        self.held = set(held)

    def holds(self, _round, _stage, _replica, peer_id, _envelope_hash) -> bool:
        return peer_id in self.held

    def closable(self, _round, _stage) -> dict[bytes, bytes]:
        return {digest(p): b"" for p in self.held}

    def have(self, _round, _stage) -> dict:
        return {}

    def rejected(self, _round, _stage) -> dict:
        return {}

    def fetch(self, _round, _stage, announced, also_from=None) -> None:
        # a named contribution is fetched (from its sender or the coordinator)
        self.held.add(announced.peer_id)

    def prefetch(self, _round, _stage) -> None:
        pass

    def want(self, _round, _stage) -> None:
        pass


class Node:
    """One member's rooms over a real libp2p host."""

    def __init__(self, tmp_path, name: str, identity: Identity, seats: dict[str, Seat], round_timeout: float,
                 held: set[str]) -> None:
        self.name = name
        self.stop = threading.Event()
        self.host = P2PHost.start(P2PConfig(), identity, data_dir=tmp_path / name)
        self.peer_id = self.host.peer_id
        self.book = RoundBook()
        self.membership = Membership(self.peer_id, f"c-{self.peer_id}", 1, 1, self.book,
                                     seat=lambda _account, key: seats.get(key.decode()),
                                     own_seat=seats[self.peer_id])
        self.pool = Pool(held)
        validator = EnvelopeValidator(RUN, max_size=msg.MAX_GOSSIP_PAYLOAD + 4096, max_rounds_ahead=64)
        self.inbox = GossipInbox(RUN, validator, self.book, self.membership, self.pool,
                                 held_stages=lambda: (0,))
        messenger = Messenger(identity=identity, run_id=RUN, host=self.host, station=Station(),
                              said=SaidLog(root=tmp_path / name / "said", exempt_kinds=(msg.HELLO,),
                                           max_bytes=1 << 20))
        self.coordinator = RoundCoordinator(self.peer_id, 2, round_timeout, self.book, self.membership,
                                            self.pool, contributed=lambda _r: True, gossip=messenger.gossip,
                                            resync=messenger.resync, previous_life_finished=-1,
                                            stop=self.stop)
        queue = self.host.subscribe(run_topic(RUN), validator=self.inbox.relay_ok,
                                    keep_for_sync=lambda data: self.inbox.keep_for_sync(data, self.peer_id))
        self.consumer = threading.Thread(target=self.inbox.run, args=(queue, self.stop), daemon=True)
        self.consumer.start()
        self.result: msg.Close | BaseException | None = None

    def meet(self, everyone: list[Node], replicas: dict[str, int]) -> None:
        for other in everyone:
            if other is not self:
                self.book.add_hello(other.peer_id, other.peer_id.encode(),
                                    msg.Hello(f"c-{other.peer_id}", 1, b"\x01" * 20, [], ROUND, 0))
            self.book.add_announce(ROUND, 0, Announced(other.peer_id, replicas[other.peer_id],
                                                       digest(other.peer_id), 100))
        self.membership.refresh()

    def await_close(self) -> None:
        try:
            self.membership.set_connected(self.host.peers())
            self.result = self.coordinator.await_close(ROUND, 0)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.result = exc

    def close(self) -> None:
        self.stop.set()
        self.consumer.join(timeout=5.0)  # it polls the stop every 0.5 s: no inbox thread outlives its test
        self.host.close()


@pytest.fixture
def members(tmp_path):
    identities = [Identity.generate() for _ in range(3)]
    ids = [i.peer_id for i in identities]
    seats = {peer: Seat((index, 0), index) for index, peer in enumerate(ids)}  # join order: leader first
    started: list[Node] = []

    def start(round_timeouts: list[float], held: list[set[int]]) -> list[Node]:
        for index, identity in enumerate(identities):
            started.append(Node(tmp_path, f"n{index}", identity, seats, round_timeouts[index],
                                {ids[j] for j in held[index]}))
        for node in started[1:]:
            node.host.connect(started[0].host.listen_addrs[0])
        started[2].host.connect(started[1].host.listen_addrs[0])
        replicas = {peer: seat.index for peer, seat in seats.items()}
        for node in started:
            node.meet(started, replicas)
        deadline = time.monotonic() + 30
        while any(len(n.host.topic_peers(run_topic(RUN))) < 2 for n in started):
            assert time.monotonic() < deadline, "the gossip mesh did not form"
            time.sleep(0.2)
        return started

    yield start
    for node in started:
        node.close()


def run_all(nodes: list[Node], timeout: float = 60.0) -> list:
    threads = [threading.Thread(target=n.await_close, daemon=True) for n in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    return [n.result for n in nodes]


def test_a_live_leaders_close_wins_over_a_backup_whose_deadline_came_first(members, monkeypatch):
    # The 60-minute soak's round 12: the leader misses one contribution and closes only at its own
    # deadline, with a quorum; the backups hold all three and their deadlines (each node's runs from its
    # own apply) come long before the leader's. Before, the rank-1 backup closed at its deadline + 6 s x 1
    # with all three and aggregated its own close while the leader's was still to come: a fork.
    monkeypatch.setattr(coordination, "CLOSE_FALLBACK_S", 0.5)
    leader, backup, third = members(round_timeouts=[8.0, 0.5, 0.5], held=[{0, 1}, {0, 1, 2}, {0, 1, 2}])
    started = time.monotonic()
    results = run_all([leader, backup, third])
    assert all(isinstance(r, msg.Close) for r in results), results
    leaders = results[0]
    assert [e[1] for e in leaders.contributions] == [leader.peer_id, backup.peer_id]  # the leader's, 2 of 3
    assert results == [leaders] * 3  # every node aggregates the leader's close
    assert time.monotonic() - started >= 8.0  # which came at the leader's deadline
    # The backups asked (a signed takeover reached the leader) and none of them closed.
    assert {backup.peer_id, third.peer_id} <= set(leader.book.takeovers_of(ROUND, 0))
    for node in (leader, backup, third):
        assert set(node.book.snapshot_closes(ROUND, 0)) == {leader.peer_id}


def test_a_leader_that_cannot_close_yields_and_the_backup_closes_for_everyone(members, monkeypatch):
    # The leader holds only its own contribution (no quorum of 2) at its deadline; the backup asked: the
    # leader signs a yield, and every node, the leader too, aggregates the backup's close at once.
    monkeypatch.setattr(coordination, "CLOSE_FALLBACK_S", 0.5)
    leader, backup, third = members(round_timeouts=[3.0, 0.5, 30.0], held=[{0}, {0, 1, 2}, {0, 1, 2}])
    results = run_all([leader, backup, third])
    assert all(isinstance(r, msg.Close) for r in results), results
    assert results[0] == results[1] == results[2]
    assert len(results[1].contributions) == 3
    assert set(backup.book.snapshot_closes(ROUND, 0)) == {backup.peer_id}
    assert leader.peer_id in third.book.yielded(ROUND, 0)


def test_a_dead_leader_is_taken_over_without_waiting_for_an_answer(members, monkeypatch):
    # The leader's process is gone (its connections closed and its last message older than the peer
    # TTL, Membership.alive): the backup closes at once, as before, and the third node takes its close.
    monkeypatch.setattr(coordination, "CLOSE_FALLBACK_S", 0.5)
    leader, backup, third = members(round_timeouts=[60.0, 0.5, 0.5], held=[{0, 1, 2}, {1, 2}, {1, 2}])
    leader.close()
    for node in (backup, third):
        node.book.peers[leader.peer_id].seen_at -= 60  # its last hello is long past the peer TTL
        deadline = time.monotonic() + 20
        while leader.peer_id in node.host.peers():
            assert time.monotonic() < deadline, "the dead leader's connection stayed open"
            time.sleep(0.2)
    started = time.monotonic()
    results = run_all([backup, third])
    assert all(isinstance(r, msg.Close) for r in results), results
    assert results[0] == results[1] and [e[1] for e in results[0].contributions] == [backup.peer_id,
                                                                                     third.peer_id]
    assert time.monotonic() - started < coordination.PENDING_LIMIT_S  # no answer was waited for
    assert not backup.book.takeovers_of(ROUND, 0)


def test_a_connected_leader_that_answers_nothing_is_closed_without_after_the_answer_limit(members,
                                                                                          monkeypatch):
    # Byzantine or starved past the limit: connected (so present) but it never closes nor yields. The
    # backup waits the answer limit after its takeover, then closes, and everyone takes that close.
    monkeypatch.setattr(coordination, "CLOSE_FALLBACK_S", 0.5)
    monkeypatch.setattr(coordination, "PENDING_LIMIT_S", 3.0)
    leader, backup, third = members(round_timeouts=[60.0, 0.5, 0.5], held=[{0, 1, 2}, {1, 2}, {1, 2}])
    started = time.monotonic()
    results = run_all([backup, third])  # the leader's coordinator never runs: it answers nothing
    assert all(isinstance(r, msg.Close) for r in results), results
    assert results[0] == results[1] and len(results[0].contributions) == 2
    assert time.monotonic() - started >= 3.0  # the answer limit after the takeover
    assert backup.peer_id in leader.book.takeovers_of(ROUND, 0)


def test_a_coordinator_that_yielded_has_no_close_that_counts():
    # A yield and a later close of the same coordinator (Byzantine, or a restart that forgot it): the
    # close is skipped like an equivocator's, and the next coordinator counts at once.
    book = RoundBook()
    seats = {"peer-a": Seat((0, 0), 0), "peer-b": Seat((1, 0), 1), "peer-c": Seat((2, 0), 2)}
    membership = Membership("peer-c", "c2", 1, 1, book, seat=lambda _a, key: seats.get(key.decode()),
                            own_seat=seats["peer-c"])
    for peer in ("peer-a", "peer-b"):
        book.add_hello(peer, peer.encode(), msg.Hello(f"c-{peer}", 1, b"\x01" * 20, [], ROUND, 0))
    membership.refresh()
    pool = Pool({"peer-a", "peer-b", "peer-c"})
    coordinator = RoundCoordinator("peer-c", 1, 60.0, book, membership, pool, contributed=lambda _r: True,
                                   gossip=lambda *a: b"", resync=lambda: None, previous_life_finished=-1)
    for peer, index in (("peer-a", 0), ("peer-b", 1), ("peer-c", 2)):
        book.add_announce(ROUND, 0, Announced(peer, index, digest(peer), 100))
    leaders = msg.Close([[0, "peer-a", digest("peer-a"), 100]])
    seconds = msg.Close([[0, "peer-a", digest("peer-a"), 100], [1, "peer-b", digest("peer-b"), 100]])
    book.add_yield(ROUND, 0, "peer-a")
    book.add_close(ROUND, 0, "peer-a", leaders, b"a")
    book.add_close(ROUND, 0, "peer-b", seconds, b"b")
    started = time.monotonic()
    assert coordinator.await_close(ROUND, 0) == seconds
    assert time.monotonic() - started < 30  # not at the deadline (60 s) + 6 s: at once, once settled


def test_takeover_and_yield_payloads_are_decoded_strictly():
    for kind, message in ((msg.TAKEOVER, msg.Takeover()), (msg.YIELD, msg.Yield())):
        data = msg.encode_payload(message)
        assert msg.decode_payload(kind, data) == message
        import msgpack
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(kind, msgpack.packb({"extra": 1}))
        with pytest.raises(msg.ProtocolError):
            msg.decode_payload(kind, b"\xc1")
