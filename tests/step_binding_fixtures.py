"""A ledger whose round 1 lists three contributions, under a StepProver bound to it: what StepProver's run
claims (issue 78) are about (tests/test_step_proof_run.py, tests/test_step_proof_binding.py)."""

from __future__ import annotations

import dataclasses
import functools

from ledger.stepbinding import RunSubject, bind_run
from ledger.stepproof import StepProverClient, deploy
from tests.fraud_fixtures import DILOCO, Committed, aggregated_round, commit, contribution
from tests.ledger_fixtures import deploy as deploy_ledger

SHAPES = {"w": (2, 40)}  # 80 elements: a full chunk and a short one
NORMED = dataclasses.replace(DILOCO, commitments="normed")
STAKE = 10**18


@functools.cache
def honest_round():
    """Round 1 of three raw contributions, aggregated honestly (tests/test_contribution_binding.py's)."""
    blobs = [contribution(SHAPES, "raw", 100 + i, scale=1e-2) for i in range(3)]
    return aggregated_round(SHAPES, blobs, NORMED)


def bound_prover(w3, bond: int, clock: int) -> tuple[StepProverClient, Committed]:
    """A ledger on ``w3`` with a normed run whose rounds 0 and 1 are committed (members 1-3), and a StepProver
    bound to it."""
    round_ = honest_round()
    committed = commit(deploy_ledger(w3, min_stake=STAKE), round_, round_.honest, stake=STAKE)
    return StepProverClient(w3, deploy(w3, bond, clock, committed.deployment.ledger)), committed


def subject_of(committed: Committed, index: int = 0) -> RunSubject:
    """The subject of a run claim about round 1's contribution ``index`` (stage 0), from round 0's start."""
    return bind_run(committed.records[1], committed.stages[1], committed.states[1].factors, index,
                    committed.records[0], committed.stages[0], 0)
