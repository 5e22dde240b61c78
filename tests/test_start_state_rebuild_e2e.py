"""Start states rebuilt when asked, in a real run (``storage.start_states = "rebuild"``, the default;
node/live/checks/staterebuild.py): two one-node replicas of ``tiny`` on a real anvil, each checking the
other every round (``spot_checks=4``), each keeping one start state in three. Every check of the other's
round whose state the other dropped is answered by a replay of its own rounds in its child process: the
fetched bytes hash to what the envelope binds (the blob protocol checks it) and the rerun from them is
exact. The audit of every contribution from the two nodes' directories replays the dropped states from the
kept ones and passes with every rerun exact."""

from __future__ import annotations

import re
import time

import pytest
from node_fixtures import TINY, node_log, run_logs

from bench.retention_disk import rebuilds

SPOT_LINE = re.compile(r"spot check of replica (\d+) round (\d+): (\w+)")


@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_dropped_start_states_are_rebuilt_for_the_spot_checks_and_the_audit(make_run):
    from node.tools.audit import audit_run

    run = make_run(replicas=2, stages=1, settings=[*TINY, "diloco.inner_steps=1", "rounds=40",
                                                   "join_timeout=60", "spot_checks=4",
                                                   "storage.start_state_every=3"])
    run.start()

    def rebuilt_and_checked(slot) -> bool:
        text = node_log(slot)
        exact = {int(t) for _r, t, v in SPOT_LINE.findall(text) if v == "exact"}
        return len([t for t in exact if t % 3]) >= 2  # two rounds whose state the other replica dropped

    deadline = time.monotonic() + 1200
    while not all(rebuilt_and_checked(s) for s in run.nodes):
        assert all(s.process.poll() is None for s in run.nodes), "a node exited:\n" + run_logs(run)
        assert time.monotonic() < deadline, "no two checks of dropped states each:\n" + run_logs(run)
        time.sleep(2.0)
    run.stop_nodes()

    for slot in run.nodes:
        tally = rebuilds(slot.data_dir)
        assert tally["rebuilt"] >= 2 and tally["failed"] == 0, (slot.name, tally)
        verdicts = [v for _r, _t, v in SPOT_LINE.findall(node_log(slot))]
        assert verdicts and set(verdicts) == {"exact"}, (slot.name, verdicts)
        assert tally["spot_checks_not_done"] == 0, (slot.name, tally)

    report = audit_run(run.client(), run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert report.counts()["FAIL"] == 0, report.summary()
    reruns = dict(report.reexecuted)
    assert reruns.get("exact", 0) >= 2 * 3 and set(reruns) == {"exact"}, reruns
