"""A node answers end disputes in a run with the plain end rule (issue 78, docs/FRAUD_PROOF.md "The node
defends its contributions", "The claim's end"), on py-evm and on anvil.

The run's creator set the toy program and the plain end rule (StepProver ``endRuleOf`` 1); round 1 lists the
run's encoder's coding of the toy's honest ``S - E`` (tests/step_binding_fixtures.py ``toy_end_round``) and
two random contributions. The member that signed the coding runs the node's case defender (its NodeChain, its
ChunkedStates holding round 0's start and round 1's payload pieces, its data directory's reward sources).

What is tested: an outsider's case on that contribution with end disputes of elements of all three state
tensors (W[5] among them, a clamped element of the 2-bit coding) and a challenger that lies at every level of
the step game is dismissed: the node checks its end against its payload, claims, answers every end dispute
with the bit width it reads from its pieces and wins every game; the challengers' and the opener's bonds are
its. A payload one element off (W[5] one ulp: what a tampered payload or a training that is not the program
gives) is found by the node's own check before it claims: it says which element and posts no claim, and the
case overturns the round from its deadline. Default tier: anvil; the py-evm runs and the quant coding's in
the slow tier.
"""

from __future__ import annotations

import logging
import random

import pytest

from ledger.stepproof import PHASES
from node.live.fraud.endcheck import piece_bits
from tests.step_binding_fixtures import end_subject, toy_end_round, toy_origins
from tests.test_case_defense import (
    BACKENDS,
    LIAR,
    OPENER,
    _claim_of,
    _defender,
    _liar,
    _open,
    _play,
    _setup,
)
from tests.test_step_case import _address, _lands_at, _ledger_state, _named
from tests.test_step_proof import _backend

#: End disputes (state tensor, element): x's last, W[5] and W's last, bias's last.
DISPUTED = ((0, 11), (1, 5), (1, 31), (2, 7))
CHALLENGERS = (4, 6, 7, 9)  # dev accounts outside the run, one per end dispute


def _end_run(w3, tmp_path, codec: str, off: int | None = None):
    """The plain-end run over ``toy_end_round(codec, off)``; the coding's subject and its index."""
    round_, blob = toy_end_round(codec, off)
    client, cases, committed, states = _setup(w3, tmp_path, window=600, end_rule=True, round_=round_)
    subject, _pieces = end_subject(committed, blob)
    index = list(committed.states[1].factors.payload_roots).index(subject.payload_root)
    return client, cases, committed, states, subject, index  # member index + 1 signed it


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_node_answers_every_end_dispute_and_the_case_is_dismissed(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states, subject, index = _end_run(w3, tmp_path, "raw")
    stake, node = client.bond, _address(w3, index + 1)
    defender = _defender(committed, states, tmp_path, member=index + 1)
    _open(cases, committed, index=index)
    defender.poll()  # the node checks its end against its payload and claims
    claim_id = _claim_of(client, cases, subject, node)
    games = {}
    for challenger, (q, elem) in zip(CHALLENGERS, DISPUTED):
        account = _address(w3, challenger)
        client._send("challengeEnd", account, claim_id, q, elem, value=stake)
        games[bytes(client.contract.functions.gameIdOf(claim_id, account).call())] = (account, None)
    liar = _address(w3, LIAR)
    client._send("challengeRun", liar, claim_id, value=stake)
    games[bytes(client.contract.functions.gameIdOf(claim_id, liar).call())] = (liar, _liar(random.Random(5)))
    _play(client, defender, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == len(games) * stake
    case = cases.case(subject)
    _lands_at(w3, max(case["ends"] + 1, w3.eth.block_number + 1))
    before = w3.eth.get_balance(node)
    defender.poll()  # dismissed: the opener's bond is the node's, and it withdraws
    assert cases.case(subject)["opener"] == "0x" + "00" * 20
    assert w3.eth.get_balance(node) - before > (len(games) + 1) * stake - 10**16
    assert committed.deployment.client(0).invalid_from(committed.run_id) is None


@pytest.mark.slow
def test_a_quant_coding_is_defended_with_the_bit_width_its_pieces_show(request, tmp_path):
    """The 2-bit coding (most of W clamped): the width named in the first answer on a tensor fixes it for the
    claim; the node names the least width that holds the tensor's codes, which is the encoder's where an
    element is clamped, and answers every dispute."""
    w3 = _backend(request, "anvil")
    client, cases, committed, states, subject, index = _end_run(w3, tmp_path, "quant")
    pieces = states.pieces_of(1, 0, subject.payload_root)
    assert piece_bits(pieces, toy_origins())[1] == 2  # W: the encoder's 2 bits
    stake, node = client.bond, _address(w3, index + 1)
    defender = _defender(committed, states, tmp_path, member=index + 1)
    _open(cases, committed, index=index)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    games = {}
    for challenger, (q, elem) in zip(CHALLENGERS, DISPUTED):
        account = _address(w3, challenger)
        client._send("challengeEnd", account, claim_id, q, elem, value=stake)
        games[bytes(client.contract.functions.gameIdOf(claim_id, account).call())] = (account, None)
    _play(client, defender, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == len(games) * stake


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_payload_one_element_off_is_not_claimed_and_the_case_overturns(request, backend, tmp_path, caplog):
    w3 = _backend(request, backend)
    client, cases, committed, states, subject, index = _end_run(w3, tmp_path, "raw", off=5)
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    defender = _defender(committed, states, tmp_path, member=index + 1)
    case = _open(cases, committed, index=index)[1]
    defender.poll()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "CANNOT DEFEND" in errors[0], errors
    assert "(state tensor 1 element 5: raw piece is not fl(S - E))" in errors[0]
    assert cases.case(subject)["claims"] == 0
    opener = _address(w3, OPENER)
    reader, attesters = _ledger_state(committed)
    _lands_at(w3, case["deadline"])  # the deadline's last block still takes claims: not yet
    assert _named(client, "overturnContribution", opener, cases.key(subject),
                  list(attesters)) == "ProverStepCaseRunning"
    _lands_at(w3, max(case["deadline"] + 1, w3.eth.block_number + 1))
    cases.overturn(opener, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
