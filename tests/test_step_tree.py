"""The tree sum as an op of the step game (issue 78): ``TREESUM``, each row's sum as
``training.exact_math.tree_sum`` adds it (halves added, an odd level's last node carried), proven on chain by
a descent of the disputed row's tree (StepProver ``postChildren``: the two children of the disputed node,
whose float32 sum must be the node; ``pickChild``: the challenger's pick) down to one input element opened
against the input's root (``proveStep``), on py-evm and anvil.

What is tested: the levels end in the kernel's bits for every length up to 70 and some longer; an honest tree
sum is upheld against a challenger that disputes everything (always the left child, always the right one
through the carried nodes, at random); a one-ulp cheat in one node of the tree, a wrong leaf, a wrong carried
element and a wrong sum of lengths 1 and 2 are proven; bad moves are refused by name; a tree sum inside a
program's step (odd rows) played by the node's one-sided defender (``ledger.stepdefense.defender_move``); a
stateful fuzzer (hypothesis) with honest defenders against adversarial challengers and cheating defenders
(forged children included) against honest challengers.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from eth_abi import encode

from ledger.chain import connect_pyevm
from ledger.chunkproof import tree_root
from ledger.reverts import decode_revert
from ledger.stepdefense import DefenseSide, GameMemory, defender_move
from ledger.stepproof import (
    PHASES,
    TREESUM,
    Defender,
    Operation,
    StepTrace,
    output_opening,
    play,
    step_game,
    sum_step_opening,
    tree_children,
)
from tests.ledger_fixtures import mine
from tests.test_step_proof import BOND, _backend, _bump, _setup, _spread
from training import exact_kernel, exact_math
from training.step_trace import (
    MATMUL,
    MUL,
    SUB,
    element_leaves,
    op_point,
    run_op,
    tree_levels,
    tree_levels_of,
)

NEG_ZERO = 0x80000000  # -0.0: x + -0.0 is x for every x, so (node, -0.0) always adds up to the node


def _op(x: torch.Tensor, out: torch.Tensor) -> Operation:
    rows, n = x.shape
    return Operation(TREESUM, rows, n, 1, element_leaves(x), [], element_leaves(out), rows * n, 0)


def _honest(x: torch.Tensor) -> Defender:
    rows, n = x.shape
    return Defender(_op(x, run_op(TREESUM, rows, n, 1, x, x)), "", lambda e, p: op_point(TREESUM, rows, n, 1,
                                                                                          x, x, e, p))


def _judge(x: torch.Tensor, row: int):
    """An honest challenger: it agrees with a posted node exactly when it is the true one."""
    truth = tree_levels(x, x.shape[1], row)
    return lambda node, bits: bits == truth[node[0]][node[1]]


def _bumped(levels: list[list[int]], level: int, index: int) -> list[list[int]]:
    """``levels`` with node ``index`` of ``level`` one ulp larger in magnitude, the levels above
    recomputed."""
    changed = list(levels[level])
    changed[index] += 1
    return levels[:level] + tree_levels_of(np.array(changed, dtype=np.uint32).view(np.float32))


def _cheat(x: torch.Tensor, row: int, levels: list[list[int]]) -> Defender:
    """A defender of a sum whose row ``row`` is the top of ``levels`` (its posts read ``levels``)."""
    rows, n = x.shape
    out = run_op(TREESUM, rows, n, 1, x, x).clone()
    out.view(torch.int32)[row] = np.array(levels[-1][0], dtype=np.uint32).view(np.int32).item()
    return Defender(_op(x, out), "", lambda e, p: levels[p[0]][p[1]])


def _as(defender: Defender, account: str) -> Defender:
    return Defender(defender.op, account, defender.sums)


def _time_out(client, game: bytes, caller: str) -> None:
    """Mine past the defender's clock and end the game (``timeout``)."""
    mine(client.w3, client.game(game)["defenderLeft"] + 1)
    client._send("timeout", caller, game)


def _named(client, name: str, sender: str, *args) -> str:
    with pytest.raises(Exception) as info:
        getattr(client.contract.functions, name)(*args).call({"from": sender})
    revert = decode_revert(info.value, name)
    return type(revert).__name__ if revert is not None else repr(info.value)


