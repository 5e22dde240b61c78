"""End to end: real anvil, real node processes on loopback, the real round protocol.

Each test launches ``dlx-node start`` processes with the local launcher, lets
them train a tiny model for a few outer rounds, and checks the chain record.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from node_fixtures import TINY, assert_chain_roots, node_state, run_logs

from node.commands.launcher import LocalRun
from node.live.state.roundbook import PEER_TTL_S


def _wait_for_round(run: LocalRun, round_index: int, timeout: float) -> None:
    client = run.client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        last = client.last_round(run.run_id)
        if last is not None and last >= round_index:
            return
        assert run.running(), "every node exited early:\n" + run_logs(run)
        time.sleep(1.0)
    raise AssertionError(f"round {round_index} not committed within {timeout}s\n" + run_logs(run))


@pytest.mark.timeout(420)
def test_two_replicas_by_two_stages_commit_every_round_once(make_run):
    run = make_run(replicas=2, stages=2, split=True, settings=TINY + ["rounds=3", "join_timeout=60"])
    run.start()
    assert run.wait(360, progress=True), run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2]
    assert all(c.commit.num_contributors == 4 for c in history.commits)
    # Every node computed the weights root the chain records, every round.
    assert_chain_roots(run, history.commits)
    # Losses went down and were recorded as scaled integers.
    assert history.commits[-1].commit.eval_loss_micro < history.commits[0].commit.eval_loss_micro
    # Every published checkpoint's content hash is the sha256 of the file the nodes serve. A node
    # assembles a checkpoint from every stage's shard; in the run's last round a peer that
    # already exited cannot serve its shard any more, so a node may lack that last file (it
    # says so in its log), but every file a node has is the chain's bytes, and someone has it.
    assert [c.round for c in history.checkpoints] == [0, 1, 2]
    for ckpt in history.checkpoints:
        served = [s.data_dir / "checkpoints" / f"round-{ckpt.round:08d}.safetensors" for s in run.nodes]
        present = [path for path in served if path.exists()]
        assert present, f"no node holds the checkpoint of round {ckpt.round}"
        for path in present:
            assert hashlib.sha256(path.read_bytes()).digest() == ckpt.content_hash, path
    assert not history.disputes
    _assert_round_timing(run, rounds=3)
    # No thread of any node died with a traceback (a start-up race logged one at every node's start once).
    for slot in run.nodes:
        text = "\n".join(p.read_text() for p in slot.data_dir.glob("node-*.log"))
        assert "Traceback" not in text, (slot.name, text[-3000:])


def _assert_round_timing(run: LocalRun, rounds: int) -> None:
    """Every node logged one period per round trained and one finish per round applied, consistently."""
    for slot in run.nodes:
        records = [json.loads(line) for line in (slot.data_dir / "timing.jsonl").read_text().splitlines()]
        periods = [r for r in records if r["kind"] == "period"]
        finishes = [r for r in records if r["kind"] == "finish"]
        assert [r["round"] for r in periods] == list(range(rounds)), (slot.name, records)
        assert sorted(r["round"] for r in finishes) == list(range(rounds)), (slot.name, records)
        assert periods[0]["wall_s"] is None  # no previous round in this life
        for r in periods[1:]:
            assert 0 < r["inner_s"] <= r["wall_s"], (slot.name, r)
            assert r["inner_s"] + sum(r[f"{p}_s"] for p in ("encode", "close_wait", "fetch_wait",
                                                            "aggregate")) \
                <= r["wall_s"] + 1e-3, (slot.name, r)
            assert 0 < r["utilization"] <= 1
        for r in finishes:
            assert r["close_wait_s"] + r["fetch_wait_s"] + r["aggregate_s"] <= r["total_s"] + 1e-3, \
                (slot.name, r)
        timing = slot.status()["timing"]
        assert timing["periods"] == rounds - 1 and 0 < timing["utilization"] <= 1, timing


@pytest.mark.timeout(420)
@pytest.mark.parametrize("variant", [
    pytest.param(["diloco.delay_correction=eager"], id="eager-delay", marks=pytest.mark.slow),
    # Every variant runs with `pytest -m slow` (scripts/slow-tests.sh); the default suite runs the default.
    pytest.param(["diloco.one_step_delay=false"], id="no-delay", marks=pytest.mark.slow),
    pytest.param(["diloco.overlap_steps=2"], id="partial-overlap", marks=pytest.mark.slow),
])
def test_node_runs_the_other_round_schedules(make_run, variant):
    """The node follows training.schedule.round_actions for every variant the benchmark measures."""
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + ["rounds=3", "join_timeout=60", *variant])
    run.start()
    assert run.wait(360, progress=True), run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2]
    assert all(c.commit.num_contributors == 2 for c in history.commits)
    assert_chain_roots(run, history.commits)
    assert history.commits[-1].commit.eval_loss_micro < history.commits[0].commit.eval_loss_micro
    assert not history.disputes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_whole_run_stopped_and_restarted_resumes(make_run):
    """Every node stops (SIGTERM) with rounds finished but not committed; restarted, the run goes on.

    Nobody holds the gossiped closes of those rounds any more: each node re-applies the
    set it sealed in its archive, re-attests, and the rounds commit once, in order.
    """
    run = make_run(replicas=2, stages=2, split=False, settings=TINY + ["rounds=0", "join_timeout=60"])
    run.start()
    _wait_for_round(run, 2, 300)
    run.stop_nodes()
    stopped_at = run.client().last_round(run.run_id)
    finished = [node_state(slot)["last_finished"] for slot in run.nodes]
    run.start()
    _wait_for_round(run, max(stopped_at, *finished) + 3, 300)
    run.stop_nodes()
    history = run.client().history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds))), rounds
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        for c in history.commits:
            if str(c.commit.round) in roots:
                assert roots[str(c.commit.round)] == c.commit.weights_root.hex(), slot.name
    assert not history.disputes


@pytest.mark.timeout(600)
def test_node_killed_mid_round_rejoins_from_checkpoint(make_run):
    # Rounds of a few seconds (H=40) so the run is still going when the victim is back (~15 s).
    # spot_checks=8: each node re-executes the other's every contribution and checks every chain
    # link, across the restart too: a restarted replica's fresh state is not a broken chain.
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + ["rounds=12", "join_timeout=60", "diloco.inner_steps=40", "spot_checks=8"])
    run.start()
    _wait_for_round(run, 1, 240)
    victim = run.nodes[1]
    run.kill(victim, signal.SIGKILL)
    time.sleep(2)
    run.start_node(victim)
    assert run.wait(480, progress=True), run_logs(run)
    history = run.client().history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(12)), rounds  # no duplicate, no missing round
    log = (victim.data_dir / "node-2.log").read_text()
    assert "from the chain-verified checkpoint of round" in log
    assert node_state(victim)["last_contributed"] == 11
    # After the restart both replicas contribute again.
    assert history.commits[-1].commit.num_contributors == 2
    assert not history.disputes
    assert not history.accusations, run_logs(run)
    survivor = json.loads((run.nodes[0].data_dir / "status.json").read_text())
    assert survivor["spot_checks"] >= 4 and survivor["chain_checks"] >= 2, survivor
    assert survivor["spot_check_mismatches"] == 0, survivor


def _wait_for(predicate, timeout: float, what: str, run: LocalRun) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert run.running(), "every node exited early:\n" + run_logs(run)
        time.sleep(1.0)
    raise AssertionError(f"{what}: not within {timeout}s\n" + run_logs(run))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stalled_member_still_contributes_to_every_round(make_run):
    """A member frozen (SIGSTOP) for longer than the liveness TTL is waited for, not left out.

    A stopped or CPU-starved process keeps its connections open, so it is still expected; the
    others wait for its contribution up to the round deadline (60 s here) and the round holds
    every replica. Only a peer that is disconnected and silent counts as gone.
    """
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + ["rounds=6", "join_timeout=60", "diloco.inner_steps=40"])
    run.start()
    _wait_for_round(run, 1, 300)
    sleeper = run.nodes[1]
    sleeper.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(PEER_TTL_S + 5)  # the stall itself is the test's subject, not a wait for an event
    finally:
        sleeper.process.send_signal(signal.SIGCONT)
    assert run.wait(480, progress=True), run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(6))
    assert [c.commit.num_contributors for c in history.commits] == [2] * 6, run_logs(run)
    assert not history.disputes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_round_without_its_quorum_is_waited_for_not_an_exit(make_run):
    """With quorum = every replica, a member frozen past the deadline and every fallback pauses the run.

    The round stays open (docs/PROTOCOL.md, "A round without a quorum"): the others warn and
    keep waiting instead of exiting, and when the member is back the round closes with both.
    """
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + ["rounds=10", "join_timeout=60", "quorum=2", "round_timeout=10",
                                    "diloco.inner_steps=40"])
    run.start()
    _wait_for_round(run, 0, 300)
    sleeper, waiter = run.nodes[1], run.nodes[0]

    def waiting() -> bool:
        log = "\n".join(p.read_text() for p in waiter.data_dir.glob("node-*.log"))
        return "waiting for replicas to come back" in log

    sleeper.process.send_signal(signal.SIGSTOP)
    try:
        _wait_for(waiting, 300, "the other node reports the round without quorum", run)
    finally:
        sleeper.process.send_signal(signal.SIGCONT)
    assert run.wait(480, progress=True), run_logs(run)
    assert waiter.process.returncode == 0
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(10))
    assert [c.commit.num_contributors for c in history.commits] == [2] * 10, run_logs(run)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_late_joiner_catches_up_and_contributes_despite_an_absurd_hello(make_run):
    # An open-ended run (rounds=0): the founders keep going until the test has seen the joiner
    # contribute, however long the joiner's start takes on a loaded machine. A fixed number of
    # rounds would race it: the founders could finish and stop serving blobs before it joins.
    # One founder is an adversary whose hellos claim round 10**12: the joiner must not believe it.
    run = make_run(replicas=3, stages=2, split=False,
                   settings=TINY + ["rounds=0", "join_timeout=5", "diloco.inner_steps=40"])
    run.nodes[1].command = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py"),
                            "absurd-hello"]
    for slot in run.nodes[:2]:
        run.start_node(slot)
    _wait_for_round(run, 2, 300)
    joiner = run.nodes[2]
    run.start_node(joiner)
    client = run.client()

    def joiner_in_a_commit() -> bool:
        last = client.last_round(run.run_id)
        return last is not None and client.commit_of(run.run_id, last).num_contributors == 3

    _wait_for(joiner_in_a_commit, 420, "no round committed with the joiner's contribution", run)
    joined_at = client.last_round(run.run_id)
    _wait_for_round(run, joined_at + 1, 120)
    run.stop_nodes()
    history = client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds))), rounds  # no duplicate, no missing round
    assert all(c.commit.num_contributors == 2 for c in history.commits[:3])
    # Once in, the joiner is in every later round.
    assert all(c.commit.num_contributors == 3 for c in history.commits[joined_at:joined_at + 2])
    log = (joiner.data_dir / "node-1.log").read_text()
    assert "from the chain-verified checkpoint of round" in log
    assert "claim to train round 1000000000000" in log
    roots = node_state(joiner)["weights_roots"]
    assert roots, "the joiner recorded no round"
    for c in history.commits:
        if str(c.commit.round) in roots:
            assert roots[str(c.commit.round)] == c.commit.weights_root.hex()
    assert not history.disputes
