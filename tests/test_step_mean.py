"""The mean and a norm's statistic as programs of the step game (issue 78): RMSNorm's mean of squares over
each row, ``x * x`` (``MUL``), the rows' tree sums (``TREESUM``), divided by the count (``DIV`` by a constant
operand: a program input index ``CONST_INPUT + bits`` names the one-element tensor of those float32 bits,
whose root ``openOp`` recomputes, ``StepProverMath.constRoot``), on py-evm and anvil.

What is tested: the program's mean is ``training.exact_ops.mean_dims``'s bits; a one-ulp cheat in the mean or
in the sum under it is proven by an honest challenger and the honest step is upheld against a challenger that
disputes the mean; a trace that divides by another count loses at the division, and an opening that names
another constant's root is refused; the node's program file takes constants and runs them.
"""

from __future__ import annotations

import pytest
import torch

from ledger.chunkproof import tree_root
from ledger.reverts import decode_revert
from ledger.stepproof import PHASES, StepTrace, const_leaf, step_game
from node.errors import ConfigError
from node.stepprogram import StepProgram
from tests.test_step_proof import _backend, _bump, _setup, _spread
from training import exact_ops
from training.step_trace import (
    DIV,
    MUL,
    SUB,
    TREESUM,
    const_index,
    element_leaves,
    float32_bits,
    op_point,
    program_input,
    run_op,
)

ROWS, WIDTH = 4, 5
#: state x (4 x 5), g (5); q = x * x, s = the rows' tree sums of q, m = s / 5 (the mean of squares, RMSNorm's
#: statistic), g' = g - m (m broadcast as e % 4). Trace leaves 0-1 the state, 2-5 the ops' outputs.
PROGRAM = [(MUL, 20, 0, 1, 20, 20, 0, 0), (TREESUM, ROWS, WIDTH, 1, 20, 0, 2, 2),
           (DIV, ROWS, 0, 1, ROWS, 1, 3, const_index(WIDTH)), (SUB, WIDTH, 0, 1, WIDTH, ROWS, 1, 4)]
COPIES = [0, 5]
MEAN = 2  # the op index of the division


def _run(state, program=PROGRAM, cheat: tuple[int, int] | None = None) -> list[torch.Tensor]:
    tensors = [t.reshape(-1) for t in state]
    for j, (kind, rows, inner, cols, _al, _bl, ai, bi) in enumerate(program):
        out = run_op(kind, rows, inner, cols, program_input(tensors, ai), program_input(tensors, bi))
        tensors.append(_bump(out, cheat[1]) if cheat and cheat[0] == j else out)
    return tensors


def _trace(tensors) -> StepTrace:
    return StepTrace([element_leaves(t) for t in tensors], PROGRAM, COPIES, 3)


def _state():
    generator = torch.Generator().manual_seed(9)
    return [_spread(generator, ROWS, WIDTH), _spread(generator, WIDTH)]


def _sums(tensors):
    def sums(j, elem, point):
        kind, rows, inner, cols, _al, _bl, ai, bi = PROGRAM[j]
        return op_point(kind, rows, inner, cols, program_input(tensors, ai), program_input(tensors, bi), elem,
                        point)
    return sums


def _honest_challenger(truth, mine, elem: int) -> dict:
    """It agrees with every trace tree that is the truth's, picks ``elem`` of the split op and judges a
    tree's nodes by the truth's."""
    true_trace = _trace(truth)
    first = next(j for j in range(len(PROGRAM)) if not torch.equal(truth[2 + j].view(torch.int32),
                                                                   mine[2 + j].view(torch.int32)))
    return dict(dispute=lambda last: ("trace", 0),
                judge_root=lambda j, root: root == tree_root(true_trace.tree(j)),
                pick=lambda op: elem,
                judge=lambda j, point, bits: bits == _sums(truth)(first, elem, point),
                sums=_sums(mine))


