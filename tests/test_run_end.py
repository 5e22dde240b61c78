"""A run with a round limit ends for a node only once its last round is committed or provably cannot be.

node/live/round/ending.py with the real membership and reporter; the chain is a stand-in at its boundary
(what it answers for the last committed round and the quorum) and the clock a counter, so the rules
are checked without waiting round timeouts.
"""

from __future__ import annotations

import threading

import pytest
from test_node_rooms import PEERS, rooms

from node.config import load_config
from node.live.round import ending
from node.live.round.ending import RunEnd
from node.live.state.station import Station
from node.live.state.status import Progress, Reporter


class Chain:
    """The chain's answers: the last committed round moves along ``rounds`` one poll at a time."""

    def __init__(self, rounds: list[int], quorum: int) -> None:
        self.rounds = rounds
        self.quorum = quorum
        self.polls = 0

    def last_round(self, _run_id: int) -> int:
        self.polls += 1
        return self.rounds[min(self.polls, len(self.rounds)) - 1]

    def quorum_of(self, _run_id: int) -> int:
        return self.quorum


def run_end(tmp_path, chain: Chain, live: list[str], stop: threading.Event | None = None):
    _book, membership, _pool, _coordinator = rooms()
    membership.set_connected(live)
    cfg = load_config(None, ["rounds=5", "round_timeout=60"])
    clock = iter(range(0, 10**9, 30))  # 30 s a poll
    reporter = Reporter(path=tmp_path / "status.json", progress=Progress(), peer_id="peer-a", run_id=1,
                        station=Station())
    return RunEnd(cfg=cfg, chain=chain, membership=membership, reporter=reporter, peer_id="peer-a",
                  stop=stop or threading.Event(), clock=lambda: next(clock))


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(ending, "POLL_S", 0.001)


def test_it_waits_for_the_last_round_on_chain_and_says_so(tmp_path):
    chain = Chain([2, 3, 3, 4], quorum=2)
    why = run_end(tmp_path, chain, live=PEERS).await_last_commit()
    assert why == "round 4, the run's last, is committed"
    assert chain.polls == 4  # not before the chain held it


def test_too_few_live_members_for_the_quorum_ends_it_after_two_round_timeouts(tmp_path):
    # Three placed members heard from (peer-a itself, peer-b and peer-c) for a quorum of four.
    chain = Chain([3], quorum=4)
    why = run_end(tmp_path, chain, live=PEERS).await_last_commit()
    assert why == "round 4 cannot be committed: 3 live member(s) for a quorum of 4 record signatures " \
                  "(last committed round 3)"
    assert chain.polls == 5  # short from the poll at 30 s to the one at 150 s: two round timeouts, not sooner


def test_a_chain_that_does_not_move_with_enough_members_live_ends_it(tmp_path):
    chain = Chain([3], quorum=2)
    why = run_end(tmp_path, chain, live=PEERS).await_last_commit()
    assert why.startswith("round 4 cannot be committed: the chain's last round (3) has not moved for 600s")


def test_a_stop_ends_the_wait(tmp_path):
    stop = threading.Event()
    stop.set()
    assert run_end(tmp_path, Chain([3], quorum=2), live=PEERS, stop=stop).await_last_commit() == \
        "stopped before the run's last round was committed"


class KeptProofs:
    """A FraudProver's deferred proofs at its boundary: ``rounds`` until ``sent_after`` looks, then none."""

    def __init__(self, rounds: list[int], sent_after: int | None) -> None:
        self.rounds = rounds
        self.sent_after = sent_after
        self.looks = 0

    def open_rounds(self) -> list[int]:
        self.looks += 1
        return [] if self.sent_after is not None and self.looks > self.sent_after else list(self.rounds)


def test_a_node_holding_a_kept_proof_stays_up_until_it_is_sent(tmp_path, caplog):
    end = run_end(tmp_path, Chain([4], quorum=2), live=PEERS)
    end.prover = KeptProofs([1], sent_after=3)
    assert end.await_last_commit() == "round 4, the run's last, is committed"
    assert end.prover.looks == 4  # it looked until the proof was gone, not once
    assert "staying up to send the proof(s) of round(s) [1]" in caplog.text
    assert "not sent yet" not in caplog.text


def test_a_kept_proof_the_chain_never_lets_in_is_left_for_the_next_start(tmp_path, caplog):
    end = run_end(tmp_path, Chain([4], quorum=2), live=PEERS)
    end.prover = KeptProofs([1], sent_after=None)  # a chain that mines only on transactions: never due
    assert end.await_last_commit() == "round 4, the run's last, is committed"  # bounded: it ends
    assert "the next `dlx-node start` sends them" in caplog.text
