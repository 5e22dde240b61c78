"""How long a holder of the sliced exchange waits for a slice whose inputs are withheld (rule 3 of
docs/PROTOCOL.md, "Withholding costs only the withholder"): the first CANDIDATE_TURNS candidates' turns,
then its own replay's turn, then the close is refused, whatever the number of members. It waited for
every member's turn: (n + 1) x p2p.transfer_timeout per stage, linear in the replicas."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from node import protocol as msg
from node.live.exchange.protocol import InputsWithheld
from node.live.exchange.sliced import SlicedExchange
from node.live.exchange.sliced_partials import CANDIDATE_TURNS

pytestmark = pytest.mark.timeout(120)


class NothingServed:
    """The pool and host of a holder to which no member serves anything (every input withheld)."""

    def __init__(self) -> None:
        self.book = SimpleNamespace(snapshot_closes=lambda outer_round, stage: {})
        self.asked: set[bytes] = set()

    def fetch(self, outer_round, stage, announced, also_from=None):
        self.asked.add(announced.envelope_hash)

    def in_flight(self, digest):
        return False

    def have(self, outer_round, stage):
        return {}

    def has_blob(self, sha256_hex):
        return False


def _holder(turn_timeout: float) -> tuple[SlicedExchange, NothingServed]:
    nothing = NothingServed()
    exchange = SlicedExchange.__new__(SlicedExchange)
    exchange.pool, exchange.host, exchange.peer_id = nothing, nothing, "a holder that is no member"
    exchange.turn_timeout, exchange.stop = turn_timeout, threading.Event()
    exchange._cond, exchange._announced, exchange._missing_said = threading.Condition(), {}, set()
    exchange.archive = SimpleNamespace(blobs=lambda outer_round, kind: [])
    plan = SimpleNamespace(num_slices=2)
    exchange.station = SimpleNamespace(worker=lambda: SimpleNamespace(plans={0: plan}))
    return exchange, nothing


@pytest.mark.parametrize("members", [3, 16, 64])
def test_a_withheld_slice_is_refused_after_the_first_candidates_turns_whatever_the_members(members):
    exchange, _nothing = _holder(turn_timeout=0.2)
    close = msg.Close([[replica, f"member-{replica}", bytes([replica]) * 32, 451]
                       for replica in range(members)])
    with pytest.raises(InputsWithheld) as refused:
        exchange.partials(5, 0, close)
    turns = min(members, CANDIDATE_TURNS)
    assert f"after every candidate's turn ({turns + 1} x" in str(refused.value)