def test_the_levels_end_in_the_kernels_tree_sum_bit_for_bit():
    generator = torch.Generator().manual_seed(78)
    for n in [*range(1, 71), 127, 128, 129, 1000, 4097]:
        x = _spread(generator, 3, n)
        kernel = run_op(TREESUM, 3, n, 1, x, x)  # exact_kernel.tree_sum: the training's
        torch_levels = exact_math.tree_sum(x, 1).reshape(-1)
        assert torch.equal(kernel.view(torch.int32), torch_levels.view(torch.int32)), n
        for row in range(3):
            levels = tree_levels(x, n, row)
            assert levels[0] == [int(v) for v in x[row].numpy().view(np.uint32)]
            assert [len(level) for level in levels][-1] == 1 and len(levels) == 1 + math.ceil(math.log2(n))
            assert levels[-1][0] == int(kernel.view(torch.int32)[row]) & 0xFFFFFFFF
    x = _spread(generator, 4, 7, 3)  # the middle dimension of three: each (r, c)'s sum over k
    kernel = run_op(TREESUM, 4, 7, 3, x, x)
    assert torch.equal(kernel.view(torch.int32), exact_math.tree_sum(x, 1).reshape(-1).view(torch.int32))
    bits = kernel.view(torch.int32)
    assert all(tree_levels(x, 7, e, 3)[-1][0] == int(bits[e]) & 0xFFFFFFFF for e in range(12))
    for version in (2, 3):  # the kernel's versions add the same pairs
        x = _spread(generator, 5, 37)
        assert torch.equal(exact_kernel.tree_sum(x, 1, version).view(torch.int32),
                           exact_math.tree_sum(x, 1).view(torch.int32))


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_an_honest_tree_sum_is_upheld_and_a_one_ulp_node_and_a_wrong_leaf_are_proven(request, backend):
    w3 = _backend(request, backend)
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    x = _spread(torch.Generator().manual_seed(1), 4, 70)
    honest = _as(_honest(x), defender)
    claim = client.claim(honest.op, defender)
    bound = 2 + 2 * math.ceil(math.log2(70)) + 1
    for row, judge in ((1, lambda *_: False), (2, lambda *_: True), (3, _judge(x, 3))):
        won, moves = play(client, claim, honest, challenger, row, judge)  # left always, right always, truth
        assert won and moves <= bound
    assert not client.wrong(claim)
    assert client.contract.functions.balanceOf(defender).call() == 3 * BOND

    row, truth = 2, tree_levels(x, 70, 2)
    # one sum node one ulp off, carried up to the row's sum (the lowest whose ulp is not rounded away above)
    level, index = next((up, i) for up in range(1, len(truth) - 1) for i in range(len(truth[up - 1]) // 2)
                        if _bumped(truth, up, i)[-1] != truth[-1])
    levels = _bumped(truth, level, index)
    cheat = _as(_cheat(x, row, levels), defender)
    cheat_claim = client.claim(cheat.op, defender)
    game = client.challenge(cheat_claim, row, challenger)
    client._send("openOutput", defender, game, *output_opening(cheat.op, row))
    while client.game(game)["hi"] > level:  # down to the bumped node: its true children do not add up to it
        state = client.game(game)
        left, right = tree_children(70, state["hi"], state["lo"])
        client._send("postChildren", defender, game, levels[left[0]][left[1]], levels[right[0]][right[1]])
        client._send("pickChild", challenger, game, levels[left[0]][left[1]] == truth[left[0]][left[1]])
    state = client.game(game)
    assert (state["hi"], state["lo"]) == (level, index)
    left, right = tree_children(70, level, index)
    assert _named(client, "postChildren", defender, game, truth[left[0]][left[1]],
                  truth[right[0]][right[1]]) == "ProverStepTreeMismatch"
    _time_out(client, game, challenger)
    assert client.wrong(cheat_claim)

    wrong_input = x.clone()
    wrong_input[row, 33] = -x[row, 33] * 2  # the sum of a misread element
    levels = tree_levels(wrong_input, 70, row)
    assert levels[-1] != truth[-1]
    leaf_cheat = _as(_cheat(x, row, levels), defender)
    leaf_claim = client.claim(leaf_cheat.op, defender)
    won, moves = play(client, leaf_claim, leaf_cheat, challenger, row, _judge(x, row))
    assert not won and client.wrong(leaf_claim) and moves <= bound
    assert max(gas for _, gas, _ in client.gas_log) < 10_000_000
    assert max(size for _, _, size in client.gas_log) < 128 * 1024


def test_odd_lengths_carry_the_last_element_and_lengths_one_and_two():
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    generator = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 5, 7, 37):
        x = _spread(generator, 2, n)
        honest = _as(_honest(x), defender)
        claim = client.claim(honest.op, defender)
        halvings = math.ceil(math.log2(n)) if n > 1 else 0
        won, moves = play(client, claim, honest, challenger, 1, lambda *_: False)  # the left path: all sums
        assert won and moves == 3 + 2 * halvings
        won, moves = play(client, claim, honest, challenger, 1, lambda *_: True)  # the right: the carried
        assert won and moves <= 3 + 2 * halvings
        # the carried (last) element misread: the sum is off, the descent passes the carried nodes
        wrong_input = x.clone()
        wrong_input[1, n - 1] = -x[1, n - 1] * 2
        levels = tree_levels(wrong_input, n, 1)
        assert levels[-1] != tree_levels(x, n, 1)[-1], n
        cheat = _as(_cheat(x, 1, levels), defender)
        cheat_claim = client.claim(cheat.op, defender)
        won, moves = play(client, cheat_claim, cheat, challenger, 1, _judge(x, 1))
        assert not won and client.wrong(cheat_claim) and moves <= 3 + 2 * halvings
    # length 1: the sum is the element (copied); a wrong one is refuted by the leaf's opening at once
    x = _spread(generator, 3, 1)
    cheat = _as(_cheat(x, 0, _bumped(tree_levels(x, 1, 0), 0, 0)), defender)
    won, moves = play(client, client.claim(cheat.op, defender), cheat, challenger, 0, _judge(x, 0))
    assert not won and moves == 3
    # length 2: a sum one ulp off cannot post its true elements; forged ones (sum, -0.0) fail at the leaf
    x = _spread(generator, 1, 2)
    wrong = _bumped(tree_levels(x, 2, 0), 1, 0)
    cheat = _as(_cheat(x, 0, [[wrong[1][0], NEG_ZERO], wrong[1]]), defender)
    won, moves = play(client, client.claim(cheat.op, defender), cheat, challenger, 0, _judge(x, 0))
    assert not won and moves == 5


