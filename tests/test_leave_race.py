"""A contribution made while its seat was in force never makes a right round wrong (issue 79, point 1), on
py-evm and on anvil.

The attack: a member contributes to round t, then leaves before the honest quorum's commit of t, even in the
commit's own block ahead of it (``leaveRun`` with a higher tip: both transactions mined in one block), or
leaves, withdraws as early as it may and joins again while t's proof window is open. The round lists its
signed contribution; under the old rule (in force: left after t's commit) the binding found a contributor with
no seat in round t, the right round was proven wrong and its honest attesters slashed. The rule now
(docs/FRAUD_PROOF.md, "The binding"; ``ProverBinding._inForce``): a seat is in force in every round from its
join round on while its stake is held or was taken for cause, and a withdrawn seat in the rounds up to the one
open at its withdrawal, kept across a rejoin. So leaving changes nothing, and a withdrawal (at least
``unbondingBlocks`` after the leave) or a rejoin never unbinds a listed contribution.
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger import errors
from tests.fraud_fixtures import DILOCO, aggregated_round, commit, contribution
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: the py-evm / anvil fixture)

SHAPES = {"w": (2, 40)}
NORMED = dataclasses.replace(DILOCO, commitments="normed")
STAKE = 10**18
LEAVER = 3  # member 3 signed contribution 2 of round 1 (contribution j is member j + 1's)


@pytest.fixture(scope="module")
def honest():
    blobs = [contribution(SHAPES, "raw", 100 + i, scale=1e-2) for i in range(3)]
    return aggregated_round(SHAPES, blobs, NORMED)


def assert_right_and_kept(committed) -> None:
    """Neither proof holds, nothing is overturned, the honest attesters keep their stakes."""
    prover, run_id = committed.prover(), committed.run_id
    with pytest.raises((errors.ProverNormCorrect, errors.ProverProofWindowClosed)):
        prover.prove_wrong_norm(committed.scale_proof(), commit=False)
    with pytest.raises((errors.ProverRoundCorrect, errors.ProverProofWindowClosed)):
        prover.prove_wrong_aggregation(committed.proof(1), commit=False)
    assert prover.invalid_from(run_id) is None
    for index in committed.attesters:
        seat = prover.member(run_id, committed.deployment.client(index).address)
        assert seat.status == "active" and seat.stake == STAKE, (index, seat)


def test_a_contributor_leaving_in_the_commit_block_ahead_of_it_leaves_the_round_right(chain_w3, honest):
    deployment = deploy(chain_w3, min_stake=STAKE)
    committed = commit(deployment, honest, honest.honest, stake=STAKE, leaving=(LEAVER,))
    prover, run_id = committed.prover(), committed.run_id
    seat = prover.member(run_id, deployment.client(LEAVER).address)
    # it left before the commit, in its block: round 1 was still the open round
    assert seat.status == "unbonding" and seat.left_round == 1
    unbonding = prover.run_struct(run_id)["unbondingBlocks"]
    assert seat.unbonding_end - unbonding == prover.commit_block_of(run_id, 1)
    assert committed.states[1].factors.norms.contributors[2] == deployment.client(LEAVER).address
    opens_at, closes_at = prover.proof_window_of(run_id, 1)
    for latest in (opens_at, closes_at - 2):  # the window's first blocks and its last
        mine(chain_w3, max(0, latest - chain_w3.eth.block_number))
        assert_right_and_kept(committed)


def test_a_contributor_withdrawing_and_rejoining_within_the_window_leaves_the_round_right(chain_w3, honest):
    """Member 3 leaves just after round 0's commit (round 1 open), round 1 lands late enough that 3's earliest
    withdrawal falls inside round 1's dispute window; 3 withdraws there and joins again at once (joinRound 2):
    neither the deleted seat nor the new one unbinds its round-1 contribution."""
    deployment = deploy(chain_w3, min_stake=STAKE)
    accusation = 8
    bound_ = 64 + 4 * accusation  # LedgerCore.proofWindowBound at 1 game step, dispute window 64
    committed = commit(deployment, honest, honest.honest, stake=STAKE, max_game_steps=1,
                       accusation_blocks=accusation, dispute_blocks=64, unbonding_blocks=bound_,
                       between=lambda run: run.client(LEAVER).leave_run(run.run_id), gap=4 * accusation + 8)
    prover, run_id, leaver = committed.prover(), committed.run_id, deployment.client(LEAVER)
    committed_at = prover.commit_block_of(run_id, 1)
    seat = prover.member(run_id, leaver.address)
    assert seat.left_round == 1 and seat.unbonding_end < committed_at + 64  # inside round 1's dispute window
    mine(chain_w3, max(0, seat.unbonding_end - chain_w3.eth.block_number))
    leaver.withdraw_stake(run_id)
    assert prover.member(run_id, leaver.address) is None
    assert_right_and_kept(committed)
    leaver.join_run(run_id)
    assert prover.member(run_id, leaver.address).join_round == 2
    assert_right_and_kept(committed)
    assert chain_w3.eth.block_number < committed_at + 64  # all of it within the dispute window


def test_an_outsider_is_still_unbound_after_the_change(chain_w3, honest):
    """The rule still binds: account 7, which never joined, signs contribution 2 (the old rule's case)."""
    committed = commit(deploy(chain_w3, min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       contributors=(1, 2, 7))
    prover = committed.prover()
    assert prover.norm_proof_holds(committed.scale_proof())
    prover.prove_wrong_norm(committed.scale_proof())
    assert prover.invalid_from(committed.run_id) == 1
