"""The elementwise functions on chain (issue 78, docs/FRAUD_PROOF.md "Elementwise functions"): StepProver's op
kinds UNARY (8) and UNARY_SLOPE (9), recomputed by contracts/src/Float64Functions.sol bit for bit as training
computes them (training/exact_ops.py ``UNARY``, kernel versions 1 and 3; ``exact_kernel.sqrt`` version 3).

Three layers, each against the one below: training's bits; the Python mirror (ledger/stepfunctions.py) on
thousands of inputs per function; the contract on a sample of them per function on py-evm and a larger one
(one eth_call batch a function) on anvil; then element games and a step game with unary ops.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import stepfunctions as sf
from ledger.chain import connect_pyevm
from ledger.stepproof import UNARY, UNARY_SLOPE, Defender, Operation, StepProverClient, StepTrace, deploy
from ledger.stepproof import play, step_game
from tests.ledger_fixtures import deploy_library, fresh_anvil_w3
from training import exact_ops
from training.step_trace import UNARY_CODES, element_leaves, run_op

BOND = 10**15
CLOCK = 20
NO_LEDGER = "0x" + "00" * 20
OPS = sf.OPS


def _f32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


SPECIAL = np.array(sf.EDGE_INPUTS, dtype=np.uint32)


def inputs(count: int, seed: int) -> np.ndarray:
    """``count`` float32 bit patterns: the special ones, uniformly random bits, and values of the usual
    range (normal, several scales)."""
    rng = np.random.default_rng(seed)
    rest = count - len(SPECIAL)
    random_bits = rng.integers(0, 2**32, rest // 2, dtype=np.uint64).astype(np.uint32)
    scale = 10.0 ** rng.integers(-4, 3, rest - rest // 2)
    usual = _f32(rng.standard_normal(rest - rest // 2) * scale)
    return np.concatenate([SPECIAL, random_bits, usual])


def training_bits(kind: int, code: int, bits: np.ndarray, version: int = 3) -> np.ndarray:
    """What training computes: ``run_op`` (kernel version 3's compiled pass) or version 1's torch formulas."""
    x = torch.from_numpy(bits.view(np.float32).copy())
    if version == 3:
        out = run_op(kind, len(bits), code, 1, x, x)
    else:
        value, slope = exact_ops.UNARY[UNARY_CODES[code]](x.to(torch.float64))
        out = (value if kind == UNARY else slope).float()
    return out.numpy().view(np.uint32)


def _mismatches(got, want, bits) -> list[str]:
    return [f"x=0x{int(b):08x}: 0x{int(g):08x} != 0x{int(w):08x}" for g, w, b in zip(got, want, bits)
            if not sf.same32(int(g), int(w))]


# ------------------------------------------------------------------ the mirror against training


def test_codes_are_the_same_in_training_and_ledger():
    assert {code: name for code, name in UNARY_CODES.items()} == sf.NAMES
    assert set(UNARY_CODES.values()) - {"sqrt"} == set(exact_ops.UNARY)


@pytest.mark.parametrize("kind, code", OPS)
def test_the_mirror_is_training_bit_for_bit(kind, code):
    bits = inputs(4000, seed=code + 100 * kind)
    mirror = [sf.unary_bits(kind, code, int(b)) for b in bits]
    assert not _mismatches(mirror, training_bits(kind, code, bits), bits)[:5]
    if UNARY_CODES[code] != "sqrt":  # kernel version 1's torch formulas: the same bits as version 3's pass
        assert not _mismatches(mirror, training_bits(kind, code, bits, version=1), bits)[:5]


def test_a_wrong_code_is_refused_in_training_and_ledger():
    x = torch.ones(3)
    for kind, code in ((UNARY, 0), (UNARY, 9), (UNARY_SLOPE, 8), (UNARY_SLOPE, 0)):
        with pytest.raises(ValueError, match="elementwise function"):
            run_op(kind, 3, code, 1, x, x)
        with pytest.raises(sf.UnaryCodeError, match="function code"):
            sf.unary_bits(kind, code, 0x3F800000)


# ------------------------------------------------------------------ the contract's library


def _library(w3):
    return deploy_library(w3, "Float64Functions")


def _on_chain(library, kind, code, bits, batch=64) -> list[int]:
    out = []
    for start in range(0, len(bits), batch):
        chunk = [int(b) for b in bits[start:start + batch]]
        out += library.functions.unaryMany(kind, code, chunk).call({"gas": 30_000_000})
    return out


@pytest.fixture(scope="module")
def pyevm_library():
    return _library(connect_pyevm())


#: The special inputs py-evm recomputes every op at in the default tier (anvil takes thousands): +-0, the
#: smallest subnormal, +-inf, a NaN, the largest float32, exp's two clamps, -1, 1e-30 and 300.
PYEVM_SAMPLE = SPECIAL[[0, 1, 2, 8, 9, 10, 13, 15, 16, 24, 26, 34]]


def test_the_contract_is_the_mirror_on_pyevm(pyevm_library):
    for kind, code in OPS:
        got = _on_chain(pyevm_library, kind, code, PYEVM_SAMPLE)
        want = [sf.unary_bits(kind, code, int(b)) for b in PYEVM_SAMPLE]
        assert not _mismatches(got, want, PYEVM_SAMPLE)[:5], (kind, code)


@pytest.mark.slow
@pytest.mark.parametrize("kind, code", OPS)
def test_the_contract_is_the_mirror_on_pyevm_at_length(pyevm_library, kind, code):
    bits = inputs(len(SPECIAL) + 24, seed=7 + code + 100 * kind)
    got = _on_chain(pyevm_library, kind, code, bits)
    assert not _mismatches(got, [sf.unary_bits(kind, code, int(b)) for b in bits], bits)[:5]


def test_the_contract_is_training_on_anvil_for_thousands_of_inputs(request):
    library = _library(fresh_anvil_w3(request, timeout=120.0))
    for kind, code in OPS:
        bits = inputs(1000, seed=11 + code + 100 * kind)
        got = _on_chain(library, kind, code, bits, batch=250)
        assert not _mismatches(got, training_bits(kind, code, bits), bits)[:5], (kind, code)


def test_the_soft_float_pieces(pyevm_library):
    fns = pyevm_library.functions
    f64 = lambda x: int(np.float64(x).view(np.uint64))  # noqa: E731
    rng = np.random.default_rng(3)
    pairs = [(1.0, 2.0 ** -60), (1.0, -(2.0 ** -60)), (1.0, -1.0), (-0.0, -0.0), (0.0, -0.0), (1e308, 1e308),
             (float("inf"), float("-inf")), (5e-324, -5e-324), (2.2250738585072014e-308, -5e-324)]
    pairs += [tuple(v) for v in rng.standard_normal((20, 2)) * 10.0 ** rng.integers(-30, 30, (20, 2))]
    for x, y in pairs:
        with np.errstate(all="ignore"):
            want = int(np.float64(np.float64(x) + np.float64(y)).view(np.uint64))
        got = fns.add64(f64(x), f64(y)).call()
        assert got == want or (np.isnan(np.float64(x) + np.float64(y))), (x, y, hex(got), hex(want))
    for v in (0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999999999999994, 1074.5, -1075.5, 3.0, -0.0, 7e-300):
        assert fns.rint(f64(v)).call() == round(v)
    for v in (1.0, 0.75, 3.0, 1e-310, 5e-324, -6.5, 1e300):
        m, e = fns.frexp(f64(v)).call()
        assert (np.uint64(m).view(np.float64), e) == np.frexp(np.float64(v))


# ------------------------------------------------------------------ games


def _backend(request, name):
    return connect_pyevm() if name == "pyevm" else fresh_anvil_w3(request, timeout=60.0)


def _unary_op(kind: int, code: int, x: torch.Tensor, out: torch.Tensor) -> Operation:
    return Operation(kind, x.numel(), code, 1, element_leaves(x), [], element_leaves(out), x.numel(), 0)


def _bump(t: torch.Tensor, index: int) -> torch.Tensor:
    bits = t.detach().clone().contiguous().view(-1).view(torch.int32)
    bits[index] += 1
    return bits.view(torch.float32)


@pytest.mark.parametrize("backend", ["pyevm", "anvil"])
def test_an_honest_unary_claim_is_upheld_and_a_one_ulp_cheat_proven(request, backend):
    w3 = _backend(request, backend)
    client = StepProverClient(w3, deploy(w3, BOND, CLOCK, NO_LEDGER))
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    x = torch.from_numpy(inputs(130, seed=5).view(np.float32).copy())
    ops = ((UNARY_SLOPE, 6), (UNARY, 8)) if backend == "pyevm" else ((UNARY, 6), (UNARY_SLOPE, 6), (UNARY, 2))
    for kind, code in ops:
        out = run_op(kind, 130, code, 1, x, x)
        op = _unary_op(kind, code, x, out)
        claim = client.claim(op, defender)
        for elem in (0, 129):  # a challenger that disputes anything loses to the honest claim
            assert play(client, claim, Defender(op, defender), challenger, elem, lambda *_: False)[0]
        elem = 100  # a finite output: one ulp off is another value
        assert np.isfinite(out[elem].item())
        wrong = _unary_op(kind, code, x, _bump(out, elem))
        wrong_claim = client.claim(wrong, defender)
        won, moves = play(client, wrong_claim, Defender(wrong, defender), challenger, elem, lambda *_: False)
        assert not won and client.wrong(wrong_claim) and moves <= 3
    assert max(gas for _, gas, _ in client.gas_log) < 10_000_000


def test_a_wrong_function_code_or_shape_is_refused_at_the_claim():
    w3 = connect_pyevm()
    client = StepProverClient(w3, deploy(w3, BOND, CLOCK, NO_LEDGER))
    x = torch.ones(4)
    good = _unary_op(UNARY, 1, x, run_op(UNARY, 4, 1, 1, x, x))
    for bad in (_unary_op(UNARY, 0, x, x), _unary_op(UNARY, 9, x, x), _unary_op(UNARY_SLOPE, 8, x, x),
                Operation(UNARY, 4, 1, 1, good.a, good.a, good.out, 4, 4),  # a b operand
                Operation(UNARY, 4, 1, 2, good.a, [], good.out, 4, 0),  # cols other than 1
                Operation(UNARY, 4, 1, 1, good.a, [], good.out, 3, 0)):  # a shorter than the output
        with pytest.raises(Exception, match="revert|ProverStepBadOp|0x"):
            client.claim(bad, w3.eth.accounts[1])
    client.claim(good, w3.eth.accounts[1])


#: A toy step with unary ops: state x (16), W (16); h = x * W, g = gelu(h), d = gelu'(h), s = sqrt(|..|)
#: of d * d, W' = W - g * s (trace leaves 0-1 the state, 2-7 the ops' outputs).
PROGRAM = [(3, 16, 0, 1, 16, 16, 0, 1), (UNARY, 16, 6, 1, 16, 0, 2, 2), (UNARY_SLOPE, 16, 6, 1, 16, 0, 2, 2),
           (3, 16, 0, 1, 16, 16, 4, 4), (UNARY, 16, 8, 1, 16, 0, 5, 5), (3, 16, 0, 1, 16, 16, 3, 6),
           (2, 16, 0, 1, 16, 16, 1, 7)]
COPIES = [0, 8]


def _run_program(state, cheat_op=None, cheat_elem=0):
    tensors = [t.reshape(-1) for t in state]
    for j, (kind, rows, inner, cols, _al, _bl, ai, bi) in enumerate(PROGRAM):
        out = run_op(kind, rows, inner, cols, tensors[ai], tensors[bi])
        tensors.append(_bump(out, cheat_elem) if j == cheat_op else out)
    return tensors


def _trace(tensors):
    return StepTrace([element_leaves(t) for t in tensors], PROGRAM, COPIES, 4)


def _challenger(truth, mine):
    from ledger.chunkproof import tree_root

    truth_trace = _trace(truth)

    def pick(op):
        j = next(j for j in range(len(PROGRAM)) if not torch.equal(mine[2 + j].view(torch.int32),
                                                                 truth[2 + j].view(torch.int32)))
        return int((mine[2 + j].view(torch.int32) != truth[2 + j].view(torch.int32)).nonzero()[0])

    return dict(dispute=lambda last: ("trace", 0), pick=pick,
                judge_root=lambda j, root: root == tree_root(truth_trace.tree(j)), judge=lambda *_: False,
                sums=lambda *_: 0)


def _state():
    generator = torch.Generator().manual_seed(9)
    return [torch.randn(16, generator=generator) * 3, torch.randn(16, generator=generator)]


@pytest.mark.parametrize("backend, cheat_op", [("pyevm", 1), ("pyevm", 2), ("pyevm", 4), ("anvil", 2)])
def test_a_one_ulp_cheat_in_a_unary_op_of_a_step_is_proven(request, backend, cheat_op):
    w3 = _backend(request, backend)
    client = StepProverClient(w3, deploy(w3, BOND, CLOCK, NO_LEDGER))
    truth = _run_program(_state())
    mine = _run_program(_state(), cheat_op, 3)
    won, moves = step_game(client, _trace(mine), w3.eth.accounts[1], w3.eth.accounts[2],
                           **_challenger(truth, mine))
    assert not won
    assert moves <= 4 + 2 * 3 + 3  # claim..disputeTrace, the halvings over 7 ops, openOp, pick, openOutput


def test_an_honest_step_with_unary_ops_never_loses_to_an_adversarial_challenger():
    import random

    w3 = connect_pyevm()
    client = StepProverClient(w3, deploy(w3, BOND, CLOCK, NO_LEDGER))
    truth = _run_program(_state())
    rng = random.Random(781)
    for game in range(3):
        won, _ = step_game(client, _trace(truth), w3.eth.accounts[1], w3.eth.accounts[2],
                           dispute=lambda last: ("trace", 0), judge_root=lambda j, root: rng.random() < 0.5,
                           pick=lambda op: rng.randrange(op.rows * op.cols), judge=lambda *_: False,
                           sums=lambda *_: 0, claimed=game > 0)
        assert won


def test_a_program_op_of_an_unknown_code_never_holds_in_a_step_game():
    """A step whose program names function code 9 (none) loses at that op, whatever its output: the contract
    recomputes nothing for it (``unaryHolds`` false)."""
    w3 = connect_pyevm()
    client = StepProverClient(w3, deploy(w3, BOND, CLOCK, NO_LEDGER))
    x, w = _state()
    product = run_op(3, 16, 0, 1, x, w)
    program = [(3, 16, 0, 1, 16, 16, 0, 1), (UNARY, 16, 9, 1, 16, 0, 2, 2)]
    tensors = [x, w, product, run_op(UNARY, 16, 1, 1, product, product)]  # "code 9" computed as exp
    trace = StepTrace([element_leaves(t) for t in tensors], program, [0, 3], 3)
    won, _ = step_game(client, trace, w3.eth.accounts[1], w3.eth.accounts[2],
                       dispute=lambda last: ("trace", 0), judge_root=lambda j, root: j <= 1,
                       pick=lambda op: 0, judge=lambda *_: False, sums=lambda *_: 0)
    assert not won


# ------------------------------------------------------------------ fuzzing the mirror against training


def _fuzz(kind_code, raw):
    kind, code = kind_code
    bits = np.array([raw], dtype=np.uint32)
    assert not _mismatches([sf.unary_bits(kind, code, raw)], training_bits(kind, code, bits), bits)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(OPS), st.integers(0, 2**32 - 1))
def test_fuzz_the_mirror_against_training(kind_code, raw):
    _fuzz(kind_code, raw)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(OPS), st.one_of(st.integers(0, 2**32 - 1),
                                       st.floats(-800, 800, width=32).map(lambda v: int(_f32([v])[0]))))
def test_fuzz_the_mirror_against_training_at_length(kind_code, raw):
    _fuzz(kind_code, raw)


@pytest.mark.slow
def test_fuzz_the_contract_against_training_on_anvil(request):
    library = _library(fresh_anvil_w3(request, timeout=300.0))
    for kind, code in OPS:
        bits = inputs(5000, seed=1000 + code + 100 * kind)
        got = _on_chain(library, kind, code, bits, batch=250)
        assert not _mismatches(got, training_bits(kind, code, bits), bits)[:5], (kind, code)
