"""A member whose weights left the run's committed record re-bases on it and trains on (real processes).

A fork (docs/PROTOCOL.md, "When a node's weights leave the record") leaves a member with weights
the quorum did not commit: every later round of its would disagree too. node/live/forkrepair.py
re-derives the committed round from its contributions, re-bases the member on it in place (no
restart, no re-entry from a checkpoint) and keeps its dispute only if its own computation stood.

- ``fork-close`` (tests/adversary.py): in round 2 the member takes another close (the accepted
  one without its first entry) and aggregates it correctly: it disputes with its signed record.
- ``diverge-once``: in round 2 the member's sum leaves an entry of its own close out (a local
  fault): its close gives the record's result, so it does not dispute.

Either way it re-bases on round 2's record before it applies round 3, and from round 2 on every
member holds the chain's roots; the member contributes to every later round.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]


@pytest.mark.slow  # 8 rounds of 3 replicas: several minutes on a loaded machine (run with -m slow)
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("fault", "logged", "disputes"), [
    ("fork-close", "adversary: round 2 stage 0 took a close without its first entry", [2]),
    ("diverge-once", "adversary: round 2 stage 0 aggregated without the close's first entry", []),
])
def test_a_forked_member_re_bases_on_the_record_and_every_root_stays_equal(make_run, fault, logged, disputes):
    # Rounds of a few seconds (H=40): the commit of round 2 comes while round 3 trains.
    rounds = 8
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40"])
    forked = run.nodes[-1]
    forked.command = [*ADVERSARY, fault]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=840) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = "\n".join(p.read_text() for p in forked.data_dir.glob("node-*.log"))
    assert logged in log
    # Its dispute is on chain only if its own computation stood.
    assert [d.round for d in history.disputes] == disputes, run_logs(run)
    # It re-based in place on round 2's record: no restart, no re-entry from a checkpoint.
    assert "re-based stage(s) [0] on the committed record" in log, log[-4000:]
    state = node_state(forked)
    assert state["rebased"] == [2]
    assert "reentered_for" not in state
    assert "starting again from the chain's latest checkpoint" not in log
    assert "Traceback" not in log
    # From round 2 on, every member holds the chain's roots (the forked one too), and it contributes again.
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        later = [c for c in commits if c.commit.round >= 2]
        assert [roots.get(str(c.commit.round)) for c in later] == \
            [c.commit.weights_root.hex() for c in later], (slot.name, run_logs(run))
    assert all(c.commit.num_contributors == 3 for c in commits if c.commit.round >= 3), run_logs(run)
    assert not history.accusations, run_logs(run)
