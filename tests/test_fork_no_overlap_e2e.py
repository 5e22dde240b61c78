"""Without the overlap, a round begun on a forked result is never announced, whenever the verdict comes (real
processes).

docs/PROTOCOL.md, "The rounds a fork touched". With the one-step delay and no overlap
("rebase", ``diloco.overlap_steps=0``) round t+2 starts from a state that holds round t's result
and applies nothing before its encode: it binds no applied result (``applied_hash`` is zero), so
nothing but the member itself keeps a round begun on its forked round t out of the record. Before,
it was withheld only if the chain's verdict of round t came before its encode; announced later, a
spot check drawing it found its start state off the record (``state_mismatch``) and would accuse an
honest member, and ``audit --reexecute all`` failed it.

Here the forked member (``diverge-slow-verdict`` in tests/adversary.py: the ``diverge-once`` fault,
and the chain's verdict of round 2 reaches it only once its round 4 is encoded, whatever the load) must hold
round 4's announcement until the verdict (node/live/record/forkrepair.py ``ForkRepair.announceable``: its
round 2 is not confirmed by a quorum of attestations) and then withhold it; it re-bases in place
before it applies round 3 (``ForkRepair.due`` waits for the same verdict), nobody is accused, every
member reruns every other replica's rounds exactly, every node's roots are the chain's from round 2
on, and the audit rerunning every contribution passes.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

from node.tools.audit import OK, audit_run

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]


def _log(slot) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))


def _excluded(slot, run_id: int, outer_round: int) -> list[list]:
    manifest = slot.data_dir / "archive" / f"run-{run_id}" / f"round-{outer_round:08d}" / "round.json"
    return json.loads(manifest.read_text()).get("excluded", []) if manifest.exists() else []


# 3 replicas that each rerun the others' every round, and a 60 s round deadline (run with -m slow)
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_without_the_overlap_a_round_begun_on_a_forked_result_is_withheld_whenever_the_verdict_comes(
    make_run):
    rounds = 7
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40",
                             "diloco.overlap_steps=0", "spot_checks=4"])
    forked, honest = run.nodes[-1], run.nodes[:-1]
    forked.command = [*ADVERSARY, "diverge-slow-verdict"]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=1300) == 0, run_logs(run)
    client = run.client()
    history = client.history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = _log(forked)
    assert "adversary: round 2 stage 0 aggregated without the close's first entry" in log
    assert "adversary: the chain's verdict of round 2 reaches this node only after it encoded round 4" in log
    # Round 4 (begun on the forked round 2) waited for the
    # verdict, then was withheld; the node re-based in place.
    assert re.search(r"round 2: [^\n]*; waiting for the chain's record before announcing round 4", log), \
        log[-6000:]
    assert "round 4: not contributed: trained on a result this node re-based away from" in log
    assert "re-based stage(s) [0] on the committed record" in log, log[-6000:]
    state = node_state(forked)
    assert state["rebased"] == [2] and "reentered_for" not in state, state
    assert "Traceback" not in log
    assert not history.disputes, run_logs(run)  # its own close gives the record: a local fault
    # Round 4 closed without it; every other round holds
    # all three (round 3 started from the record's round 1).
    assert [c.commit.num_contributors for c in commits] == [3, 3, 3, 3, 2, 3, 3], run_logs(run)
    replica = forked.status()["placement"]["replica"]
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        later = [c for c in commits if c.commit.round >= 2]
        assert [roots.get(str(c.commit.round)) for c in later] == \
            [c.commit.weights_root.hex() for c in later], (slot.name, run_logs(run))
        text = _log(slot)
        verdicts = re.findall(r"spot check of replica (\d+) round (\d+): (\w+)", text)
        assert {v for _r, _round, v in verdicts} <= {"exact"}, (slot.name, verdicts)
        assert "follows neither from the rerun" not in text, slot.name
    # Nothing without the overlap binds an applied result: no holder leaves anything out as built elsewhere.
    assert not [e for slot in honest for r in range(rounds) for e in _excluded(slot, run.run_id, r)
                if e[4] == "other_result"]
    assert not history.accusations, run_logs(run)
    # Every contribution reruns exactly from the archives,
    # the forked member's included (it announced no round 4).
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    checks = {c.name: c.reason for c in report.all_checks() if c.name.startswith("re-execution of round")}
    mine = {int(re.search(r"round (\d+)", name).group(1)): reason for name, reason in checks.items()
            if name.endswith(f"replica {replica}")}
    assert 4 not in mine and {0, 1, 2, 3, 5} <= set(mine), mine
    assert all("exact" in reason for reason in mine.values()), mine
