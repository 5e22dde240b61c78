"""Unit tests of the live node's rooms: membership claims and the checks a close must pass.

Real RoundBook, Membership and RoundCoordinator; the contribution pool is the
boundary here (a small stand-in that says which envelopes are held or refused).
"""

from __future__ import annotations

import hashlib
import threading
import time
from types import SimpleNamespace

import pytest

from node import protocol as msg
from node.live.exchange import coordination
from node.live.exchange.coordination import (
    CLOSE_FALLBACK_S,
    CLOSE_SETTLE_S,
    PENDING,
    PENDING_LIMIT_S,
    RoundCoordinator,
)
from node.live.peers.membership import Membership
from node.live.state.roundbook import RoundBook
from node.live.state.topology import Seat

PEERS = ["peer-a", "peer-b", "peer-c"]


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def hello(cluster: str, training_round: int = 0, first_round: int = 0) -> msg.Hello:
    return msg.Hello(cluster, 1, b"\x01" * 20, [], training_round, first_round)


class Pool:
    """Stand-in for ContributionPool: held (replica, peer, digest) triples and refused digests."""

    lazy = False  # the sliced exchange's pool is lazy (tests/test_node_sliced.py)

    def __init__(self) -> None:
        self.held: set[tuple[int, str, bytes]] = set()
        self.refused: dict[bytes, tuple[str, str]] = {}
        self.fetched: list[bytes] = []
        self.sources: list[tuple[str, str | None]] = []

    def holds(self, _round, _stage, replica, peer_id, envelope_hash) -> bool:
        return (replica, peer_id, envelope_hash) in self.held

    def rejected(self, _round, _stage) -> dict[bytes, tuple[str, str]]:
        return dict(self.refused)

    def fetch(self, _round, _stage, announced, also_from=None) -> None:
        self.fetched.append(announced.envelope_hash)
        self.sources.append((announced.peer_id, also_from))

    def have(self, _round, _stage) -> dict:
        return {}

    def prefetch(self, _round, _stage) -> None:
        pass

    def want(self, outer_round, stage) -> None:
        self.wanted = (outer_round, stage)


def key_of(peer: str) -> bytes:
    return peer.encode().ljust(32, b"k")


def rooms(quorum: int = 1, clock=time.monotonic, round_timeout: float = 60.0, seats: list[str] | None = None):
    """The rooms of peer-a with peer-b and peer-c placed; ``seats``: the order the three joined the run on
    chain (default: all at once, ranked by peer id)."""
    book = RoundBook()
    taken = {key_of(peer): Seat((index if seats else 0, 0), index)
                 for index, peer in enumerate(seats or PEERS)}
    membership = Membership("peer-a", "c0", 1, 2, book, seat=lambda _account, key: taken.get(key),
                            own_seat=taken[key_of("peer-a")])
    for index, peer in enumerate(PEERS[1:], start=1):
        book.add_hello(peer, key_of(peer), hello(f"c{index}"))
    membership.refresh()
    pool = Pool()
    coordinator = RoundCoordinator("peer-a", quorum, round_timeout, book, membership, pool,
                                   contributed=lambda _r: True, gossip=lambda *a: b"", resync=lambda: None,
                                   previous_life_finished=-1, clock=clock)
    return book, membership, pool, coordinator


def entry(replica: int, peer: str) -> list:
    return [replica, peer, digest(peer), 100]


