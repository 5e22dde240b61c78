"""The norm proof's arithmetic (issue 43, docs/FRAUD_PROOF.md "The clip scales"): the exact sums of squares
and the norm rule in Python, the integer binary64 arithmetic behind the proof (NormRule.sol, through its
harness on py-evm: pure functions, no adversary's move) compared with Python's float, and the node's side
(which proof a difference calls for, a served norm state checked against its leaf).

Split from tests/test_norm_proof.py (its round and fixtures).
"""

from __future__ import annotations

import dataclasses
import math
import random
import struct

import numpy as np
import pytest
import torch

import contracts
from ledger import errors
from ledger.chain import connect_pyevm
# re-exported: tests/test_norm_proof_availability.py imports these from here
from ledger.availability import (  # noqa: F401
    FACTORS,
    PAYLOAD,
    availability_answer,
    availability_target,
    sums_which,
)
from ledger.chunkproof import Factors
from ledger.normproof import (SCALES, SumTree, clip_scales, norm_of, square_sum,
                              sum_bytes, sum_to_double, sum_words)
from node.fraudproof import chunk_square_sums
from tests.fraud_fixtures import (
    lied_sum,
    with_scale,
)
from tests.ledger_fixtures import deploy, mine  # noqa: F401 (mine: tests/test_norm_proof_availability.py)
from training.chunks import float64_bits, stage_layout
from training.codec_wire import decode_declared
from training.robust import contribution_norm

from tests.test_norm_proof import NORMED, SHAPES, bits64, blobs, f64, honest  # noqa: F401 (honest: fixture)


# -------------------------------------------------------------------------------------------- the Python side


def test_the_sums_are_the_training_norms_exactly(honest):
    """n_j = sqrt(double(S_j)) is training/robust.py's norm bit for bit, and the committed scales are its
    rule."""
    norms = honest.honest.factors.norms
    decoded = [decode_declared(blob, SHAPES, stage_index=0, outer_round=1)[1] for blob in blobs()]
    assert [norm_of(total) for total in norms.sums] == [contribution_norm(t) for t in decoded]
    scales = clip_scales(norms.sums, f64(norms.clip_bits))
    assert [float64_bits(s) for s in scales] == list(honest.honest.factors.scale_bits)
    assert scales[:2] == [1.0, 1.0] and scales[2] < 1.0
    assert norms.steps == () and f64(norms.clip_bits) == 2.0
    for tree, total, root in zip(honest.honest.sum_trees, norms.sums, norms.roots, strict=True):
        assert tree.total == total == sum(tree.sums) and tree.root == root
        assert len(tree.sums) == len(stage_layout(SHAPES))


@pytest.mark.parametrize("seed", range(6))
def test_square_sums_match_fsum_on_random_tensors_with_subnormals_and_extremes(seed):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(3000) * 10.0 ** rng.integers(-45, 38, 3000)).astype(np.float32)
    values[:20] = np.array([0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4028235e38, -3.4028235e38, 2**-149, 2**-126,
                            1.0, -1.0, 0.5, 2.0, 3.0, 7.0, 1e-40, 1e20, -1e30, 65504.0, 1e-20],
                           dtype=np.float32)
    rng.shuffle(values)
    total = square_sum(values.astype("<f4").tobytes())
    exact = math.fsum(float(x) * float(x) for x in values)  # each square exact; one rounding of the sum
    assert sum_to_double(total) == exact
    assert norm_of(total) == contribution_norm({"x": torch.from_numpy(values)})


def test_a_stage_sum_is_the_sum_of_its_chunks_and_hostile_sums_are_refused():
    tensors = {"a": torch.randn(5, 30), "b": torch.randn(7)}
    sums = chunk_square_sums(tensors)
    assert len(sums) == len(stage_layout({name: tuple(t.shape) for name, t in tensors.items()}))
    assert norm_of(sum(sums)) == contribution_norm(tensors)
    with pytest.raises(errors.LedgerInputError):
        square_sum(struct.pack("<f", math.inf))
    with pytest.raises(errors.LedgerInputError):
        square_sum(b"\x00\x00\x80")
    with pytest.raises(errors.LedgerInputError):
        sum_bytes(2**768)
    with pytest.raises(errors.LedgerInputError):
        SumTree.of([])


def test_factors_of_version_two_keep_their_bytes_and_version_three_round_trips(honest):
    factors = honest.honest.factors
    v2 = dataclasses.replace(factors, norms=None)
    assert v2.encode()[96:128] == (192).to_bytes(32, "big")  # six fields: unchanged bytes
    assert Factors.decode(v2.encode()) == v2
    assert Factors.decode(factors.encode()) == factors
    with pytest.raises(errors.LedgerInputError):
        Factors.decode(factors.encode() + bytes(32))


# ----------------------------------------------------------------------------------------------- NormRule.sol


