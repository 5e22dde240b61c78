"""A run claim's batches are the run's data (issue 78, docs/FRAUD_PROOF.md "The data's binding"), on py-evm
and on anvil.

The run's creator fixes the run's data with its program (StepProver.setData: the root over the training
split's token ids, the seed, the split's length, the batch rows and the block size). A run claim commits its
steps' batches (``batchRoot``) and names the account they are drawn with (``dataKey``, the member the round's
factors list, checked at the claim). Anyone may bond that one token of one step's batch is not the run's data
(``challengeData``); the defender must open it and the corpus's token at the row's window offset (recomputed
on chain with sha256) within its clock, or the claim is proven wrong. And a program op that reads the step's
batch (``DATA_INPUT``) opens it under the claim's ``batchRoot`` (StepProverMath.openOp), so a claim that
commits the run's batches but computed with others loses its step game.

The program and the corpus are tests/step_data_fixtures.py's (the toy step plus an embedding lookup of the
batch).
"""

from __future__ import annotations

import pytest
import torch

from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepdata import DataClient, batch_root, data_opening
from ledger.stepdefense import DataSide, DefenseSide, GameMemory, defender_move
from ledger.stepproof import PHASES, StepProverClient, run_game, state_roots
from rulebook.data_windows import window_offset
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, subject_of, toy_round
from tests.step_data_fixtures import (
    ROWS,
    SEED,
    WINDOW,
    batches_of,
    claim_of,
    corpus,
    corpus_leaves,
    program_fields,
    run_steps,
    terms,
    traces_of,
)
from tests.test_step_case import CLOCK, OUTSIDER, WINDOW as PROOF_WINDOW, _address, _lands_at, _ledger_state
from tests.test_step_case import FRONT, _named, _open
from tests.test_step_end import copied_in_one_block
from tests.test_step_proof import _backend
from tests.test_step_proof_run import _start_state
from training.data_binding import batch_leaves, key_window_offsets, train_ids


def _setup(w3, data: bool = True):
    """The ledger's StepProver over a run whose program reads each step's batch and whose data is fixed
    (``data``), round 1 listing three contributions (member ``j + 1`` signed contribution ``j``)."""
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    fix = fix_program(client, program_fields())

    def before(run):
        fix(run)
        if data:
            DataClient(client).set_data(run.deployment.client(run.members[0]).address, run.run_id, terms())

    committed = commit(deployment, toy_round(), toy_round().honest, stake=STAKE, accusation_blocks=CLOCK,
                       dispute_blocks=PROOF_WINDOW, inner_steps=TOY_STEPS, before=before)
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    return client, committed


def _claim(client, sender: str, claim: tuple, subject) -> bytes:
    client._send("claimRun", sender, claim, subject.binding, value=client.bond)
    return bytes(client.contract.functions.runIdOf(claim, sender).call())


def _side(traces, batches, subject) -> DefenseSide:
    """An honest defender's side: its traces, the corpus and its claim's batches."""
    leaves = [batch_leaves(b) for b in batches]
    return DefenseSide(traces, [], [], lambda *a: 0,
                       data=DataSide(terms(), list(corpus_leaves()), leaves, subject.data_key, subject.round))


def _answer(client, game_id: bytes, side: DefenseSide, defender: str):
    """The defender's move in ``game_id`` as the node plays it (``defender_move``), sent."""
    name, args = defender_move(game_id, client.game(game_id), side, GameMemory())
    return client._send(name, defender, *args)


