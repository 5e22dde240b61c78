"""A run claim (StepProver.claimRun, issue 78) is bound to the ledger's record, on py-evm and on anvil: it
names a contribution's payload root that its round's committed record lists for its stage and the weights
root the round starts from (contracts/src/StepProverBinding.sol). An outsider's claim about a made-up
contribution, a wrong index, a start state the record does not hold, or a record never committed is refused
by name; anyone may defend a contribution the record lists. A front-runner that copies a challenge from the
mempool gets a game of its own beside the copied one (a run claim takes any number at once, one per
challenger): it cannot take the honest challenger's game. If it walks away its bond goes to the defender
one block past its clock (not in the clock's last block) and the honest game goes on; if it plays the
honest moves and refutes the claim first it is paid both bonds, and the honest challenger, which refutes it
too, gets its own bond back (the defender's is spent).
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger.account import dev_account
from ledger.stepproof import PHASES, run_claim, run_game, state_roots
from tests.chain_backends import GAS, one_block
from tests.ledger_fixtures import mine
from tests.step_binding_fixtures import bound_prover, subject_of
from tests.test_step_proof import BOND, CLOCK, _backend
from tests.test_step_proof_run import _honest_policy, _refused, _run, _start_state, _traces

OUTSIDER = 8  # a dev account that never joins the run


def _binding(subject, **changes):
    """``subject``'s RunBinding with fields replaced (record, stageLeaf, stagePath, factors, index, ...)."""
    names = ("record", "stageLeaf", "stagePath", "factors", "index", "prevRecord", "prevStageLeaf",
             "prevStagePath", "replica")
    fields = dict(zip(names, subject.binding))
    fields.update(changes)
    return tuple(fields[name] for name in names)


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_an_outsiders_claims_about_what_the_record_does_not_hold_are_refused(request, backend):
    w3 = _backend(request, backend)
    client, committed = bound_prover(w3, BOND, CLOCK)
    outsider = dev_account(OUTSIDER, w3.eth.chain_id).address
    traces = _traces(_run(_start_state()))
    subject = subject_of(committed, 1)
    made_up = dataclasses.replace(subject, payload_root=b"\x13" * 32)
    assert _refused(client, "claimRun", outsider, run_claim(traces, made_up), made_up.binding,
                    value=BOND) == "ProverStepNotListed"
    # a listed root named at another contribution's index
    assert _refused(client, "claimRun", outsider, run_claim(traces, subject), _binding(subject, index=2),
                    value=BOND) == "ProverStepNotListed"
    # a start the record does not hold: round 1's own weights (its end), not round 0's
    ended = dataclasses.replace(subject, start_weights=committed.stages[1][0].weights_root)
    assert _refused(client, "claimRun", outsider, run_claim(traces, ended), ended.binding,
                    value=BOND) == "ProverStepWrongStart"
    # a record that was never committed (its loss changed)
    forged = list(subject.binding[0])
    forged[5] += 1
    assert _refused(client, "claimRun", outsider, run_claim(traces, subject),
                    _binding(subject, record=tuple(forged)), value=BOND) == "ProverNotCommitted"
    # round 1's own record given as the start's (round 0's) record
    assert _refused(client, "claimRun", outsider, run_claim(traces, subject),
                    _binding(subject, prevRecord=subject.binding[0]), value=BOND) == "ProverBadRecords"
    assert client.contract.functions.balanceOf(outsider).call() == 0
    # anyone may defend a contribution the record lists, from the round's start
    claim = run_claim(traces, subject)
    client._send("claimRun", outsider, claim, subject.binding, value=BOND)
    claim_id = bytes(client.contract.functions.runIdOf(claim, outsider).call())
    assert client.contract.functions.claimOf(claim_id).call()[0] == outsider
    events = client.contract.events.RunClaimed().get_logs(from_block=0)
    assert [(e.args.runId, e.args.round, e.args.stage, e.args.payloadRoot) for e in events] == [
        (committed.run_id, 1, 0, subject.payload_root)]


