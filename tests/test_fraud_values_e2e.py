"""Issue 62 with real processes: a colluding full quorum commits a round the run does not allow, and one
honest member alone overturns it from the factors.

Three node processes on a real anvil, one replica each, a normed run (the default, version 3) created with its
document's values on chain (RunParams' schedule root, Nesterov flag, norm clip, genesis root) and k = 2: two
of them run a move of tests/adversary_collusion.py (the whole quorum), the third is honest and outside the
quorum:

- ``collude-lr``: in round 1 both step with outer lr 7.0 and commit factors that say so, every chunk the outer
  step of those factors (no chunk proof can touch it; before issue 62 the honest node logged the round
  "unprovable"). The honest node opens the factors the colluders serve, finds their lr is not the run's
  schedule's and sends the values proof (proveWrongAggregation over the factors and the schedule leaf);
- ``collude-lr-late``: the same, serving nothing and answering each availability challenge in the last blocks
  of its window: the honest node challenges the factors, its re-entry after its fork waits for that game
  (node/live/peers/lifecycle.py), it follows the late answer to the values proof;
- ``collude-fabricate``: round 1 lists, beside the real contributions, a fabricated one no member signed (a
  non-member's signature, listed as a member): the honest node sends the binding proof (proveWrongNorm over
  the factors alone);
- ``collude-fabricate-own``: the fabricated contribution listed under the non-member's own address and valid
  signature (only the contract's ``memberOf`` tells), rounds 0 and 1 committed back to back (the colluders
  withhold their signatures of round 0 until round 1 is aggregated): the proof waits for round 0's window,
  past round 1's own dispute window, where ProverBinding read no seat before (docs/FRAUD_PROOF.md, "The
  binding").

Each time the honest node commits to its proof a block before sending it: the round and every later one become
invalid, both colluders are slashed, the honest member is paid half of the slash, and it never signs a record
on top of round 1. In process, with the other moves (Nesterov, binding, a non-member's contribution, round 0):
tests/test_fraud_live_values.py; the re-entry's hold: tests/test_reentry_hold.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from eth_utils import keccak

from ledger.availability import FACTORS
from ledger.normproof import SCALES
from tests.adversary_collusion import LATE_MARGIN_BLOCKS
from tests.node_fixtures import TINY, assert_round_1_proven_against_the_colluders, run_logs

ADVERSARY = [sys.executable, str(Path(__file__).resolve().parent / "adversary.py")]
STAKE = 10**18


def _logs(slots) -> str:
    return "\n".join(p.read_text() for slot in slots for p in slot.data_dir.glob("node-*.log"))


#: What the honest node's log says of each move: why the round is wrong, and that it proved it.
FOUND = {"collude-lr": "factors' lr/mu bits", "collude-lr-late": "factors' lr/mu bits",
         "collude-fabricate": "factors list one member's account twice",
         "collude-fabricate-own": "factors list a contributor that held no seat in the round"}
#: The most blocks ``collude-fabricate-own`` leaves between the commits of rounds 0 and 1 (the chain is not
#: mined meanwhile: only the nodes' own transactions add blocks).
BACK_TO_BACK_BLOCKS = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("attack", ["collude-lr", "collude-lr-late", "collude-fabricate",
                                    "collude-fabricate-own"])
def test_one_honest_member_alone_overturns_a_colluding_quorums_wrong_round(make_run, attack):
    """``collude-lr-late`` (tests/adversary_collusion.py): the colluders serve nothing and answer each
    challenge in the last blocks of its window; the honest node's weights left the record (its own aggregate
    stood), and its re-entry from the chain's checkpoint waits until its game on round 1 is over
    (node/live/peers/lifecycle.py): before, its next life held neither the challenge nor its state of round 1,
    and the round stood. ``collude-fabricate``: the colluders list a fourth contribution beside the real
    ones, signed by an account that holds no seat (the binding proof)."""
    run = make_run(replicas=3, stages=1, split=False, settings=[*TINY, "join_timeout=90", "rounds=16"],
                   attest_quorum=2, attest_quorum_bps=0, allow_weak_quorum=True, stake_wei=STAKE)
    honest, colluders = run.nodes[0], run.nodes[1:]
    for slot in colluders:
        slot.command = [*ADVERSARY, attack]
    run.start()
    client = run.client()
    assert client.run_values(run.run_id)["schedule_rounds"] >= 1  # the run binds its schedule
    deadline = time.monotonic() + 600
    while client.invalid_from(run.run_id) is None:
        assert time.monotonic() < deadline, "round 1 was never proven wrong\n" + run_logs(run)
        assert run.running(), "every node exited early:\n" + run_logs(run)
        # Time passes on the chain: round 0's proof window closes (the proof waits for it), a late answer's
        # window runs out. anvil_mine, not tests.ledger_fixtures.mine (which checks the exact count): the
        # nodes' transactions add blocks too. Back to back: nothing mined until round 1 is committed.
        if attack != "collude-fabricate-own" or client.commit_block_of(run.run_id, 1) is not None:
            client.w3.provider.make_request("anvil_mine", ["0x4"])
        time.sleep(2.0)
    assert client.invalid_from(run.run_id) == 1, run_logs(run)
    honest_account = assert_round_1_proven_against_the_colluders(client, run, honest, colluders)
    logs = _logs([honest])
    assert FOUND[attack] in logs and "proven wrong on chain (stage 0" in logs, logs[-4000:]
    kept = json.loads((honest.data_dir / "proofs" / "round-00000001-stage0.json").read_text())["proof"]
    if attack.startswith("collude-fabricate"):
        assert "adversary: round 1 stage 0: listing a fabricated contribution" in _logs(colluders)
        assert kept["kind"] == "norm" and kept["contribution"] == SCALES  # the binding: the factors alone
    else:
        assert "adversary: round 1 stage 0: stepping with outer lr 7.0" in _logs(colluders)
        assert kept["new_weights"] == "0x" and kept["schedule_leaf"] != "0x"  # the values proof: factors only
    if attack == "collude-fabricate-own":
        _assert_back_to_back(client, run)
    if attack == "collude-lr-late":
        _assert_the_late_game(client, run, honest, colluders, honest_account, logs)
    # The prover was paid half of the two stakes slashed at once: the ledger pays the AggregationProver, which
    # pays a proof committed a block before it (commit-reveal) to its sender (RewardClaimed), none held.
    paid = _events(client, "RewardClaimed(uint256,uint64,address,uint256)")
    assert len(paid) == 1 and not _events(client, "RewardEscrowed(uint256,uint64,address,uint256,uint64)")
    assert "0x" + bytes(paid[0]["topics"][3])[-20:].hex() == honest_account.lower()
    # (issue 79) paid from the run's proof fund, sized by the launcher to the prover's gas: half the slash, or
    # the whole fund where that is less
    reward, left = int.from_bytes(bytes(paid[0]["data"]), "big"), client.proof_fund_of(run.run_id)
    assert reward == min(len(colluders) * STAKE // 2, reward + left) and reward > 0
    # It never signed a record on top of the wrong round 1.
    state = json.loads((honest.data_dir / "state.json").read_text())
    assert all(int(r) <= 1 for r in state.get("signed_records", {})), state.get("signed_records")


def _assert_back_to_back(client, run) -> None:
    """Rounds 0 and 1 were committed at most BACK_TO_BACK_BLOCKS apart, and the proof landed after round 1's
    own dispute window (where the seats were not read before)."""
    first, second = (client.commit_block_of(run.run_id, r) for r in (0, 1))
    assert 0 < second - first <= BACK_TO_BACK_BLOCKS, (first, second)
    (proven,) = _events(client, "ProverRewarded(uint256,uint64,address,uint256)")
    assert proven["blockNumber"] >= second + client.run_struct(run.run_id)["disputeBlocks"], (proven, second)


def _events(client, signature: str, *topics) -> list:
    topic = "0x" + keccak(text=signature).hex().removeprefix("0x")
    return client.w3.eth.get_logs({"fromBlock": 0, "topics": [topic, *topics]})


def _assert_the_late_game(client, run, honest, colluders, honest_account: str, logs: str) -> None:
    """The honest node challenged the withheld factors of round 1 (its game: one step, the values proof needs
    nothing else), each step was answered in the last blocks of its window, and its re-entry waited for the
    game (then the round was overturned: no re-entry at all)."""
    assert "no attester serves them; challenging their availability on chain" in logs, logs[-4000:]
    assert "answered late" in _logs(colluders)
    assert "the re-entry waits until that game is over" in logs, logs[-4000:]
    assert "was overturned on chain: the record this node left is gone" in logs, logs[-4000:]
    steps = [c for c in client.availability_challenges(run.run_id, 0)
             if c["round"] == 1 and c["challenger"].lower() == honest_account.lower()]
    assert steps and all(c["which"] == FACTORS for c in steps), steps
    assert client.game_of(run.run_id, 1, 0, honest_account)["steps"] == len(steps)
    for challenge in steps:
        (answer,) = _events(client, "AvailabilityAnswered(bytes32,bytes,bytes32[],address)",
                            "0x" + bytes(challenge["id"]).hex())
        assert challenge["deadline"] - LATE_MARGIN_BLOCKS < answer["blockNumber"] < challenge["deadline"], \
            (answer["blockNumber"], challenge["deadline"])
    state = json.loads((honest.data_dir / "state.json").read_text())
    assert 1 not in state.get("reentered_for", []), state.get("reentered_for")
