"""Forks that cannot be re-based in place, and a forked member's contributions under re-execution (real processes).

test_fork_recovery_e2e.py shows a forked member re-basing in place. Two things it does not show:

- the fallback (node/live/lifecycle.py): a member that applied a later round on its forked weights
  before the chain's record of the forked round came cannot re-base; it must stop, start again in the
  same process (``dlx-node start``'s re-entry) from the chain's latest checkpoint, and contribute
  again with every root equal to the chain's (``diverge-late`` in tests/adversary.py);
- re-execution of a forked member's contributions: those trained before its re-base start from its
  forked weights, honestly. Every member reruns every other replica's contribution (``spot_checks``
  high) and the audit reruns them all from the archives: none should be judged a cheat, no member
  accused, and the start-state chain across the fork and the re-base should hold or be judged
  "restarted from the record" (``diverge-once``). It does not yet: see the xfail below.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from node_fixtures import TINY, node_state, run_logs

from node.tools.audit import OK, audit_run

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]


def _log(slot) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))


@pytest.mark.slow  # 3 replicas, 12 rounds and a re-entry: several minutes on a loaded machine (run with -m slow)
@pytest.mark.timeout(1200)
def test_a_fork_found_too_late_re_enters_from_the_chain_and_contributes_again(make_run):
    rounds = 12
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40"])
    forked = run.nodes[-1]
    forked.command = [*ADVERSARY, "diverge-late"]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=1100) == 0, run_logs(run)
    history = run.client().history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = _log(forked)
    assert "adversary: round 2 stage 0 aggregated without the close's first 2 entries" in log
    assert "adversary: applying round 3 without waiting for the chain's record of round 2" in log
    # It could not re-base in place: it stopped and started again (same process) from the chain.
    assert "starting again from the chain's latest checkpoint" in log, log[-6000:]
    state = node_state(forked)
    assert state.get("reentered_for") and set(state["reentered_for"]) <= {2, 3}, state.get("reentered_for")
    assert "rebased" not in state
    second_life = log.split("starting again from the chain's latest checkpoint", 1)[1]
    restored = re.search(r"restored stages \[[\d, ]+\] from the chain-verified checkpoint of round (\d+)", second_life)
    assert restored, second_life[-4000:]
    entered = int(re.search(r"entering at round (\d+)", second_life).group(1))
    assert int(restored.group(1)) >= 2 and entered < rounds, (restored.group(0), entered)
    assert "Traceback" not in log
    # From its new entry on, it holds the chain's roots, and its contributions are in the records again.
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        later = [c for c in commits if c.commit.round >= entered]
        assert [roots.get(str(c.commit.round)) for c in later] == \
            [c.commit.weights_root.hex() for c in later], (slot.name, run_logs(run))
    assert commits[entered].commit.num_contributors == 3, run_logs(run)
    assert not history.accusations, run_logs(run)
    # Round 2 was its own local fault (its close gives the record), and round 3 was computed on round 2's
    # forked weights: neither is a difference of the record's to dispute.
    assert not history.disputes, run_logs(run)


# Known failing (issue 30, found by this test): with the overlap (the default schedule at H=40), the forked
# member applies its forked round 2 in the middle of round 3's training, and its round 3 contribution is
# announced before the chain's verdict of round 2: rerun from its start state with the record's round 2, it
# does not reproduce (relative distance 0.35), so `audit --reexecute all` FAILS it and a spot check drawing
# it would accuse an honest member. What would fix it: withhold a contribution whose training used a round
# the peers attested differently until that round's verdict, and drop it if the round forked.
@pytest.mark.xfail(strict=True, reason="a forked member's round trained on its forked apply does not rerun")
@pytest.mark.slow  # 3 replicas that each rerun the others' every round: several minutes (run with -m slow)
@pytest.mark.timeout(1500)
def test_a_forked_members_contributions_before_its_re_base_rerun_exactly(make_run):
    rounds = 7
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, "join_timeout=60", f"rounds={rounds}", "diloco.inner_steps=40",
                             "spot_checks=4"])
    forked = run.nodes[-1]
    forked.command = [*ADVERSARY, "diverge-once"]
    run.start()
    for slot in run.nodes:
        assert slot.process.wait(timeout=1300) == 0, run_logs(run)
    client = run.client()
    history = client.history(run.run_id)
    commits = history.commits
    assert [c.commit.round for c in commits] == list(range(rounds)), run_logs(run)
    log = _log(forked)
    assert "re-based stage(s) [0] on the committed record" in log, log[-4000:]
    assert node_state(forked)["rebased"] == [2]
    forked_replica = forked.status()["placement"]["replica"]
    # No member judged any contribution a cheat nor found a broken start-state link: the forked member's
    # rounds trained from its forked weights (before the re-base) rerun from the states they bind.
    checked: dict[str, set[int]] = {}
    for slot in run.nodes:
        text = _log(slot)
        verdicts = re.findall(r"spot check of replica (\d+) round (\d+): (\w+)", text)
        assert {v for _r, _round, v in verdicts} <= {"exact"}, (slot.name, verdicts)
        assert "follows neither from the rerun" not in text, slot.name
        assert "failed its spot check" not in text, slot.name
        checked[slot.name] = {int(r) for replica, r, _v in verdicts if int(replica) == forked_replica}
    assert not history.accusations, run_logs(run)
    # The audit reruns every contribution from the archives, the forked member's rounds 2-4 included.
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    reruns = {c.name for c in report.all_checks()
              if c.name.startswith("re-execution of round") and c.status == OK and "exact" in c.reason}
    around_the_fork = {f"re-execution of round {r} replica {forked_replica}" for r in (2, 3, 4)}
    assert around_the_fork <= reruns, (sorted(around_the_fork - reruns), checked)
