"""Training does not run more than ``max_rounds_ahead`` rounds past the chain's last commit
(node/live/round/pacing.py)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from test_node_assembly import TINY, FakeCommitter, OfflineParts

from node.config import MIN_ROUNDS_AHEAD, claim_window, load_config
from node.errors import ConfigError
from node.live.assembly import HONEST
from node.live.exchange.coordination import RoundStopped
from node.live.node import Node
from node.live.round import pacing
from node.live.round.entry import RunEntry
from node.live.round.pacing import WAITING, CommitPace, may_begin
from node.live.state.roundclock import RoundClock
from node.live.state.status import Progress
from p2p.errors import P2PError


def test_the_rule_and_its_bounds():
    assert may_begin(0, -1, 2) and may_begin(1, -1, 2) and not may_begin(2, -1, 2)
    assert may_begin(10, 8, 2) and not may_begin(11, 8, 2) and may_begin(11, 8, 3)
    assert load_config(None, []).max_rounds_ahead == 8
    for checkpoint_every in (1, 2, 5):
        cfg = load_config(None, [f"checkpoint_every={checkpoint_every}"])
        # The bound stays inside the window in which peers hear a member's rounds (RunEntry's).
        assert claim_window(checkpoint_every) == RunEntry.round_window(SimpleNamespace(cfg=cfg))
        assert cfg.max_rounds_ahead < claim_window(checkpoint_every)
        load_config(None, [f"checkpoint_every={checkpoint_every}",
                           f"max_rounds_ahead={claim_window(checkpoint_every) - 1}"])
        with pytest.raises(ConfigError, match="max_rounds_ahead=.*below 8 \\+ 2 \\* checkpoint_every"):
            load_config(None, [f"checkpoint_every={checkpoint_every}",
                               f"max_rounds_ahead={claim_window(checkpoint_every)}"])
    # Below 2, the one-step delay could not commit: round t-1's commit needs round t trained.
    with pytest.raises(ConfigError, match=f"at least {MIN_ROUNDS_AHEAD}"):
        load_config(None, ["max_rounds_ahead=1"])
    for bad in ("spot_check_drain_s=-1", "spot_check_drain_s=nan", "max_rounds_ahead=x"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])


class MovingChain:
    """The chain's last round, moved by the test; unreachable while ``down``."""

    def __init__(self) -> None:
        self.last = -1
        self.down = False
        self.reads = 0

    def last_round(self, run_id: int) -> int:
        self.reads += 1
        if self.down:
            raise P2PError("chain RPC unreachable")  # any DLX error: an outage
        return self.last


def test_a_round_waits_for_commits_and_goes_on_when_they_catch_up(monkeypatch):
    monkeypatch.setattr(pacing, "POLL_S", 0.05)
    cfg = load_config(None, ["max_rounds_ahead=3"])
    chain, progress, states = MovingChain(), Progress(), []

    def set_state(state: str) -> None:
        progress.state = state
        states.append(state)

    reporter = SimpleNamespace(set_state=set_state)
    stop = threading.Event()
    pace = CommitPace(cfg=cfg, chain=chain, progress=progress, reporter=reporter, clock=RoundClock(),
                      stop=stop)
    pace.await_room(2)
    assert chain.reads == 0  # well inside the bound: the chain is not asked
    progress.last_commit = 4  # this node's own confirmed commits count
    pace.await_room(7)
    assert chain.reads == 0 and states == []
    progress.state = "training"

    done = threading.Event()
    thread = threading.Thread(target=lambda: (pace.await_room(9), done.set()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while WAITING not in states:
        assert time.monotonic() < deadline, "round 9 did not wait (last commit 4, bound 3)"
        time.sleep(0.02)
    chain.down = True  # an outage: the wait goes on, nothing breaks
    chain.last = 5
    time.sleep(0.3)
    assert not done.is_set()
    chain.down = False  # round 5 on chain: 9 - 5 = 4 > 3, still waiting
    time.sleep(0.3)
    assert not done.is_set()
    chain.last = 6
    assert done.wait(60), "round 9 did not go on once round 6 was committed"
    assert pace.waited_s > 0

    stop_thread_error = []

    def stopped():
        try:
            pace.await_room(20)
        except RoundStopped as exc:
            stop_thread_error.append(exc)

    thread = threading.Thread(target=stopped, daemon=True)
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(60)
    assert stop_thread_error, "a stop did not end the wait"


class HeldCommitter(FakeCommitter):
    """Rounds reach the chain only once the test releases the commits (a slow signer quorum, an outage)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.held = True

    def submit(self, outer_round: int) -> None:
        self.submitted.append(outer_round)
        self.handled_through = outer_round
        if not self.held:
            self.ctx.chain.committed = max(self.ctx.chain.committed, outer_round)

    def release(self) -> None:
        self.held = False
        if self.submitted:
            self.ctx.chain.committed = max(self.ctx.chain.committed, *self.submitted)


@pytest.mark.timeout(300)
def test_a_node_waits_at_the_bound_and_its_own_commits_let_it_go_on(tmp_path):
    """The real run loop (host and chain faked) at the least bound, 2: with nothing committed it trains rounds
    0 and 1 and waits before round 2, having finished round 0 (what the chain needs from it); once round 0 is
    committed it goes on and finishes the run: the rounds it waits on never need it to train further."""
    import dataclasses

    cfg = load_config(None, [*TINY, "rounds=5", "max_rounds_ahead=2", f"data_dir={tmp_path}"])
    parts = OfflineParts(cfg, stop=threading.Event(),
                         kinds=dataclasses.replace(HONEST, committer=HeldCommitter))
    node = Node(cfg, parts=parts)
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(node.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 240
        while node.progress.state != WAITING:
            assert thread.is_alive() and time.monotonic() < deadline, f"never waited: {node.progress.state}"
            time.sleep(0.1)
        time.sleep(1.0)  # held: it must not train on
        status = json.loads((tmp_path / "status.json").read_text())
        assert node.progress.round == 1 and node.progress.state == WAITING and status["state"] == WAITING
        assert parts.committer.submitted == [0]
        parts.committer.release()
        thread.join(240)
        assert not thread.is_alive(), "the run did not finish once commits caught up"
    finally:
        node.stop()
        thread.join(60)
    [progress] = outcome
    assert progress.last_finished == 4 and parts.committer.submitted == [0, 1, 2, 3, 4]
    periods = [json.loads(line) for line in (tmp_path / "timing.jsonl").read_text().splitlines()]
    waited = [p["round"] for p in periods if p["kind"] == "period" and p["commit_wait_s"] > 0]
    assert waited[:1] == [2]  # the wait shows in round 2's period
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["state"] == "stopped" and status["spot_checks_left_undone"] == 0
