"""A node started before its chain waits for it; what waiting cannot fix fails at once.

Real anvil, real ``dlx-node start`` processes. The chain is stopped (anvil dumps its
state file) before the node starts, and restarted from the file on the same port only
after the node has logged the wait and 12 s have passed: past the 10 s a starting node
used to give the RPC before exiting with code 5. (Waiting for the second report, 30 s
later, cost the suite 20 s; the one-line-per-interval rule is the count asserted below.)
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from node_fixtures import TINY, run_logs

from ledger.chain import OUTAGE_REPORT_EVERY_S
from ledger.anvil import AnvilProcess
from node.commands.launcher import LocalRun


def _logs(slot) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(slot.data_dir.glob("node-*.log")))


def _wait_for(predicate, timeout: float, what: str, run: LocalRun, exit_ok: bool = False) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if not exit_ok:
            assert len(run.running()) == len(run.nodes), "a node exited:\n" + run_logs(run)
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s\n" + run_logs(run))


def _stop_chain(run: LocalRun) -> int:
    port = int(run.url.rsplit(":", 1)[1])
    run.anvil.stop()  # SIGTERM: anvil dumps the chain (deployment, run) to chain-state.json
    run.anvil = None
    return port


@pytest.mark.timeout(400)
def test_a_node_started_before_its_chain_waits_for_it_then_trains(make_run):
    run = make_run(replicas=1, stages=1, split=False, settings=TINY + ["rounds=2"])
    (slot,) = run.nodes
    port = _stop_chain(run)
    run.start()
    down_at = time.monotonic()
    _wait_for(lambda: "chain RPC unreachable" in _logs(slot), OUTAGE_REPORT_EVERY_S + 60,
              "the node's report of the wait", run)
    _wait_for(lambda: time.monotonic() - down_at > 12.0, 30, "12 s of waiting", run)

    run.anvil = AnvilProcess(state_file=run.workdir / "chain-state.json", port=port)
    run.anvil.start()
    waited = time.monotonic() - down_at
    # The node joins and trains the run's two rounds, then exits by itself.
    _wait_for(lambda: slot.process.poll() is not None, 300, "the node finishing the run", run, exit_ok=True)
    assert slot.process.returncode == 0, run_logs(run)
    assert run.client().last_round(run.run_id) == 1

    log = _logs(slot)
    assert "chain RPC reachable again" in log
    # One line when the wait starts, one per OUTAGE_REPORT_EVERY_S, not one per request: counted in the wait's
    # own episode (up to its end line; a request that later timed out on a loaded machine is an episode of its
    # own), start lines by their form ("<what>: chain RPC unreachable (<error>)", not a caller's "unreachable
    # after N attempt(s)").
    wait = log[:log.index("chain RPC reachable again")]
    reports = len(re.findall(r"chain RPC unreachable \(", wait)) + wait.count("chain RPC still unreachable")
    assert 1 <= reports <= 1 + waited / OUTAGE_REPORT_EVERY_S, reports


@pytest.mark.timeout(200)
def test_a_node_waiting_for_its_chain_stops_cleanly_on_sigterm(make_run):
    run = make_run(replicas=1, stages=1, split=False, settings=TINY + ["rounds=2"])
    (slot,) = run.nodes
    _stop_chain(run)
    run.start()
    _wait_for(lambda: "chain RPC unreachable" in _logs(slot), 120, "the node's report of the wait", run)
    run.stop_nodes()  # SIGTERM
    assert slot.process.returncode == 0, run_logs(run)
    # The wait is the start command's pre-flight's (node/commands/preflight.py), or the node's own.
    log = _logs(slot)
    assert "stopped before the chain answered" in log or "stopped during start-up (signal 15)" in log, log


@pytest.fixture(scope="module")
def unstarted_run(tmp_path_factory):
    """One run on a live chain, its node never started, for the refusals below: each start fails before it
    sends or writes anything the next one would see (was one chain and deployment per case)."""
    run = LocalRun(tmp_path_factory.mktemp("unstarted"), replicas=1, stages=1, split=False,
                   settings=TINY + ["rounds=2"], attest_quorum=1, attest_quorum_bps=0, allow_weak_quorum=True)
    run.setup()
    yield run
    run.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("override", "message"), [
    ("ledger.chain_id=1", "serves chain id 31337, but ledger.chain_id = 1"),
    ("ledger.ledger_address=0x00000000000000000000000000000000000000aa",
     "no TrainingLedger at 0x00000000000000000000000000000000000000AA on chain 31337"),
    ("ledger.registry_address=0x00000000000000000000000000000000000000bb",
     "no NodeRegistry at 0x00000000000000000000000000000000000000bb on chain 31337"),
    ("ledger.ledger_address=0x1234", "must be a 0x-prefixed 20-byte hex address"),
])
def test_what_waiting_cannot_fix_fails_at_once_with_what_to_change(unstarted_run, override, message):
    (slot,) = unstarted_run.nodes
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "start", "--no-progress", "--yes", "--config",
         str(slot.config_path),
         "--set", override], capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert message in result.stderr, result.stderr[-3000:]
    assert "chain RPC unreachable" not in result.stderr
