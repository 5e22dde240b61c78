"""Who a close waits for: a joiner or a restarted node costs the others nothing until it trains.

Real RoundBook, Membership and RoundCoordinator (tests/test_node_rooms.py's rooms); the rule is
:meth:`node.live.exchange.coordination.RoundCoordinator.expects` (docs/PROTOCOL.md, "Who a close waits for").
peer-a coordinates, peer-b is an established member, peer-c joins.
"""

from __future__ import annotations

from types import SimpleNamespace

from test_node_rooms import Pool, digest, hello, key_of, rooms

from node import protocol as msg
from node.live.round.resume import first_contributed_round
from node.live.state.roundbook import Announced

ALL = {"peer-a", "peer-b", "peer-c"}


class HeldPool(Pool):
    def closable(self, _round, _stage) -> set[bytes]:
        return {envelope for _replica, _peer, envelope in self.held}


def setup(joiner_training: int, joiner_first: int, outer_round: int = 5):
    book, membership, _pool, coordinator = rooms(quorum=2)
    pool = HeldPool()
    coordinator.contributions = pool
    book.add_hello("peer-b", key_of("peer-b"), hello("c1", training_round=outer_round, first_round=0))
    book.add_hello("peer-c", key_of("peer-c"),
                   hello("c2", training_round=joiner_training, first_round=joiner_first))
    for replica, peer in ((0, "peer-a"), (1, "peer-b")):
        contribute(book, pool, outer_round, replica, peer)
    return book, pool, coordinator


def contribute(book, pool, outer_round, replica, peer):
    announce(book, outer_round, replica, peer)
    pool.held.add((replica, peer, digest(peer)))


def announce(book, outer_round, replica, peer):
    """``peer``'s announces of its replica's contribution to ``outer_round``: of both stages it holds (a close
    of stage 0 takes a replica only with its stage-1 contribution: RoundCoordinator.partial_replicas)."""
    for stage in (0, 1):
        envelope = digest(peer if stage == 0 else f"{peer}/1")
        book.add_announce(outer_round, stage, Announced(peer, replica, envelope, 100))


def closed_replicas(coordinator, outer_round: int) -> list[int] | None:
    close = coordinator.ready_close(outer_round, 0, final=False, alive=ALL)
    return None if close is None else sorted(e[0] for e in close.contributions)


def test_a_joiner_that_has_not_decided_where_it_enters_is_not_waited_for():
    _book, _pool, coordinator = setup(joiner_training=-1, joiner_first=-1)
    assert not coordinator.expects("peer-c", 5, 0)
    assert closed_replicas(coordinator, 5) == [0, 1]  # at once, not at the deadline


def test_a_joiner_still_catching_up_is_waited_for_only_from_the_round_it_trains():
    book, pool, coordinator = setup(joiner_training=-1, joiner_first=6, outer_round=6)
    assert closed_replicas(coordinator, 6) == [0, 1]  # restoring and catching up: not waited for
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=6, first_round=6))
    assert coordinator.expects("peer-c", 6, 0)
    assert closed_replicas(coordinator, 6) is None  # it trains round 6 now: its contribution is waited for
    contribute(book, pool, 6, 2, "peer-c")
    assert closed_replicas(coordinator, 6) == [0, 1, 2]
    assert not coordinator.expects("peer-c", 5, 0)  # before its first round, never


def took(coordinator, outer_round, peers):
    """The close this node took for ``outer_round`` names ``peers`` (replica = index)."""
    coordinator.adopt(outer_round, 0, msg.Close([[i, p, digest(p), 100] for i, p in enumerate(peers)]))


def test_a_joiner_seen_in_a_close_is_waited_for_like_any_member_even_when_its_hello_lags():
    _book, _pool, coordinator = setup(joiner_training=6, joiner_first=6, outer_round=7)
    took(coordinator, 6, ["peer-a", "peer-b", "peer-c"])  # it contributed to round 6; its hello still says 6
    assert coordinator.expects("peer-c", 7, 0)
    assert closed_replicas(coordinator, 7) is None