def test_the_windows_are_the_chains_and_the_corpus():
    """The contract's window offset is the rulebook's (training's keyed windows); a step's batch rows are the
    training split's ids at those offsets, ``x`` and ``y`` their first and last ``block`` ids."""
    from ledger.chain import connect_pyevm

    w3 = connect_pyevm()
    from tests.ledger_fixtures import deploy_library

    math_lib = deploy_library(w3, "StepProverMath")
    key = "0xABaBaBaBABabABabAbAbABAbABabababaBaBABaB"  # 0xab.. in checksum case
    cases = ((0, 0, 0, 0, 1), (SEED, 1, 5, 1, 717), (2**64 - 1, 2**64 - 1, 7, 3, 10**9))
    for seed, round_, step, row, n in cases:
        chain = math_lib.functions.windowOffset(seed, key, round_, step, row, n).call()
        assert chain == window_offset(seed, bytes.fromhex(key[2:]), round_, step, row, n)
    depths = [math_lib.functions.batchDepth(s).call() for s in (1, 2, 3, 4, 5, 6, 8, 9)]
    assert depths == [0, 1, 2, 2, 3, 3, 3, 4]
    n_start = corpus().split_tokens("train") - WINDOW
    offsets = key_window_offsets(SEED, bytes.fromhex(key[2:]), 1, TOY_STEPS, ROWS, n_start)
    train = train_ids(corpus())
    for k, batch in enumerate(batches_of(key, 1, TOY_STEPS)):
        assert batch.shape == (ROWS, WINDOW + 1)
        for b in range(ROWS):
            assert batch[b].tolist() == train[offsets[k][b]:offsets[k][b] + WINDOW + 1].tolist()
        xs, ys = corpus().windows("train", torch.tensor(offsets[k]), WINDOW)
        assert torch.equal(batch[:, :-1], xs) and torch.equal(batch[:, 1:], ys)
    # another account draws other windows
    other = key_window_offsets(SEED, b"\xac" * 20, 1, TOY_STEPS, ROWS, n_start)
    assert other != offsets


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_an_honest_claim_answers_every_data_dispute(request, backend):
    w3 = _backend(request, backend)
    client, committed = _setup(w3)
    data, stake = DataClient(client), client.bond
    assert data.terms_of(committed.run_id) == terms()
    defender = _address(w3, 4)  # not a member: it holds the contribution's inputs (the corpus, the start)
    subject = subject_of(committed, 1)
    assert subject.data_key == _address(w3, 2)  # the member the factors list for contribution 1
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    traces = traces_of(run_steps(_start_state(), batches), batches)
    claim_id = _claim(client, defender, claim_of(traces, subject, batches), subject)
    side = _side(traces, batches, subject)
    # outside the batch: a step past the claim's, a row past the batch, a position past the window
    for step, row, pos in ((TOY_STEPS, 0, 0), (0, ROWS, 0), (0, 0, WINDOW + 1)):
        assert _named(client, "challengeData", _address(w3, 5), claim_id, step, row, pos,
                      value=stake) == "ProverStepBadElement"
    # the first token, the last, and chosen ones; each answered from the corpus
    disputes = ((0, 0, 0), (TOY_STEPS - 1, ROWS - 1, WINDOW), (2, 1, 2), (3, 0, WINDOW))
    for challenger, (step, row, pos) in zip((5, 6, 7, 9), disputes):
        game = data.challenge(claim_id, step, row, pos, _address(w3, challenger))
        if step == 2:  # another step's batch, and another chunk of the corpus, are refused by name
            good = data_opening(terms(), side.data.batches, side.data.corpus, subject.data_key, 1, step,
                                terms().element(row, pos))
            other = data_opening(terms(), side.data.batches, side.data.corpus, subject.data_key, 1, 3,
                                 terms().element(row, pos))
            assert _named(client, "proveData", defender, game, other) == "ProverStepBadOpening"
            wrong = list(good)
            wrong[5] = (side.data.corpus[0], other[5][1]) if good[5][0] != side.data.corpus[0] else other[5]
            assert _named(client, "proveData", defender, game, tuple(wrong)) == "ProverStepBadOpening"
            # an outsider may not answer for the defender
            assert _named(client, "proveData", _address(w3, OUTSIDER), game, good) == "ProverStepNotYourMove"
        _answer(client, game, side, defender)
        assert client.game(game)["phase"] == PHASES.index("Done")
    assert not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == len(disputes) * stake


