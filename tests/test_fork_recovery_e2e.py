"""A member whose weights left the run's committed record re-bases on it and trains on (real processes).

A fork (docs/PROTOCOL.md, "When a node's weights leave the record") leaves a member with weights
the quorum did not commit: every later round of its would disagree too. node/live/record/forkrepair.py
re-derives the committed round from its contributions, re-bases the member on it in place (no
restart, no re-entry from a checkpoint) and keeps its dispute only if its own computation stood.

- ``fork-close`` (tests/adversary.py): in round 2 the member takes another close (the accepted
  one without its first entry) and aggregates it correctly: it disputes with its signed record.
- ``diverge-once``: in round 2 the member's sum leaves an entry of its own close out (a local
  fault): its close gives the record's result, so it does not dispute.

Either way it re-bases on round 2's record before it applies round 3 (it applies round 3 only once round 2
stands: its own result of round 2 is never confirmed by a quorum of attestations, so it waits for the chain's
verdict, whenever the peers' attestations and the record come), and from round 2 on every member holds the
chain's roots. With the overlap (H=40: 4 steps) its round 3 applied its forked round 2
mid-round: that contribution binds the forked result (``applied_hash``), so every holder leaves it out of
round 3; its round 4 started on the forked state before the re-base, so it is never announced; it
contributes again from round 5. The last test reruns everything (every member's spot checks and the
audit's ``--reexecute all``): nobody is judged a cheat and the audit passes.
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
    # Round 3 holds its contribution left out (built on its forked round 2), round 4 none (trained on the
    # forked state before the re-base), every later round all three.
    assert commits[3].commit.num_contributors == 3 and commits[4].commit.num_contributors == 2, run_logs(run)
    assert all(c.commit.num_contributors == 3 for c in commits if c.commit.round >= 5), run_logs(run)
    assert "round 4: not contributed: trained on a result this node re-based away from" in log
    assert not history.accusations, run_logs(run)


def _left_out(slot, run_id: int, outer_round: int) -> list[list]:
    """The entries a node's archive sealed as left out of ``outer_round`` for being built on another
    result."""
    manifest = slot.data_dir / "archive" / f"run-{run_id}" / f"round-{outer_round:08d}" / "round.json"
    if not manifest.exists():
        return []
    return [e for e in json.loads(manifest.read_text()).get("excluded", []) if e[4] == "other_result"]


@pytest.mark.slow  # 3 replicas that each rerun the others' every round: several minutes (run with -m slow)
@pytest.mark.timeout(1500)
def test_a_forked_members_rounds_rerun_or_are_left_out_and_the_audit_with_every_rerun_passes(make_run):
    """It heals in place whenever the peers' attestations and the chain's record come: it applies round 3 only
    once round 2 stands (node/live/record/forkrepair.py ``ForkRepair.due``), and its round 2 is never
    confirmed by a quorum of attestations."""
    rounds = 7
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40",
                             "diloco.overlap_steps=4", "spot_checks=4"])
    forked, honest = run.nodes[-1], run.nodes[:-1]
    forked.command = [*ADVERSARY, "diverge-once"]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=1300) == 0, run_logs(run)
    client = run.client()
    history = client.history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = "\n".join(p.read_text() for p in forked.data_dir.glob("node-*.log"))
    assert "adversary: round 2 stage 0 aggregated without the close's first entry" in log
    replica = forked.status()["placement"]["replica"]
    assert "re-based stage(s) [0] on the committed record" in log, log[-4000:]
    assert node_state(forked)["rebased"] == [2] and "reentered_for" not in node_state(forked)
    assert "round 4: not contributed: trained on a result this node re-based away from" in log
    healed = 2  # its roots are the chain's from round 2 on
    # Its round 3 (trained on its forked round 2 after the mid-round apply) is left out by every honest
    # holder, and so is any later round it sent before healing;
    # nothing else is ever left out as built elsewhere.
    left = [sorted((r, int(e[1])) for r in range(rounds) for e in _left_out(slot, run.run_id, r))
            for slot in honest]
    assert left[0] == left[1] and (3, replica) in left[0], left
    assert all(who == replica and r < max(healed, 5) for r, who in left[0]), left
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        later = [c for c in commits if c.commit.round >= healed]
        assert [roots.get(str(c.commit.round)) for c in later] == \
            [c.commit.weights_root.hex() for c in later], (slot.name, run_logs(run))
        # No member judged any contribution a cheat nor found a broken start-state link.
        text = "\n".join(p.read_text() for p in slot.data_dir.glob("node-*.log"))
        verdicts = re.findall(r"spot check of replica (\d+) round (\d+): (\w+)", text)
        assert {v for _r, _round, v in verdicts} <= {"exact"}, (slot.name, verdicts)
        assert "follows neither from the rerun" not in text, slot.name
    assert not history.accusations, run_logs(run)
    # The audit reruns every contribution from the archives: the forked member's rounds reproduce exactly,
    # except those built on its forked result, reported as such and left out of their rounds.
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    checks = {c.name: c.reason for c in report.all_checks() if c.name.startswith("re-execution of round")}
    mine = {int(re.search(r"round (\d+)", name).group(1)): reason for name, reason in checks.items()
            if name.endswith(f"replica {replica}")}
    elsewhere = {r for r, reason in mine.items() if "not a rerun of the record" in reason}
    assert elsewhere == {r for r, who in left[0]}, mine
    assert all("exact" in reason for r, reason in mine.items() if r not in elsewhere), mine
    assert {0, 1, 2} <= set(mine) and any(r > 3 for r in set(mine) - elsewhere), mine