def test_a_joiner_that_has_started_training_is_waited_for_even_where_it_is_behind():
    book, _pool, coordinator = setup(joiner_training=9, joiner_first=6, outer_round=10)
    assert coordinator.expects("peer-c", 10, 0)  # caught up, training round 9: it comes
    assert closed_replicas(coordinator, 10) is None
    # still catching up
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=5, first_round=6))
    assert not coordinator.expects("peer-c", 10, 0)
    book.add_announce(10, 0, Announced("peer-c", 2, digest("peer-c"), 100))  # announced 10: on its way
    assert coordinator.expects("peer-c", 10, 0) and closed_replicas(coordinator, 10) is None


def test_a_member_seen_contributing_and_restarted_is_waited_for_as_before():
    book, _pool, coordinator = setup(joiner_training=-1, joiner_first=-1, outer_round=20)
    took(coordinator, 3, ["peer-a", "peer-b", "peer-c"])
    assert coordinator.expects("peer-c", 20, 0)  # restarting, not decided yet: waited for as before
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=-1, first_round=21))
    assert not coordinator.expects("peer-c", 20, 0) and coordinator.expects("peer-c", 21, 0)


def test_a_member_that_entered_no_later_than_this_node_is_waited_for_as_before():
    book, _pool, coordinator = setup(joiner_training=-1, joiner_first=-1, outer_round=20)
    book.add_hello("peer-b", key_of("peer-b"), hello("c1", training_round=3, first_round=0))
    assert coordinator.expects("peer-b", 20, 0)  # a founder, like this node: a slow round of it is waited for


def test_after_a_whole_run_restart_the_peers_entering_with_this_node_are_waited_for():
    book, _pool, coordinator = setup(joiner_training=-1, joiner_first=9, outer_round=9)
    coordinator.station = SimpleNamespace(first_round=9)  # this node (re)entered at round 9 too
    assert coordinator.expects("peer-c", 9, 0)  # entered with it, still restoring: waited for
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=-1, first_round=-1))
    assert coordinator.expects("peer-c", 9, 0)  # not decided yet, in the round this node entered at
    assert not coordinator.expects("peer-c", 10, 0)


def test_at_a_fresh_start_every_founder_is_waited_for_in_round_0():
    book, pool, coordinator = setup(joiner_training=-1, joiner_first=-1, outer_round=0)
    assert coordinator.expects("peer-c", 0, 0)
    assert closed_replicas(coordinator, 0) is None
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=-1, first_round=0))
    assert closed_replicas(coordinator, 0) is None  # decided round 0, not training yet: still waited for
    contribute(book, pool, 0, 2, "peer-c")
    assert closed_replicas(coordinator, 0) == [0, 1, 2]


def test_a_node_sitting_rounds_out_is_never_waited_for():
    _book, _pool, coordinator = setup(joiner_training=-1, joiner_first=2**62, outer_round=0)
    assert not coordinator.expects("peer-c", 0, 0) and not coordinator.expects("peer-c", 5, 0)


def test_a_restarted_member_is_not_waited_for_in_the_rounds_it_sits_out_before_its_entry():
    """bench_chaos.py --split (issue 30): killed in round 48's exchange, its replica entered at 51; its
    hello named 48 (the round it re-announced) and rounds 49 and 50 each waited out the deadline."""
    book, pool, coordinator = setup(joiner_training=-1, joiner_first=-1, outer_round=49)
    took(coordinator, 47, ["peer-a", "peer-b", "peer-c"])
    contribute(book, pool, 50, 0, "peer-a")
    contribute(book, pool, 50, 1, "peer-b")
    first = first_contributed_round(51, reannounced={48})  # what its hellos declare (node.py)
    book.add_hello("peer-c", key_of("peer-c"), hello("c2", training_round=-1, first_round=first))
    assert closed_replicas(coordinator, 49) == [0, 1] and closed_replicas(coordinator, 50) == [0, 1]
    assert coordinator.expects("peer-c", 51, 0)


def test_a_round_before_its_first_that_a_member_re_announced_waits_for_that_contribution():
    """Its earlier life's contribution of round 48, announced again: the close holds it whatever the
    timing."""
    book, pool, coordinator = setup(joiner_training=-1, joiner_first=51, outer_round=48)
    took(coordinator, 47, ["peer-a", "peer-b", "peer-c"])
    announce(book, 48, 2, "peer-c")  # on its way, not fetched yet
    assert coordinator.expects("peer-c", 48, 0)
    assert closed_replicas(coordinator, 48) is None
    pool.held.add((2, "peer-c", digest("peer-c")))
    assert closed_replicas(coordinator, 48) == [0, 1, 2]