def test_a_valid_close_passes_and_bad_ones_are_refused_with_a_reason():
    _book, _membership, pool, coordinator = rooms(quorum=2)
    for replica, peer in enumerate(PEERS):
        pool.held.add((replica, peer, digest(peer)))
    good = msg.Close([entry(0, "peer-a"), entry(1, "peer-b")])
    assert coordinator.judge(0, 0, "c-good", good) is None
    assert "quorum" in coordinator.judge(0, 0, "c-empty", msg.Close([]))
    assert "quorum" in coordinator.judge(0, 0, "c-short", msg.Close([entry(0, "peer-a")]))
    assert "canonical" in coordinator.judge(0, 0, "c-order",
                                            msg.Close([entry(1, "peer-b"), entry(0, "peer-a")]))
    duplicate = msg.Close([entry(0, "peer-a"), [0, "peer-a", digest("other"), 100], entry(1, "peer-b")])
    assert "duplicate" in coordinator.judge(0, 0, "c-dup", duplicate)
    pool.refused[digest("peer-c")] = ("peer-c", "payload does not decode")
    refused = msg.Close([entry(0, "peer-a"), entry(2, "peer-c")])
    assert "does not decode" in coordinator.judge(0, 0, "c-bad", refused)
    # A verdict is kept: the same coordinator's close is not re-judged into validity later.
    pool.refused.clear()
    assert "does not decode" in coordinator.judge(0, 0, "c-bad", refused)
    assert set(coordinator.invalid_closes(0, 0)) == {"c-empty", "c-short", "c-order", "c-dup", "c-bad"}


def test_a_close_naming_contributions_not_here_is_pending_and_fetches_them():
    _book, _membership, pool, coordinator = rooms()
    close = msg.Close([entry(0, "peer-a"), entry(1, "peer-b")])
    assert coordinator.judge(3, 1, "c", close) == PENDING
    assert set(pool.fetched) == {digest("peer-a"), digest("peer-b")}
    pool.held.update({(0, "peer-a", digest("peer-a")), (1, "peer-b", digest("peer-b"))})
    assert coordinator.judge(3, 1, "c", close) is None
    # Held, but signed by another replica than the close claims: never counts as here.
    wrong = msg.Close([[2, "peer-b", digest("peer-b"), 100]])
    assert coordinator.judge(3, 1, "c2", wrong) == PENDING


def test_a_pending_close_is_fetched_from_its_coordinator_too():
    _book, _membership, pool, coordinator = rooms()
    close = msg.Close([entry(1, "peer-b")])
    assert coordinator.judge(0, 0, "peer-c", close) == PENDING
    assert pool.sources == [("peer-b", "peer-c")]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pending_close_is_refused_only_after_a_stall_without_progress():
    # A starved machine fetches slowly: as long as entries keep arriving the close stays
    # pending, however long it takes in all (refusing it would make nodes aggregate
    # different sets); only a stall as long as the limit refuses it.
    clock = Clock()
    _book, _membership, pool, coordinator = rooms(clock=clock, round_timeout=50.0)
    limit = coordinator.stall_limit()
    assert limit == 50.0
    close = msg.Close([entry(0, "peer-a"), entry(1, "peer-b"), entry(2, "peer-c")])
    assert coordinator.judge(0, 0, "c", close) == PENDING
    for replica, peer in enumerate(PEERS[:2]):
        clock.now += limit - 1
        pool.held.add((replica, peer, digest(peer)))
        assert coordinator.judge(0, 0, "c", close) == PENDING  # progress: the clock restarts
    clock.now += limit - 1
    assert coordinator.judge(0, 0, "c", close) == PENDING  # 3 x (limit - 1) in all: still waited for
    clock.now += 2
    reason = coordinator.judge(0, 0, "c", close)
    assert "1 of 3 still missing after 50s without progress" in reason
    # The verdict is kept even if the last entry turns up afterwards.
    pool.held.add((2, "peer-c", digest("peer-c")))
    assert coordinator.judge(0, 0, "c", close) == reason
    # The limit never drops below PENDING_LIMIT_S, and follows a shorter transfer timeout.
    _b, _m, _p, short = rooms(round_timeout=1.0)
    assert short.stall_limit() == PENDING_LIMIT_S
    _b, _m, _p, fast = rooms(round_timeout=600.0)
    fast.transfer_timeout = 45.0
    assert fast.stall_limit() == 45.0


def test_an_absurd_training_round_claim_is_ignored_for_the_entry_round():
    book, membership, _pool, _coordinator = rooms()
    book.add_hello("peer-b", key_of("peer-b"), hello("c1", training_round=12))
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=10**12))
    assert membership.live_training_round(last_committed=10, window=8) == 12
    # An unplaced peer's claim does not count either.
    unbound = Membership("peer-a", "c0", 1, 2, book, seat=lambda _account, _key: None)
    assert unbound.live_training_round(last_committed=10, window=8) == -1


