"""A run claim's start is the round's committed start (issue 78, docs/FRAUD_PROOF.md "The claim's start"), on
py-evm and on anvil: anyone may bond that one element of a claim's first state is not the committed start's
(StepProver.challengeStart, the state tensor and element named); the defender must open it under the claim's
start root and the committed stage chunk that holds it (the run's origin of that tensor, fixed with its
program) within its clock, or the claim is proven wrong.

The round here starts from the toy program's state (tests/step_binding_fixtures.py ``toy_round``): its
committed stage weights are the toy's x, W and bias. A coalition defends a contribution it fabricated with a
true run of the run's program from another start (one weight changed): before the start was bound, that claim
stood against every challenger (each of its steps is right) and the honest case was dismissed; now the honest
challenger names the changed element, the defender cannot open it, the clock decides, and the case overturns
the round. An honest claim from the committed start answers every start dispute.
"""

from __future__ import annotations

import pytest

from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepproof import PHASES, StepProverClient, run_claim, start_opening
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, subject_of, toy_origins, toy_round
from tests.test_step_case import CLOCK, OUTSIDER, WINDOW, _address, _lands_at, _ledger_state, _named, _open
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _run, _start_state, _traces


def _setup(w3):
    """The ledger's StepProver over a run whose round 0 commits the toy's start state and round 1 lists three
    contributions; the run's program is the toy's and its origins the committed stage's tensors."""
    round_ = toy_round()
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=CLOCK,
                       dispute_blocks=WINDOW, inner_steps=TOY_STEPS,
                       before=fix_program(client, None, toy_origins()))
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    return client, CaseClient(client), committed


def _challenge_start(client, claim_id: bytes, challenger: str, q: int, elem: int) -> bytes:
    client._send("challengeStart", challenger, claim_id, q, elem, value=client.bond)
    return bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_coalitions_claim_from_another_start_is_refuted_and_the_case_overturns_the_round(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    stake, origins = client.bond, toy_origins()
    committed_leaves = committed.states[0].weight_leaves
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    subject = subject_of(committed, 0)
    case = _open(w3, cases, outsider, subject)
    # the coalition's claim: a true run of the run's program from a start whose W[5] is changed
    start = _start_state()
    start[1] = start[1].clone()
    start[1].view(-1)[5] += 0.25
    other = _traces(_run(start))
    claim = run_claim(other, subject)
    client._send("claimRun", member, claim, subject.binding, value=stake)
    claim_id = bytes(client.contract.functions.runIdOf(claim, member).call())
    # its start agrees with the committed one elsewhere: a dispute of another element is answered
    game = _challenge_start(client, claim_id, _address(w3, 5), 1, 4)
    client._send("proveStart", member, game, start_opening(other[0], origins, 1, 4, committed_leaves))
    assert client.game(game)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    # the honest challenger names W[5]: no opening of the claim's start gives the committed value
    game = _challenge_start(client, claim_id, outsider, 1, 5)
    opening = start_opening(other[0], origins, 1, 5, committed_leaves)
    assert _named(client, "proveStart", member, game, opening) == "ProverStepBadOpening"
    state = client.game(game)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"])  # the defender's clock's last block: running
    with pytest.raises(RuntimeError):
        client._send("timeout", outsider, game)
    receipt = client._send("timeout", outsider, game)
    assert receipt["blockNumber"] == state["turnSince"] + state["defenderLeft"] + 1
    assert client.wrong(claim_id)
    assert (cases.case(subject)["claims"], cases.case(subject)["refuted"]) == (1, 1)
    reader, attesters = _ledger_state(committed)
    _lands_at(w3, max(case["deadline"], w3.eth.block_number + 1))
    cases.overturn(outsider, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
    assert all(reader.member(committed.run_id, a).status == "slashed" for a in attesters)
    # the opener: its case bond back and the claim's two bonds
    assert client.contract.functions.balanceOf(outsider).call() == 3 * stake


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_an_honest_claim_answers_every_start_dispute(request, backend):
    w3 = _backend(request, backend)
    client, _cases, committed = _setup(w3)
    stake, origins = client.bond, toy_origins()
    committed_leaves = committed.states[0].weight_leaves
    defender = _address(w3, 4)  # not a member: it holds the contribution's inputs
    subject = subject_of(committed, 1)
    honest = _traces(_run(_start_state()))
    claim = run_claim(honest, subject)
    client._send("claimRun", defender, claim, subject.binding, value=stake)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    # a start state tensor past the state is refused; an element past a tensor is answered without opening it
    assert _named(client, "challengeStart", _address(w3, 5), claim_id, 3, 0,
                  value=stake) == "ProverStepBadElement"
    for challenger, (q, elem) in zip((5, 6, 7, 8, 9), ((0, 0), (0, 11), (1, 31), (2, 7), (2, 8))):
        game = _challenge_start(client, claim_id, _address(w3, challenger), q, elem)
        if q == 2 and elem == 7:  # another tensor's chunk of the committed start is refused by name
            wrong = list(start_opening(honest[0], origins, q, elem, committed_leaves))
            wrong[5] = (committed_leaves[0], [])
            assert _named(client, "proveStart", defender, game, tuple(wrong)) == "ProverStepBadOpening"
        opening = start_opening(honest[0], origins, q, elem, committed_leaves)
        client._send("proveStart", defender, game, opening)
        assert client.game(game)["phase"] == PHASES.index("Done")
    assert not client.wrong(claim_id)
    # the defender is paid the five challengers' bonds (its own stays the claim's stake)
    assert client.contract.functions.balanceOf(defender).call() == 5 * stake