def test_bad_tree_sums_and_moves_are_refused_by_name():
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger, outsider = w3.eth.accounts[1:4]
    x = _spread(torch.Generator().manual_seed(5), 2, 9)
    op = _op(x, run_op(TREESUM, 2, 9, 1, x, x)).as_tuple()
    for field, value in ((2, 0), (3, 2), (4, 17), (5, 1)):  # inner 0, cols 2 or aLen not rows*inner*cols, b
        bad = tuple(value if i == field else v for i, v in enumerate(op))
        with pytest.raises(Exception):
            client._send("claim", defender, bad, value=BOND)
    honest = _as(_honest(x), defender)
    claim = client.claim(honest.op, defender)
    game = client.challenge(claim, 1, challenger)
    assert _named(client, "postChildren", defender, game, 0, 0) == "ProverStepWrongPhase"  # not opened yet
    client._send("openOutput", defender, game, *output_opening(honest.op, 1))
    assert PHASES[client.game(game)["phase"]] == "Tree"
    assert _named(client, "pickChild", challenger, game, True) == "ProverStepNotYourMove"
    left, right = tree_children(9, 4, 0)
    bits = [honest.sums(1, node) for node in (left, right)]
    assert _named(client, "postChildren", outsider, game, *bits) == "ProverStepNotYourMove"
    assert _named(client, "postChildren", defender, game, bits[0] + 1, bits[1]) == "ProverStepTreeMismatch"
    assert _named(client, "proveStep", defender, game, *output_opening(honest.op, 1)[1:]) == \
        "ProverStepWrongPhase"
    client._send("postChildren", defender, game, *bits)
    assert _named(client, "postChildren", defender, game, *bits) == "ProverStepNotYourMove"
    client._send("pickChild", challenger, game, False)
    assert (client.game(game)["hi"], client.game(game)["lo"]) == (3, 0)