def test_claimed_rounds_span_each_live_replicas_first_through_current_round():
    # What a re-forming cluster checks before skipping a round: who still contributes to it.
    book, membership, _pool, _coordinator = rooms()
    # re-entered at 89
    book.add_hello("peer-b", key_of("peer-b"), hello("c1", training_round=89, first_round=89))
    # waits for a partner
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=-1, first_round=2**62))
    assert membership.claimed_rounds(last_committed=86, window=10) == [(89, 89)]
    # A claim past the window is ignored, as for the entry round.
    book.add_hello("peer-b", key_of("peer-b"), hello("c1", training_round=10**12, first_round=0))
    assert membership.claimed_rounds(last_committed=86, window=10) == []


def test_a_coordinator_that_signed_two_different_closes_is_refused():
    book, _membership, pool, coordinator = rooms()
    pool.held.update({(0, "peer-a", digest("peer-a")), (1, "peer-b", digest("peer-b"))})
    close = msg.Close([entry(0, "peer-a"), entry(1, "peer-b")])
    book.add_close(0, 0, "peer-b", close, b"first")
    assert coordinator.judge(0, 0, "peer-b", close) is None
    # The inbox files the equivocation when the second, different close arrives.
    book.add_close_equivocation(1, 0, "peer-b")
    assert "equivocation" in coordinator.judge(1, 0, "peer-b", close)
    assert "peer-b" in coordinator.invalid_closes(1, 0)


def test_another_coordinators_close_is_used_only_once_it_has_settled():
    # peer-b joined the run first (replica 0) and leads; peer-a is replica 1.
    book, membership, pool, coordinator = rooms(seats=["peer-b", "peer-a", "peer-c"])
    pool.held.update({(1, "peer-a", digest("peer-a")), (0, "peer-b", digest("peer-b"))})
    membership.set_connected(PEERS)
    outer_round = 3
    assert coordinator.rotation(outer_round, 0)[0] == "peer-b"
    close = msg.Close([entry(0, "peer-b"), entry(1, "peer-a")])
    book.add_close(outer_round, 0, "peer-b", close, b"envelope")
    assert coordinator.await_close(outer_round, 0) == close
    # Never sooner than the settle time after its arrival: a second version would have voided it.
    assert book.close_age(outer_round, 0, "peer-b") >= CLOSE_SETTLE_S


def test_a_lower_ranked_coordinators_close_waits_for_the_deadline_while_the_leader_is_present():
    # Seated (and replicas) in the order peer-c, peer-b, peer-a: peer-c leads, peer-b is next.
    book, membership, pool, coordinator = rooms(seats=["peer-c", "peer-b", "peer-a"])
    pool.held.update({(2, "peer-a", digest("peer-a")), (1, "peer-b", digest("peer-b"))})
    membership.set_connected(PEERS)
    outer_round = 3
    coordinator.round_timeout = 3.0
    censoring = msg.Close([entry(1, "peer-b")])  # leaves out peer-a's contribution
    book.add_close(outer_round, 0, "peer-b", censoring, b"envelope")
    started = time.monotonic()
    assert coordinator.await_close(outer_round, 0) == censoring
    # Used only after round deadline + 1 x fallback (the leader peer-c never closed).
    assert time.monotonic() - started >= 3.0 + CLOSE_FALLBACK_S


def test_a_deadline_that_has_not_started_holds_back_the_fallback(monkeypatch):
    # The apply prefetch waits for a close while the next round trains; its round deadline runs
    # only from when the training thread reaches the apply (clock_from), as inline.
    monkeypatch.setattr(coordination, "CLOSE_FALLBACK_S", 0.2)
    book, membership, pool, coordinator = rooms(round_timeout=0.3, seats=["peer-c", "peer-b", "peer-a"])
    pool.held.update({(2, "peer-a", digest("peer-a")), (1, "peer-b", digest("peer-b"))})
    membership.set_connected(PEERS)
    outer_round = 3
    censoring = msg.Close([entry(1, "peer-b")])
    book.add_close(outer_round, 0, "peer-b", censoring, b"envelope")
    reached: list[float] = []
    started = time.monotonic()
    threading.Timer(3.0, lambda: reached.append(time.monotonic())).start()
    assert coordinator.await_close(outer_round, 0, clock_from=lambda: reached[0] if reached else None) \
        == censoring
    # Not before the apply was reached + deadline + 1 x fallback (settled long before).
    assert time.monotonic() - started >= 3.0 + 0.3 + 0.2