@pytest.mark.parametrize("backend, how", [("pyevm", "token"), ("pyevm", "offset"), ("anvil", "token")])
def test_a_claim_on_other_batches_cannot_show_its_inputs_and_its_case_overturns(request, backend, how):
    """A coalition member's true run of the program on batches that are not the run's data (one token of
    step 3 changed, or step 3's first row drawn one id further), committed as its batches: it answers a
    dispute
    of a token it did not change, cannot answer the changed one, its clock's last block still runs and the
    next block's ``timeout`` refutes it; the outsider's case then overturns the round."""
    w3 = _backend(request, backend)
    client, committed = _setup(w3)
    data, stake = DataClient(client), client.bond
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    subject = subject_of(committed, 0)
    case = _open(w3, CaseClient(client), outsider, subject)
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    used = [b.clone() for b in batches]
    if how == "token":
        used[3][1, 2] = (used[3][1, 2] + 1) % 8
    else:
        start = window_offset(SEED, bytes.fromhex(subject.data_key[2:]), 1, 3, 0, terms().tokens - WINDOW)
        used[3][0] = train_ids(corpus())[start + 1:start + WINDOW + 2]
    assert not torch.equal(used[3], batches[3])
    traces = traces_of(run_steps(_start_state(), used), used)
    claim_id = _claim(client, member, claim_of(traces, subject, used), subject)
    side = _side(traces, used, subject)
    same = (1, 0, 1)  # a token of another step: its own batch's, the corpus's
    game = data.challenge(claim_id, *same, _address(w3, 5))
    _answer(client, game, side, member)
    assert not client.wrong(claim_id)
    row, pos = next((r, p) for r in range(ROWS) for p in range(WINDOW + 1)
                    if used[3][r, p] != batches[3][r, p])
    game = data.challenge(claim_id, 3, row, pos, outsider)
    name, args = defender_move(game, client.game(game), side, GameMemory())
    assert _named(client, name, member, *args) == "ProverStepBadOpening"
    state = client.game(game)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"])  # the defender's clock's last block: running
    assert _named(client, "timeout", outsider, game) == "ProverStepClockRunning"
    with pytest.raises(RuntimeError):
        client._send("timeout", outsider, game)
    receipt = client._send("timeout", outsider, game)
    assert receipt["blockNumber"] == state["turnSince"] + state["defenderLeft"] + 1
    assert client.wrong(claim_id)
    cases = CaseClient(client)
    assert (cases.case(subject)["claims"], cases.case(subject)["refuted"]) == (1, 1)
    reader, attesters = _ledger_state(committed)
    _lands_at(w3, max(case["deadline"], w3.eth.block_number + 1))
    cases.overturn(outsider, subject, attesters)
    assert reader.invalid_from(committed.run_id) == 1
    assert client.contract.functions.balanceOf(outsider).call() == 3 * stake


def _honest_step_policy(truth, mine, batches):
    """An honest challenger's step game on step ``i`` (``truth``, ``mine``: each step's trace tensors; the
    split op here is the lookup, which has no partial sums)."""
    from ledger.chunkproof import tree_root

    true_traces = traces_of(truth, batches)

    def policy(i):
        def pick(op):
            j = next(j for j in range(7) if not torch.equal(mine[i][3 + j].view(torch.int32),
                                                            truth[i][3 + j].view(torch.int32)))
            return int((mine[i][3 + j].view(torch.int32) != truth[i][3 + j].view(torch.int32)).nonzero()[0])

        return dict(dispute=lambda last: ("trace", 0),
                    judge_root=lambda j, root: root == tree_root(true_traces[i].tree(j)), pick=pick,
                    judge=lambda j, point, bits: True, sums=lambda j, e, p: 0)
    return policy


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_a_claim_that_commits_the_runs_batches_but_computed_others_loses_its_step_game(request, backend):
    """The claim's ``batchRoot`` is the run's batches (every data dispute is answered), but its step 3 ran on
    a batch with one token changed: the honest challenger bisects to step 3 and to its lookup op, whose batch
    input the defender must open under the claim's ``batchRoot``: its own batch does not open there, and the
    clock refutes the claim."""
    w3 = _backend(request, backend)
    client, committed = _setup(w3)
    member, challenger = _address(w3, 1), _address(w3, OUTSIDER)
    subject = subject_of(committed, 0)
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    used = [b.clone() for b in batches]
    used[3][0, 1] = (used[3][0, 1] + 3) % 8
    truth, mine = run_steps(_start_state(), batches), run_steps(_start_state(), used)
    traces = traces_of(mine, used, committed=batches)
    true_roots = state_roots(traces_of(truth, batches))
    won, _moves = run_game(client, traces, member, challenger, subject=subject,
                           judge_state=lambda i, root: root == true_roots[i],
                           step_policy=_honest_step_policy(truth, mine, batches),
                           batch_root=batch_root([batch_leaves(b) for b in batches]))
    assert not won and client.game(client.contract.functions.gameIdOf(
        client.contract.functions.runIdOf(claim_of(traces, subject, batches), member).call(), challenger
    ).call())["lo"] == 5  # the op the game split on: the lookup


