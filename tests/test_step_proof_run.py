"""The contribution proof's top leg (issue 78): StepProver's bisection over a contribution's H inner steps.

A run claim says H steps of one program take the state root ``S_0`` to ``S_H`` (state trees: each state
tensor's own chunk tree's root, then zeros, so one element of any state is provable against its root). The
defender posts the state root after the midpoint step, the challenger agrees or not, down to one step, whose
step game (the ops' bisection, then the element game) decides. The program is tests/test_step_proof.py's toy
step run H = 6 times (its state fed back), on py-evm and on a real anvil.

What is tested: an honest challenger beats a contributor with a one-ulp cheat in any step (the cheat carried
on consistently after it) and its bond is paid to the challenger; an honest defender beats challengers that
disagree with everything, agree with everything, or answer at random; moves in the last block of each side's
clock are taken and one block later the clock decides; an outsider cannot move in another's game, and a
challenger has one running game on a claim at a time (others play their own at once: tests/test_step_case.py).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ledger.chain import connect_pyevm
from ledger.chunkproof import tree_root
from ledger.stepbinding import RunSubject
from ledger.stepproof import PHASES, run_claim, run_game, state_roots
from tests.step_binding_fixtures import bound_prover, subject_of
from tests.ledger_fixtures import mine
from tests.test_step_proof import (
    BOND,
    CLOCK,
    COPIES,
    _backend,
    _honest_challenger,
    _run_program,
    _sums_of,
    _trace,
)

STEPS = 6


def _start_state():
    """A state whose values stay finite for ``STEPS`` toy steps (W grows about quadratically each step)."""
    generator = torch.Generator().manual_seed(4)
    return [torch.randn(3, 4, generator=generator) * 0.5, torch.randn(4, 8, generator=generator) * 0.5,
            torch.randn(8, generator=generator) * 0.5]


def _run(state, cheat_step=None, cheat_op=0, cheat_elem=5):
    """Each of ``STEPS`` steps' tensors; a cheat bumps one op's output at ``cheat_step`` and carries on."""
    steps = []
    for i in range(STEPS):
        tensors = _run_program(state, cheat_op if i == cheat_step else None, cheat_elem)
        steps.append(tensors)
        state = [tensors[c] for c in COPIES]
    return steps


def _traces(steps):
    return [_trace(tensors) for tensors in steps]


def _honest_policy(truth_steps, mine_steps):
    """An honest challenger's step game at step ``i`` (tests/test_step_proof.py's honest challenger)."""
    def policy(i):
        c = _honest_challenger(truth_steps[i], mine_steps[i], _trace(mine_steps[i]))
        elem_of = {}

        def pick(op):
            elem_of["e"] = c["pick"](op)
            return elem_of["e"]

        return dict(dispute=c["dispute"], judge_root=c["judge_root"], pick=pick,
                    judge=lambda j, p, bits: c["judge_factory"](j, p, bits)(elem_of["e"]),
                    sums=_sums_of(mine_steps[i]))
    return policy


def _random_policy(rng, honest_steps):
    def policy(i):
        return dict(dispute=lambda last: ("copy", rng.randrange(8)) if rng.random() < 0.3 else ("trace", 0),
                    judge_root=lambda j, root: rng.random() < 0.5,
                    pick=lambda op: rng.randrange(op.rows * op.cols),
                    judge=lambda j, p, bits: rng.random() < 0.5, sums=_sums_of(honest_steps[i]))
    return policy


def test_the_state_roots_chain_and_open_one_element():
    steps = _run(_start_state())
    traces = _traces(steps)
    roots = state_roots(traces)
    assert len(roots) == STEPS + 1 and len(set(roots)) == STEPS + 1
    for i in range(STEPS - 1):  # the state tree after step i is the one step i + 1 starts from
        assert tree_root(traces[i].end_tree()) == roots[i + 1] == tree_root(traces[i + 1].tree(0))
    subject = RunSubject(7, 1, 0, b"\x01" * 32, b"\x02" * 32, ())
    claim = run_claim(traces, subject)
    assert claim[4] == roots[0] and claim[5] == roots[-1] and claim[6] == STEPS
    assert claim[7:] == (7, 1, 0, b"\x01" * 32, b"\x02" * 32, bytes(32), "0x" + "00" * 20)


@pytest.mark.parametrize("backend, cheat_step, cheat_op", [("pyevm", 0, 0), ("pyevm", 3, 1), ("pyevm", 5, 3),
                                                            ("anvil", 2, 0)])
def test_an_honest_challenger_proves_a_one_ulp_cheat_in_any_step(request, backend, cheat_step, cheat_op):
    w3 = _backend(request, backend)
    client, committed = bound_prover(w3, BOND, CLOCK)
    subject = subject_of(committed)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    truth = _run(_start_state())
    mine_steps = _run(_start_state(), cheat_step, cheat_op)
    truth_roots = state_roots(_traces(truth))
    splits = []

    def judge_state(i, root):
        splits.append(i)
        return root == truth_roots[i]

    won, moves = run_game(client, _traces(mine_steps), defender, challenger, subject=subject,
                          judge_state=judge_state, step_policy=_honest_policy(truth, mine_steps))
    assert not won
    halvings = math.ceil(math.log2(STEPS))
    assert len(splits) <= halvings
    # claim + challenge, the steps' halvings, then the step game's (tests/test_step_proof.py bound)
    assert moves <= 2 + 2 * halvings + 1 + 2 * 3 + 2 + 2 + 2 * 2 + 1
    assert client.contract.functions.balanceOf(challenger).call() == 2 * BOND
    assert client.contract.functions.balanceOf(defender).call() == 0
    assert max(gas for _, gas, _ in client.gas_log) < 10_000_000
    assert max(size for _, _, size in client.gas_log) < 128 * 1024


def test_an_honest_defender_beats_every_lying_challenger():
    """Disagree with everything, agree with everything, then random answers at every level (py-evm)."""
    w3 = connect_pyevm()
    client, committed = bound_prover(w3, BOND, CLOCK)
    subject = subject_of(committed)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    honest = _run(_start_state())
    traces = _traces(honest)
    rng = random.Random(7801)
    judges = [lambda i, root: False, lambda i, root: True] + [lambda i, root: rng.random() < 0.5] * 3
    for game, judge_state in enumerate(judges):
        won, _ = run_game(client, traces, defender, challenger, subject=subject, judge_state=judge_state,
                          step_policy=_random_policy(rng, honest), claimed=game > 0)
        assert won
    assert client.contract.functions.balanceOf(defender).call() == len(judges) * BOND


def test_the_clock_in_the_steps_bisection_and_who_may_move():
    w3 = connect_pyevm()
    client, committed = bound_prover(w3, BOND, CLOCK)
    subject = subject_of(committed)
    defender, challenger, outsider = w3.eth.accounts[1:4]
    traces = _traces(_run(_start_state()))
    roots = state_roots(traces)
    claim = run_claim(traces, subject)
    client._send("claimRun", defender, claim, subject.binding, value=BOND)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    client._send("challengeRun", challenger, claim_id, value=BOND)
    game = bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())
    assert client.game(game)["phase"] == PHASES.index("Steps")
    with pytest.raises(Exception):  # the challenger's second game on the claim while its first runs
        client._send("challengeRun", challenger, claim_id, value=BOND)
    with pytest.raises(Exception):  # an outsider posts for the defender
        client._send("postStateRoot", outsider, game, roots[3])
    with pytest.raises(Exception):  # the challenger cannot judge before a root is posted
        client._send("judgeStateRoot", challenger, game, True)
    # the defender's last block: it may still move
    mine(w3, client.game(game)["turnSince"] + CLOCK - 1 - w3.eth.block_number)
    client._send("postStateRoot", defender, game, roots[3])
    assert client.game(game)["defenderLeft"] == 0
    with pytest.raises(Exception):  # an outsider judges for the challenger
        client._send("judgeStateRoot", outsider, game, True)
    with pytest.raises(Exception):  # the defender cannot move twice
        client._send("postStateRoot", defender, game, roots[3])
    # the challenger's last block (the reverted moves above were mined too)
    mine(w3, client.game(game)["turnSince"] + client.game(game)["challengerLeft"] - 1 - w3.eth.block_number)
    client._send("judgeStateRoot", challenger, game, True)
    state = client.game(game)
    assert (state["lo"], state["hi"], state["challengerLeft"]) == (3, STEPS, 0)
    with pytest.raises(Exception):  # the defender's clock is spent: its next move is refused
        client._send("postStateRoot", defender, game, roots[4])
    client._send("timeout", outsider, game)
    assert client.wrong(claim_id)
    assert client.contract.functions.balanceOf(challenger).call() == 2 * BOND


def test_a_run_of_one_step_starts_in_the_step_game():
    w3 = connect_pyevm()
    client, committed = bound_prover(w3, BOND, CLOCK, steps=1)  # a run of H = 1
    subject = subject_of(committed)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    truth = _run(_start_state())[:1]
    mine_steps = [_run_program([truth[0][c] for c in (0, 1, 2)], 2, 9)]
    won, moves = run_game(client, _traces(mine_steps), defender, challenger, subject=subject,
                          judge_state=lambda i, root: pytest.fail("no steps to bisect"),
                          step_policy=_honest_policy(truth, mine_steps))
    assert not won and moves > 3


def _refused(client, name: str, sender: str, *args, value: int = 0) -> str:
    """Send move ``name``: the transaction must revert; the error it reverts with, named by the same call made
    right after (a failed receipt carries no revert data)."""
    from ledger.reverts import decode_revert

    with pytest.raises(Exception):
        client._send(name, sender, *args, value=value)
    with pytest.raises(Exception) as info:
        getattr(client.contract.functions, name)(*args).call({"from": sender, "value": value})
    revert = decode_revert(info.value, name)
    return type(revert).__name__ if revert is not None else repr(info.value)


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_judgment_one_block_past_the_clock_is_refused_and_outsiders_by_name(request, backend):
    """On both backends, each refusal named: an outsider's or the wrong side's move (NotYourMove), a
    challenger's second game on a run claim while its first runs (ClaimClosed), a judgment one block past the
    challenger's time (ClockOut, the game unchanged); then ``timeout`` gives the game to the defender."""
    w3 = _backend(request, backend)
    client, committed = bound_prover(w3, BOND, CLOCK)
    subject = subject_of(committed)
    defender, challenger, outsider = w3.eth.accounts[1:4]
    traces = _traces(_run(_start_state()))
    roots = state_roots(traces)
    claim = run_claim(traces, subject)
    client._send("claimRun", defender, claim, subject.binding, value=BOND)
    claim_id = bytes(client.contract.functions.runIdOf(claim, defender).call())
    client._send("challengeRun", challenger, claim_id, value=BOND)
    game = bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())
    assert _refused(client, "postStateRoot", outsider, game, roots[3]) == "ProverStepNotYourMove"
    assert _refused(client, "postStateRoot", challenger, game, roots[3]) == "ProverStepNotYourMove"
    assert _refused(client, "challengeRun", challenger, claim_id, value=BOND) == "ProverStepClaimClosed"
    client._send("postStateRoot", defender, game, roots[3])
    assert _refused(client, "judgeStateRoot", outsider, game, True) == "ProverStepNotYourMove"
    before = client.game(game)
    mine(w3, before["turnSince"] + before["challengerLeft"] - w3.eth.block_number)  # its tx lands one past
    assert _refused(client, "judgeStateRoot", challenger, game, True) == "ProverStepClockOut"
    after = client.game(game)
    assert (after["lo"], after["hi"], after["moves"], after["midPosted"]) == (0, STEPS, before["moves"], True)
    client._send("timeout", outsider, game)
    assert client.game(game)["phase"] == PHASES.index("Done")
    assert not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(defender).call() == BOND