def _file_close(book, membership, outer_round: int, coordinator: str, close: msg.Close) -> None:
    """File a close of stage 0 as the inbox does: the sender's placement and standing are checked first."""
    membership.check_sender(SimpleNamespace(kind=msg.CLOSE, sender_peer_id=coordinator, stage=0, replica=-1))
    book.add_close(outer_round, 0, coordinator, close, b"envelope-" + coordinator.encode())


@pytest.mark.parametrize("ejected_first", [True, False])
def test_the_close_of_a_round_does_not_depend_on_when_an_ejection_is_learnt(ejected_first):
    # peer-c leads the round, peer-b is next, and peer-c is found guilty on chain around the time
    # the round closes. One node learns of it before peer-c's close arrives, another only after:
    # both must aggregate the same close (docs/PROTOCOL.md, "Closing a round"). Before, the first
    # refused peer-c's close at the inbox and skipped peer-c in the rotation, so it took peer-b's.
    book, membership, pool, coordinator = rooms(seats=["peer-c", "peer-b", "peer-a"])
    pool.held.update({(2, "peer-a", digest("peer-a")), (1, "peer-b", digest("peer-b")),
                      (0, "peer-c", digest("peer-c"))})
    membership.set_connected(PEERS)
    outer_round = 3
    leaders = msg.Close([entry(0, "peer-c"), entry(1, "peer-b"), entry(2, "peer-a")])
    seconds = msg.Close([entry(1, "peer-b"), entry(2, "peer-a")])
    if ejected_first:
        membership.eject("peer-c")
    _file_close(book, membership, outer_round, "peer-c", leaders)
    _file_close(book, membership, outer_round, "peer-b", seconds)
    if not ejected_first:
        membership.eject("peer-c")
    assert coordinator.await_close(outer_round, 0) == leaders
    # The ejection still counts where it is the node's own choice: its announces are refused and
    # a coordinator no longer waits for its contribution.
    with pytest.raises(msg.ProtocolError):
        membership.check_sender(SimpleNamespace(kind=msg.ANNOUNCE, sender_peer_id="peer-c", stage=0,
                                                replica=0))
    assert "peer-c" not in membership.alive() and "peer-c" in membership.present()


def test_a_hello_far_off_the_clock_or_of_another_run_is_refused():
    from node.live.inbox import HELLO_MAX_AGE_S, GossipInbox
    from p2p.envelope import Envelope, EnvelopeValidator
    from p2p.identity import Identity

    book, membership, pool, _coordinator = rooms()
    inbox = GossipInbox(7, EnvelopeValidator(7, max_size=1 << 16), book, membership, pool,
                        held_stages=lambda: ())
    identity = Identity.generate()
    payload = msg.encode_payload(hello("c9"))

    def sent(run_id: int = 7, age_s: float = 0.0) -> bytes:
        stamp = int((time.time() - age_s) * 1000)
        return Envelope.create(identity, run_id, 0, msg.HELLO, payload, timestamp_ms=stamp).to_bytes()

    for stale in (sent(age_s=HELLO_MAX_AGE_S + 30), sent(age_s=-(HELLO_MAX_AGE_S + 30)), sent(run_id=8)):
        with pytest.raises(msg.ProtocolError):
            inbox.handle(stale)
    assert identity.peer_id not in book.peers
    inbox.handle(sent(age_s=5))
    assert book.peers[identity.peer_id].hello.cluster == "c9"


