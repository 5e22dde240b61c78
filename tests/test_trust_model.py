"""The security model (docs/TRUST.md) fuzzed as a whole: tests/trust_machine.py drives the real contract on
py-evm with honest members, a coalition below the quorum fraction and outsiders, checking every invariant
after every step. A short run here; the long one is slow (``pytest -m slow``)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, settings

from tests.trust_machine import TrustMachine

_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False, database=None)


@pytest.mark.timeout(900)
def test_the_model_holds_in_a_short_fuzz():
    TrustMachine.TestCase.settings = settings(max_examples=2, stateful_step_count=20, **_SETTINGS)
    TrustMachine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_the_model_holds_in_a_long_fuzz():
    examples = int(os.environ.get("DLX_TRUST_FUZZ_EXAMPLES", "400"))
    TrustMachine.TestCase.settings = settings(max_examples=examples, stateful_step_count=250, **_SETTINGS)
    TrustMachine.TestCase().runTest()


def test_honest_members_split_by_a_stage_holder_stay_credited():
    """The fuzzer's split move (issue 63), step by step: one honest member signs each round's result with
    another checkpoint hash or loss figure, the coalition commits the others' record; the split member attests
    its own record, is credited with the round and never falls behind; the model holds after each round."""
    from tests.trust_machine import COALITION, HONEST, INACTIVITY

    machine = TrustMachine()
    machine.deploy_run()
    split = (HONEST[-1],)
    reader = machine.client(HONEST[0])
    for round_ in range(INACTIVITY + 2):
        assert machine.split_commit(COALITION[0], split, checkpoint=round_ % 2 == 0)
        seat = reader.member(machine.run_id, machine.client(split[0]).address)
        assert machine.client(split[0]).address not in machine.attesters_of(round_)
        assert seat.status == "active" and seat.active_round == round_ + 1
        machine.the_model_holds()


def test_the_prover_and_the_challenger_cannot_invalidate_right_rounds():
    """The fuzzer's I7 actors, step by step: proofs over real and tampered leaves and answered challenges
    against right rounds are all refused, and the model holds after each."""
    from ledger import errors
    from ledger.availability import PAYLOAD, WEIGHTS, availability_answer, availability_target
    from tests.trust_machine import COALITION, HONEST
    from tests.trust_params import OUTSIDER

    machine = TrustMachine()
    machine.deploy_run()
    for _ in range(3):
        assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    outsider = machine.client(OUTSIDER)
    for round_, chunk, tampered in ((1, 0, False), (2, 1, False), (2, 0, True)):
        # the real leaves: the chunk is right; tampered leaves do not open the committed root
        with pytest.raises(errors.ProverBadStagePath if tampered else errors.ProverRoundCorrect):
            outsider.prove_wrong_aggregation(machine.proof_of(round_, chunk, tampered=tampered),
                                             attesters=machine.attesters_of(round_),
                                             commit=False)
        machine.the_model_holds()
    from ledger.normproof import scale_proof
    from tests.fraud_fixtures import with_scale
    from training.chunks import float64_bits
    for round_ in (0, 1, 2):  # round 0 holds version-3 factors of no contribution: nothing to clip
        state = machine.state_of(round_)  # as committed: its contributions bound to members (issue 62)
        unnormed = dataclasses.replace(state, factors=dataclasses.replace(state.factors, norms=None),
                                       sum_trees=[])
        for claimed, error in ((state, errors.ProverNormCorrect),
                               (with_scale(state, 0, float64_bits(0.5)) if round_ else None,
                                errors.ProverBadStagePath),
                               # its factors as version 2: not the root's
                               (unnormed, errors.ProverBadStagePath)):
            if claimed is None:
                continue
            proof = scale_proof(machine.records[round_], [claimed.leaf().encode()], 0,
                                claimed.factors.encode())
            with pytest.raises(error):
                outsider.prove_wrong_norm(proof, attesters=machine.attesters_of(round_), commit=False)
        machine.the_model_holds()
    state = machine.state_of(2)
    for which in (WEIGHTS, PAYLOAD + 1):
        target = availability_target(machine.records[2], [state.leaf()], state.factors, 0, which, 1)
        challenge = outsider.challenge_availability(target)
        machine.client(HONEST[1]).answer_challenge(challenge, *availability_answer(state, which, 1))
        with pytest.raises(errors.ProverChallengeSettled):
            outsider.expire_challenge(challenge, attesters=())
        machine.the_model_holds()
    assert outsider.invalid_from(machine.run_id) is None


# (issue 62) a walk no longer stops at the dispute window: each answer gives it a fresh window, so the
# mistaken walk of a right round goes on to its bisection's end on py-evm: longer than the default timeout.
@pytest.mark.timeout(900)
def test_the_sum_walk_overturns_lied_sums_and_spares_right_rounds():
    """The fuzzer's sum-tree actors (tests/trust_sums.py), step by step: a captured run's lied chunk sum
    walked with truthful answers (junk refused on the way) and an unclipped scale behind lower sums are
    proven, an unanswered sum-tree leaf expires, each round falls with its attesters slashed and the walker
    paid half; a walk of a right round of the machine's run, answered by the honest members, proves nothing.
    The model holds after each."""
    from tests.ledger_fixtures import mine
    from tests.trust_machine import COALITION, HONEST, STAKE
    from tests.trust_sums import CAPTURED_ANSWER_BLOCKS, WALKER

    machine = TrustMachine()
    machine.deploy_run()
    for _ in range(2):
        assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    reader = machine.client(HONEST[0])
    for lie, answers, outcome in ((("chunk", 1, 5, 1), ["junk", "truthful"] * 6, "proofs"),
                                  (("unclipped",), ["truthful"] * 6, "proofs"),
                                  (("chunk", 2, 0, -1), ["truthful", "silent"], "expired")):
        machine.coalition_commits_a_lied_sum(lie, answers)
        case = machine.lied_rounds[-1]
        if outcome == "expired":
            assert not case.ended() and reader.invalid_from(case.run_id) is None
            mine(machine.w3, CAPTURED_ANSWER_BLOCKS + 1)
            machine.the_walk_goes_on(["silent"])
        assert set(getattr(case.prover.log, outcome)) == {1}, case.prover.log
        assert reader.invalid_from(case.run_id) == 1
        for index in COALITION:
            assert reader.member(case.run_id, machine.client(index).address).status == "slashed"
        machine.the_model_holds()
    assert machine.junk_answers_refused >= 6
    received = machine.w3.eth.get_balance(machine.client(WALKER).address) - machine.walker_start \
        + machine.walker_paid
    # half of two seats' stake, three times (and the expired challenge's bond back)
    assert received >= 3 * STAKE
    assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    before = machine.mistaken_walks
    machine.anyone_walks_a_right_round_mistakenly(1, 1, 1)
    assert machine.mistaken_walks == before + 1 and reader.invalid_from(machine.run_id) is None
    machine.the_model_holds()


@pytest.mark.timeout(900)
def test_the_game_moves_leave_the_walker_its_reward():
    """The fuzzer's issue-62 moves (tests/trust_game.py), step by step: a coalition that answers every step of
    the walk in the last block of its window or through a relay, copies the walker's proof ahead of it and
    leaves its run at once still loses the round, its stakes (its withdrawals refused), and the reward, which
    the walker gets with every bond back, more than the walk cost it; the model holds."""
    from tests.trust_game import GameMoves
    from tests.trust_machine import COALITION, HONEST
    from tests.trust_sums import CAPTURED_DISPUTE_BLOCKS

    machine = TrustMachine()
    machine.deploy_run()
    late, relayed, copies = GameMoves.late_answers, GameMoves.relayed_answers, GameMoves.copies
    machine.coalition_commits_a_lied_sum(("chunk", 1, 5, 1), ["late", "relay"] * 8, moves=(True, True))
    case = machine.lied_rounds[-1]
    machine.captured_coalition_withdraws()
    assert case.ended() and case.prover.log.proofs, case.prover.log
    reader = machine.client(HONEST[0])
    assert reader.invalid_from(case.run_id) == 1
    assert machine.w3.eth.block_number > case.commit_block + CAPTURED_DISPUTE_BLOCKS  # the clock carried it
    for index in COALITION:
        assert reader.member(case.run_id, machine.client(index).address).status == "slashed"
    assert GameMoves.late_answers > late and GameMoves.relayed_answers > relayed
    assert GameMoves.copies == copies + 1
    assert case.copier_gain == 0 and case.copier_checked
    machine.the_model_holds()


class _First:
    """A stand-in for hypothesis' ``data``: the first element of a sampled_from, the empty list of a lists."""

    def draw(self, strategy):
        inner = getattr(strategy, "wrapped_strategy", strategy)
        elements = getattr(inner, "elements", None)
        return elements[0] if isinstance(elements, (list, tuple)) else []  # st.lists: the empty list


