"""Availability of a version-3 round's sum trees and factors (issue 43): the challenge names a contribution's
sum-tree leaf or a stage's factors; answered, the round stands (or a lie the answer opens is proven);
unanswered, it falls.

Split from tests/test_norm_proof.py, whose rounds, fixtures and proof builders these tests use (py-evm, in
process).
"""

from __future__ import annotations

import dataclasses

import pytest
from ledger import errors
from ledger.availability import FACTORS, PAYLOAD, availability_answer, availability_target, sums_which
from ledger.chain import connect_pyevm
from ledger.chunkproof import Factors
from ledger.normproof import scale_proof, sum_bytes, sum_proof
from node.commitments import scheme_named
from tests.fraud_fixtures import DILOCO, aggregated_round, commit, lied_sum
from tests.ledger_fixtures import deploy, mine
from tests.test_norm_proof import (SHAPES, STAKE, assert_overturned, blobs, honest, on_chain,  # noqa: F401
                                   right, stage_leaves)


def sums_target(committed, contribution: int, chunk: int):
    state = committed.states[1]
    return availability_target(committed.records[1], committed.stages[1], state.factors, 0,
                               sums_which(len(state.payload_leaves), contribution), chunk)


def test_a_sum_tree_leaf_is_challenged_and_answered(right):
    """A right round's sum-tree leaf: an honest member answers with the chunk's sum and its sum path; the bond
    is forfeited and the round stands. Another chunk's leaf, a payload leaf or a cut path do not answer it."""
    challenger, committer = right.prover(), right.deployment.client(2)
    state = right.states[1]
    which = sums_which(3, 2)
    assert which == PAYLOAD + 3 + 2
    challenge = challenger.challenge_availability(sums_target(right, 2, 5))
    assert challenger.challenge_of(challenge)["sums"]
    leaf, path = availability_answer(state, which, 5)
    assert leaf == sum_bytes(state.sum_trees[2].sums[5]) and len(path) % 4 == 0
    with pytest.raises(errors.ProverBadPath):  # chunk 6's sum does not open chunk 5
        committer.answer_challenge(challenge, *availability_answer(state, which, 6))
    with pytest.raises(errors.ProverBadSumPath):  # a payload leaf is no 96-byte sum
        committer.answer_challenge(challenge, *availability_answer(state, PAYLOAD + 2, 5))
    with pytest.raises(errors.ProverBadSumPath):
        committer.answer_challenge(challenge, leaf, path[:-4])
    with pytest.raises(errors.ProverBadPath):  # another contribution's tree
        committer.answer_challenge(challenge, *availability_answer(state, sums_which(3, 1), 5))
    committer.answer_challenge(challenge, leaf, path)
    assert challenger.challenge_of(challenge)["settled"]
    assert challenger.availability_answer(challenge)[0] == leaf
    with pytest.raises(errors.ProverChallengeExists):
        challenger.challenge_availability(sums_target(right, 2, 5))
    assert challenger.invalid_from(right.run_id) is None


def test_a_withheld_sum_tree_leaf_overturns_the_round(honest):
    committed = on_chain(honest, honest.honest)
    challenger = committed.prover()
    challenge = challenger.challenge_availability(sums_target(committed, 0, 0))
    mine(committed.deployment.w3, challenger.run_info(committed.run_id).accusation_blocks)
    challenger.expire_challenge(challenge)
    assert_overturned(committed)


def test_a_lied_sum_opened_by_a_challenge_is_proven(honest):
    """The colluders lied about one chunk's sum and serve no tree: the answer they must give (or lose the
    round) is the lied leaf with its path, which is all a sum proof needs."""
    wrong = lied_sum(honest.honest, 1, 4)
    committed = on_chain(honest, wrong)
    challenger = committed.prover()
    challenge = challenger.challenge_availability(sums_target(committed, 1, 4))
    committed.deployment.client(1).answer_challenge(challenge,
                                                    *availability_answer(wrong, sums_which(3, 1), 4))
    leaf, path = challenger.availability_answer(challenge)
    own = honest.honest  # the prover's own state: its weights and pieces are the committed ones
    proof = sum_proof(committed.records[1], stage_leaves(committed), 0, committed.states[1].factors.encode(),
                      own.weight_leaves, own.payload_leaves[1], own.sum_trees[1], 1, 4)
    proof = dataclasses.replace(proof, sum_leaf=leaf, sum_path=list(path))
    assert leaf != sum_bytes(own.sum_trees[1].sums[4])
    challenger.prove_wrong_norm(proof)
    assert_overturned(committed)


