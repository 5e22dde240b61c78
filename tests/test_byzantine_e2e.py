"""A malicious member with validly signed messages cannot crash or stall the honest nodes.

Real node processes and a real anvil; the attacker is tests/adversary.py, the
real node with one behaviour patched.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]
SETTINGS = [*TINY, "join_timeout=60"]


def _roots(slot) -> dict:
    return node_state(slot)["weights_roots"]


@pytest.mark.timeout(600)
def test_malformed_payloads_are_excluded_and_honest_nodes_keep_committing(make_run):
    run = make_run(replicas=3, stages=2, split=False, settings=SETTINGS + ["rounds=4"], attest_quorum=2)
    attacker = run.nodes[2]
    attacker.command = [*ADVERSARY, "malformed-payload"]
    run.start()
    honest = run.nodes[:2]
    for slot in honest:
        assert slot.process.wait(timeout=480) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2, 3]
    # Only the two honest replicas are in any round; both computed the chain's roots.
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)
    for slot in honest:
        roots = _roots(slot)
        assert [roots[str(c.commit.round)] for c in history.commits] == [
            c.commit.weights_root.hex() for c in history.commits]
        log = "\n".join(p.read_text() for p in slot.data_dir.glob("node-*.log"))
        assert "rejected: payload does not decode" in log
        # The signed envelopes that prove it are kept.
        assert list((slot.data_dir / "evidence").glob("*.envelope")), slot.name
    assert history.commits[-1].commit.eval_loss_micro < history.commits[0].commit.eval_loss_micro


@pytest.mark.timeout(600)
def test_an_empty_close_is_ignored_and_the_next_coordinator_closes(make_run):
    run = make_run(replicas=2, stages=2, split=False, settings=SETTINGS + ["rounds=4"])
    attacker = run.nodes[1]
    attacker.command = [*ADVERSARY, "empty-close"]
    run.start()
    honest = run.nodes[0]
    assert honest.process.wait(timeout=480) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2, 3]
    roots = _roots(honest)
    assert [roots[str(c.commit.round)] for c in history.commits] == [
        c.commit.weights_root.hex() for c in history.commits]
    # The attacker's contributions are valid: it is in every round; only its closes were refused.
    assert all(c.commit.num_contributors == 2 for c in history.commits), run_logs(run)


@pytest.mark.timeout(600)
def test_an_equivocating_coordinator_is_skipped_and_honest_nodes_stay_identical(make_run):
    run = make_run(replicas=3, stages=2, split=False, settings=SETTINGS + ["rounds=4"], attest_quorum=2)
    attacker = run.nodes[2]
    attacker.command = [*ADVERSARY, "equivocating-close"]
    run.start()
    honest = run.nodes[:2]
    for slot in honest:
        assert slot.process.wait(timeout=480) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2, 3]
    for slot in honest:
        roots = _roots(slot)
        assert [roots[str(c.commit.round)] for c in history.commits] == [
            c.commit.weights_root.hex() for c in history.commits], run_logs(run)
    # Both versions of the attacker's closes reached the honest nodes, which skipped them.
    logs = "\n".join(p.read_text() for slot in honest for p in slot.data_dir.glob("node-*.log"))
    assert "signed two different closes" in logs, run_logs(run)


@pytest.mark.timeout(600)
def test_huge_contributions_are_clipped_and_the_run_stays_finite(make_run):
    """x1e6 the honest pseudo-gradient, validly encoded and signed: the norm rule bounds its harm."""
    run = make_run(replicas=3, stages=2, split=False, settings=SETTINGS + ["rounds=4"], attest_quorum=2)
    attacker = run.nodes[2]
    attacker.command = [*ADVERSARY, "huge-1e6"]
    run.start()
    honest = run.nodes[:2]
    for slot in honest:
        assert slot.process.wait(timeout=480) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    assert [c.commit.round for c in history.commits] == [0, 1, 2, 3]
    for slot in honest:
        roots = _roots(slot)
        assert [roots[str(c.commit.round)] for c in history.commits] == [
            c.commit.weights_root.hex() for c in history.commits], run_logs(run)
    losses = [c.commit.eval_loss_micro / 1e6 for c in history.commits]
    # Without the rule the weights reach ~1e38 after one round and NaN after two.
    assert all(0 < loss < 10 for loss in losses), losses
    assert losses[-1] < losses[0], losses
