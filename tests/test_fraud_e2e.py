"""Issue 43 with real processes: every attester of the quorum colludes, one honest member alone overturns it.

Three node processes on a real anvil, one replica each, a normed run (the default: version 3, chunked roots
with the norm commitment) with k = 2: two of them run tests/adversary.py ``collude-root`` (in round 1 both
change one element of their new weights by one ulp, attest it, sign one record and commit it with their two
signatures: the whole quorum). The third, honest and outside the quorum, derives another weights root, fetches
the state the colluders published under their stage leaf, finds the chunk and sends ``proveWrongAggregation``
itself: the round and every later one become invalid, both colluders are slashed, the honest member is paid
half of the slash, and ``pull`` refuses the round, and ``audit`` prints the proof (checked on chain) and says
the round is already proven. The in-process tier (no node processes, the same parts) is
tests/test_fraud_live.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from eth_utils import keccak

from node.errors import RoundDisputed
from node.tools.audit import audit_run
from node.tools.pull import pull_checkpoint
from node.tools.report import OK
from tests.node_fixtures import TINY, assert_round_1_proven_against_the_colluders, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py"), "collude-root"]
STAKE = 10**18


def _proof_item(report):
    verdict = next(r for r in report.rounds if r.round == 1)
    item = next((c for c in verdict.checks if c.name == "fraud proof"), None)
    assert item is not None and item.status == OK and "already proven on chain" in item.reason, verdict.checks
    assert any(note.startswith("fraud proof (proveWrongAggregation's argument): {") for note in verdict.notes)
    return item


def _logs(slots) -> str:
    return "\n".join(p.read_text() for slot in slots for p in slot.data_dir.glob("node-*.log"))


def _let_round_1s_proof_window_open(client, run_id: int) -> None:
    """Time passes on the chain up to the block where round 1's proof window opens (round 0's can no longer be
    overturned: a proof of 1 waits for it), never past it: a chain that mines only on transactions may not get
    there before the run ends, and mining past the window's close would shut the proof out."""
    if client.commit_count(run_id) < 2:
        return
    opens, _closes = client.proof_window_of(run_id, 1)
    behind = opens - client.w3.eth.block_number
    if behind > 0:
        # anvil_mine, not tests.ledger_fixtures.mine: the nodes' own transactions add blocks meanwhile
        client.w3.provider.make_request("anvil_mine", [hex(min(behind, 4))])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_honest_member_alone_overturns_a_colluding_quorum(make_run, tmp_path):
    run = make_run(replicas=3, stages=1, split=False, settings=[*TINY, "join_timeout=90", "rounds=8"],
                   attest_quorum=2, attest_quorum_bps=0, allow_weak_quorum=True, stake_wei=STAKE)
    honest, colluders = run.nodes[0], run.nodes[1:]
    for slot in colluders:
        slot.command = ADVERSARY
    run.start()
    client = run.client()
    deadline = time.monotonic() + 600
    while client.invalid_from(run.run_id) is None:
        assert time.monotonic() < deadline, "round 1 was never proven wrong\n" + run_logs(run)
        assert run.running(), "every node exited early:\n" + run_logs(run)
        _let_round_1s_proof_window_open(client, run.run_id)
        time.sleep(2.0)
    assert client.invalid_from(run.run_id) == 1, run_logs(run)
    assert client.commitments_of(run.run_id) == 3  # the default: version 3, created so on chain
    honest_account = assert_round_1_proven_against_the_colluders(client, run, honest, colluders)
    logs = _logs([honest])
    assert "proven wrong on chain (stage 0" in logs, logs[-4000:]
    assert "adversary: round 1 stage 0: element 0" in _logs(colluders)
    assert list((honest.data_dir / "proofs").glob("round-00000001-stage0.json"))
    # The prover was paid half of the two stakes slashed: the ledger pays the AggregationProver
    # (ProverRewarded), which pays the proof committed a block before it to its sender (RewardClaimed).
    topic = "0x" + keccak(text="RewardClaimed(uint256,uint64,address,uint256)").hex().removeprefix("0x")
    rewards = client.w3.eth.get_logs({"fromBlock": 0, "topics": [topic]})
    assert len(rewards) == 1
    assert "0x" + bytes(rewards[0]["topics"][3])[-20:].hex() == honest_account.lower()
    # (issue 79) paid from the run's proof fund, which the launcher sized to the prover's gas: half the
    # slash, or the whole fund where that is less
    reward, left = int.from_bytes(bytes(rewards[0]["data"]), "big"), client.proof_fund_of(run.run_id)
    assert reward == min(len(colluders) * STAKE // 2, reward + left) and reward > 0
    # audit prints the proof it would submit, checked on chain (isWrong), and says the round is proven
    # already: its own (its replay, and round 1's checkpoint
    # the colluders published), or the one the honest node kept.
    own = _proof_item(audit_run(client, run.run_id, archives=[honest.data_dir / "archive",
                                                                *[slot.data_dir for slot in colluders]]))
    assert "built from the replay and the round's checkpoint" in own.reason, own
    # Without round 1's checkpoint (the colluders' archives only: their contributions, not their checkpoints),
    # the proof the honest node kept.
    kept = _proof_item(audit_run(client, run.run_id, archives=[honest.data_dir,
                                                                 *[slot.data_dir / "archive"
                                                                   for slot in colluders]]))
    assert "kept by a node's prover" in kept.reason, kept
    # pull refuses the proven round (and what descends from it); round 0 still pulls.
    with pytest.raises(RoundDisputed, match="fraud proof"):
        pull_checkpoint(client, run.run_id, tmp_path / "pulled1", round_index=1, archives=[honest.data_dir],
                        final_only=False)
    pulled = pull_checkpoint(client, run.run_id, tmp_path / "pulled0", round_index=0,
                             archives=[honest.data_dir], final_only=False)
    assert pulled.round == 0
