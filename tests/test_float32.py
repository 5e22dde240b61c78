"""The Float32 soft-float (contracts/src/Float32.sol) agrees with torch bit for bit, on a real EVM.

Every operation runs through Float32Harness: on the in-process py-evm for every combination of edge values
(signed zeros, the smallest and largest subnormals, the smallest normal, 1, the largest finite value,
infinities, quiet and signalling NaNs) and for operands built to round at an exact tie, to overflow, to
underflow and to round up into the next binade (each of which the test checks it actually met); on the
session's anvil for the edges again, the built operands, and a few thousand random and edge-biased operands
per operation. Results are compared bit
for bit, a NaN result by class only (docs/SOFTFLOAT.md: the NaN bits follow x86's rule). The millions-of-
operands run is bench/fuzz_float32.py.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from ledger.chain import connect_pyevm, connect_rpc
from tests.float32_reference import (
    IDENTITY,
    OPS,
    biased_bits,
    deploy_harness,
    edge_operands,
    harness_call,
    is_nan,
    mismatches,
    near_bits,
    random_bits,
    reference,
    tie_operands,
)

#: What the edge and tie operands of each rounding operation must include (rounding_events' names).
REQUIRED_EVENTS = {
    "add": {"tie", "next_binade", "overflow", "subnormal"},
    "sub": {"tie", "next_binade", "overflow", "subnormal"},
    "mul": {"tie", "next_binade", "overflow", "subnormal", "underflow", "underflow_zero"},
    "div": {"tie", "next_binade", "overflow", "subnormal", "underflow", "underflow_zero"},
    "mul64": {"tie", "next_binade", "overflow", "subnormal", "underflow", "underflow_zero"},
    "div64": {"tie", "next_binade", "overflow", "subnormal", "underflow", "underflow_zero"},
    "toFloat32": {"tie", "next_binade", "overflow", "subnormal", "underflow", "underflow_zero"},
    "fromInt": {"tie", "next_binade"},
    "fromInt32": {"tie", "next_binade", "overflow"},
}
RANDOM_PER_OP = 1500  # random bit patterns, and as many edge-biased ones, per operation (anvil)


@pytest.fixture(scope="module")
def pyevm():
    w3 = connect_pyevm()
    return w3, deploy_harness(w3)


@pytest.fixture(scope="module")
def anvil(anvil_session):
    w3 = connect_rpc(anvil_session.url, timeout=60.0)
    return w3, deploy_harness(w3)


def check_against_torch(chain, op, a, b) -> np.ndarray:
    """Run ``op`` on the harness and assert every result is torch's; the results."""
    w3, address = chain
    got = harness_call(w3, address, op, a, b, gas=2_000_000_000)
    expected = reference(op, a, b)
    bad = mismatches(op, got, expected)
    shown = [
        f"{op.name}({int(a[i]):#x}{'' if b is None else f', {int(b[i]):#x}'}) = {int(got[i]):#x}, "
        f"torch {int(expected[i]):#x}"
        for i in bad[:5]
    ]
    assert bad.size == 0, f"{bad.size} of {len(got)} differ from torch: {shown}"
    return got


def _value(bits: int, width: int) -> float:
    dtype = (np.uint32, np.float32) if width == 4 else (np.uint64, np.float64)
    return dtype[1](dtype[0](bits).view(dtype[1]))


def exact_result(op, x, y) -> Fraction | None:
    """The exact (unrounded) result of a rounding operation, None when an operand is not finite (or b = 0)."""
    if op.name in ("fromInt", "fromInt32"):
        return Fraction(x)
    values = [_value(int(x), op.width)] + ([] if y is None else [_value(int(y), op.width)])
    if not all(np.isfinite(values)):
        return None
    fractions = [Fraction(float(v)) for v in values]
    if op.name == "toFloat32":
        return fractions[0]
    first, second = fractions
    if op.name in ("add",):
        return first + second
    if op.name == "sub":
        return first - second
    if op.name in ("mul", "mul64"):
        return first * second
    return first / second if second else None


def rounding_events(op, a, b, got) -> Counter:
    """How often the results of a rounding operation met each case: an exact ``tie``, a round up into the
    ``next_binade``, ``overflow`` to infinity, a ``subnormal`` result, an inexact tiny result (``underflow``)
    and a non-zero exact result rounded to zero (``underflow_zero``)."""
    width = op.out_width
    floating = np.float32 if width == 4 else np.float64
    smallest_normal = Fraction(float(np.finfo(floating).tiny))
    events = Counter()
    for i in range(len(got)):
        exact = exact_result(op, a[i], None if b is None else b[i])
        if exact is None:
            continue
        result = _value(int(got[i]), width)
        if np.isinf(result):
            events["overflow"] += 1
            continue
        rounded = Fraction(float(result))
        if exact != 0 and rounded == 0:
            events["underflow_zero"] += 1
        if rounded != 0 and abs(rounded) < smallest_normal:
            events["subnormal"] += 1
            events["underflow"] += rounded != exact
        if rounded == exact:
            continue
        with np.errstate(over="ignore"):
            neighbour = np.nextafter(result, floating(np.inf if exact > rounded else -np.inf))
        if np.isfinite(neighbour) and 2 * exact == rounded + Fraction(float(neighbour)):
            events["tie"] += 1
        magnitude = abs(rounded)
        if magnitude.numerator & (magnitude.numerator - 1) == 0 \
                and magnitude.denominator & (magnitude.denominator - 1) == 0:
            events["next_binade"] += abs(exact) < magnitude
    return events


