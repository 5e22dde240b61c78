"""The audit re-executes only rounds the chain committed.

A run that is stopped (not run to its last round) leaves rounds its nodes sealed but never committed, and at a
fork the nodes may have sealed different closes of such a round. The archives' union of an uncommitted round
is no one's close: rerun against it, an honest contribution of the next round is "built on another result".
The 25-minute soak of 2026-11-26 (issue 45) FAILED its audit so, on rounds 26 and 27 of a chain that held
0-24. Real node archives (node.store.archive.Archive, as the nodes seal them), the audit's own reexec_checks.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

from node.config import NodeConfig
from node.store.archive import Archive, ArchivedContribution
from node.tools.audit_reexec_checks import recorded_pairs, reexec_checks
from node.tools.report import AuditReport

RUN_ID = 1


def _archives(tmp_path, rounds_by_node: dict[str, dict[int, list[int]]]):
    """One archive per node, sealing for each round the replicas listed (one stage: stage 0)."""
    dirs = []
    for name, rounds in rounds_by_node.items():
        archive = Archive(tmp_path / name / "archive", RUN_ID)
        for outer_round, replicas in rounds.items():
            sealed = []
            for replica in replicas:
                envelope = f"round {outer_round} replica {replica}".encode()
                archive.put(outer_round, envelope)
                sealed.append(ArchivedContribution(0, replica, f"peer-{replica}",
                                                   hashlib.sha256(envelope).digest()))
            archive.seal_round(outer_round, sealed, [])
        dirs.append(tmp_path / name)
    return dirs


def _history(committed: list[int]):
    return SimpleNamespace(commits=[SimpleNamespace(commit=SimpleNamespace(round=r)) for r in committed],
                           head_hash=b"\x07" * 32, accusations=[], memberships=[],
                           run=SimpleNamespace(run_id=RUN_ID, max_rounds=0))


def test_recorded_pairs_leave_out_rounds_the_chain_did_not_commit():
    sealed = {4: [[0, 0, "a", "00"], [0, 1, "b", "11"]], 5: [[0, 0, "a", "22"]], 6: [[0, 1, "b", "33"]]}
    pairs, unrecorded = recorded_pairs(sealed, _history([3, 4]))
    assert pairs == [(4, 0), (4, 1)]
    assert unrecorded == [5, 6]
    assert recorded_pairs(sealed, _history([])) == ([], [4, 5, 6])


def test_the_audit_judges_no_contribution_of_a_round_past_the_chain(tmp_path):
    """Two nodes sealed different closes of round 14 (a fork at the run's end) and the chain holds 12 and 13:
    the re-execution items name rounds 12 and 13 only, and a note says which sealed rounds were not judged."""
    dirs = _archives(tmp_path, {"n0": {12: [0, 1], 13: [0, 1], 14: [0]},
                                "n1": {12: [0, 1], 13: [0, 1], 14: [1]}})
    report = AuditReport(run_id=RUN_ID, chain_id=1, registry="", ledger="", config_hash="", num_stages=1,
                         inner_steps=1, head="", replay=True)
    cfg = NodeConfig()
    cfg.pipeline.num_stages = 1
    replayer = SimpleNamespace(cfg=cfg, _corpus=lambda: None, corpus_problem="not in this test")
    reexec_checks(report, _history([12, 13]), replayer, dirs, -1)
    judged = sorted(check.round for check in report.general if check.round is not None)
    assert judged == [12, 12, 13, 13], [(c.name, c.status, c.reason) for c in report.general]
    # nothing was rerun (no corpus here): one more item says so, with no round (issue 80 point 1)
    assert [c.name for c in report.general if c.round is None] == ["re-execution"]
    assert any("round(s) 14 sealed in the archives but not committed" in note for note in report.notes), \
        report.notes
