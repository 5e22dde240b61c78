"""A fork that cannot be re-based in place: the re-entry fallback (real processes).

test_fork_recovery_e2e.py shows a forked member re-basing in place. This shows the fallback:

- the fallback (node/live/peers/lifecycle.py): a member that applied a later round on its forked weights
  before the chain's record of the forked round came cannot re-base; it must stop, start again in the
  same process (``dlx-node start``'s re-entry) from the chain's latest checkpoint, and contribute
  again with every root equal to the chain's (``diverge-late`` in tests/adversary.py).

A forked member's rounds around an in-place re-base under re-execution (its round trained on its forked
apply is left out by every holder, the audit with --reexecute all passes) are tested in
test_fork_recovery_e2e.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from node_fixtures import KEEP_ALL, TINY, node_state, run_logs

from node.tools.audit import OK, audit_run

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]


def _log(slot) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))


# 3 replicas, 12 rounds and a re-entry: several minutes on a loaded machine (run with -m slow)
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_fork_found_too_late_re_enters_from_the_chain_and_contributes_again(make_run):
    rounds = 12
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, *KEEP_ALL, "join_timeout=60", f"rounds={rounds}",
                             "diloco.inner_steps=40"])
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
    restored = re.search(r"restored stages \[[\d, ]+\] from the chain-verified checkpoint of round (\d+)",
                         second_life)
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
    # Its rounds trained on the forked round 2 (its round 3 after the mid-round apply, and any later one
    # sent before it stopped) were left out by every holder; what it sealed off the record was set aside
    # when it re-entered, so the audit rerunning every contribution from every archive passes.
    assert re.search(r"rounds \[\d+(, \d+)*\] of the archive set aside", log), log[-4000:]
    report = audit_run(run.client(), run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert report.ok, [c.line() for c in report.all_checks() if c.status != OK]
    replica = forked.status()["placement"]["replica"]
    reruns = {c.name: c.reason for c in report.all_checks() if c.name.startswith("re-execution of round")}
    assert "not a rerun of the record" in reruns[f"re-execution of round 3 replica {replica}"], reruns