def operands(op, *parts) -> tuple:
    """The concatenation of ``(a, b)`` operand parts (Python ints for the integer operations)."""
    if op.width == 32:
        return [v for a, _ in parts for v in a], None
    a = np.concatenate([a for a, _ in parts])
    return a, (np.concatenate([b for _, b in parts]) if op.binary else None)


@pytest.mark.parametrize("name", list(OPS))
def test_every_pair_of_edge_values_matches_torch_on_pyevm(pyevm, name):
    op = OPS[name]
    a, b = edge_operands(op)
    got = check_against_torch(pyevm, op, a, b)
    if op.result in ("f32", "f64") and op.operand != "int":
        assert is_nan(got, op.out_width).any(), f"{name}: no NaN result among the edge operands"


@pytest.mark.parametrize("name", list(OPS))
def test_ties_and_random_operands_match_torch_on_anvil(anvil, name):
    op = OPS[name]
    rng = np.random.default_rng(4400 + op.number)
    edges = edge_operands(op)
    ties = tie_operands(rng, op, 300)
    uniform = random_bits(rng, op.width, RANDOM_PER_OP)
    biased = biased_bits(rng, op.width, RANDOM_PER_OP)
    if op.binary:
        # the second operand: random, edge-biased, or a's neighbours (results near a tie or a cancellation)
        half = RANDOM_PER_OP // 2
        random_part = (uniform,
                       np.concatenate([random_bits(rng, op.width, half), near_bits(rng, uniform[half:])]))
        biased_part = (biased,
                       np.concatenate([biased_bits(rng, op.width, half), near_bits(rng, biased[half:])]))
    else:
        random_part, biased_part = (uniform, None), (biased, None)
    a, b = operands(op, edges, ties, random_part, biased_part)
    got = check_against_torch(anvil, op, a, b)
    required = REQUIRED_EVENTS.get(name, set())
    if required:
        count = len(edges[0]) + len(ties[0])  # the edges and ties must meet every case on their own
        events = rounding_events(op, a[:count], None if b is None else b[:count], got[:count])
        met = {event for event, times in events.items() if times}
        assert required <= met, f"{name}: operands never met {sorted(required - met)}: {events}"


def test_nan_rule_is_x86s(pyevm):
    """The documented NaN bits (docs/SOFTFLOAT.md): the first NaN operand quieted, else the negative default
    NaN."""
    w3, address = pyevm
    inf, nan_payload, snan = 0x7F800000, 0x7FC12345, 0xFFA00001

    def run(name, a, b=None):
        op = OPS[name]
        dtype = np.uint32 if op.width == 4 else np.uint64
        return [int(v) for v in harness_call(w3, address, op, np.array(a, dtype=dtype),
                                             None if b is None else np.array(b, dtype=dtype))]

    assert run("add", [inf, 0, nan_payload, snan], [inf | 0x80000000, 0, snan, nan_payload]) == [
        0xFFC00000, 0, nan_payload, snan | 0x00400000]
    assert run("mul", [0, 0x3F800000], [inf, snan]) == [0xFFC00000, snan | 0x00400000]
    assert run("div", [0, inf], [0x80000000, inf]) == [0xFFC00000, 0xFFC00000]
    assert run("sub", [0x3F800000], [snan]) == [snan | 0x00400000]  # b's own sign, not negated
    assert run("toFloat32", [0x7FF0000000000001, 0xFFF8000012345678]) == [0x7FC00000,
                                                                          0xFFC00000 | (0x12345678 >> 29)]
    assert run("toFloat64", [snan]) == [0xFFF4000020000000 | 0x0008000000000000]
    assert run("sqrt64", [0xBFF0000000000000]) == [0xFFF8000000000000]


def test_same32_holds_any_two_nans_equal_and_nothing_else(pyevm):
    w3, address = pyevm
    op = OPS["same32"]
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32)
    a, b = np.repeat(nans, 4), np.tile(nans, 4)
    assert harness_call(w3, address, op, a, b).all()
    others = np.array([0x00000000, 0x80000000, 0x7F800000, 0x3F800000], dtype=np.uint32)
    a, b = np.repeat(others, 4), np.tile(others, 4)
    assert list(harness_call(w3, address, op, a, b)) == [int(x == y) for x, y in zip(a, b)]  # -0 is not +0


def test_gas_is_measured_against_the_identity(pyevm):
    """The gas harness reports the library's own cost: zero for the identity, more for a slow path than a
    fast one (a subnormal operand takes the general path)."""
    w3, address = pyevm
    ones = np.full(4, 0x3F800001, dtype=np.uint32)
    assert not harness_call(w3, address, IDENTITY, ones, measure=True).any()
    fast = harness_call(w3, address, OPS["mul"], ones, ones, measure=True)
    slow = harness_call(w3, address, OPS["mul"], np.full(4, 3, dtype=np.uint32), ones, measure=True)
    assert (fast > 0).all() and (slow > fast).all()
