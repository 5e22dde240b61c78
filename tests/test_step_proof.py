"""The contribution proof's bottom legs (issue 78): the trace of a reproducible inner step
(training/step_trace.py) and StepProver (contracts/src/StepProver.sol), the bisection over one product
element's partial sums and the final float32 step, on py-evm and on a real anvil.

What is tested: the traced inner steps give the bits of untraced ones and the same trace twice; the partial
sums end in ``ordered_matmul``'s bits; a one-ulp cheat in a product or an elementwise op is proven and the
cheat's bond goes to the challenger; an honest claim is upheld against every challenger answer (a stateful
fuzzer: random challengers against honest defenders, cheating defenders with random posted sums against honest
challengers); the clock; outsiders and bad openings.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ledger.chain import connect_pyevm
from ledger.chunkproof import tree_root
from ledger.stepproof import ADD, DIV, MATMUL, MUL, Defender, Operation, StepProverClient, deploy, play
from tests.ledger_fixtures import fresh_anvil_w3, mine
from training import exact_kernel
from training.exact_probe import trainer_for
from training.step_trace import element_leaves, partial_sums, state_tensors, trace_steps

BOND = 10**15
CLOCK = 20
NO_LEDGER = "0x" + "00" * 20


def _spread(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """float32 values spanning several orders of magnitude, both signs."""
    base = torch.randn(*shape, generator=generator)
    return (base * torch.pow(10.0, torch.randint(-3, 3, shape, generator=generator).float())).float()


def _bump(t: torch.Tensor, index: int) -> torch.Tensor:
    """``t`` with element ``index`` one unit in the last place larger in magnitude."""
    bits = t.detach().clone().contiguous().view(-1).view(torch.int32)
    bits[index] += 1
    return bits.view(torch.float32).view(t.shape)


def _matmul_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Operation:
    rows, inner = a.shape
    cols = b.shape[1]
    return Operation(MATMUL, rows, inner, cols, element_leaves(a), element_leaves(b), element_leaves(out),
                     rows * inner, inner * cols)


def _elementwise_op(kind: int, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Operation:
    return Operation(kind, out.numel(), 0, 1, element_leaves(a), element_leaves(b), element_leaves(out),
                     a.numel(), b.numel())


def _honest_sums(a, b, cols):
    cache = {}

    def sums(elem, point):
        if elem not in cache:
            cache[elem] = partial_sums(a, b, elem // cols, elem % cols)
        return cache[elem][point]

    return sums


def _honest_judge(a, b, cols, elem):
    truth = partial_sums(a, b, elem // cols, elem % cols)
    return lambda point, posted: posted == truth[point]


@pytest.fixture(scope="module")
def product():
    generator = torch.Generator().manual_seed(11)
    a, b = _spread(generator, 3, 70), _spread(generator, 70, 5)
    return a, b, exact_kernel.ordered_matmul(a, b)


# ------------------------------------------------------------------ the trace (training/step_trace.py)


def test_traced_inner_steps_are_the_inner_steps_bit_for_bit():
    cfg, plain = trainer_for("tiny", "adamw", True, 2, 3)
    _, traced = trainer_for("tiny", "adamw", True, 2, 3)
    _, again = trainer_for("tiny", "adamw", True, 2, 3)

    def batches():
        generator = torch.Generator().manual_seed(7)
        return [tuple(torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=generator)
                      for _ in range(2)) for _ in range(2)]

    losses = [plain.train_step(x, y) for x, y in batches()]
    start, traces = trace_steps(traced, batches(), tree_root)
    assert [t.loss for t in traces] == losses
    for (name, want), (_, got) in zip(state_tensors(plain), state_tensors(traced), strict=True):
        assert torch.equal(want.view(torch.int32), got.view(torch.int32)), name
    phases = {phase for t in traces for phase, _, _ in t.ops}
    assert phases == {"forward", "backward", "optimizer"}
    assert any("linear" in name or "addmm" in name for _, name, _ in traces[0].ops)
    assert len({start, traces[0].state_root, traces[1].state_root}) == 3
    start_again, traces_again = trace_steps(again, batches(), tree_root)
    assert start_again == start
    assert [(t.ops, t.state_root) for t in traces_again] == [(t.ops, t.state_root) for t in traces]


def test_partial_sums_end_in_ordered_matmuls_bits(product):
    a, b, out = product
    bits = out.contiguous().view(torch.int32).numpy().astype(np.uint32)
    for row in range(a.shape[0]):
        for col in range(b.shape[1]):
            sums = partial_sums(a, b, row, col)
            assert sums[0] == 0 and len(sums) == a.shape[1] + 1
            assert sums[-1] == int(bits[row, col])


# ------------------------------------------------------------------ the contract (StepProver.sol)


def _setup(w3):
    address = deploy(w3, BOND, CLOCK, NO_LEDGER)  # op and step claims only: no run claim here
    return StepProverClient(w3, address)


def _backend(request, name):
    return connect_pyevm() if name == "pyevm" else fresh_anvil_w3(request, timeout=60.0)


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_one_ulp_cheat_in_a_product_is_proven_and_an_honest_one_upheld(request, backend, product):
    w3 = _backend(request, backend)
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    a, b, out = product
    cols = b.shape[1]
    honest = Defender(_matmul_op(a, b, out), defender, _honest_sums(a, b, cols))
    claim = client.claim(honest.op, defender)
    # a challenger that disagrees with everything still loses to the honest claim
    won, moves = play(client, claim, honest, challenger, 7, lambda point, posted: False)
    assert won and not client.wrong(claim)
    assert moves <= 2 + 2 * int(np.ceil(np.log2(a.shape[1]))) + 1
    assert client.contract.functions.balanceOf(defender).call() == BOND

    elem = 8
    cheat_out = _bump(out, elem)
    truth = _honest_sums(a, b, cols)
    cheat = Defender(_matmul_op(a, b, cheat_out), defender,
                     lambda e, point: truth(e, point) + (point > 40))  # honest up to 40, one ulp off after
    cheat_claim = client.claim(cheat.op, defender)
    won, _ = play(client, cheat_claim, cheat, challenger, elem, _honest_judge(a, b, cols, elem))
    assert not won and client.wrong(cheat_claim)
    assert client.contract.functions.balanceOf(challenger).call() == 2 * BOND
    assert max(gas for _, gas, _ in client.gas_log) < 10_000_000
    assert max(size for _, _, size in client.gas_log) < 128 * 1024


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_a_one_ulp_cheat_in_an_elementwise_op_is_proven(request, backend):
    w3 = _backend(request, backend)
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    generator = torch.Generator().manual_seed(5)
    x, bias = _spread(generator, 130), _spread(generator, 10)
    out = x + bias.repeat(13)  # one IEEE add per element: the bias broadcast as e % 10
    op = _elementwise_op(ADD, x, bias, out)
    claim = client.claim(op, defender)
    assert play(client, claim, Defender(op, defender), challenger, 129, lambda *_: False)[0]
    for kind, value in ((MUL, x * x), (DIV, x / x.flip(0))):
        other = x if kind == MUL else x.flip(0)
        assert play(client, client.claim(_elementwise_op(kind, x, other, value), defender),
                    Defender(_elementwise_op(kind, x, other, value), defender), challenger, 64,
                    lambda *_: False)[0]
        wrong = _elementwise_op(kind, x, other, _bump(value, 64))
        wrong_claim = client.claim(wrong, defender)
        assert not play(client, wrong_claim, Defender(wrong, defender), challenger, 64, lambda *_: False)[0]
        assert client.wrong(wrong_claim)


def test_the_clock_and_who_may_move(product):
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger, outsider = w3.eth.accounts[1:4]
    a, b, out = product
    op = _matmul_op(a, b, out)
    claim = client.claim(op, defender)
    game = client.challenge(claim, 3, challenger)
    with pytest.raises(Exception):  # a second game on a busy claim
        client.challenge(claim, 4, outsider)
    from ledger.stepproof import opening, EMPTY
    with pytest.raises(Exception):  # an outsider moves for the defender
        client._send("openOutput", outsider, game, opening(op.out, 3), EMPTY, EMPTY)
    with pytest.raises(Exception):  # a wrong element's opening
        client._send("openOutput", defender, game, opening(op.out, 100), EMPTY, EMPTY)
    with pytest.raises(Exception):  # the clock still runs
        client._send("timeout", outsider, game)
    # the last block of the defender's time (the reverted moves above were mined too): it may still move
    mine(w3, client.game(game)["turnSince"] + CLOCK - 1 - w3.eth.block_number)
    client._send("openOutput", defender, game, opening(op.out, 3), EMPTY, EMPTY)
    assert client.game(game)["defenderLeft"] == 0
    mine(w3, 1)  # one block more: the defender's clock is spent
    with pytest.raises(Exception):
        client._send("postSum", defender, game, 0)
    client._send("timeout", outsider, game)
    assert client.wrong(claim)
    assert client.contract.functions.balanceOf(challenger).call() == 2 * BOND


def test_fuzz_honest_never_loses(product):
    """Random challengers against honest claims, honest challengers against random cheats (py-evm)."""
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    a, b, out = product
    cols = b.shape[1]
    truth = _honest_sums(a, b, cols)
    honest = Defender(_matmul_op(a, b, out), defender, truth)
    honest_claim = client.claim(honest.op, defender)
    rng = random.Random(78)
    for _ in range(4):  # an adversarial challenger: random answers, random element
        elem = rng.randrange(out.numel())
        won, _ = play(client, honest_claim, honest, challenger, elem, lambda *_: rng.random() < 0.5)
        assert won
    for trial in range(4):  # an adversarial defender: a one-ulp cheat, random posted sums
        elem = rng.randrange(out.numel())
        flips = {p: rng.random() < 0.5 for p in range(a.shape[1] + 1)}
        cheat = Defender(_matmul_op(a, b, _bump(out, elem)), defender,
                         lambda e, point: truth(e, point) ^ int(flips[point]))
        claim = client.claim(cheat.op, defender)
        won, _ = play(client, claim, cheat, challenger, elem, _honest_judge(a, b, cols, elem))
        assert not won


# ------------------------------------------------------------------ one step of a program (StepClaim)

from ledger.stepproof import StepTrace, step_game  # noqa: E402
from training.step_trace import SUB, run_op  # noqa: E402

#: A toy step in the documented op kinds: state x (3x4), W (4x8), bias (8); h = x W, y = h + bias,
#: z = y * y, W' = W - z, bias' = bias * y. Trace leaves: 0-2 the state, 3-7 the ops' outputs.
PROGRAM = [(MATMUL, 3, 4, 8, 12, 32, 0, 1), (ADD, 24, 0, 1, 24, 8, 3, 2), (MUL, 24, 0, 1, 24, 24, 4, 4),
           (SUB, 32, 0, 1, 32, 24, 1, 5), (MUL, 8, 0, 1, 8, 24, 2, 4)]
COPIES = [0, 6, 7]


def _run_program(state, cheat_op=None, cheat_elem=0):
    tensors = [t.reshape(-1) for t in state]
    for j, (kind, rows, inner, cols, _al, _bl, ai, bi) in enumerate(PROGRAM):
        out = run_op(kind, rows, inner, cols, tensors[ai], tensors[bi])
        if j == cheat_op:
            out = _bump(out, cheat_elem)
        tensors.append(out)
    return tensors


def _trace(tensors, end=None):
    return StepTrace([element_leaves(t) for t in tensors], PROGRAM, COPIES, 3, end)


def _state():
    generator = torch.Generator().manual_seed(3)
    return [_spread(generator, 3, 4), _spread(generator, 4, 8), _spread(generator, 8)]


def _honest_challenger(truth_tensors, mine_tensors, mine_trace):
    truth = _trace(truth_tensors)

    def dispute(last):
        if last != tree_root(truth.tree(len(PROGRAM))):
            return "trace", 0
        mine_end, true_end = mine_trace.end_tree(), truth.end_tree()
        return "copy", next(q for q in range(len(true_end)) if mine_end[q] != true_end[q])

    def pick(op):
        j = next(j for j in range(len(PROGRAM)) if not torch.equal(
            mine_tensors[3 + j].view(torch.int32), truth_tensors[3 + j].view(torch.int32)))
        mine, true = mine_tensors[3 + j].view(torch.int32), truth_tensors[3 + j].view(torch.int32)
        return int((mine != true).nonzero()[0])

    def judge(j, point, bits):
        kind, rows, inner, cols, _al, _bl, ai, bi = PROGRAM[j]
        a, b = truth_tensors[ai].view(rows, inner), truth_tensors[bi].view(inner, cols)
        return lambda elem: partial_sums(a, b, elem // cols, elem % cols)[point] == bits

    return dict(dispute=dispute, judge_root=lambda j, root: root == tree_root(truth.tree(j)), pick=pick,
                judge_factory=judge)


def _sums_of(tensors):
    def sums(j, elem, point):
        kind, rows, inner, cols, _al, _bl, ai, bi = PROGRAM[j]
        return partial_sums(tensors[ai].view(rows, inner), tensors[bi].view(inner, cols),
                            elem // cols, elem % cols)[point]
    return sums


def _play_honest_challenger(client, w3, mine_tensors, mine_trace, truth_tensors):
    c = _honest_challenger(truth_tensors, mine_tensors, mine_trace)
    elem_of = {}

    def pick(op):
        elem_of["e"] = c["pick"](op)
        return elem_of["e"]

    return step_game(client, mine_trace, w3.eth.accounts[1], w3.eth.accounts[2], dispute=c["dispute"],
                     judge_root=c["judge_root"], pick=pick,
                     judge=lambda j, p, bits: c["judge_factory"](j, p, bits)(elem_of["e"]),
                     sums=_sums_of(mine_tensors))


#: The forward product, an add, the "update" on py-evm; the product on anvil too (the same code path).
@pytest.mark.parametrize("backend, cheat_op", [("pyevm", 0), ("pyevm", 1), ("pyevm", 3), ("anvil", 0)])
def test_a_one_ulp_cheat_in_any_op_of_a_step_is_proven(request, backend, cheat_op):
    w3 = _backend(request, backend)
    client = _setup(w3)
    state = _state()
    truth = _run_program(state)
    mine = _run_program(state, cheat_op, 5)
    won, moves = _play_honest_challenger(client, w3, mine, _trace(mine), truth)
    assert not won
    assert moves <= 2 + 2 * 3 + 2 + 2 + 2 * 2 + 1  # claim..postTrace, ops halvings, open, pick, sums, final


def test_a_state_root_that_is_not_the_traces_copy_is_proven():
    w3 = connect_pyevm()
    client = _setup(w3)
    state = _state()
    truth = _run_program(state)
    honest = _trace(truth)
    end = list(honest.end_tree())
    end[1] = honest.roots()[1]  # W' claimed as the old W: the update skipped
    won, _ = _play_honest_challenger(client, w3, truth, _trace(truth, end), truth)
    assert not won


def test_fuzz_an_honest_step_never_loses_to_any_challenger():
    w3 = connect_pyevm()
    client = _setup(w3)
    state = _state()
    truth = _run_program(state)
    trace = _trace(truth)
    rng = random.Random(780)
    for game in range(6):
        won, _ = step_game(
            client, trace, w3.eth.accounts[1], w3.eth.accounts[2],
            dispute=lambda last: ("copy", rng.randrange(8)) if rng.random() < 0.3 else ("trace", 0),
            judge_root=lambda j, root: rng.random() < 0.5,
            pick=lambda op: rng.randrange(op.rows * op.cols),
            judge=lambda j, p, bits: rng.random() < 0.5, sums=_sums_of(truth), claimed=game > 0)
        assert won


def test_an_element_alone_in_its_chunk_is_opened():
    """A tensor's last chunk leaf of one element is 28 bytes: its header is read from those (the opening read
    32 bytes and reverted, so no element of a tensor of 64 m + 1 elements past the last full chunk, nor of a
    one-element tensor, could be opened: an honest defender lost there)."""
    w3 = connect_pyevm()
    client = _setup(w3)
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    generator = torch.Generator().manual_seed(65)
    for numel in (65, 1):
        x, y = _spread(generator, numel), _spread(generator, numel)
        op = _elementwise_op(ADD, x, y, x + y)
        assert play(client, client.claim(op, defender), Defender(op, defender), challenger, numel - 1,
                    lambda *_: False)[0]
