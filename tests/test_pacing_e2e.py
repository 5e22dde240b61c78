"""A real node process holds its training while the chain's commits cannot catch up, and goes on once they do.

Real anvil, one real node process (one replica of the tiny model), ``max_rounds_ahead=2``. Once round 0
is committed the chain goes away (SIGTERM: anvil dumps its state); the node trains on until round t with
t - last committed > 2 and waits, "waiting for commits" in status.json, its round standing. Anvil comes
back from its file on the same port; the node's queued commits go through and its training goes on.
"""

from __future__ import annotations

import time

import pytest
from node_fixtures import TINY, run_logs

from ledger.anvil import AnvilProcess
from node.commands.launcher import LocalRun
from node.live.round.pacing import WAITING


def _wait_for(predicate, timeout: float, what: str, run: LocalRun) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert run.running(), "the node exited:\n" + run_logs(run)
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s\n" + run_logs(run))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_node_waits_for_commits_through_an_outage_and_goes_on(make_run):
    run = make_run(replicas=1, stages=1, split=False,
                   settings=TINY + ["rounds=0", "join_timeout=60", "max_rounds_ahead=2",
                                    "ledger.retry_seconds=2"])
    run.start()
    [slot] = run.nodes
    client = run.client()
    _wait_for(lambda: client.last_round(run.run_id) is not None, 180, "round 0 committed", run)
    port = int(run.url.rsplit(":", 1)[1])
    run.anvil.stop()
    _wait_for(lambda: slot.status().get("state") == WAITING, 180, "the node waiting for commits", run)
    held_round = slot.status()["round"]
    time.sleep(5.0)  # held: no training past the bound while the chain is away
    status = slot.status()
    assert status["state"] == WAITING and status["round"] == held_round, status
    log = "\n".join(path.read_text(errors="replace") for path in sorted(slot.data_dir.glob("node-*.log")))
    assert f"round {held_round + 1}: waiting for commits" in log, log[-3000:]

    run.anvil = AnvilProcess(state_file=run.workdir / "chain-state.json", port=port)
    run.anvil.start()
    client = run.client()
    _wait_for(lambda: slot.status().get("round", -1) >= held_round + 3, 240,
              "training going on after the outage", run)
    # Round held_round + 3 began only with round held_round + 1 committed (2 rounds ahead at most).
    assert client.last_round(run.run_id) >= held_round + 1
    run.stop_nodes()
    assert slot.process.returncode == 0, run_logs(run)