def test_column_sums_a_broadcasts_backward():
    """``rows`` 1: each column's tree sum (``tree_sum`` over dimension 0: a broadcast bias's gradient over the
    batch), ``a`` as (1, inner, cols); an honest claim upheld on every column, a misread element proven."""
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    x = _spread(torch.Generator().manual_seed(11), 9, 5)  # 9 rows (odd: a carried row), 5 columns
    out = run_op(TREESUM, 1, 9, 5, x, x)
    assert torch.equal(out.view(torch.int32), exact_math.tree_sum(x, 0).reshape(-1).view(torch.int32))
    op = Operation(TREESUM, 1, 9, 5, element_leaves(x), [], element_leaves(out), 45, 0)
    honest = Defender(op, defender, lambda e, p: op_point(TREESUM, 1, 9, 5, x, x, e, p))
    claim = client.claim(op, defender)
    rng = random.Random(5)
    for col in range(5):
        assert play(client, claim, honest, challenger, col, lambda *_: rng.random() < 0.5)[0]
    truth, misread = tree_levels(x, 9, 3, 5), x.clone()
    misread[4, 3] = -2 * x[4, 3]
    levels = tree_levels(misread, 9, 3, 5)
    assert levels[-1] != truth[-1]
    wrong = out.clone()
    wrong.view(torch.int32)[3] = np.array(levels[-1][0], dtype=np.uint32).view(np.int32).item()
    cheat = Defender(Operation(TREESUM, 1, 9, 5, element_leaves(x), [], element_leaves(wrong), 45, 0),
                     defender, lambda e, p: levels[p[0]][p[1]])
    cheat_claim = client.claim(cheat.op, defender)
    won, moves = play(client, cheat_claim, cheat, challenger, 3,
                      lambda node, bits: bits == truth[node[0]][node[1]])
    assert not won and client.wrong(cheat_claim) and moves <= 3 + 2 * math.ceil(math.log2(9))


# ------------------------------------------------------------------ inside a program's step

#: state x (3x4), W (4x7), bias (7); h = x W (3 rows of 7, odd), q = h * h, s = the rows' tree sums of q,
#: bias' = bias - s (s broadcast as e % 3), W' = W - h (h as e % 21). Trace leaves 0-2 the state, 3-7 the
#: ops'.
PROGRAM = [(MATMUL, 3, 4, 7, 12, 28, 0, 1), (MUL, 21, 0, 1, 21, 21, 3, 3), (TREESUM, 3, 7, 1, 21, 0, 4, 4),
           (SUB, 7, 0, 1, 7, 3, 2, 5), (SUB, 28, 0, 1, 28, 21, 1, 3)]
COPIES = [0, 7, 6]


def _run_program(state, cheat_elem: int | None = None) -> list[torch.Tensor]:
    tensors = [t.reshape(-1) for t in state]
    for j, (kind, rows, inner, cols, _al, _bl, ai, bi) in enumerate(PROGRAM):
        out = run_op(kind, rows, inner, cols, tensors[ai], tensors[bi])
        tensors.append(_bump(out, cheat_elem) if kind == TREESUM and cheat_elem is not None else out)
    return tensors


def _program_sums(tensors):
    def sums(j, elem, point):
        kind, rows, inner, cols, _al, _bl, ai, bi = PROGRAM[j]
        return op_point(kind, rows, inner, cols, tensors[ai], tensors[bi], elem, point)
    return sums


