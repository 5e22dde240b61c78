"""Re-execution spot checks in a sliced run (``diloco.exchange = "sliced"``): real anvil, real node processes.

A member whose slices are not what its start state produces (``tests/sliced_adversary.py
slices-sign-flip``: every slice of its bundle negated and re-encoded; each slice's norm is the honest
one, so the per-slice norm rule lets it through) is rerun by the others against the slices its signed
reference binds (node/live/checks/sliced_rerun.py), accused, found guilty by the quorum, slashed and removed;
the honest members rerun each other bit for bit and nobody accuses them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from node_fixtures import KEEP_ALL, TINY, run_logs

from ledger.account import dev_account
from node.tools.audit import FAIL, OK, audit_run

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "sliced_adversary.py")]
#: An upper bound only: the run is stopped once the cheater is out and a round went on without it.
MAX_ROUNDS = 100


def _logs(slots) -> str:
    return "\n".join(p.read_text() for slot in slots for p in slot.data_dir.glob("node-*.log"))


def _wait_for(predicate, timeout: float, what: str, run) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s\n" + run_logs(run)
        time.sleep(2.0)


@pytest.mark.slow  # about 2 min on a quiet machine; the reruns themselves: tests/test_sliced_reexec.py
@pytest.mark.timeout(1800)
def test_a_member_whose_slices_its_state_does_not_produce_is_rerun_accused_and_ejected(make_run):
    # spot_checks=8 with 3 members: every node reruns every other replica's contribution of every round.
    run = make_run(replicas=3, stages=1, split=False, attest_quorum=2,
                   settings=[*TINY, *KEEP_ALL, "join_timeout=60", f"rounds={MAX_ROUNDS}", "spot_checks=8",
                             "diloco.exchange=sliced", "p2p.transfer_timeout=20"])
    cheater = run.nodes[-1]
    cheater.command = [*ADVERSARY, "slices-sign-flip"]
    run.start()
    honest = run.nodes[:-1]
    assert cheater.process.wait(timeout=900) == 6, run_logs(run)  # removed: "not registered"
    client = run.client()

    def a_round_without_the_cheater() -> bool:
        assert all(s.process.poll() is None for s in honest), "an honest node exited:\n" + run_logs(run)
        return any(c.commit.num_contributors == 2 for c in client.history(run.run_id).commits)

    _wait_for(a_round_without_the_cheater, 600, "a round committed without the cheater", run)
    run.stop_nodes()
    for slot in honest:
        assert slot.process.returncode == 0, run_logs(run)

    history = client.history(run.run_id)
    cheater_account = dev_account(cheater.account, client.chain_id).address.lower()
    honest_accounts = {dev_account(s.account, client.chain_id).address.lower() for s in honest}
    # Accusations name only the cheater; a guilty verdict signed by both honest members slashed it.
    assert {a.accused.lower() for a in history.accusations} == {cheater_account}, run_logs(run)
    guilty = [a for a in history.accusations if a.guilty]
    assert guilty and {s.lower() for s in guilty[0].signers} == honest_accounts, run_logs(run)
    assert [s.account.lower() for s in history.slashings] == [cheater_account]
    # The honest members reran each other against the slices their references bind, bit for bit, and the
    # cheater's reruns did not reproduce its slices.
    for slot in honest:
        lines = [line for line in _logs([slot]).splitlines() if "spot check of replica" in line]
        assert any(": exact (" in line for line in lines), slot.name + "\n" + "\n".join(lines)
        assert any(": mismatch (" in line for line in lines), slot.name + "\n" + "\n".join(lines)
    # The audit reruns every sliced contribution from the archives (the members' bundles): the honest ones
    # reproduce bit for bit; the cheater's do not, and since the chain found it guilty the run caught it;
    # its ejection stands (the evidence's rerun fails too).
    report = audit_run(client, run.run_id, archives=[s.data_dir for s in run.nodes], reexecute=-1)
    assert not [c.line() for c in report.general if c.status == FAIL], report.general
    reruns = [c for c in report.general if c.name.startswith("re-execution of round")]
    caught = [c for c in reruns if "does not reproduce" in c.reason]
    assert caught and all(c.status == OK and "found guilty on chain" in c.reason for c in caught), reruns
    assert any(c.reason.startswith("reproduced (exact") for c in reruns), reruns
    ejection = [c for c in report.general if c.name.startswith(f"ejection of {guilty[0].accused}")]
    assert ejection and all(c.status == OK and "does not reproduce" in c.reason for c in ejection), \
        report.general
