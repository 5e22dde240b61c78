"""A run whose contributions travel in parts (diloco.exchange_parts = 4; docs/SCALE.md, "The per-shard
exchange of a node that is a cluster"), end to end: real anvil, real ``dlx-node start`` processes, CPU.
Replica 0 is a node of 2 processes (compute.processes = 2), replica 1 an ordinary node. Every contribution
is a version-2 envelope, each node fetches the other's in parts (each part checked alone as it arrives,
from the peers that hold the envelope), the rounds commit with both contributions, and the run audits with
every contribution rerun from the archived (version-2) envelopes."""

from __future__ import annotations

import re

import pytest
from node_fixtures import KEEP_ALL, TINY, run_logs

from node.config import dump_toml, load_config

ROUNDS = 3
IN_PARTS = re.compile(r"round (\d+) stage 0: contribution \w+ fetched in (\d+) parts")
FORWARDED = re.compile(r"round (\d+) stage 0: (\d+) contributions forwarded to 2 ranks in 4 parts")


# a few minutes on 2 cores (two nodes, one of two processes, anvil): the cluster node e2e's template
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_in_parts_with_a_cluster_node_commits_and_audits(make_run):
    from node.tools.audit import audit_run
    from node.tools.report import FAIL
    from p2p.envelope import decode_envelope

    run = make_run(replicas=2, stages=1, split=False, attest_quorum=2, settings=[
        *TINY, *KEEP_ALL, f"rounds={ROUNDS}", "join_timeout=120", "spot_checks=8",
        "diloco.exchange_parts=4"])
    cluster = run.nodes[0]
    cfg = load_config(cluster.config_path, ["compute.processes=2"])
    assert cfg.diloco.exchange_parts == 4
    cluster.config_path.write_text("# a cluster node of 2 processes\n" + dump_toml(cfg.to_dict()))
    run.start()
    assert run.wait(1200, progress=False), run_logs(run)

    for node in run.nodes:  # each node fetched the other's contributions in parts
        logs = "\n".join(p.read_text(errors="replace") for p in node.data_dir.glob("node-*.log"))
        fetched = IN_PARTS.findall(logs)
        assert fetched and all(int(count) == 4 for _r, count in fetched), run_logs(run)
        # every round's contribution of the other replica came in parts (none fell back to the whole blob)
        assert {int(r) for r, _c in fetched} >= set(range(ROUNDS)), run_logs(run)
        assert "no parts announcement of contribution" not in logs, run_logs(run)
        print(node.data_dir.name, "fetched in parts, by round:", sorted(int(r) for r, _c in fetched))
        assert "parts announcement of" not in logs, run_logs(run)  # the refusal's log line: none refused
    # the cluster node's apply: rank 0 forwarded each round's contributions to its ranks a part at a time
    # (training/cluster_exchange.py forward_to_ranks), no whole-contribution scatter
    logs = "\n".join(p.read_text(errors="replace") for p in cluster.data_dir.glob("node-*.log"))
    forwarded = {int(r): int(c) for r, c in FORWARDED.findall(logs)}
    assert set(forwarded) >= set(range(ROUNDS)) and all(c == 2 for c in forwarded.values()), run_logs(run)
    archived = [decode_envelope(p.read_bytes(), 1 << 30) for node in run.nodes
                for p in node.data_dir.rglob("round-*/*.env")]
    contributions = [e for e in archived if e.kind == "contribution"]
    assert len(contributions) >= 2 * ROUNDS and all(e.in_parts and len(e.sizes) == 4 for e in contributions)

    client = run.client()
    history = client.history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(ROUNDS)), run_logs(run)
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)
    assert not history.accusations and not history.disputes, run_logs(run)
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=2 * ROUNDS)
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    assert reruns and not [c for c in reruns if c.status == FAIL], [c.line() for c in reruns]
    assert not report.failed, report.summary()