def test_record_signatures_are_checked_and_a_bad_one_costs_only_itself():
    from node.live.inbox import GossipInbox
    from p2p.envelope import Envelope, EnvelopeValidator
    from p2p.identity import Identity

    book, membership, pool, _coordinator = rooms()
    member, outsider = b"\x0a" * 20, b"\x0b" * 20

    def signer(record, account, signature):  # stand-in for the chain: recover + membership
        if signature[:1] == b"\x00":
            raise msg.ProtocolError("signature does not verify")
        if account != member:
            raise msg.ProtocolError("not a member")
        return "0x" + account.hex(), hashlib.sha256(repr(record.fields()).encode()).digest()

    inbox = GossipInbox(7, EnvelopeValidator(7, max_size=1 << 16), book, membership, pool,
                        held_stages=lambda: (), record_signer=signer)
    def sent(account: bytes, signature: bytes, root: bytes = b"\x01" * 32,
             payload: bytes | None = None) -> bytes:
        body = payload if payload is not None else msg.encode_payload(
            msg.RecordSignature(b"\x00" * 32, root, b"\x02" * 32, 1, 2, 3, 4, b"\x00" * 32, account,
                                signature))
        return Envelope.create(Identity.generate(), 7, 0, msg.RECORD, body).to_bytes()  # one sender each

    with pytest.raises(msg.ProtocolError):  # malformed: a 64-byte signature
        inbox.handle(sent(member, b"\x01" * 64))
    with pytest.raises(msg.ProtocolError):  # not msgpack at all
        inbox.handle(sent(member, b"", payload=b"\xc1" * 40))
    with pytest.raises(msg.ProtocolError):  # a non-member's signature
        inbox.handle(sent(outsider, b"\x01" * 65, root=b"\x03" * 32))
    with pytest.raises(msg.ProtocolError):  # a signature that does not verify
        inbox.handle(sent(member, b"\x00" * 65, root=b"\x04" * 32))
    assert book.snapshot_signatures(0) == {}
    inbox.handle(sent(member, b"\x01" * 65))
    (record, signatures), = book.snapshot_signatures(0).values()
    assert record.weights_root == b"\x01" * 32 and list(signatures) == ["0x" + member.hex()]


def test_a_member_signing_two_records_of_a_round_is_kept_as_evidence_once():
    book = RoundBook()
    book.add_record_signature(3, b"a" * 32, "rec-a", "0xm", b"sig-a")
    book.add_record_signature(3, b"a" * 32, "rec-a", "0xm", b"sig-a")  # a replay is not equivocation
    assert book.take_record_equivocations() == []
    book.add_record_signature(3, b"b" * 32, "rec-b", "0xm", b"sig-b")
    assert book.take_record_equivocations() == [(3, "0xm", ("rec-a", b"sig-a"), ("rec-b", b"sig-b"))]
    # Only the first record counts toward a quorum.
    assert {d: list(s) for d, (_r, s) in book.snapshot_signatures(3).items()} == {b"a" * 32: ["0xm"]}


def test_a_round_message_that_arrives_before_its_senders_hello_is_kept_and_filed_once_placed():
    """The host delivers each gossip message once: a close that overtakes its sender's hello (a loaded
    machine, a joiner catching up) must not be lost, and a sender that never appears costs a bounded slot."""
    from node.live.inbox import GossipInbox
    from p2p.envelope import Envelope, EnvelopeValidator
    from p2p.identity import Identity

    book, membership, pool, _coordinator = rooms()
    inbox = GossipInbox(7, EnvelopeValidator(7, max_size=1 << 16), book, membership, pool,
                        held_stages=lambda: ())
    late = Identity.generate()
    seats = membership.seat  # the chain: the late sender holds the run's fourth seat
    membership.seat = lambda account, key: Seat((3, 0), 3) if key == late.public_key_bytes \
        else seats(account, key)
    close = Envelope.create(late, 7, 1, msg.CLOSE, msg.encode_payload(msg.Close([entry(3, late.peer_id)])),
                            stage=0, replica=3).to_bytes()
    with pytest.raises(msg.ProtocolError, match="not placed yet"):
        inbox.handle(close)
    assert not book.snapshot_closes(1, 0)
    inbox._retry_deferred()  # still not placed: kept
    assert not book.snapshot_closes(1, 0) and len(inbox._deferred) == 1
    book.add_hello(late.peer_id, late.public_key_bytes, hello("c3"))
    inbox._retry_deferred()
    assert late.peer_id in book.snapshot_closes(1, 0) and not inbox._deferred


