"""The chain's RPC goes away mid-run: real anvil, real node processes, the real round protocol.

The test stops the run's anvil (SIGTERM: it dumps its state file, blocks included),
lets the nodes train two rounds with no chain, restarts anvil from the file on
the same port, and checks that the nodes never exited, logged the outage at a
bounded rate, committed every round they trained exactly once and in order, and
that ``dlx-node audit`` passes on the result.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from node_fixtures import KEEP_ALL, TINY, assert_chain_roots, node_state, wait_for

from ledger.chain import OUTAGE_REPORT_EVERY_S
from ledger.anvil import AnvilProcess
from node.commands.launcher import LocalRun


def _finished(run: LocalRun) -> list[int]:
    return [node_state(slot).get("last_finished", -1) if (slot.data_dir / "state.json").exists() else -1
            for slot in run.nodes]


def _logs(slot) -> str:
    return "\n".join(path.read_text(errors="replace") for path in sorted(slot.data_dir.glob("node-*.log")))


@pytest.mark.timeout(300)
def test_nodes_ride_out_a_chain_outage_and_commit_every_round_once(make_run):
    run = make_run(replicas=2, stages=2, split=False,
                   settings=TINY + KEEP_ALL + ["rounds=0", "join_timeout=60",
                                    # Give up on each request after 2 s: the outage outlasts the
                                    # ledger's own retries, so the committer must queue and retry.
                                    "ledger.retry_seconds=2"])
    run.start()
    client = run.client()
    wait_for(lambda: client.last_round(run.run_id) is not None, 180, "round 0 committed", run,
             none_exits=True)

    port = int(run.url.rsplit(":", 1)[1])
    run.anvil.stop()  # SIGTERM: anvil dumps the chain, blocks and logs included, to chain-state.json
    down_at = time.monotonic()
    before = max(_finished(run))
    # The nodes keep training and finishing rounds with no chain; their commits queue up.
    # Two rounds queued behind the outage are enough for the order (a third cost ~10 s of the suite).
    wait_for(lambda: min(_finished(run)) >= before + 2, 180, "two rounds finished during the outage", run,
             none_exits=True)
    for slot in run.nodes:
        assert "chain RPC unreachable" in _logs(slot), slot.name

    run.anvil = AnvilProcess(state_file=run.workdir / "chain-state.json", port=port)
    run.anvil.start()
    outage = time.monotonic() - down_at
    trained = max(_finished(run))

    def recorded_by_all() -> bool:
        return all({str(r) for r in range(trained + 1)} <= set(node_state(slot)["weights_roots"])
                   for slot in run.nodes)

    wait_for(lambda: client.last_round(run.run_id) >= trained and recorded_by_all(), 180,
             f"every round trained during the outage (through {trained}) committed and recorded", run,
             none_exits=True)
    run.stop_nodes()
    assert all(slot.process.returncode == 0 for slot in run.nodes), \
        [slot.process.returncode for slot in run.nodes]

    history = client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds))), rounds  # in order, none twice, none missing
    assert all(c.commit.num_contributors == 2 for c in history.commits), \
        [c.commit.num_contributors for c in history.commits]
    assert_chain_roots(run, history.commits[:trained + 1])  # every node holds the chain's roots
    assert not history.disputes
    for slot in run.nodes:
        log = _logs(slot)
        assert "chain step failed" not in log and "chain step crashed" not in log, slot.name
        # One line when an outage starts and one when it ends, one per OUTAGE_REPORT_EVERY_S between: not one
        # per request. (A request that timed out on a loaded machine is an outage of its own, with its two
        # lines; the node may stop inside such an episode, before a request answers and ends it: its last
        # start line then has no end line.) A start line is "<what>: chain RPC unreachable (<error>)"; a
        # caller that gave up logs ChainUnavailable's "chain RPC
        # unreachable after N attempt(s)", which starts nothing.
        starts = [m.start() for m in re.finditer(r"chain RPC unreachable \(", log)]
        ends = [m.start() for m in re.finditer(r"chain RPC reachable again", log)]
        still = log.count("chain RPC still unreachable")
        assert ends and len(starts) - len(ends) in (0, 1), (slot.name, len(starts), len(ends))
        if len(starts) > len(ends):
            assert starts[-1] > ends[-1], slot.name
        assert still <= 1 + outage / OUTAGE_REPORT_EVERY_S, (slot.name, still)

    audit = subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id),
         "--deployment", str(run.workdir / "deployment.json"),
         *[arg for slot in run.nodes for arg in ("--archive", str(slot.data_dir))]],
        capture_output=True, text=True, timeout=120, check=False)
    assert audit.returncode == 0 and "PASSED" in audit.stdout, audit.stdout[-3000:] + audit.stderr[-3000:]