@pytest.mark.parametrize("backend", ["pyevm", pytest.param("anvil", marks=pytest.mark.slow)])
def test_the_data_clock_a_front_runners_copy_and_who_may_move(request, backend):
    """A copied ``challengeData`` in the honest challenger's block gets a game of its own, and the honest
    defender answers both; an answer in the defender's clock's last block is taken, one block later refused
    (``ProverStepClockOut``) and ``timeout`` refutes the claim; a claim naming another data key is refused."""
    w3 = _backend(request, backend)
    client, committed = _setup(w3)
    data, stake = DataClient(client), client.bond
    defender, outsider, front = _address(w3, 4), _address(w3, OUTSIDER), _address(w3, FRONT)
    subject = subject_of(committed, 2)
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    traces = traces_of(run_steps(_start_state(), batches), batches)
    claim = claim_of(traces, subject, batches)
    other_key = (*claim[:-1], _address(w3, 1))  # the batches of another member's account
    refused = _named(client, "claimRun", defender, other_key, subject.binding, value=stake)
    assert refused == "ProverStepWrongDataKey"
    claim_id = _claim(client, defender, claim, subject)
    side = _side(traces, batches, subject)
    assert copied_in_one_block(w3, client, "challengeData", (claim_id, 4, 1, 3), FRONT, OUTSIDER) == [1, 1]
    games = [bytes(client.contract.functions.gameIdOf(claim_id, who).call()) for who in (front, outsider)]
    assert all(client.game(g)["phase"] == PHASES.index("Data") for g in games)
    # a challenger cannot time out a defender whose clock runs
    assert _named(client, "timeout", outsider, games[1]) == "ProverStepClockRunning"
    late, later = (data.challenge(claim_id, 5, 0, 0, _address(w3, i)) for i in (6, 7))
    for game in games:
        _answer(client, game, side, defender)
    for game, extra in ((late, 0), (later, 1)):
        state = client.game(game)
        _lands_at(w3, max(w3.eth.block_number + 1, state["turnSince"] + state["defenderLeft"] + 2 * extra))
        if extra:
            name, args = defender_move(game, client.game(game), side, GameMemory())
            assert _named(client, name, defender, *args) == "ProverStepClockOut"
            client._send("timeout", _address(w3, 7), game)
        else:
            _answer(client, game, side, defender)
    assert client.wrong(claim_id)
    balance = client.contract.functions.balanceOf
    assert (balance(defender).call(), balance(front).call(), balance(outsider).call()) == (3 * stake, 0, 0)


def test_a_run_without_data_takes_no_data_dispute_and_its_terms_are_the_creators_once(request):
    w3 = _backend(request, "pyevm")
    client, committed = _setup(w3, data=False)
    data = DataClient(client)
    assert data.terms_of(committed.run_id) is None
    subject = subject_of(committed, 1)
    batches = batches_of(subject.data_key, 1, TOY_STEPS)
    traces = traces_of(run_steps(_start_state(), batches), batches)
    claim_id = _claim(client, _address(w3, 4), claim_of(traces, subject, batches), subject)
    assert _named(client, "challengeData", _address(w3, 5), claim_id, 0, 0, 0,
                  value=client.bond) == "ProverStepDataUnbound"
    creator = committed.deployment.client(1).address
    for sender in (creator, _address(w3, 5)):  # after the first commit nobody sets it
        refused = _named(client, "setData", sender, committed.run_id, terms().as_tuple())
        assert refused == "ProverStepProgramFixed"


def test_fuzz_an_honest_claim_answers_any_token_and_a_changed_token_is_always_refuted(request):
    """Random disputes (py-evm, seeded): an honest claim answers every token a challenger names; a claim whose
    batches differ from the run's data in one random token answers every other token named and is refuted at
    that one by the clock."""
    import random

    w3 = _backend(request, "pyevm")
    client, committed = _setup(w3)
    data, rng = DataClient(client), random.Random(78)
    challenger = _address(w3, 5)

    def token():
        return rng.randrange(TOY_STEPS), rng.randrange(ROWS), rng.randrange(WINDOW + 1)

    for index, defender, changed in ((1, _address(w3, 4), None), (0, _address(w3, 1), token())):
        subject = subject_of(committed, index)
        used = batches_of(subject.data_key, 1, TOY_STEPS)
        if changed is not None:
            step, row, pos = changed
            used[step][row, pos] = (used[step][row, pos] + rng.randrange(1, 8)) % 8
        traces = traces_of(run_steps(_start_state(), used), used)
        claim_id = _claim(client, defender, claim_of(traces, subject, used), subject)
        side = _side(traces, used, subject)
        for _ in range(8):
            named = token()
            if named == changed:
                continue
            _answer(client, data.challenge(claim_id, *named, challenger), side, defender)
            assert not client.wrong(claim_id)
        if changed is not None:
            game = data.challenge(claim_id, *changed, challenger)
            name, args = defender_move(game, client.game(game), side, GameMemory())
            assert _named(client, name, defender, *args) == "ProverStepBadOpening"
            _lands_at(w3, client.game(game)["turnSince"] + client.game(game)["defenderLeft"] + 1)
            client._send("timeout", challenger, game)
            assert client.wrong(claim_id)