def test_sync_keeps_every_run_message_our_hellos_and_others_hellos_only_now_and_then(monkeypatch):
    """What the host keeps to re-serve over /dlx/sync (``GossipInbox.keep_for_sync``): each peer
    re-serves what it keeps to every puller, so another sender's hellos are kept once per
    HELLO_SYNC_EVERY_S, ours and every other kind always, garbage never."""
    import node.live.inbox as inbox_module
    from node.live.inbox import HELLO_SYNC_EVERY_S, GossipInbox
    from p2p.envelope import Envelope, EnvelopeValidator
    from p2p.identity import Identity

    book, membership, pool, _coordinator = rooms()
    inbox = GossipInbox(7, EnvelopeValidator(7, max_size=1 << 16), book, membership, pool,
                        held_stages=lambda: ())
    me, other = Identity.generate(), Identity.generate()
    clock = [1000.0]
    monkeypatch.setattr(inbox_module.time, "monotonic", lambda: clock[0])

    def hello_of(identity, n):
        return Envelope.create(identity, 7, 0, msg.HELLO, msg.encode_payload(hello(f"c{n}"))).to_bytes()

    keep = lambda data: inbox.keep_for_sync(data, me.peer_id)  # noqa: E731
    announce = Envelope.create(other, 7, 0, msg.ANNOUNCE, b"x", stage=0).to_bytes()
    assert keep(announce) and keep(hello_of(me, 1)) and keep(hello_of(me, 2))
    assert keep(hello_of(other, 1))
    clock[0] += 1
    assert not keep(hello_of(other, 2)) and keep(hello_of(me, 3))
    clock[0] += HELLO_SYNC_EVERY_S
    assert keep(hello_of(other, 3)) and not keep(hello_of(other, 4))
    assert not keep(b"not an envelope") and not keep(announce[:-1])


def test_coordinators_rank_by_chain_seat_so_a_joiner_heard_by_some_holders_only_comes_last_in_every_view():
    # peer-a's view knows peer-b and peer-c; peer-c joined the run last on chain. A holder that has
    # not heard peer-c's hello yet (a view without it) must name the same coordinators ahead of it.
    seats = ["peer-b", "peer-a", "peer-c"]
    _book, _membership, _pool, knows_joiner = rooms(seats=seats)
    book = RoundBook()
    taken = {key_of(peer): Seat((index, 0), index) for index, peer in enumerate(seats)}
    membership = Membership("peer-a", "c0", 1, 2, book, seat=lambda _account, key: taken.get(key),
                            own_seat=taken[key_of("peer-a")])
    book.add_hello("peer-b", key_of("peer-b"), hello("c1"))
    without_joiner = RoundCoordinator("peer-a", 1, 60.0, book, membership, Pool(),
                                      contributed=lambda _r: True, gossip=lambda *a: b"", resync=lambda: None,
                                      previous_life_finished=-1)
    for outer_round in range(50):
        for stage in (0, 1):
            full = knows_joiner.rotation(outer_round, stage)
            assert full == ["peer-b", "peer-a", "peer-c"]  # join order, whatever the round
            assert without_joiner.rotation(outer_round, stage) == full[:2]


def test_a_close_of_the_first_seated_coordinator_is_taken_by_a_view_that_has_not_heard_of_a_joiner():
    # The fork test_join once showed: the holder that knows the joiner and the one that does not must
    # take the same close. Here peer-b (seated first) closes; peer-a knows the joiner peer-c, seated last.
    book, membership, pool, coordinator = rooms(seats=["peer-b", "peer-a", "peer-c"])
    pool.held.update({(1, "peer-a", digest("peer-a")), (0, "peer-b", digest("peer-b"))})
    membership.set_connected(PEERS)
    close = msg.Close([entry(0, "peer-b"), entry(1, "peer-a")])
    book.add_close(7, 0, "peer-b", close, b"envelope")
    started = time.monotonic()
    assert coordinator.await_close(7, 0) == close
    assert time.monotonic() - started < 30  # taken once settled, not after the 60 s deadline
