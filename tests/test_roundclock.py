"""The per-round timing a node logs (node/live/state/roundclock.py): periods, phases, exchange time."""

from __future__ import annotations

import json

import pytest

from node.live.state.roundclock import RoundClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_periods_run_from_one_rounds_training_to_the_next(tmp_path):
    clock = FakeClock()
    rc = RoundClock(tmp_path / "timing.jsonl", clock=clock)
    clock.now += 10.0
    first = rc.trained(0, inner_seconds=9.5)
    assert first["wall_s"] is None and first["utilization"] is None  # no previous end in this life
    with rc.phase("encode"):
        clock.now += 1.0
    rc.add("close_wait", 2.0)
    clock.now += 2.0
    clock.now += 10.0  # round 1's inner steps (the schedule's apply(t-1) would sit in here with the delay)
    second = rc.trained(1, inner_seconds=10.0)
    assert second["wall_s"] == pytest.approx(13.0)
    assert second["utilization"] == pytest.approx(10.0 / 13.0, abs=1e-5)
    assert second["encode_s"] == pytest.approx(1.0) and second["close_wait_s"] == pytest.approx(2.0)
    assert second["other_s"] == pytest.approx(0.0)
    clock.now += 8.0
    third = rc.trained(2, inner_seconds=8.0)  # the phases were reset with the period
    assert third["encode_s"] == 0.0 and third["utilization"] == pytest.approx(1.0)
    summary = rc.summary()
    assert summary["periods"] == 2 and summary["utilization"] == pytest.approx(18.0 / 21.0, abs=1e-5)
    lines = [json.loads(line) for line in (tmp_path / "timing.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2]


def test_inner_seconds_never_count_beyond_the_wall():
    clock = FakeClock()
    rc = RoundClock(None, clock=clock)
    rc.trained(0, 1.0)
    clock.now += 5.0
    record = rc.trained(1, inner_seconds=5.2)  # two clocks read at slightly different moments
    assert record["utilization"] == 1.0 and rc.summary()["inner_s"] == pytest.approx(5.0)


def test_exchange_time_runs_from_the_own_contribution_to_the_last_arrival():
    clock = FakeClock()
    rc = RoundClock(None, clock=clock)
    rc.published(3)
    sent = clock.now
    record = rc.finished(3, last_arrival=sent + 4.5, close_wait=1.0, total=2.0)
    assert record["exchange_s"] == pytest.approx(4.5) and record["close_wait_s"] == 1.0
    # Everything was here before this node's own contribution went out: no exchange wait.
    rc.published(4)
    assert rc.finished(4, last_arrival=sent - 1.0)["exchange_s"] == 0.0
    # A round this process did not contribute to (a catch-up after a restart): unknown.
    assert rc.finished(5, last_arrival=sent)["exchange_s"] is None


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown phase"):
        RoundClock(None).add("lunch", 1.0)


def test_lane_seconds_are_reported_apart_from_the_phases():
    clock = FakeClock()
    rc = RoundClock(None, clock=clock)
    rc.trained(0, 1.0)
    with rc.lane("encode"):
        clock.now += 3.0  # on the lane, while the inner steps run: not a phase of the period
    clock.now += 7.0
    record = rc.trained(1, inner_seconds=10.0)
    assert record["lane_encode_s"] == pytest.approx(3.0) and record["encode_s"] == 0.0
    assert record["utilization"] == pytest.approx(1.0) and record["other_s"] == pytest.approx(0.0)
    assert rc.trained(2, inner_seconds=1.0)["lane_encode_s"] == 0.0  # reset with the period
    with pytest.raises(ValueError), rc.lane("aggregate"):
        pass


def test_a_rounds_budget_runs_from_the_last_training_less_the_waits_for_others():
    """The budget of a time-bounded round (RoundClock.budget_elapsed): the node's own work since the last
    round's training (encode, the outer step) counts, its waits for closes, contributions and commits do not;
    the first round of a life, and the first after an abandoned one, count from their own start."""
    clock = FakeClock()
    rc = RoundClock(None, clock=clock)
    with pytest.raises(RuntimeError, match="round_starting"):
        rc.budget_elapsed()
    rc.round_starting()
    clock.now += 3.0
    assert rc.budget_elapsed() == pytest.approx(3.0)
    rc.trained(0, inner_seconds=3.0)
    with rc.phase("encode"):
        clock.now += 0.5
    rc.add("close_wait", 4.0)
    rc.add("fetch_wait", 1.0)
    rc.add("commit_wait", 2.0)
    rc.add("aggregate", 0.25)
    clock.now += 7.25
    rc.round_starting()  # a period runs: it does not move the budget's start
    clock.now += 1.0
    assert rc.budget_elapsed() == pytest.approx(0.5 + 0.25 + 1.0)
    rc.trained(1, inner_seconds=1.0)
    clock.now += 2.0
    rc.interrupted()  # the pipeline broke: the wait for the partner is in no round's budget
    clock.now += 60.0
    rc.round_starting()
    clock.now += 1.5
    assert rc.budget_elapsed() == pytest.approx(1.5)
    assert rc.trained(2, inner_seconds=1.5)["wall_s"] is None  # nor in a period's wall time


def test_a_period_records_its_steps_and_cpu_seconds():
    clock, cpu = FakeClock(), FakeClock()
    rc = RoundClock(None, clock=clock, cpu_clock=cpu)
    first = rc.trained(0, inner_seconds=1.0, steps=12, inner_cpu_seconds=0.9)
    assert first["steps"] == 12 and first["inner_cpu_s"] == pytest.approx(0.9)
    assert first["process_cpu_s"] is None  # no period before it in this life
    clock.now += 10.0
    cpu.now += 4.0  # every thread of the process over the period
    second = rc.trained(1, inner_seconds=9.0, steps=30, inner_cpu_seconds=3.0)
    assert second["steps"] == 30 and second["process_cpu_s"] == pytest.approx(4.0)
    assert second["inner_cpu_s"] == pytest.approx(3.0)