def test_a_listed_contributor_leaving_before_the_commit_leaves_the_round_right():
    """The fuzzer's issue-79 move, step by step: a member whose contribution the honest record lists leaves
    before the honest commit lands; the scales' proof of that round (the binding's) is refused, no honest
    member is slashed and the model holds (fails on the old binding rule: the round was proven wrong)."""
    from ledger.normproof import scale_proof
    from tests.trust_params import OUTSIDER, REFUSED

    machine = TrustMachine()
    machine.deploy_run()
    races = TrustMachine.leave_races
    machine.honest_commit(_First())
    machine.contributor_leaves_before_the_commit(_First())
    assert TrustMachine.leave_races == races + 1
    round_ = max(machine.records)
    state = machine.state_of(round_)
    reader = machine.client(OUTSIDER)
    listed = {a.lower() for a in state.factors.norms.contributors}
    gone = [a for a in listed if reader.member(machine.run_id, a).status != "active"]
    assert gone, "a listed contributor left before the commit"
    proof = scale_proof(machine.records[round_], [state.leaf().encode()], 0, state.factors.encode())
    try:
        reader.prove_wrong_norm(proof, attesters=machine.attesters_of(round_), commit=False)
    except REFUSED:
        pass
    else:
        raise AssertionError(f"I7: round {round_} proven wrong after its listed contributor {gone} left")
    machine.the_model_holds()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_squatter_copying_every_challenge_of_the_walk_spends_none_of_its_clock():
    """The fuzzer's issue-79 squatter, step by step: the coalition copies each challenge of the walker's walk
    into a game of its own ahead of it and answers each copy in the last block of its window; the walker's own
    steps still open (ids name the challenger), its walk completes within the proof window and proves the lied
    round, and the model (H, W, G1-G3, S1-S3) holds."""
    from tests.trust_game import GameMoves
    from tests.trust_machine import HONEST

    machine = TrustMachine()
    machine.deploy_run()
    squats, late = GameMoves.squats, GameMoves.squats_answered_late
    machine.coalition_commits_a_lied_sum(("chunk", 1, 5, 1), ["truthful"] * 12, moves=(False, False, True))
    case = machine.lied_rounds[-1]
    assert case.ended() and case.prover.log.proofs and not case.prover.log.unprovable, case.prover.log
    assert machine.client(HONEST[0]).invalid_from(case.run_id) == 1
    assert GameMoves.squats - squats == len(case.squats) >= 2  # every step of the walk was copied
    assert GameMoves.squats_answered_late > late
    machine.the_model_holds()


def test_pull_and_audit_call_nothing_final_before_the_chain_while_a_challenge_is_open():
    """The fuzzer's issue-79 finality read (F), step by step: with an availability challenge of the latest
    round open, and blocks passing to the end of its answer window, pull's standing and audit's last final
    round never run ahead of the chain's isFinal; the honest answer closes it."""
    from tests.trust_machine import COALITION, HONEST, WINDOW
    from tests.trust_proofs import RightRoundProofs

    machine = TrustMachine()
    machine.deploy_run()
    assert machine.commit(HONEST[0], machine.honest_record(), list(HONEST) + list(COALITION))
    reads, answered = RightRoundProofs.finality_reads_open, RightRoundProofs.challenges_answered
    machine.anyone_reads_finality_while_a_challenge_is_open(True, [WINDOW - 2])  # to its last block
    assert RightRoundProofs.finality_reads_open == reads + 2  # two reads with the challenge open
    assert RightRoundProofs.challenges_answered == answered + 1
    reader = machine.client(HONEST[0])
    assert not reader.is_final(machine.run_id, 0)
    machine.blocks_pass(2 * WINDOW)
    assert reader.is_final(machine.run_id, 0)  # the read compares a final round too
    machine.finality_agrees()
    machine.the_model_holds()
