"""A run whose data windows are keyed by account (``training.data_windows = "account"``, issue 78) on a split
cluster: 2 replicas x 2 stages, one stage per node, each node its own member account (and, in the slow tier,
one node a replica).

Real node processes, a real anvil, real gloo pipelines. The two stages of a replica read the same batch, drawn
by the account of the replica's stage-0 member (the signer of its stage-0 contribution, the key the chain's
data dispute recomputes the windows from); every node's spot checks rerun the other replica with that key,
the contributor's, and reproduce it bit for bit; the audit's reruns (the key read from the chain's seats)
reproduce what they sample; and every recorded contribution binds the data commitment of those windows,
not of the replica index's nor of its own signer's (for stage 1).
"""

from __future__ import annotations

import json

import pytest
from node_fixtures import KEEP_ALL, TINY, run_logs
from test_split_spotchecks_e2e import _spot_checks, _wait_for

from ledger.account import dev_account
from node import protocol as msg
from node.runconfig import node_config_from_run
from p2p.envelope import decode_envelope
from training.data import corpus_from_config
from training.reexec import data_commitment

#: An upper bound only: the run is stopped once every node has checked the other replica.
MAX_ROUNDS = 60


@pytest.mark.timeout(1500)
# One node a replica (its own account keys it) is the slow tier's: the split run covers its path and more.
@pytest.mark.parametrize("split", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_run_keyed_by_account_trains_and_reexecutes_with_the_first_stage_members_key(make_run, split):
    run = make_run(replicas=2, stages=2, split=split,
                   settings=[*TINY, *KEEP_ALL, f"rounds={MAX_ROUNDS}", "join_timeout=60", "spot_checks=8",
                             "training.data_windows=account"])
    run.start()

    def checked() -> bool:
        assert all(s.process.poll() is None for s in run.nodes), "a node exited:\n" + run_logs(run)
        return all(any(v == "exact" for _r, _t, v in _spot_checks(s)) for s in run.nodes)

    _wait_for(checked, 1200, "a spot check done by every node", run)
    run.stop_nodes()
    client = run.client()
    history = client.history(run.run_id)
    rounds = len(history.commits)
    assert [c.commit.round for c in history.commits] == list(range(rounds)) and rounds < MAX_ROUNDS
    assert all(c.commit.num_contributors == len(run.nodes) for c in history.commits)
    assert not history.accusations and not history.disputes

    statuses = {s.name: json.loads((s.data_dir / "status.json").read_text()) for s in run.nodes}
    account = {s.name: bytes.fromhex(dev_account(s.account, client.chain_id).address[2:]) for s in run.nodes}
    first_stage = {statuses[s.name]["placement"]["replica"]: account[s.name] for s in run.nodes
                   if 0 in statuses[s.name]["placement"]["stages"]}
    assert len(first_stage) == 2, statuses
    for slot in run.nodes:
        checks = _spot_checks(slot)
        assert checks and {v for _r, _t, v in checks} == {"exact"}, (slot.name, checks)
        assert statuses[slot.name]["spot_check_mismatches"] == 0, statuses[slot.name]

    # What every recorded contribution binds: the windows of its replica's stage-0 member's account.
    cfg = node_config_from_run(json.loads((run.workdir / "run.json").read_text()))
    assert cfg.training.data_windows == "account"
    corpus = corpus_from_config(cfg.training, cfg.model)
    archives = [s.data_dir / "archive" / f"run-{run.run_id}" for s in run.nodes]
    seen = set()
    for outer_round in range(min(rounds, 3)):
        name = f"round-{outer_round:08d}"
        recorded = json.loads((archives[0] / name / "recorded.json").read_text())
        for stage, rep, _peer, digest in recorded["contributions"]:
            held = [a / name / f"{digest}.env" for a in archives if (a / name / f"{digest}.env").exists()]
            assert held, (outer_round, stage, rep)
            env = decode_envelope(held[0].read_bytes(), 1 << 32)
            bound = msg.decode_contribution_body(env.payload).data_commitment
            want = data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, rep, outer_round, None,
                                   first_stage[rep])
            assert bound == want, (outer_round, stage, rep)
            for other in set(account.values()) - {first_stage[rep]}:
                assert bound != data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, rep, outer_round,
                                                None, other)
            seen.add((outer_round, stage, rep))
    assert {(s, r) for _t, s, r in seen} == {(s, r) for s in (0, 1) for r in first_stage}, seen

    # The audit reruns sampled contributions from the four archives, the key read from the chain's seats.
    from node.tools.audit import audit_run
    from node.tools.report import FAIL, OK

    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], replay=False,
                       reexecute=4)
    reruns = [c for c in report.general if c.name.startswith("re-execution")]
    assert len(reruns) == 4, [c.line() for c in reruns]
    assert all(c.status == OK and "reproduced" in c.reason for c in reruns), [c.line() for c in reruns]
    assert not [c for c in report.general if c.status == FAIL], [c.line() for c in report.general]
