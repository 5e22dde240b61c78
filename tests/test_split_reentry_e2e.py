"""A split cluster's survivor and its restarted partner re-enter together and their rounds re-execute (issue
30).

Real node processes, real anvil, real gloo pipelines: 2 replicas x 2 stages. One stage node of replica 0
is killed with SIGKILL while the other replica trains on; its partner sits rounds out, finishing the
rounds replica 1 closes, and the killed node is started again. The pair agrees on an entry round and
both train it from states the record gives (node/live/round/entry.py, RunEntry.reenter: the survivor from its
held global state, the restarted node from a checkpoint). That round holds both replicas' contributions,
every round is committed once, in order, and ``audit --reexecute all`` over the four archives reruns
every contribution, the re-entered ones included (their start states bind the record's global weights),
and finds nothing wrong.
"""

from __future__ import annotations

import signal

import pytest
from node_fixtures import KEEP_ALL, TINY, node_log, stopped_cleanly, wait_for


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_re_formed_pipeline_enters_a_round_both_replicas_contribute_to_and_it_reexecutes(make_run):
    run = make_run(replicas=2, stages=2, split=True,
                   settings=[*TINY, *KEEP_ALL, "rounds=0", "join_timeout=60"])
    run.start()
    client = run.client()

    def last() -> int:
        committed = client.last_round(run.run_id)
        return -1 if committed is None else committed

    wait_for(lambda: last() >= 1, 300, "round 1 committed", run)
    survivor, victim = [s for s in run.nodes if s.cluster == "cluster-0"]
    run.kill(victim, signal.SIGKILL)
    wait_for(lambda: "waiting for the partner to come back" in node_log(survivor), 180,
              "the survivor noticed the broken pipeline", run)
    at_kill = last()
    # The other replica goes on: the survivor finishes its rounds as a non-contributor meanwhile.
    wait_for(lambda: last() >= at_kill + 2, 300, "two rounds committed without replica 0", run)
    run.start_node(victim)
    wait_for(lambda: "re-formed; entering at round" in node_log(survivor), 300, "the pipeline re-formed", run)
    reentry = int(node_log(survivor).split("re-formed; entering at round ")[1].split()[0])
    wait_for(lambda: last() >= reentry + 1, 300, "the round after the re-entry committed", run)
    history, _rounds = stopped_cleanly(run, client)  # every node exited 0, rounds in order, none missing
    # The round the pair entered holds every node's contribution (both stages of both replicas).
    assert history.commits[reentry].commit.num_contributors == len(run.nodes), \
        [c.commit.num_contributors for c in history.commits]
    assert f"entering at round {reentry}" in node_log(victim)

    from node.tools.audit import audit_run
    from node.tools.report import FAIL, OK

    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], replay=False,
                       reexecute=-1)
    # A failing run's directories are kept (pyproject: tmp_path_retention_policy "failed"): named here.
    kept = f"nodes' logs and archives under {run.workdir}"
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    assert reruns, ([c.line() for c in report.general], kept)
    assert all(c.status == OK for c in reruns), ([c.line() for c in reruns if c.status != OK], kept)
    assert not [c for c in report.general if c.status == FAIL], ([c.line() for c in report.general], kept)