def _program_state():
    generator = torch.Generator().manual_seed(7)
    return [_spread(generator, 3, 4), _spread(generator, 4, 7), _spread(generator, 7)]


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_one_ulp_tree_sum_in_a_step_is_proven_and_the_nodes_defender_upholds_an_honest_one(request,
                                                                                            backend):
    w3 = _backend(request, backend)
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    state = _program_state()
    truth, mine_ = _run_program(state), _run_program(state, cheat_elem=2)
    true_trace = StepTrace([element_leaves(t) for t in truth], PROGRAM, COPIES, 3)
    cheat_trace = StepTrace([element_leaves(t) for t in mine_], PROGRAM, COPIES, 3)
    x = truth[4].view(3, 7)
    won, moves = step_game(
        client, cheat_trace, defender, challenger, dispute=lambda last: ("trace", 0),
        judge_root=lambda j, root: root == tree_root(true_trace.tree(j)), pick=lambda op: 2,
        judge=lambda j, node, bits: bits == tree_levels(x, 7, 2)[node[0]][node[1]], sums=_program_sums(mine_))
    assert not won
    assert moves <= 2 + 2 + 2 * 3 + 2 + 2 * 3 + 1  # claim..disputeTrace, ops halvings, open, pick, tree, leaf
    # the honest step, defended one move at a time as a node does (defender_move), against a challenger that
    # agrees with the trace up to the tree sum, then disputes each row's sum and picks children at random
    claim = true_trace.claim()
    client._send("claimStep", defender, claim, value=client.bond)
    claim_id = bytes(client.w3.keccak(encode(["(bytes32,uint32,uint32,uint8,bytes32,bytes32)", "address"],
                                             [claim, defender])))
    honest_sums = _program_sums(truth)
    side = DefenseSide([true_trace], [], [], lambda step, j, elem, point: honest_sums(j, elem, point))
    for row in range(3):  # a fresh game each (a step claim's game keeps its last lo: defender_move reads it)
        other = w3.eth.accounts[3 + row]
        client._send("challengeStep", other, claim_id, value=client.bond)
        game = bytes(client.contract.functions.gameIdOf(claim_id, other).call())
        memory, rng = GameMemory(), random.Random(row)
        while (state_ := client.game(game))["phase"] != PHASES.index("Done"):
            move = defender_move(game, state_, side, memory)
            if move is not None:
                client._send(move[0], defender, *move[1])
                continue
            _challenger_move(client, game, state_, other, row, rng)
        assert not client.wrong(claim_id) and PHASES[client.game(game)["phase"]] == "Done"
    assert client.contract.functions.balanceOf(defender).call() == 3 * client.bond


