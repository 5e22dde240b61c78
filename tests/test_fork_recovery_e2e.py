"""A member whose weights left the run's committed record re-enters from the chain (real processes).

A fork (docs/PROTOCOL.md, "When a node's weights leave the record") leaves a member with weights
the quorum did not commit: every later round of its would disagree too. tests/adversary.py
``diverge-once`` makes one member aggregate round 2 without the close's first entry. It must
dispute the committed record with its own (the evidence stays on chain), start again in the same
process from the chain's latest checkpoint, hold the chain's roots from then on and contribute
again; the others never notice more than one round's odd attestation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]


@pytest.mark.slow  # 12 rounds of 3 replicas and a restart: 550 s at load ~50 (run with -m slow)
@pytest.mark.timeout(900)
def test_a_member_whose_weights_left_the_record_disputes_and_re_enters_from_the_chain(make_run):
    # Rounds of a few seconds (H=40), so the others still train when the forked member is back.
    rounds = 12
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40"])
    forked = run.nodes[-1]
    forked.command = [*ADVERSARY, "diverge-once"]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=840) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = "\n".join(p.read_text() for p in forked.data_dir.glob("node-*.log"))
    assert "adversary: round 2 stage 0 aggregated without the close's first entry" in log
    # It disputed round 2 with its own signed record, then started again from the chain's checkpoint.
    assert [d.round for d in history.disputes] == [2], run_logs(run)
    assert "starting again from the chain's latest checkpoint" in log
    restored = [int(line.rsplit(" ", 1)[1]) for line in log.splitlines()
                if "from the chain-verified checkpoint of round" in line]
    assert restored and restored[-1] >= 2, log[-3000:]
    assert node_state(forked)["reentered_for"] == [2]
    # From its re-entry on it holds the chain's roots, like every other member, and contributes again.
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        later = [c for c in commits if c.commit.round > restored[-1]]
        assert later and [roots.get(str(c.commit.round)) for c in later] == \
            [c.commit.weights_root.hex() for c in later], (slot.name, run_logs(run))
    assert commits[-1].commit.num_contributors == 3, run_logs(run)
    assert not history.accusations, run_logs(run)