def test_withheld_version_two_factors_in_a_normed_run_are_challenged_opened_and_proven(honest):
    """The version escape with the factors withheld: they are no tree's leaf, so the challenger asks for the
    stage leaf's preimage of factorsHash (FACTORS); the colluders must publish them (or lose the round), and
    the bytes they publish are a norm proof's factors."""
    loose = aggregated_round(SHAPES, blobs(), dataclasses.replace(DILOCO, norm_clip=0.0))
    committed = commit(deploy(connect_pyevm(), min_stake=STAKE), loose, loose.honest, stake=STAKE,
                       commitments=scheme_named("normed").version)
    challenger, colluder = committed.prover(), committed.deployment.client(1)
    target = availability_target(committed.records[1], committed.stages[1], Factors(0, 0, False, (), (), ()),
                                 0, FACTORS, 0)  # the challenger knows no factors: they are not read
    with pytest.raises(errors.ProverBadChunk):
        challenger.challenge_availability(target[:-1] + (1,))
    challenge = challenger.challenge_availability(target)
    with pytest.raises(errors.ProverBadPath):  # any other bytes do not answer it
        colluder.answer_challenge(challenge, honest.honest.factors.encode(), [])
    colluder.answer_challenge(challenge, *availability_answer(loose.honest, FACTORS, 0))
    factors, path = challenger.availability_answer(challenge)
    assert path == [] and Factors.decode(factors).norms is None
    challenger.prove_wrong_norm(scale_proof(committed.records[1], stage_leaves(committed), 0, factors))
    assert_overturned(committed)


def test_unanswered_factors_overturn_the_round(honest):
    committed = on_chain(honest, honest.honest)
    challenger = committed.prover()
    challenge = challenger.challenge_availability(availability_target(
        committed.records[1], committed.stages[1], honest.honest.factors, 0, FACTORS, 0))
    mine(committed.deployment.w3, challenger.run_info(committed.run_id).accusation_blocks)
    challenger.expire_challenge(challenge)
    assert_overturned(committed)


def test_sum_tree_challenges_name_only_trees_the_round_has(right, honest):
    challenger = right.prover()
    state = right.states[1]
    with pytest.raises(errors.ProverBadTarget):  # three accepted: sum trees 5, 6, 7 and no eighth
        challenger.challenge_availability(availability_target(right.records[1], right.stages[1],
                                                              state.factors, 0, PAYLOAD + 6, 0))
    with pytest.raises(errors.LedgerInputError):
        sums_which(3, 3)
    v2 = aggregated_round(SHAPES, blobs(), DILOCO)
    chunked = on_chain(v2, v2.honest)
    with pytest.raises(errors.ProverBadTarget):  # version-2 factors carry no sum trees
        chunked.prover().challenge_availability(availability_target(
            chunked.records[1], chunked.stages[1], v2.honest.factors, 0, PAYLOAD + 3, 0))
    with pytest.raises(IndexError):  # nor does a version-2 state answer one
        availability_answer(v2.honest, PAYLOAD + 3, 0)


@pytest.mark.parametrize("chunks", [1, 2, 7, 22, 33])
def test_a_walk_over_answered_sum_leaves_finds_every_lied_leaf_by_bisection(chunks):
    """What the live prover reads of each answer (node.live.fraud.walks.SumWalk): the path's total is the
    committed tree's, and the lowest differing sibling leads to the lied leaf in at most ceil(log2(chunks)) +
    1 openings, wherever it is."""
    from ledger.normproof import SumTree, differing_sum_subtree, path_sums, path_total

    own = SumTree.of([(7 * i + 3) << 250 for i in range(chunks)])
    for lied in range(chunks):
        sums = list(own.sums)
        sums[lied] -= 1 << 200
        committed = SumTree.of(sums)
        chunk, opened = 0, 1
        while committed.sums[chunk] == own.sums[chunk]:
            path = committed.path(chunk)
            assert path_total(sum_bytes(committed.sums[chunk]), path) == committed.total
            chunk = differing_sum_subtree(own, chunk, path)
            opened += 1
        assert chunk == lied and opened <= (chunks - 1).bit_length() + 1
        assert differing_sum_subtree(own, 0, own.path(0)) is None  # nothing differs: nowhere to go
    with pytest.raises(errors.LedgerInputError):
        path_sums([b"\x00" * 32] * 3)
    with pytest.raises(errors.LedgerInputError):
        path_total(b"\x00" * 95, [])