def test_the_programs_mean_of_squares_is_the_trainings_bit_for_bit():
    generator = torch.Generator().manual_seed(4)
    for rows, width in ((4, 5), (3, 7), (2, 64), (5, 129)):
        x = _spread(generator, rows, width)
        program = [(MUL, rows * width, 0, 1, rows * width, rows * width, 0, 0),
                   (TREESUM, rows, width, 1, rows * width, 0, 1, 1),
                   (DIV, rows, 0, 1, rows, 1, 2, const_index(width))]
        tensors = _run([x], program)
        mean = exact_ops.mean_dims(x * x, -1)
        assert torch.equal(tensors[3].view(torch.int32), mean.view(torch.int32)), (rows, width)
    assert program_input([], const_index(5.0)).item() == 5.0
    assert tree_root([const_leaf(float32_bits(5.0))]) == tree_root(element_leaves(torch.tensor([5.0])))


@pytest.mark.parametrize("backend, cheat", [("pyevm", (MEAN, 3)), ("pyevm", (1, 2)), ("anvil", (MEAN, 1))])
def test_a_one_ulp_mean_or_sum_is_proven_and_the_honest_mean_upheld(request, backend, cheat):
    w3 = _backend(request, backend)
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    truth, mine = _run(_state()), _run(_state(), cheat=cheat)
    won, moves = step_game(client, _trace(mine), defender, challenger,
                           **_honest_challenger(truth, mine, cheat[1]))
    assert not won
    assert moves <= 2 + 2 + 2 * 2 + 2 + 2 * 3 + 1  # claim..disputeTrace, ops halvings, open, pick, tree, leaf
    # the honest step against a challenger that agrees up to the mean and disputes its every element
    for elem in range(ROWS):
        won, _ = step_game(client, _trace(truth), defender, w3.eth.accounts[3 + elem],
                           dispute=lambda last: ("trace", 0), judge_root=lambda j, root: j <= MEAN,
                           pick=lambda op, e=elem: e, judge=lambda *_: False, sums=_sums(truth),
                           claimed=elem > 0)
        assert won


def test_a_trace_with_another_count_loses_at_the_division_and_another_constant_is_refused():
    from ledger.chain import connect_pyevm

    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    truth = _run(_state())
    other = [(DIV, *spec[1:7], const_index(WIDTH - 1)) if spec[0] == DIV else spec for spec in PROGRAM]
    divided_by_4 = _run(_state(), other)  # the program says 5; this trace divided by 4
    won, _ = step_game(client, _trace(divided_by_4), defender, challenger,
                       **_honest_challenger(truth, divided_by_4, 0))
    assert not won
    # an opening of the division that names 4.0's root for the constant 5.0 is refused
    trace = _trace(truth)
    client._send("claimStep", defender, trace.claim(), value=client.bond)
    from eth_abi import encode

    claim_id = bytes(w3.keccak(encode(["(bytes32,uint32,uint32,uint8,bytes32,bytes32)", "address"],
                                      [trace.claim(), defender])))
    outsider = w3.eth.accounts[4]
    client._send("challengeStep", outsider, claim_id, value=client.bond)
    game = bytes(client.contract.functions.gameIdOf(claim_id, outsider).call())
    client._send("postTrace", defender, game, tree_root(trace.tree(len(PROGRAM))))
    client._send("disputeTrace", outsider, game)
    while (state := client.game(game))["phase"] == PHASES.index("Ops"):
        mid = (state["lo"] + state["hi"]) // 2
        client._send("postRoot", defender, game, tree_root(trace.tree(mid)))
        client._send("judgeRoot", outsider, game, mid <= MEAN)
    assert client.game(game)["lo"] == MEAN
    opening = list(trace.op_opening(MEAN))
    opening[6] = tree_root([const_leaf(float32_bits(WIDTH - 1.0))])
    with pytest.raises(Exception) as info:
        client.contract.functions.openOp(game, tuple(opening)).call({"from": defender})
    assert type(decode_revert(info.value, "openOp")).__name__ == "ProverStepBadOpening"
    client._send("openOp", defender, game, trace.op_opening(MEAN))


def test_the_nodes_program_file_takes_constants():
    origins = ((0, ROWS * WIDTH, 0, 2), (1, WIDTH, 1, 2))
    program = StepProgram(tuple(PROGRAM), tuple(COPIES), 3, origins)
    runs = program.run(_state(), 2)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(runs[0], _run(_state())))
    bad = [*PROGRAM[:MEAN], (DIV, ROWS, 0, 1, ROWS, 1, 3, 2**33), PROGRAM[3]]
    with pytest.raises(ConfigError, match="is not"):
        StepProgram(tuple(bad), tuple(COPIES), 3, origins)
