"""The record's loss figures: every member derives them from the same attestations, however late they come.

A round's record carries the mean train and held-out loss of the replicas it aggregated, from their
last-stage attestations; each member signs one record per round. The 60-minute soak
(bench/bench_soak.py, 20-200 ms links, a loaded 2-core machine) stopped at a round whose eight members
signed five different records: each had waited 10 s for the attestations, then averaged those it had.
Real RoundBook and Membership; the committer's chain and host are not reached by what is tested here.
"""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest

from node import protocol as msg
from node.live.record.committer import Committer
from node.live.state.roundbook import RoundBook
from tests.member_fixtures import PEERS, three_seat_membership

WEIGHTS = b"w" * 32
#: Later than the old fixed wait (10 s), well inside the round deadline of the test's node.
LATE_S = 12.0


def attestation(loss: float) -> msg.Attestation:
    return msg.Attestation(WEIGHTS, b"r" * 32, 3, loss, loss + 0.5, 100, b"", b"")


@pytest.fixture
def member():
    """A member's committer (peer-a, three seats) and its book, by round timeout; closed at the test's end."""
    made = []

    def make(round_timeout: float) -> tuple[Committer, RoundBook]:
        membership, book = three_seat_membership()
        node = SimpleNamespace(membership=membership, book=book, stop_event=threading.Event(),
                               cfg=SimpleNamespace(round_timeout=round_timeout))
        committer = Committer(node)
        made.append(committer)
        return committer, book

    yield make
    for committer in made:
        committer.close()


def test_a_late_attestation_of_an_aggregated_replica_is_waited_for_up_to_the_round_deadline(member):
    committer, book = member(round_timeout=120.0)
    book.add_attestation(7, 0, "peer-a", attestation(2.0))
    book.add_attestation(7, 0, "peer-b", attestation(3.0))
    timer = threading.Timer(LATE_S, lambda: book.add_attestation(7, 0, "peer-c", attestation(4.0)))
    timer.start()
    try:
        reporters = committer._loss_reporters(7, 0, {0, 1, 2}, WEIGHTS)
    finally:
        timer.cancel()
    # The slowest replica's figures are in: the same set a member that heard it first derives.
    assert [peer for peer, _a in reporters] == PEERS
    assert math.isclose(sum(a.train_loss for _p, a in reporters) / 3, 3.0)


def test_a_replica_that_never_attests_is_left_out_once_the_deadline_passes(member):
    committer, book = member(round_timeout=1.0)
    book.add_attestation(7, 0, "peer-a", attestation(2.0))
    book.add_attestation(7, 0, "peer-b", attestation(3.0))
    reporters = committer._loss_reporters(7, 0, {0, 1, 2}, WEIGHTS)
    assert [peer for peer, _a in reporters] == PEERS[:2]
    # An attestation of other weights (its node aggregated something else) never counts.
    book.add_attestation(7, 0, "peer-c", msg.Attestation(b"x" * 32, b"r" * 32, 3, 9.0, 9.0, 100, b"", b""))
    assert [peer for peer, _a in committer._loss_reporters(7, 0, {0, 1, 2}, WEIGHTS)] == PEERS[:2]
