"""Placement across churn: every member derives the same placement from the same chain facts.

Real RoundBook and Membership views of one run, each fed the hellos that node heard; the chain's seats
(join order, and which seats ended) are the same table for every view, as the chain is. The fault the
soak found (bench/bench_soak.py, 35 minutes): a joiner that came after a member left for good placed
itself on replica 5 while the members that had heard the leaver's hello placed it on 6, so every
announcement of the joiner was refused and none of its contributions was ever closed.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from node import protocol as msg
from node.live.peers.membership import Membership
from node.live.peers.topology import Declaration, Seat, assign_stages, place_members
from node.live.round.roundbook import RoundBook


class Chain:
    """The run's seats in join order, as every member reads them: peer name -> Seat."""

    def __init__(self, *peers: str) -> None:
        self.seats: dict[str, Seat] = {}
        for peer in peers:
            self.join(peer)

    def join(self, peer: str) -> None:
        index = len(self.seats)
        self.seats[peer] = Seat((100 + index, 0), index)

    def leave(self, peer: str) -> None:
        seat = self.seats[peer]
        self.seats[peer] = Seat(seat.joined, seat.index, current=False)

    def seat(self, _account: bytes, key: bytes) -> Seat | None:
        return self.seats.get(key.decode())


def view(chain: Chain, me: str, clusters: dict[str, tuple[str, int]], heard: list[str],
         num_stages: int = 2) -> Membership:
    """``me``'s Membership after hearing the hellos of ``heard`` (clusters: peer -> (cluster, size))."""
    book = RoundBook()
    for peer in heard:
        cluster, size = clusters[peer]
        book.add_hello(peer, peer.encode(), msg.Hello(cluster, size, b"\x01" * 20, [], 0, 0))
    cluster, size = clusters[me]
    return Membership(me, cluster, size, num_stages, book, seat=chain.seat, own_seat=chain.seats[me])


SOLO = {p: (f"c-{p}", 1) for p in ("a", "b", "leaver", "killed", "joiner")}


def placed(membership: Membership) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {p: (pl.replica, pl.stages) for p, pl in membership.refresh().items()}


def current(membership: Membership, chain: Chain) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {p: where for p, where in placed(membership).items() if chain.seats[p].current}


def test_a_joiner_after_a_leaver_is_placed_alike_by_members_that_heard_the_leaver_and_by_itself():
    chain = Chain("a", "b", "leaver")
    old = view(chain, "a", SOLO, ["b", "leaver"])
    before = placed(old)
    chain.leave("leaver")
    chain.join("joiner")
    old.book.add_hello("joiner", b"joiner", msg.Hello("c-joiner", 1, b"\x01" * 20, [], 0, 0))
    joiner = view(chain, "joiner", SOLO, ["a", "b"])  # it never heard the leaver
    restarted = view(chain, "b", SOLO, ["a", "joiner"])  # an old member restarted after the leave
    assert current(old, chain) == current(joiner, chain) == current(restarted, chain)
    assert placed(joiner)["joiner"] == (3, (0, 1))  # its own seat's index: the 4th seat of the run
    # Nobody's index moved when the member left; the leaver keeps its placement where its hello is known.
    assert {p: placed(old)[p] for p in before} == before


def test_the_joiners_announce_passes_the_sender_check_of_a_member_that_heard_the_leaver():
    # The symptom in the soak: check_sender refused the joiner's announcements (replica 5 vs 6).
    chain = Chain("a", "b", "leaver")
    old = view(chain, "a", SOLO, ["b", "leaver"])
    old.refresh()
    chain.leave("leaver")
    chain.join("joiner")
    old.book.add_hello("joiner", b"joiner", msg.Hello("c-joiner", 1, b"\x01" * 20, [], 0, 0))
    mine = view(chain, "joiner", SOLO, ["a", "b"]).refresh()["joiner"]
    announce = SimpleNamespace(kind=msg.ANNOUNCE, stage=0, replica=mine.replica, sender_peer_id="joiner")
    old.check_sender(announce)  # raises ProtocolError on a placement mismatch
    wrong = SimpleNamespace(kind=msg.ANNOUNCE, stage=0, replica=mine.replica - 1, sender_peer_id="joiner")
    with pytest.raises(msg.ProtocolError, match="does not match its placement"):
        old.check_sender(wrong)


