"""Issue 41's takeover tried by a real 2-of-6 coalition: six node processes on a real anvil, the shipped
quorum rule (k 2, half of the counted members), two of them tests/adversary.py ``takeover``. The coalition
wins commit races with one honest signature; the honest nodes attest the rounds it left them out of, so every
ejection, the back door and the coalition's verdict are refused, and the run ends with every honest member
in force and every round the honest one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ledger.account import dev_account
from tests.node_fixtures import TINY, node_state, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py"), "takeover"]


def _logs(slots) -> str:
    return "\n".join(p.read_text() for slot in slots for p in slot.data_dir.glob("node-*.log"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_two_of_six_coalition_cannot_take_the_run(make_run, tmp_path, monkeypatch):
    run = make_run(replicas=6, stages=1, split=False, settings=[*TINY, "join_timeout=90", "rounds=5"],
                   attest_quorum=2, attest_quorum_bps=5000, allow_weak_quorum=False, stake_wei=10**18,
                   inactivity_rounds=2)
    honest, coalition = run.nodes[:4], run.nodes[4:]
    addresses = [dev_account(slot.account, run.chain_id).address for slot in coalition]
    shared = tmp_path / "coalition"
    shared.mkdir()
    monkeypatch.setenv("DLX_COALITION", ",".join(addresses))
    monkeypatch.setenv("DLX_COALITION_DIR", str(shared))
    for slot in coalition:
        slot.command = ADVERSARY
    run.start()
    for slot in honest:
        assert slot.process.wait(timeout=900) == 0, run_logs(run)
    client = run.client()
    history = client.history(run.run_id)
    assert [c.commit.round for c in history.commits] == list(range(5)), run_logs(run)
    for slot in honest:  # every committed record is the honest nodes' own
        roots = node_state(slot)["weights_roots"]
        assert [roots[str(c.commit.round)] for c in history.commits] == \
            [c.commit.weights_root.hex() for c in history.commits], run_logs(run)
    honest_accounts = {dev_account(slot.account, run.chain_id).address for slot in honest}
    for account in honest_accounts:  # nobody honest ejected or slashed
        seat = client.member(run.run_id, account)
        assert seat is not None and seat.status == "active", (account, seat)
    assert not any(m.ejected for m in history.memberships if m.account in honest_accounts)
    attacker = _logs(coalition)
    assert "adversary: committed round" in attacker, attacker[-3000:]
    assert "adversary: eject refused: " in attacker and "adversary: ejected" not in attacker
    assert "adversary: back door refused: " in attacker and "committed a back door" not in attacker
    assert "adversary: slashed" not in attacker
    # The coalition left honest signatures out of its commits: their nodes put them on chain themselves.
    assert "the commit left out this node's signature; attested it on chain" in _logs(honest), run_logs(run)
