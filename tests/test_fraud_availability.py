"""The data-availability challenge of the fraud proof (docs/FRAUD_PROOF.md), on py-evm: anyone challenges
the committers of a round to publish one committed leaf on chain within the run's accusation window;
answered, the challenger's bond is forfeited; unanswered, the round is overturned like a proven one."""

from __future__ import annotations

import pytest

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.availability import MOMENTUM, PAYLOAD, WEIGHTS, availability_answer, availability_target
from tests.fraud_fixtures import aggregated_round, commit, contribution
from tests.ledger_fixtures import deploy, mine

SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}
STAKE = 10**18


@pytest.fixture(scope="module")
def round_():
    return aggregated_round(SHAPES,
                            [contribution(SHAPES, "lowrank", 20, rank=4), contribution(SHAPES, "quant", 21)])


@pytest.fixture
def committed(round_):
    return commit(deploy(connect_pyevm(), min_stake=STAKE), round_, round_.honest, stake=STAKE)


def target(committed, which: int, chunk: int = 3):
    return availability_target(committed.records[1], committed.stages[1], committed.states[1].factors, 0,
                               which, chunk)


def test_an_unanswered_challenge_overturns_the_round_and_pays_the_challenger(committed):
    challenger = committed.prover()
    bond = challenger.run_struct(committed.run_id)["bond"]
    assert bond > 0
    before = challenger.balance()
    challenge = challenger.challenge_availability(target(committed, PAYLOAD + 1))
    with pytest.raises(errors.ProverChallengeNotDue):
        challenger.expire_challenge(challenge)
    with pytest.raises(errors.ProverChallengeExists):
        challenger.challenge_availability(target(committed, PAYLOAD + 1))
    mine(committed.deployment.w3, challenger.run_struct(committed.run_id)["accusationBlocks"])
    with pytest.raises(errors.ProverChallengeDue):  # too late to answer now
        committed.deployment.client(1).answer_challenge(challenge, *availability_answer(committed.states[1],
                                                                                         PAYLOAD + 1, 3))
    challenger.expire_challenge(challenge)
    assert challenger.invalid_from(committed.run_id) == 1
    for index in committed.attesters:
        assert challenger.member(committed.run_id, committed.deployment.client(index).address).status \
            == "slashed"
    spent = before - challenger.balance()  # gas only: the bond came back, and half of two stakes on top
    assert -STAKE < spent + STAKE < 10**16
    with pytest.raises(errors.ProverChallengeSettled):
        challenger.expire_challenge(challenge)


@pytest.mark.parametrize("which", [WEIGHTS, MOMENTUM, PAYLOAD])
def test_an_answered_challenge_forfeits_the_bond_and_leaves_the_round(committed, which):
    challenger, committer = committed.prover(), committed.deployment.client(2)
    challenge = challenger.challenge_availability(target(committed, which))
    leaf, path = availability_answer(committed.states[1], which, 3)
    wrong_leaf, wrong_path = availability_answer(committed.states[1], which, 4)
    with pytest.raises(errors.ProverBadPath):  # another chunk's leaf does not answer it
        committer.answer_challenge(challenge, wrong_leaf, wrong_path)
    receipt = committer.answer_challenge(challenge, leaf, path)
    assert receipt["status"] == 1
    assert challenger.challenge_of(challenge)["settled"]
    mine(committed.deployment.w3, challenger.run_struct(committed.run_id)["accusationBlocks"])
    with pytest.raises(errors.ProverChallengeSettled):
        challenger.expire_challenge(challenge)
    assert challenger.invalid_from(committed.run_id) is None


def test_malformed_challenges_revert(committed):
    challenger = committed.prover()
    with pytest.raises(errors.ProverBondMismatch):
        challenger.challenge_availability(target(committed, WEIGHTS), bond=1)
    with pytest.raises(errors.ProverBadTarget):  # two contributions accepted: there is no third
        challenger.challenge_availability(target(committed, PAYLOAD + 2))
    with pytest.raises(errors.ProverBadChunk):
        challenger.challenge_availability(target(committed, WEIGHTS,
                                                 chunk=len(committed.states[1].weight_leaves)))
    with pytest.raises(errors.ProverNoChallenge):
        challenger.expire_challenge(bytes(32), attesters=[])
    # after the round's dispute window nobody need keep its leaves: a challenge comes too late
    mine(committed.deployment.w3, challenger.run_struct(committed.run_id)["disputeBlocks"])
    with pytest.raises(errors.ProverChallengeTooLate):
        challenger.challenge_availability(target(committed, WEIGHTS))
