"""A close takes a split replica's stage only with its partner stages (issue 75).

tests/test_split_reentry_e2e.py failed about one run in three: the stage-1 node of replica 0 was killed
(SIGKILL) after the pipeline's held-out eval of round 4 and before it published its contribution, while its
partner published stage 0's. The stage-0 close of round 4 took replica 0 at once (every expected replica
of stage 0 was there), the stage-1 close did not (its contribution never came), and the record held
replica 0 with stage 0 only: a replica is rerun whole (every stage's start state and claim), so neither a
spot check ("replica 0's contributions of every stage are not in the round as recorded here") nor the audit
("re-execution of round 4 replica 0: unverifiable (its contributions are not in the archives)") could check
that stage-0 contribution, and a cluster could so escape every check by sending one stage only.

Real RoundBook, Membership and RoundCoordinator, as tests/test_node_rooms.py's rooms, with two split
clusters of two nodes each: peer-a (this node, stage 0) and peer-d (stage 1) are replica 0, peer-b and
peer-c the other (replica index 2: its first seat's).
"""

from __future__ import annotations

from test_join_close import HeldPool, contribute
from test_node_rooms import digest, key_of

from node import protocol as msg
from node.live.exchange.coordination import RoundCoordinator
from node.live.peers.membership import Membership
from node.live.state.roundbook import Announced, RoundBook
from node.live.state.topology import Seat

CLUSTERS = {"peer-a": "c0", "peer-d": "c0", "peer-b": "c1", "peer-c": "c1"}
ALL = set(CLUSTERS)
ROUND = 4


def split_rooms():
    """peer-a's book, pool and coordinator of a 2 x 2 run (two clusters of two nodes, one stage each)."""
    book = RoundBook()
    seats = {key_of(peer): Seat((index, 0), index) for index, peer in enumerate(CLUSTERS)}
    membership = Membership("peer-a", "c0", 2, 2, book, seat=lambda _account, key: seats.get(key),
                            own_seat=seats[key_of("peer-a")])
    for peer, cluster in CLUSTERS.items():
        if peer != "peer-a":
            book.add_hello(peer, key_of(peer), msg.Hello(cluster, 2, b"\x01" * 20, [], ROUND, 0))
    placements = membership.refresh()
    assert {p: (pl.replica, pl.stages) for p, pl in placements.items()} == {
        "peer-a": (0, (0,)), "peer-d": (0, (1,)), "peer-b": (2, (0,)), "peer-c": (2, (1,))}
    pool = HeldPool()
    coordinator = RoundCoordinator("peer-a", 1, 60.0, book, membership, pool, contributed=lambda _r: True,
                                   gossip=lambda *a: b"", resync=lambda: None, previous_life_finished=-1)
    return book, pool, coordinator


def publish(book, pool, peer: str, replica: int, stage: int) -> None:
    """``peer``'s contribution of (ROUND, stage), announced (and, of stage 0, fetched here)."""
    book.add_announce(ROUND, stage, Announced(peer, replica, digest(peer), 100))
    if stage == 0:
        pool.held.add((replica, peer, digest(peer)))


def closed(coordinator, final: bool = False, alive: set[str] = ALL) -> list[int] | None:
    close = coordinator.ready_close(ROUND, 0, final=final, alive=alive)
    return None if close is None else sorted(e[0] for e in close.contributions)


def partner_never_published():
    """Round 4 as the failing run had it: replica 2 whole, replica 0's stage 0 only (peer-d trained its stage
    1 and was killed before publishing it)."""
    book, pool, coordinator = split_rooms()
    publish(book, pool, "peer-a", 0, 0)
    publish(book, pool, "peer-b", 2, 0)
    publish(book, pool, "peer-c", 2, 1)
    return book, pool, coordinator


def test_a_replica_s_stage_waits_for_its_partner_stage_while_the_partner_is_waited_for():
    book, pool, coordinator = partner_never_published()
    assert closed(coordinator) is None  # every expected stage-0 contribution is here; replica 0's stage 1 not
    publish(book, pool, "peer-d", 0, 1)
    assert closed(coordinator) == [0, 2]


def test_a_replica_whose_partner_stage_never_came_is_left_out_at_the_deadline():
    _book, _pool, coordinator = partner_never_published()
    assert closed(coordinator, final=True) == [2]  # before: [0, 2], replica 0 with stage 0 only


def test_a_replica_whose_partner_is_gone_is_left_out_at_once():
    _book, _pool, coordinator = partner_never_published()
    assert closed(coordinator, alive=ALL - {"peer-d"}) == [2]  # before: [0, 2]


def test_a_replica_that_has_only_a_partial_contribution_never_closes_a_round_alone():
    book, pool, coordinator = split_rooms()
    publish(book, pool, "peer-a", 0, 0)
    assert closed(coordinator, final=True, alive=ALL - {"peer-d", "peer-b", "peer-c"}) is None


def test_a_round_a_restarted_node_catches_up_takes_the_run_s_close_not_a_new_one_of_its_own():
    """The restarted node ranks first among its stage's holders (its cluster joined first), entered at round
    12 and catches up round 4, which the run closed while it was away with replica 1 only: its own round-4
    contribution, which it announces again (RestartRecovery.reannounce), had not reached anyone. Before, it
    closed round 4 anew at once, with its own contribution in it: its weights left the committed record."""
    from types import SimpleNamespace

    from test_node_rooms import PEERS, entry, rooms

    book, membership, pool, coordinator = rooms()
    membership.set_connected(PEERS)
    coordinator.contributions = pool = HeldPool()
    coordinator.station = SimpleNamespace(first_round=12, catching_up=lambda r: 0 <= r < 12)
    assert coordinator.rotation(ROUND, 0)[0] == "peer-a"
    for replica, peer in enumerate(PEERS):
        contribute(book, pool, ROUND, replica, peer)  # both stages announced, stage 0's fetched
    own = coordinator.ready_close(ROUND, 0, final=False, alive=set(PEERS), log=False)
    assert sorted(e[0] for e in own.contributions) == [0, 1, 2]  # what it would sign at once (did, before)
    runs_close = msg.Close([entry(1, "peer-b"), entry(2, "peer-c")])
    book.add_close(ROUND, 0, "peer-b", runs_close, b"envelope")
    assert coordinator.await_close(ROUND, 0) == runs_close
    assert "peer-a" not in book.snapshot_closes(ROUND, 0)  # it signed no close of its own