@pytest.fixture(scope="module")
def harness():
    w3 = connect_pyevm()
    artifact = contracts.artifact("NormHarness")
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    address = w3.eth.wait_for_transaction_receipt(
        factory.constructor().transact({"from": w3.eth.accounts[0]}))[
        "contractAddress"]
    return w3.eth.contract(address=address, abi=artifact["abi"])


def edge_sums(rng: random.Random) -> list[int]:
    """Sums (units 2**-298) at every width, at and around binary64 rounding ties, and the largest."""
    sums = [0, 1, 2, 3, 2**53 - 1, 2**53, 2**53 + 1, 2**54 + 2, 2**255, 2**256 - 1, 2**256, 2**511, 2**512,
            2**767, 2**768 - 1]
    for top in (60, 200, 254, 255, 256, 257, 300, 400, 509, 510, 511, 512, 513, 600, 700, 765, 766, 767):
        base = 1 << top
        half = 1 << (top - 53)  # half a unit of the 53-bit significand
        for offset in (-1, 0, 1):
            sums += [base + half + offset, base + 3 * half + offset, base + (half << 1) + offset]
    sums += [rng.getrandbits(rng.randrange(1, 769)) for _ in range(3000)]
    return [s for s in sums if 0 <= s < 2**768]


def test_to_double_is_correctly_rounded_over_every_width(harness):
    sums = edge_sums(random.Random(1))
    words = [w for s in sums for w in sum_words(s)]
    got = harness.functions.toDouble(words).call()
    assert [f64(bits) for bits in got] == [sum_to_double(s) for s in sums]


def test_square_sums_on_chain_are_exact(harness):
    rng = np.random.default_rng(3)
    edge = [0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000,
            0x00000003]
    for batch in (edge, rng.integers(0, 0x7F800000, 64).tolist(), rng.integers(0, 0x00800000, 64).tolist(),
                  (rng.integers(0x7E000000, 0x7F800000, 64) | 0x80000000).tolist()):
        values = struct.pack(f"<{len(batch)}I", *batch)
        expected = square_sum(values)
        assert tuple(harness.functions.squareSum(batch).call()) == sum_words(expected)


def random_double(rng: random.Random) -> float:
    """A finite non-negative double of any class: subnormal, normal of any exponent, a power of two."""
    kind = rng.randrange(4)
    if kind == 0:
        return f64(rng.randrange(1, 2**52))  # subnormal
    if kind == 1:
        return math.ldexp(1.0, rng.randrange(-1074, 1000))
    return f64(rng.randrange(1, 0x7FF0000000000000))


def test_binary64_multiply_divide_and_sqrt_are_pythons_float(harness):
    """Float32.mul64, div64 and sqrt64, which the norm rule uses, against Python's float (correct rounding) on
    random and edge operands: subnormals, the extremes of the range, exact and tie results."""
    w3 = harness.w3
    artifact = contracts.artifact("Float32Harness")
    factory = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"])
    address = w3.eth.wait_for_transaction_receipt(
        factory.constructor().transact({"from": w3.eth.accounts[0]}))[
        "contractAddress"]
    float32 = w3.eth.contract(address=address, abi=artifact["abi"])
    rng = random.Random(7)
    a = [random_double(rng) for _ in range(1500)] + [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
                                                     1.0, 2.0, 0.1, 9.0, 2.0 ** -1074 * 3]
    b = [random_double(rng) for _ in range(len(a) - 8)] + [2.0, 0.5, 0.5, 3.0, 1.5, 3.0, 3.0, 4.0]
    pack = lambda xs: b"".join(struct.pack(">d", x) for x in xs)  # noqa: E731
    unpack = lambda data: [f64(int.from_bytes(data[i:i + 8], "big")) for i in range(0, len(data), 8)]  # noqa: E731
    assert unpack(float32.functions.run(4, pack(a), pack(b)).call({"gas": 10**9})) == [x * y
                                                                                       for x, y in zip(a, b)]
    assert unpack(float32.functions.run(12, pack(a), pack(b)).call({"gas": 10**9})) == [x / y
                                                                                        for x, y in zip(a, b)]
    assert unpack(float32.functions.run(13, pack(a), b"").call({"gas": 10**9})) == [math.sqrt(x) for x in a]