def _copied_in_one_block(w3, client, claim_id: bytes, first: int, second: int) -> list[int]:
    """``first`` (the front-runner, the higher tip) and ``second`` send the same challengeRun in one block;
    their receipts' statuses."""
    data = bytes.fromhex(client.contract.encode_abi("challengeRun", args=(claim_id,))[2:])
    hashes = []
    with one_block(w3):
        base = w3.eth.get_block("latest")["baseFeePerGas"]
        for position, index in enumerate((first, second)):
            account = dev_account(index, w3.eth.chain_id)
            tip = (2 - position) * 10**9
            tx = {"to": client.contract.address, "data": data, "value": BOND, "gas": GAS, "type": 2,
                  "chainId": w3.eth.chain_id, "nonce": w3.eth.get_transaction_count(account.address),
                  "maxPriorityFeePerGas": tip, "maxFeePerGas": 2 * base + tip}
            hashes.append(w3.eth.send_raw_transaction(account.sign_transaction(tx).raw_transaction))
    receipts = [w3.eth.get_transaction_receipt(h) for h in hashes]
    assert receipts[0]["blockNumber"] == receipts[1]["blockNumber"]
    return [r["status"] for r in receipts]


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_front_runners_copied_challenge_is_its_own_game_and_it_loses_its_bond_when_it_walks_away(
        request, backend):
    w3 = _backend(request, backend)
    client, committed = bound_prover(w3, BOND, CLOCK)
    defender = dev_account(1, w3.eth.chain_id).address
    honest, front = 4, 5
    honest_address, front_address = (dev_account(i, w3.eth.chain_id).address for i in (honest, front))
    traces = _traces(_run(_start_state()))
    subject = subject_of(committed, 0)
    claim = run_claim(traces, subject)
    client._send("claimRun", defender, claim, subject.binding, value=BOND)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    assert _copied_in_one_block(w3, client, claim_id, front, honest) == [1, 1]
    games = [bytes(client.contract.functions.gameIdOf(claim_id, a).call())
             for a in (front_address, honest_address)]
    assert [client.game(g)["challenger"] for g in games] == [front_address, honest_address]
    game = games[0]
    client._send("postStateRoot", defender, game, state_roots(traces)[3])
    # the front-runner does not answer: in the last block of its clock the game still runs
    state = client.game(game)
    mine(w3, state["turnSince"] + state["challengerLeft"] - 1 - w3.eth.block_number)
    assert _refused(client, "timeout", honest_address, game) == "ProverStepClockRunning"
    client._send("timeout", honest_address, game)  # one block later
    assert client.game(game)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == BOND
    assert client.contract.functions.balanceOf(front_address).call() == 0
    # the honest challenger's own game was never the front-runner's to hold
    assert client.game(games[1])["phase"] == PHASES.index("Steps")


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_front_runner_that_plays_the_honest_moves_is_paid_as_an_honest_challenger(request, backend):
    w3 = _backend(request, backend)
    client, committed = bound_prover(w3, BOND, CLOCK)
    defender = dev_account(1, w3.eth.chain_id).address
    honest, front = 4, 5
    honest_address, front_address = (dev_account(i, w3.eth.chain_id).address for i in (honest, front))
    truth, cheat = _run(_start_state()), _run(_start_state(), 3, 1)  # a one-ulp cheat in step 3's add
    subject = subject_of(committed, 2)
    claim = run_claim(_traces(cheat), subject)
    client._send("claimRun", defender, claim, subject.binding, value=BOND)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    assert _copied_in_one_block(w3, client, claim_id, front, honest) == [1, 1]
    truth_roots = state_roots(_traces(truth))
    for challenger in (front_address, honest_address):  # the front-runner's game ends first
        won, _moves = run_game(client, _traces(cheat), defender, challenger, subject=subject, claimed=True,
                               challenged=True, judge_state=lambda i, root: root == truth_roots[i],
                               step_policy=_honest_policy(truth, cheat))
        assert not won and client.wrong(claim_id)
    assert client.contract.functions.balanceOf(front_address).call() == 2 * BOND
    assert client.contract.functions.balanceOf(honest_address).call() == BOND  # its own bond back
    assert client.contract.functions.balanceOf(defender).call() == 0
    # a claim proven wrong stays wrong: a late challenge is refused
    late = dev_account(6, w3.eth.chain_id).address
    assert _refused(client, "challengeRun", late, claim_id, value=BOND) == "ProverStepClaimClosed"
