"""A node that is a cluster (issue 75) in a real run: real anvil, real ``dlx-node start`` processes, CPU.

Replica 0 is one node of ``compute.processes = 2`` (the node process is rank 0 and starts rank 1 itself;
the inner steps run under FSDP2 over gloo), replica 1 an ordinary one-process node. The rounds commit with
both contributions, the run audits with every sampled contribution rerun (the cluster's by a one-process
auditor: another platform, judged by the tolerance rule, or said to be undecided), ``pull`` gives a model
transformers loads, and the cluster's worker rank is gone once its node stopped. With both replicas
clusters of 2, each node's spot checks rerun the other's rounds on 2 ranks, bit for bit.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from node_fixtures import KEEP_ALL, TINY, run_logs

from node.config import dump_toml, load_config

ROUNDS = 3
SPOT_LINE = re.compile(r"spot check of replica 0 round (\d+): (\w+)")
SHARDED = re.compile(r"outer state of stage 0 sharded over 2 ranks: rank 0 holds (\d+) of its (\d+) tensors")
WORKERS = re.compile(r"cluster of 2 processes: rank 0 is this node, ranks 1\.\.1 are processes \[(\d+)\]")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return "State:\tZ" not in open(f"/proc/{pid}/status").read()
    except OSError:
        return False


# about 4-8 minutes at a load of 20-30 on 2 cores (two nodes, one of two processes, anvil)
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_cluster_node_of_two_processes_commits_audits_and_pulls(make_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from node.tools.audit import audit_run
    from node.tools.pull import pull_checkpoint
    from node.tools.report import FAIL

    run = make_run(replicas=2, stages=1, split=False, attest_quorum=2, settings=[
        *TINY, *KEEP_ALL, f"rounds={ROUNDS}", "join_timeout=120", "spot_checks=8"])
    cluster = run.nodes[0]
    cfg = load_config(cluster.config_path, ["compute.processes=2"])
    cluster.config_path.write_text("# a cluster node of 2 processes\n" + dump_toml(cfg.to_dict()))
    assert load_config(cluster.config_path).compute.processes == 2
    run.start()
    assert run.wait(1200, progress=False), run_logs(run)

    logs = "\n".join(p.read_text(errors="replace") for p in cluster.data_dir.glob("node-*.log"))
    found = WORKERS.search(logs)
    assert found, run_logs(run)
    sharded = SHARDED.search(logs)  # the outer state lives on the ranks (training/cluster_outer.py)
    assert sharded and 0 < int(sharded.group(1)) < int(sharded.group(2)), run_logs(run)
    worker = int(found.group(1))
    run.stop_nodes()
    deadline = time.monotonic() + 60
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(worker), f"cluster worker rank {worker} outlived its node"

    ordinary = "\n".join(p.read_text(errors="replace") for p in run.nodes[1].data_dir.glob("node-*.log"))
    verdicts = SPOT_LINE.findall(ordinary)  # the one-process node reran the cluster's rounds
    assert verdicts and "mismatch" not in {v for _t, v in verdicts}, run_logs(run)
    print("spot checks of the cluster:", verdicts)
    import json

    own = json.loads((cluster.data_dir / "status.json").read_text())  # the cluster checked the other node
    assert own["spot_checks"] >= 1 and own["spot_check_mismatches"] == 0, own

    client = run.client()
    history = client.history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(ROUNDS)), run_logs(run)
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)
    assert not history.accusations and not history.disputes, run_logs(run)

    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=2 * ROUNDS)
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    lines = [c.line() for c in reruns]
    assert reruns and not [c for c in reruns if c.status == FAIL], lines
    assert not report.failed, report.summary()
    print("\n".join(lines))
    assert report.reexecuted.get("tolerance", 0) >= 1, report.reexecuted  # the cluster's, in one process
    # an auditor allowed 2 processes reruns the cluster's rounds on 2 ranks of its own: bit for bit
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], replay=False,
                       reexecute=2 * ROUNDS, processes=2)
    assert not report.failed, report.summary()
    assert report.reexecuted == {"exact": 2 * ROUNDS}, report.reexecuted

    out = tmp_path / "model"
    result = pull_checkpoint(client, run.run_id, out, archives=[s.data_dir for s in run.nodes],
                             final_only=False)
    assert result.round == ROUNDS - 1
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.n_layer == cfg.model.n_layer


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_cluster_nodes_spot_check_each_other_bit_exactly(make_run):
    """Both replicas are nodes of 2 processes: each node's spot checks rerun the other's rounds on 2 ranks of
    its own (training/cluster_rerun.py, the node's compute.processes): every verdict is exact, none
    within tolerance; the rounds commit with both contributions."""
    run = make_run(replicas=2, stages=1, split=False, attest_quorum=2, settings=[
        *TINY, *KEEP_ALL, "rounds=2", "join_timeout=120", "spot_checks=8"])
    for node in run.nodes:
        cfg = load_config(node.config_path, ["compute.processes=2"])
        node.config_path.write_text("# a cluster node of 2 processes\n" + dump_toml(cfg.to_dict()))
    run.start()
    assert run.wait(1500, progress=False), run_logs(run)
    run.stop_nodes()
    verdicts = []
    for replica, node in enumerate(run.nodes):
        logs = "\n".join(p.read_text(errors="replace") for p in node.data_dir.glob("node-*.log"))
        other = 1 - replica
        verdicts += re.findall(rf"spot check of replica {other} round (\d+): (\w+)", logs)
    assert verdicts and {v for _r, v in verdicts} == {"exact"}, (verdicts, run_logs(run))
    print("spot checks between the clusters:", verdicts)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1], run_logs(run)
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)
    assert not history.accusations and not history.disputes, run_logs(run)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_stops_a_cluster_node_and_its_worker_rank_mid_run(make_run):
    """SIGINT (a terminal's Ctrl-C) to a cluster node in the middle of its run: it exits, and so does its
    worker rank (told to stop by rank 0's close, which every exit path of the node runs)."""
    import signal

    from node_fixtures import wait_for

    run = make_run(replicas=2, stages=1, split=False, settings=[*TINY, "rounds=200", "join_timeout=120"])
    cluster = run.nodes[0]
    cfg = load_config(cluster.config_path, ["compute.processes=2"])
    cluster.config_path.write_text("# a cluster node of 2 processes\n" + dump_toml(cfg.to_dict()))
    run.start()

    def logs() -> str:
        return "\n".join(p.read_text(errors="replace") for p in cluster.data_dir.glob("node-*.log"))

    wait_for(lambda: "round 1 stage 0: contribution" in logs(), 900, "the cluster node's round 1", run)
    worker = int(WORKERS.search(logs()).group(1))
    assert _alive(worker)
    cluster.process.send_signal(signal.SIGINT)
    cluster.process.wait(timeout=120)
    deadline = time.monotonic() + 60
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(worker), f"cluster worker rank {worker} outlived its node\n" + run_logs(run)
    run.stop_nodes()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_killed_cluster_node_leaves_no_rank_and_rejoins_from_its_checkpoint(make_run):
    """SIGKILL of a cluster node mid-run (no clean-up runs): its worker rank leaves by itself; restarted, the
    node starts a new worker, enters from the chain-verified checkpoint (every rank's inner optimizer
    fresh) and contributes again; the other node's spot checks of it find no mismatch across the
    restart."""
    import json
    import signal

    from node_fixtures import wait_for

    rounds = 10
    run = make_run(replicas=2, stages=1, split=False, settings=[
        *TINY, f"rounds={rounds}", "join_timeout=120", "diloco.inner_steps=40", "spot_checks=8"])
    cluster = run.nodes[0]
    cfg = load_config(cluster.config_path, ["compute.processes=2"])
    cluster.config_path.write_text("# a cluster node of 2 processes\n" + dump_toml(cfg.to_dict()))
    run.start()

    def log(start: int) -> str:
        path = cluster.data_dir / f"node-{start}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    wait_for(lambda: "round 1 stage 0: contribution" in log(1), 900, "the cluster node's round 1", run)
    first = int(WORKERS.search(log(1)).group(1))
    run.kill(cluster, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while _alive(first) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _alive(first), f"the killed node's worker rank {first} is still running"
    run.start_node(cluster)
    assert run.wait(1200, progress=False), run_logs(run)
    assert "from the chain-verified checkpoint of round" in log(2), run_logs(run)
    second = int(WORKERS.search(log(2)).group(1))
    assert second != first and not _alive(second)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(rounds)), run_logs(run)
    assert history.commits[-1].commit.num_contributors == 2, run_logs(run)
    assert not history.accusations and not history.disputes, run_logs(run)
    other = json.loads((run.nodes[1].data_dir / "status.json").read_text())
    assert other["spot_checks"] >= 2 and other["spot_check_mismatches"] == 0, other