@pytest.mark.parametrize("order", [
    ["kill", "join"], ["join", "kill"], ["leave", "join"], ["join", "leave"], ["kill", "leave", "join"],
    ["leave", "kill", "join"], ["join", "leave", "kill"],
])
def test_every_view_places_the_current_members_alike_whatever_the_order_of_kill_leave_and_join(order):
    # A killed member still holds its seat but sends no hello: a view started while it is down never
    # hears it. A leaver's seat ends on chain; only views that were up while it ran heard it.
    chain = Chain("a", "b", "leaver", "killed")
    everyone = ["a", "b", "leaver", "killed"]
    views = {"a": view(chain, "a", SOLO, [p for p in everyone if p != "a"])}
    alive = set(everyone)
    for event in order:
        if event == "kill":
            alive.discard("killed")
        elif event == "leave":
            alive.discard("leaver")
            chain.leave("leaver")
        else:
            chain.join("joiner")
            alive.add("joiner")
            views["a"].book.add_hello("joiner", b"joiner", msg.Hello("c-joiner", 1, b"\x01" * 20, [], 0, 0))
            views["joiner"] = view(chain, "joiner", SOLO, sorted(alive - {"joiner"}))
        views[f"b-after-{event}"] = view(chain, "b", SOLO, sorted(alive - {"b"}))  # b restarted
    # Each view places every current member it heard of at that member's seat index, whoever else it heard.
    for name, membership in views.items():
        for peer, (replica, stages) in current(membership, chain).items():
            assert (replica, stages) == (chain.seats[peer].index, (0, 1)), (name, peer)
    # The killed member comes back: every view now agrees on all current members.
    if "joiner" in views:
        views["joiner"].book.add_hello("killed", b"killed", msg.Hello("c-killed", 1, b"\x01" * 20, [], 0, 0))
        assert current(views["joiner"], chain) == current(views["a"], chain)


def test_a_split_clusters_departed_member_gives_its_seat_to_a_newcomer_in_every_view():
    # c-split was p1 + p2 (one stage each); p1 leaves for good and p3 joins c-split in its place.
    clusters = {"a": ("c-a", 1), "p1": ("c-split", 2), "p2": ("c-split", 2), "p3": ("c-split", 2)}
    chain = Chain("a", "p1", "p2")
    old = view(chain, "a", clusters, ["p1", "p2"])
    assert placed(old)["p1"][0] == placed(old)["p2"][0] == 1
    chain.leave("p1")
    # Until a newcomer completes the cluster, its partner keeps the placement it signed under.
    assert placed(old)["p2"] == (1, (1,)) and placed(old)["p1"] == (1, (0,))
    chain.join("p3")
    old.book.add_hello("p3", b"p3", msg.Hello("c-split", 2, b"\x01" * 20, [], 0, 0))
    newcomer = view(chain, "p3", clusters, ["a", "p2"])
    assert current(old, chain) == current(newcomer, chain)
    assert current(newcomer, chain)["p3"][0] == current(newcomer, chain)["p2"][0] == 2  # p2 now seated first
    assert placed(old)["p1"] == (1, (0,))  # the leaver keeps the placement it signed under


def test_assign_stages_numbers_a_cluster_by_its_first_seat_and_place_members_seats_current_members_first():
    decls = [Declaration("x", "c0", 1, Seat((5, 0), 0)), Declaration("y", "c1", 2, Seat((6, 0), 1)),
             Declaration("z", "c1", 2, Seat((6, 1), 2)), Declaration("w", "c2", 1, Seat((9, 0), 3))]
    got = assign_stages(decls, 2)
    assert {p: pl.replica for p, pl in got.items()} == {"x": 0, "y": 1, "z": 1, "w": 3}
    # Two clusters claiming one seat index (no chain gives that): one is placed, never both on one index.
    twins = [Declaration("u", "d0", 1, Seat((1, 0), 7)), Declaration("v", "d1", 1, Seat((1, 0), 7))]
    clash = assign_stages(twins, 1)
    assert list(clash) == ["u"]
    # An ended seat cannot hold a current cluster's seat: y left, a newcomer v of c1 takes its place.
    ended = [decls[0], Declaration("y", "c1", 2, Seat((6, 0), 1, current=False)), decls[2],
             Declaration("v", "c1", 2, Seat((12, 0), 4))]
    placed_now = place_members(ended, 2)
    assert {placed_now["z"].replica, placed_now["v"].replica} == {2}
    assert placed_now["y"].replica == 1 and placed_now["x"].replica == 0


def test_node_chain_reads_each_seat_index_from_the_runs_join_events_and_a_leave_ends_it(deployment):
    # Real contracts (py-evm and anvil): three founders, one leaves, a fourth joins; every NodeChain reads
    # the same index for every seat, the leaver's too, and a later join never renumbers an earlier one.
    from node.live.chain.onchain import NodeChain

    run = deployment.member_run((1, 2, 3), quorum=1)
    founders = [run.client(i) for i in (1, 2, 3)]
    founders[2].leave_run(run.run_id)
    joiner = deployment.register(4)
    NodeChain(joiner).ensure_member(run.run_id, hashlib.sha256(b"a platform").digest())
    accounts = [*founders, joiner]
    for reader in (NodeChain(founders[0]), NodeChain(joiner)):
        seats = []
        for client in accounts:
            period = reader.seat(run.run_id, bytes.fromhex(client.address[2:]), client.key_of(client.address),
                                 current=False)
            seats.append(reader.seat_of(period))
        assert [s.index for s in seats] == [0, 1, 2, 3]
        assert [s.current for s in seats] == [True, True, False, True]
        assert [s.joined for s in seats] == sorted(s.joined for s in seats)
