"""A run claim about a contribution of a run bounded by time is about the steps its member declared (issue 78,
docs/FRAUD_PROOF.md "The run's program"), on py-evm and on anvil.

In a run bounded by time each contribution declares the inner steps its replica trained, signed in its
``Contribution`` message and listed in the round's version-3 factors beside its payload root. A claim must run
the program that many times: before, every claim had to run the run's ``innerSteps`` H, so an honest
contribution that declared fewer steps could not be defended at all (its true claim was refused with
``ProverStepWrongSteps``) and any case against it won, while a claim of H steps about it was taken. A fixed-H
stage (factors listing no steps) keeps H.
"""

from __future__ import annotations

import pytest

from ledger.chunkproof import Factors, StageLeaf
from ledger.stepbinding import bind_run
from ledger.stepcase import ledger_step_prover, run_stake
from ledger.stepproof import StepProverClient, run_claim
from tests.ledger_fixtures import deploy, mine
from tests.reward_fixtures import reward_run
from tests.step_binding_fixtures import TOY_STEPS, toy_program
from tests.test_step_case import _address, _named
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _run, _start_state, _traces

DECLARED = 4  # contribution 0 of stage 0 declares 4 of the run's H = 6 steps; contribution 1 all 6


def _subject(entry, previous, stage: int, index: int):
    leaves = [StageLeaf.decode(leaf) for leaf in entry.leaves]
    before = [StageLeaf.decode(leaf) for leaf in previous.leaves]
    return bind_run(entry.record, leaves, Factors.decode(entry.factors[stage]), index, previous.record,
                    before, stage)


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_claim_runs_the_steps_its_contribution_declares(request, backend):
    w3 = _backend(request, backend)
    deployment = deploy(w3)
    rr = reward_run(deployment, pool=None, accusation_blocks=8, dispute_blocks=200, inner_steps=TOY_STEPS)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    client.set_program(rr.address(1), rr.run_id, toy_program())
    rounds = [rr.commit([[(1, None)], [(2, None)]])]
    # stage 0 of round 1 lists steps (a run bounded by time); stage 1 lists none (H)
    rounds.append(rr.commit([[(1, DECLARED), (3, TOY_STEPS)], [(2, None)]]))
    stake = run_stake(w3, deployment.ledger, rr.run_id)
    member = _address(w3, 3)
    traces = _traces(_run(_start_state()))
    assert len(traces) == TOY_STEPS

    def claim(stage: int, index: int, steps: int) -> tuple:
        subject = _subject(rounds[1], rounds[0], stage, index)
        return run_claim(traces[:steps], subject), subject.binding

    # contribution 0 declared 4 steps: a claim of 4 is taken, one of H (or of 5) refused by name
    for steps in (TOY_STEPS, DECLARED + 1, DECLARED - 1):
        assert _named(client, "claimRun", member, *claim(0, 0, steps), value=stake) == \
            "ProverStepWrongSteps", steps
    client._send("claimRun", member, *claim(0, 0, DECLARED), value=stake)
    # contribution 1 declared all H: a claim of H is taken, one of its neighbour's 4 refused
    assert _named(client, "claimRun", member, *claim(0, 1, DECLARED), value=stake) == "ProverStepWrongSteps"
    client._send("claimRun", member, *claim(0, 1, TOY_STEPS), value=stake)
    # a stage whose factors list no steps (a fixed-H run's): H, as before
    assert _named(client, "claimRun", member, *claim(1, 0, DECLARED), value=stake) == "ProverStepWrongSteps"
    client._send("claimRun", member, *claim(1, 0, TOY_STEPS), value=stake)
    mine(w3, 1)
    claimed = client.contract.events.RunClaimed().get_logs(from_block=0)
    assert [(e.args.stage, e.args.payloadRoot) for e in claimed] == [
        (0, Factors.decode(rounds[1].factors[0]).payload_roots[0]),
        (0, Factors.decode(rounds[1].factors[0]).payload_roots[1]),
        (1, Factors.decode(rounds[1].factors[1]).payload_roots[0])]
