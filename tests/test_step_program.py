"""A run's step program (issue 78, docs/FRAUD_PROOF.md "The run's program"), on py-evm and on anvil: a run
claim must be about the run's own program (fixed once by the run's creator before its first commit,
StepProver.setProgram) run for the run's H inner steps, so a coalition cannot defend a fabricated contribution
with a consistent claim about another computation; a run without a program takes no claim and no case (a case
nobody could answer would overturn any round).

Before the program was bound, both coalition claims below were taken and stood (each is a true computation,
so no challenger refutes it), and the outsider's case against the fabricated contribution was dismissed.
"""

from __future__ import annotations

import pytest

from ledger.stepcase import case_claim
from ledger.stepproof import StepTrace, program_hash, run_claim
from tests.step_binding_fixtures import STAKE, TOY_STEPS, honest_round, subject_of, toy_program
from tests.test_step_case import OUTSIDER, SALT, _address, _lands_at, _ledger_state, _named, _open, _setup
from tests.test_step_proof import ADD, COPIES, PROGRAM, SUB, _backend
from tests.test_step_proof_run import _run, _start_state, _traces
from tests.fraud_fixtures import commit
from training.step_trace import element_leaves, run_op

#: Another computation over the same state: the toy's update adds instead of subtracting (W' = W + z).
OTHER = [(ADD, *spec[1:]) if spec[0] == SUB else spec for spec in PROGRAM]


def _other_traces(state, steps: int) -> list[StepTrace]:
    """A true run of ``OTHER`` (each op computed honestly, its state fed back): a consistent claim."""
    traces = []
    for _ in range(steps):
        tensors = [t.reshape(-1) for t in state]
        for kind, rows, inner, cols, _al, _bl, ai, bi in OTHER:
            tensors.append(run_op(kind, rows, inner, cols, tensors[ai], tensors[bi]))
        traces.append(StepTrace([element_leaves(t) for t in tensors], OTHER, COPIES, 3))
        state = [tensors[c] for c in COPIES]
    return traces


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_coalition_cannot_defend_a_fabricated_contribution_with_another_computation(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    stake = client.bond
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    subject = subject_of(committed, 0)  # the coalition (members 1 and 2) listed it; nobody can defend it
    case = _open(w3, cases, outsider, subject)
    other = run_claim(_other_traces(_start_state(), TOY_STEPS), subject)
    assert program_hash(other) != client.program_of(committed.run_id)
    fewer = run_claim(_traces(_run(_start_state()))[:TOY_STEPS - 1], subject)  # H - 1 steps
    more = (*fewer[:6], TOY_STEPS + 1, *fewer[7:])
    assert _named(client, "claimRun", member, other, subject.binding, value=stake) == "ProverStepWrongProgram"
    assert _named(client, "claimRun", member, fewer, subject.binding, value=stake) == "ProverStepWrongSteps"
    assert _named(client, "claimRun", member, more, subject.binding, value=stake) == "ProverStepWrongSteps"
    with pytest.raises(RuntimeError):
        client._send("claimRun", member, other, subject.binding, value=stake)
    assert cases.case(subject)["claims"] == 0
    # nothing defends it: from the deadline on the round is overturned and the coalition slashed
    reader, attesters = _ledger_state(committed)
    _lands_at(w3, case["deadline"])
    cases.overturn(member, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
    assert all(reader.member(committed.run_id, a).status == "slashed" for a in attesters)
    assert client.contract.functions.balanceOf(outsider).call() == stake


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_the_program_is_fixed_once_by_the_creator_before_the_first_commit(request, backend):
    w3 = _backend(request, backend)
    client, cases, committed = _setup(w3)
    creator, outsider = _address(w3, 1), _address(w3, OUTSIDER)
    run_id = committed.run_id
    assert client.program_of(run_id) == program_hash(toy_program())
    other = program_hash(run_claim(_other_traces(_start_state(), 1), subject_of(committed, 0)))
    # set once: the creator cannot change it, nor anyone else, once a round is committed
    for sender in (creator, outsider):
        assert _named(client, "setProgram", sender, run_id, other, bytes(32)) == "ProverStepProgramFixed"
    # a run without a program: no claim, no case, and a program is not set after its first commit
    round_ = honest_round()
    bare = commit(committed.deployment, round_, round_.honest, stake=STAKE, inner_steps=TOY_STEPS)
    subject = subject_of(bare, 0)
    assert client.program_of(bare.run_id) == bytes(32)
    assert _named(client, "setProgram", creator, bare.run_id, other, bytes(32)) == "ProverStepProgramFixed"
    honest = run_claim(_traces(_run(_start_state())), subject)
    assert _named(client, "claimRun", creator, honest, subject.binding,
                  value=client.bond) == "ProverStepNoProgram"
    cases.commit(outsider, subject, SALT)
    assert _named(client, "openCase", outsider, case_claim(subject), subject.binding, SALT,
                  value=client.bond) == "ProverStepNoProgram"
    # a new run's creator sets it before round 0: ProgramRegistered, then fixed
    run = committed.deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, inner_steps=TOY_STEPS)
    assert _named(client, "setProgram", outsider, run.run_id, other, bytes(32)) == "ProverStepProgramFixed"
    receipt = client._send("setProgram", creator, run.run_id, other, b"\x07" * 32)
    events = client.contract.events.ProgramRegistered().process_receipt(receipt)
    assert [(e.args.runId, bytes(e.args.programHash), bytes(e.args.originRoot)) for e in events] == [
        (run.run_id, other, b"\x07" * 32)]
    assert client.contract.functions.originOf(run.run_id).call() == b"\x07" * 32
    assert _named(client, "setProgram", creator, run.run_id, other, bytes(32)) == "ProverStepProgramFixed"