def _challenger_move(client, game: bytes, state: dict, challenger: str, row: int, rng: random.Random) -> None:
    """The step game's challenger above: the trace disputed, the ops' trees agreed up to op 2 (the tree
    sum), row ``row`` of its output picked, then random children."""
    phase = PHASES[state["phase"]]
    if phase == "TraceEnd":
        client._send("disputeTrace", challenger, game)
    elif phase == "Ops":
        client._send("judgeRoot", challenger, game, (state["lo"] + state["hi"]) // 2 <= 2)
    elif phase == "Pick":
        client._send("pickElement", challenger, game, row)
    elif phase == "Tree":
        client._send("pickChild", challenger, game, rng.random() < 0.5)
    else:
        raise AssertionError(f"the challenger has no move in {phase}")


# ------------------------------------------------------------------ the stateful fuzzer


def _count(n: int, level: int) -> int:
    """Level ``level``'s node count of a tree sum over ``n`` elements."""
    for _ in range(level):
        n = (n + 1) // 2
    return n


class TreeGames(RuleBasedStateMachine):
    """Honest tree sums against challengers that pick any child, and cheating tree sums (one node one ulp off,
    or one element misread) whose defender posts, move by move, its own tree's children, the true ones, or
    forged ones that always add up (the node and -0.0, either way round) against an honest challenger, on one
    py-evm chain per example. Invariants: an honest claim never loses, a cheat never wins, each game within
    ``3 + 2 ceil(log2 n)`` moves, and the contract holds exactly what it owes (the winners' balances and the
    bond of each claim still standing)."""

    def __init__(self) -> None:
        super().__init__()
        w3 = connect_pyevm()  # a chain of its own: an example replayed meets the same state
        self.client, self.defender, self.challenger = _setup(w3), w3.eth.accounts[1], w3.eth.accounts[2]
        self.claims: dict[tuple, tuple[bytes, bool]] = {}  # op -> (claim id, honest)

    def _tensor(self, data) -> torch.Tensor:
        rows, n = data.draw(st.integers(1, 3), "rows"), data.draw(st.integers(1, 33), "n")
        return _spread(torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), "seed")), rows, n)

    @rule(data=st.data())
    def honest_defender_against_any_challenger(self, data):
        x = self._tensor(data)
        honest = _as(_honest(x), self.defender)
        key = honest.op.as_tuple()
        if key not in self.claims:
            self.claims[key] = (self.client.claim(honest.op, self.defender), True)
        row = data.draw(st.integers(0, x.shape[0] - 1), "row")
        won, moves = play(self.client, self.claims[key][0], honest, self.challenger, row,
                          lambda node, bits: data.draw(st.booleans(), f"agree with {node}"))
        assert won and moves <= 3 + 2 * math.ceil(math.log2(x.shape[1]))

    @rule(data=st.data())
    def cheating_defender_against_an_honest_challenger(self, data):
        x = self._tensor(data)
        rows, n = x.shape
        row = data.draw(st.integers(0, rows - 1), "row")
        truth = tree_levels(x, n, row)
        if n > 1 and data.draw(st.booleans(), "a node (else an element) wrong"):
            level = data.draw(st.integers(1, len(truth) - 1), "level")
            levels = _bumped(truth, level, data.draw(st.integers(0, _count(n, level - 1) // 2 - 1), "index"))
        else:
            wrong = x.clone()
            wrong[row, data.draw(st.integers(0, n - 1), "element")] = data.draw(
                st.floats(-2.0**100, 2.0**100, width=32), "read as")
            levels = tree_levels(wrong, n, row)
        assume(levels[-1] != truth[-1])
        cheat = _as(_cheat(x, row, levels), self.defender)
        assume(cheat.op.as_tuple() not in self.claims)
        claim = self.client.claim(cheat.op, self.defender)
        self.claims[cheat.op.as_tuple()] = (claim, False)
        moves = self._cheat_game(claim, cheat, row, truth, levels, data)
        assert self.client.wrong(claim) and moves <= 3 + 2 * math.ceil(math.log2(n))

    def _cheat_game(self, claim, cheat, row, truth, levels, data) -> int:
        client, n = self.client, cheat.op.inner
        game = client.challenge(claim, row, self.challenger)
        client._send("openOutput", self.defender, game, *output_opening(cheat.op, row))
        while PHASES[(state := client.game(game))["phase"]] == "Tree":
            node = int.from_bytes(state["hiRoot"], "big")
            left, right = tree_children(n, state["hi"], state["lo"])
            pair = {"own": (levels[left[0]][left[1]], levels[right[0]][right[1]]),
                    "true": (truth[left[0]][left[1]], truth[right[0]][right[1]]),
                    "forged left": (node, NEG_ZERO), "forged right": (NEG_ZERO, node)}[
                data.draw(st.sampled_from(["own", "true", "forged left", "forged right"]), "post")]
            try:
                client._send("postChildren", self.defender, game, *pair)
            except Exception:  # noqa: BLE001 - they do not add up to the node: the clock ends it
                _time_out(client, game, self.challenger)
                return client.game(game)["moves"]
            client._send("pickChild", self.challenger, game, pair[0] == truth[left[0]][left[1]])
        if PHASES[state["phase"]] == "Final":
            client._send("proveStep", self.defender, game, *sum_step_opening(cheat.op, row, state["lo"]))
        return client.game(game)["moves"]

    @invariant()
    def the_contract_holds_what_it_owes(self):
        contract, balance = self.client.contract, self.client.contract.functions.balanceOf
        standing = sum(1 for claim, _ in self.claims.values() if not self.client.wrong(claim))
        assert all(honest != self.client.wrong(claim) for claim, honest in self.claims.values())
        held = self.client.w3.eth.get_balance(contract.address)
        assert held == balance(self.defender).call() + balance(self.challenger).call() + BOND * standing


_FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class TestTreeGames(TreeGames.TestCase):
    """The default tier's few games (about 15 s on py-evm)."""

    settings = settings(max_examples=2, stateful_step_count=2, **_FUZZ)


@pytest.mark.slow
class TestTreeGamesLonger(TreeGames.TestCase):
    """More and longer sequences (about 2 min on py-evm)."""

    settings = settings(max_examples=40, stateful_step_count=4, **_FUZZ)