def test_the_norm_rule_on_chain_is_pythons(harness):
    rng = random.Random(11)
    for trial in range(60):
        count = rng.randrange(1, 12)
        top = rng.choice([40, 200, 298, 400, 600, 760])
        sums = [rng.getrandbits(rng.randrange(max(1, top - 20), top + 1)) for _ in range(count)]
        if trial % 5 == 0:
            sums[0] = 0
        if trial % 7 == 0:  # a contribution exactly at the bound: 4x the square of the median's sum
            sums[-1] = 4 * sorted(sums)[(count - 1) // 2]
        steps = [rng.randrange(1, 1000) for _ in range(count)] if trial % 3 == 0 else []
        clip = rng.choice([0.0, 1.0, 2.0, 1.5, 3.7])
        words = [w for s in sums for w in sum_words(s)]
        got = harness.functions.scales(words, steps, bits64(clip)).call()
        assert [f64(bits) for bits in got] == clip_scales(sums, clip, steps), (sums, steps, clip)



def test_the_contracts_stay_within_eip_170_and_eip_3860():
    for name in ("TrainingLedger", "AggregationProver"):
        size = (len(contracts.artifact(name)["deployedBytecode"]) - 2) // 2
        assert size <= 24_576, f"{name}: {size} bytes of deployed code, EIP-170 allows 24,576"
    initcode = (len(contracts.artifact("TrainingLedger")["bytecode"]) - 2) // 2
    assert initcode <= 49_152, \
        f"TrainingLedger: {initcode} bytes of initcode (holding the prover's), EIP-3860 allows 49,152"


# -------------------------------------------------------------------------------------------- the node's side


def test_the_node_finds_the_norm_proof_of_a_difference(honest):
    """node.fraudproof.norm_proof_of_difference: the scales first, then the first lied chunk of a tree whose
    pieces are this node's; nothing for a right round or version-2 factors."""
    from node.fraudproof import norm_proof_of_difference

    own = honest.honest
    leaves = [own.leaf().encode(), honest.other.leaf().encode()]
    # the record's fields only travel in the proof
    record = type("Record", (), {"fields": lambda self: (1, 1)})()

    def weights():
        return own.weight_leaves

    def find(committed):
        return norm_proof_of_difference(record, leaves, 0, committed.factors, committed.sum_trees, own,
                                        weights)

    proof, why = find(with_scale(own, 0, float64_bits(0.5)))
    assert proof.contribution == SCALES and "clip scale 0" in why
    proof, why = find(lied_sum(own, 1, 7))
    assert (proof.contribution, proof.chunk) == (1, 7) \
        and proof.sum_leaf == sum_bytes(own.sum_trees[1].sums[7] + 1)
    proof, why = find(own)
    assert proof is None and "differ elsewhere" in why
    v2 = dataclasses.replace(own, factors=dataclasses.replace(own.factors, norms=None), sum_trees=[])
    proof, why = find(v2)  # the run's version is on chain: version-2 factors in a version-3 run are proven
    assert proof.contribution == SCALES and proof.factors == v2.factors.encode() and "version 2" in why
    # Without the committed trees: a tree other than this
    # node's is not had (the live prover walks it: SumWalk) ...
    lied = lied_sum(own, 1, 7)
    proof, why = norm_proof_of_difference(record, leaves, 0, lied.factors, None, own, weights)
    assert proof is None and "sum trees are not had" in why
    # ... but one whose root is this node's is its own: a lied total alone is proven at any chunk.
    norms = own.factors.norms
    total_only = dataclasses.replace(own.factors, norms=dataclasses.replace(
        norms, sums=(norms.sums[0], norms.sums[1] - 1, *norms.sums[2:])))
    proof, why = norm_proof_of_difference(record, leaves, 0, total_only, None, own, weights)
    assert (proof.contribution, proof.chunk) == (1, 0) \
        and proof.sum_leaf == sum_bytes(own.sum_trees[1].sums[0])
    proof, why = norm_proof_of_difference(record, leaves, 0, own.factors, None, own, weights)
    assert proof is None and "differ elsewhere" in why


def test_a_served_norm_state_is_checked_against_the_committed_leaf(honest):
    from ledger.normproof import encode_norm_state, parse_norm_state

    state = honest.honest
    leaf = state.leaf()
    data = encode_norm_state(state.factors.encode(), state.sum_trees)
    factors, trees = parse_norm_state(data, leaf.factors_hash, leaf.num_chunks)
    assert factors == state.factors and [t.root for t in trees] == list(state.factors.norms.roots)
    lied = lied_sum(state, 2, 0)  # a lied tree under its own (committed) root parses: the proof shows the lie
    parse_norm_state(encode_norm_state(lied.factors.encode(), lied.sum_trees), lied.factors.digest(),
                     leaf.num_chunks)
    for bad, why in ((data[:-1], "truncated"), (data + b"\x00", "trailing"),
                     (encode_norm_state(state.factors.encode(), lied.sum_trees), "not the committed root")):
        with pytest.raises(errors.LedgerInputError, match=why):
            parse_norm_state(bad, leaf.factors_hash, leaf.num_chunks)
    with pytest.raises(errors.LedgerInputError, match="not the committed stage leaf"):
        parse_norm_state(data, bytes(32), leaf.num_chunks)
    with pytest.raises(errors.LedgerInputError, match="chunks"):
        parse_norm_state(data, leaf.factors_hash, leaf.num_chunks + 1)
