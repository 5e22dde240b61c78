"""The fraud proof of a wrong clip scale (issue 43, docs/FRAUD_PROOF.md "The clip scales"), on py-evm.

A version-3 (``diloco.commitments = "normed"``) round commits each accepted contribution's exact sum of
squares and its sum tree. A quorum that commits scale 1.0 for a contribution the norm rule clips, with weights
consistent with it (no chunk proof can catch that), is proven wrong from the committed sums; a quorum that
also lies about the sums is proven wrong at the chunk whose sum is not its piece's squares, or by the tree's
total. The integer binary64 arithmetic behind it (NormRule.sol) is compared with Python's float.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import struct

import numpy as np
import pytest
import torch
from eth_abi import encode

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
from ledger.chunkproof import NORMED_FACTORS_TYPES, Factors, StageLeaf, chunked_weights_root
from ledger.normproof import (SCALES, SumTree, clip_scales, first_wrong_sum, norm_of, scale_proof, square_sum,
                              sum_bytes, sum_proof, sum_to_double, sum_words)
from node.commitments import SCHEMES, scheme_named, scheme_of_version
from node.errors import ConfigError
from node.fraudproof import chunk_square_sums
from tests.fraud_fixtures import (
    DILOCO,
    Committed,
    aggregated_round,
    commit,
    contribution,
    lied_sum,
    with_scale,
)
from tests.ledger_fixtures import deploy, mine  # noqa: F401 (mine: tests/test_norm_proof_availability.py)
from training.chunks import float64_bits, stage_layout
from training.codec_wire import decode_declared
from training.robust import contribution_norm

SHAPES = {"a.weight": (16, 80), "b.bias": (70,), "c.weight": (12, 20)}
STAKE = 10**18
NORMED = dataclasses.replace(DILOCO, commitments="normed")
UNCLIPPED = dataclasses.replace(DILOCO, commitments="normed", norm_clip=0.0)
GAS: dict[str, int] = {}


def blobs() -> list[bytes]:
    """Three contributions, one per codec, the raw one large enough to be clipped
    (tests/test_fraud_proof.py)."""
    return [contribution(SHAPES, "lowrank", 10, rank=4), contribution(SHAPES, "quant", 11),
            contribution(SHAPES, "raw", 12, scale=0.5)]


@pytest.fixture(scope="module")
def honest():
    return aggregated_round(SHAPES, blobs(), NORMED)


def f64(bits: int) -> float:
    return struct.unpack(">d", bits.to_bytes(8, "big"))[0]


def bits64(value: float) -> int:
    return int.from_bytes(struct.pack(">d", value), "big")


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


# ----------------------------------------------------------------------------------------------- the proofs


def on_chain(round_, new):
    return commit(deploy(connect_pyevm(), min_stake=STAKE), round_, new, stake=STAKE)


def stage_leaves(committed) -> list[bytes]:
    return [leaf.encode() for leaf in committed.stages[1]]


def proof_of_scales(committed):
    return scale_proof(committed.records[1], stage_leaves(committed), 0, committed.states[1].factors.encode())


def proof_of_sum(committed, contribution: int, chunk: int, tree: SumTree | None = None):
    state = committed.states[1]
    return sum_proof(committed.records[1], stage_leaves(committed), 0, state.factors.encode(),
                     state.weight_leaves, state.payload_leaves[contribution], tree
                     or state.sum_trees[contribution], contribution, chunk)


def assert_overturned(committed):
    reader = committed.deployment.client(3)
    assert reader.invalid_from(committed.run_id) == 1
    for index in committed.attesters:
        assert reader.member(committed.run_id, committed.deployment.client(index).address).status == "slashed"
    assert reader.member(committed.run_id, reader.address).status == "active"


@pytest.fixture(scope="module")
def right(honest):
    return on_chain(honest, honest.honest)


def test_proofs_against_a_right_round_revert(right, honest):
    prover = right.prover()
    with pytest.raises(errors.ProverNormCorrect):
        prover.prove_wrong_norm(proof_of_scales(right))
    layout = stage_layout(SHAPES)
    bias = next(p.index for p in layout if p.name == "b.bias")
    for contribution_index in range(3):  # low-rank, quant, raw pieces
        for chunk in (0, 1, bias, len(layout) - 1):
            proof = proof_of_sum(right, contribution_index, chunk)
            assert not prover.norm_proof_holds(proof)
            with pytest.raises(errors.ProverNormCorrect):
                prover.prove_wrong_norm(proof)
    assert prover.invalid_from(right.run_id) is None


def unclipped_round(honest):
    """What a colluding quorum commits: the same contributions aggregated with scale 1.0 for all (norm_clip
    off), so the weights are consistent with the scales, but the norm commitment says the run's norm_clip =
    2."""
    loose = aggregated_round(SHAPES, blobs(), UNCLIPPED)
    state = loose.honest
    assert set(state.factors.scale_bits) == {0x3FF0000000000000}
    norms = dataclasses.replace(state.factors.norms, clip_bits=float64_bits(2.0))
    return dataclasses.replace(loose, honest=dataclasses.replace(
        state, factors=dataclasses.replace(state.factors, norms=norms)))


def test_scale_one_for_a_contribution_the_rule_clips_is_proven_and_slashes(honest):
    loose = unclipped_round(honest)
    committed = on_chain(loose, loose.honest)
    prover = committed.prover()
    # the chunk proof cannot see it: the weights follow the scales
    with pytest.raises(errors.ProverRoundCorrect):
        prover.prove_wrong_aggregation(committed.proof(1))
    prover.commit_proof(proof_of_scales(committed))  # (issue 62) a block before: the reward is paid at once
    before = prover.balance()
    receipt = prover.prove_wrong_norm(proof_of_scales(committed))
    GAS["wrong scale (M=3)"] = receipt["gasUsed"]
    assert_overturned(committed)
    fee = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert prover.balance() - before + fee == len(committed.attesters) * STAKE // 2
    with pytest.raises(errors.LedgerRunHalted):
        prover.prove_wrong_norm(proof_of_scales(committed))


def lied_sum_round(loose, contribution_index: int, *, total_only: bool = False):
    """The colluders also shrink contribution ``contribution_index``'s sum of squares so that scale 1.0
    follows (to the largest other one's): every chunk's leaf scaled down (the tree's total consistent with
    them), or only the committed total."""
    state = loose.honest
    tree = state.sum_trees[contribution_index]
    norms = state.factors.norms
    target = max(total for j, total in enumerate(norms.sums) if j != contribution_index)
    if total_only:
        fake_tree, fake_total = tree, target
    else:
        fake_tree = SumTree.of([total * target // tree.total for total in tree.sums])
        fake_total = fake_tree.total
    roots, totals = list(norms.roots), list(norms.sums)
    roots[contribution_index], totals[contribution_index] = fake_tree.root, fake_total
    assert clip_scales(totals, 2.0) == [1.0] * len(totals)  # the lie makes 1.0 the rule's scale
    factors = dataclasses.replace(state.factors, norms=dataclasses.replace(norms, roots=tuple(roots),
                                                                            sums=tuple(totals)))
    trees = list(state.sum_trees)
    trees[contribution_index] = fake_tree
    return dataclasses.replace(loose, honest=dataclasses.replace(state, factors=factors, sum_trees=trees))


def test_lied_chunk_sums_are_proven_at_a_lied_chunk(honest):
    lied = lied_sum_round(unclipped_round(honest), 2)
    committed = on_chain(lied, lied.honest)
    prover = committed.prover()
    with pytest.raises(errors.ProverNormCorrect):  # the scales follow from the (lied) sums
        prover.prove_wrong_norm(proof_of_scales(committed))
    chunk = first_wrong_sum(honest.honest.sum_trees[2].sums, committed.states[1].sum_trees[2])
    assert chunk == 0
    receipt = prover.prove_wrong_norm(proof_of_sum(committed, 2, chunk))
    GAS["wrong chunk sum (raw piece)"] = receipt["gasUsed"]
    assert_overturned(committed)


def test_a_lied_total_is_proven_by_any_chunk(honest):
    lied = lied_sum_round(unclipped_round(honest), 2, total_only=True)
    committed = on_chain(lied, lied.honest)
    prover = committed.prover()
    with pytest.raises(errors.ProverNormCorrect):
        prover.prove_wrong_norm(proof_of_scales(committed))
    assert first_wrong_sum(honest.honest.sum_trees[2].sums, committed.states[1].sum_trees[2]) is None
    receipt = prover.prove_wrong_norm(proof_of_sum(committed, 2, 5))
    GAS["wrong total"] = receipt["gasUsed"]
    assert_overturned(committed)


def test_a_lied_low_rank_chunk_sum_is_proven(honest):
    wrong = lied_sum(honest.honest, 0, 3)  # one unit (2**-298) off
    committed = on_chain(honest, wrong)
    # the scales follow from the sums; the other chunks are right
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.scale_proof())
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.sum_proof(0, 4))
    receipt = committed.prover().prove_wrong_norm(committed.sum_proof(0, 3))
    GAS["wrong chunk sum (low-rank piece)"] = receipt["gasUsed"]
    assert_overturned(committed)


def test_a_scale_other_than_the_rules_is_proven(honest):
    committed = on_chain(honest, with_scale(honest.honest, 0, float64_bits(0.5)))  # 0.5 for an unclipped one
    receipt = committed.prover().prove_wrong_norm(committed.scale_proof())
    GAS["wrong scale, one changed (M=3)"] = receipt["gasUsed"]
    assert_overturned(committed)


@pytest.mark.parametrize("change", ["clip below one", "clip infinite", "a zero step",
                                    "steps of another length", "a trailing word"])
def test_a_norm_commitment_no_honest_round_makes_is_wrong(honest, change):
    state = honest.honest
    norms = state.factors.norms
    if change == "clip below one":
        norms = dataclasses.replace(norms, clip_bits=float64_bits(0.5))
    elif change == "clip infinite":
        norms = dataclasses.replace(norms, clip_bits=0x7FF0000000000000)
    elif change == "a zero step":
        norms = dataclasses.replace(norms, steps=(1, 0, 1))
    factors = dataclasses.replace(state.factors, norms=norms)
    encoded = factors.encode()
    if change == "steps of another length":  # what Norms refuses to build: encoded by hand
        fields = [factors.lr_bits, factors.mu_bits, factors.nesterov, list(factors.envelopes),
                  list(factors.payload_roots), list(factors.scale_bits), *norms.fields()]
        fields[7] = [1, 1]
        encoded = encode(NORMED_FACTORS_TYPES, fields)
    if change == "a trailing word":
        encoded += bytes(32)
    leaf = StageLeaf(0, len(state.weight_leaves), state.leaf().weights_root, state.leaf().momentum_root,
                     hashlib.sha256(encoded).digest())
    committed = commit_leaf(honest, state, leaf)
    committed.prover().prove_wrong_norm(scale_proof(committed.records[1], stage_leaves(committed), 0,
                                                    encoded))
    assert_overturned(committed)


def commit_leaf(round_, state, leaf: StageLeaf) -> Committed:
    """A new run whose round 1 commits an explicit stage-0 leaf (whose factors hash the test chose)."""
    deployment = deploy(connect_pyevm(), min_stake=STAKE)
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE)
    records, stages = [], []
    for leaves in ([round_.prev.leaf(), round_.other.leaf()], [leaf, round_.other.leaf()]):
        if records:  # round 0's proof window closes first: a proof of round 1 never waits for it (issue 62)
            mine(deployment.w3, run.client(1).run_struct(run.run_id)["disputeBlocks"])
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(leaves))
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
        records.append(record)
        stages.append(leaves)
    return Committed(deployment, run.run_id, records, stages, [round_.prev, state], (1, 2), 6)


def test_hostile_norm_proofs_revert_with_their_errors(right, honest):
    prover = right.prover()
    proof = proof_of_sum(right, 1, 2)
    path = list(proof.sum_path)
    path[1] = (int.from_bytes(path[1], "big") + 1).to_bytes(32, "big")  # a sibling's sum changed
    with pytest.raises(errors.ProverBadSumPath):
        prover.prove_wrong_norm(dataclasses.replace(proof, sum_path=path))
    with pytest.raises(errors.ProverBadSumPath):  # a path cut short
        prover.prove_wrong_norm(dataclasses.replace(proof, sum_path=proof.sum_path[:-4]))
    with pytest.raises(errors.ProverBadSumPath):  # a leaf of the wrong width
        prover.prove_wrong_norm(dataclasses.replace(proof, sum_leaf=proof.sum_leaf[1:]))
    # chunk 2's sum leaf named as chunk 3's (its other openings right)
    with pytest.raises(errors.ProverBadSumPath):
        good = proof_of_sum(right, 1, 3)
        prover.prove_wrong_norm(dataclasses.replace(good, sum_leaf=proof.sum_leaf))
    with pytest.raises(errors.ProverBadPath) as caught:
        prover.prove_wrong_norm(dataclasses.replace(proof, piece=right.states[1].payload_leaves[0][2]))
    assert caught.value.values["which"] == 4 + 1
    with pytest.raises(errors.ProverBadPath) as caught:
        prover.prove_wrong_norm(dataclasses.replace(proof, weights=right.states[1].weight_leaves[3]))
    assert caught.value.values["which"] == 2
    with pytest.raises(errors.ProverBadTarget):
        prover.prove_wrong_norm(dataclasses.replace(proof, contribution=3))
    with pytest.raises(errors.ProverBadChunk):
        prover.prove_wrong_norm(dataclasses.replace(proof, chunk=len(right.states[1].weight_leaves)))
    with pytest.raises(errors.ProverBadFactors):
        prover.prove_wrong_norm(dataclasses.replace(proof, factors=proof.factors + bytes(32)))
    with pytest.raises(errors.ProverBadStagePath):
        prover.prove_wrong_norm(dataclasses.replace(proof, stage_leaf=right.stages[0][0].encode()))
    with pytest.raises(errors.ProverBadStage):
        prover.prove_wrong_norm(dataclasses.replace(proof, stage=2))
    with pytest.raises(errors.LedgerNotAttesters):
        loose = unclipped_round(honest)
        wrong = on_chain(loose, loose.honest)
        wrong.prover().prove_wrong_norm(proof_of_scales(wrong), attesters=[])
    assert prover.invalid_from(right.run_id) is None


def test_a_version_two_round_has_no_norm_proof(honest):
    v2 = aggregated_round(SHAPES, blobs(), DILOCO)
    assert v2.honest.factors.norms is None and v2.honest.sum_trees == []
    committed = on_chain(v2, v2.honest)
    with pytest.raises(errors.ProverNotNormed):
        committed.prover().prove_wrong_norm(proof_of_scales(committed))


# ------------------------------------------------------------------------------------------ the run's version


def test_a_quorum_committing_version_two_factors_in_a_normed_run_is_proven_and_slashed(honest):
    """The version escape: the colluders aggregate with every scale 1.0 (the raw contribution unclipped) and
    commit version-2 factors (no norm commitment to open) in a run created as version 3. The norm proof proves
    it from the run's version alone; since issue 62 the chunk proof does too (factors of another version than
    the run's are a wrong round whichever proof opens them)."""
    loose = aggregated_round(SHAPES, blobs(), dataclasses.replace(DILOCO, norm_clip=0.0))
    assert loose.honest.factors.norms is None and set(loose.honest.factors.scale_bits) == {0x3FF0000000000000}
    committed = commit(deploy(connect_pyevm(), min_stake=STAKE), loose, loose.honest, stake=STAKE,
                       commitments=scheme_named("normed").version)
    prover = committed.prover()
    assert prover.run_info(committed.run_id).commitments == 3
    assert prover.proof_holds(committed.proof(1))
    proof = proof_of_scales(committed)
    assert prover.norm_proof_holds(proof)
    prover.commit_proof(proof)  # (issue 62) a block before: the reward is paid at once
    before = prover.balance()
    receipt = prover.prove_wrong_norm(proof)
    GAS["version-2 factors in a normed run (M=3)"] = receipt["gasUsed"]
    assert_overturned(committed)
    fee = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert prover.balance() - before + fee == len(committed.attesters) * STAKE // 2
    with pytest.raises(errors.LedgerRunHalted):  # one reward per round
        prover.prove_wrong_norm(proof)


def test_any_norm_proof_over_version_two_factors_in_a_normed_run_proves_it(honest):
    """The version is checked before the proof's kind: a sum proof's contribution and chunk need not exist."""
    v2 = aggregated_round(SHAPES, blobs(), DILOCO)
    committed = commit(deploy(connect_pyevm(), min_stake=STAKE), v2, v2.honest, stake=STAKE,
                       commitments=scheme_named("normed").version)
    proof = dataclasses.replace(proof_of_scales(committed), contribution=7, chunk=10**6)
    committed.prover().prove_wrong_norm(proof)
    assert_overturned(committed)


def test_version_three_factors_in_a_chunked_run_are_proven(honest):
    """The other way round: a right version-3 round committed in a run created as version 2 is no honest
    node's (an honest node of a chunked run writes version-2 factors)."""
    committed = commit(deploy(connect_pyevm(), min_stake=STAKE), honest, honest.honest, stake=STAKE,
                       commitments=scheme_named("chunked").version)
    committed.prover().prove_wrong_norm(proof_of_scales(committed))
    assert_overturned(committed)


def test_an_honest_round_of_its_runs_version_is_not_proven(right, honest):
    """A right version-3 round in a version-3 run (the ``right`` fixture), and a right version-2 round in a
    version-2 or a hashed run: no norm proof holds (ProverNormCorrect, or ProverNotNormed: nothing to
    open)."""
    assert right.prover().run_info(right.run_id).commitments == 3
    assert not right.prover().norm_proof_holds(proof_of_scales(right))
    v2 = aggregated_round(SHAPES, blobs(), DILOCO)
    for version in ("chunked", "hashed"):
        committed = commit(deploy(connect_pyevm(), min_stake=STAKE), v2, v2.honest, stake=STAKE,
                           commitments=scheme_named(version).version)
        with pytest.raises(errors.ProverNotNormed):
            committed.prover().prove_wrong_norm(proof_of_scales(committed))
        assert committed.prover().invalid_from(committed.run_id) is None


def test_a_run_names_a_known_version_of_its_commitments():
    deployment = deploy(connect_pyevm())
    client = deployment.client(1)
    for bad in (0, 4, 255):
        with pytest.raises(errors.LedgerBadCommitments) as caught:
            client.create_run(b"v" * 32, 1, 10, commitments=bad)
        assert caught.value.values["commitments"] == bad
    with pytest.raises(errors.LedgerInputError, match="commitments"):
        client.create_run(b"v" * 32, 1, 10, commitments=256)
    for name, scheme in SCHEMES.items():  # every scheme this node knows is a version the ledger takes
        run_id = client.create_run(hashlib.sha256(name.encode()).digest(), 1, 10, commitments=scheme.version)
        assert scheme_of_version(scheme.version) is scheme_named(name) is scheme
        assert client.run_info(run_id).commitments == scheme.version
        assert client.commitments_of(run_id) == scheme.version
    assert client.run_info(client.create_run(b"d" * 32, 1, 10)).commitments == scheme_named("normed").version
    for bad in ("auto", "", None, 3):
        with pytest.raises(ConfigError, match="commitments"):
            scheme_named(bad)


def test_the_contracts_stay_within_eip_170_and_eip_3860():
    for name in ("TrainingLedger", "AggregationProver"):
        size = (len(contracts.artifact(name)["deployedBytecode"]) - 2) // 2
        assert size <= 24_576, f"{name}: {size} bytes of deployed code, EIP-170 allows 24,576"
    initcode = (len(contracts.artifact("TrainingLedger")["bytecode"]) - 2) // 2
    assert initcode <= 49_152, \
        f"TrainingLedger: {initcode} bytes of initcode (holding the prover's), EIP-3860 allows 49,152"


def test_zz_gas_figures():
    """Prints the gas the proofs above used (no assertion on it: figures for docs/LEDGER.md)."""
    print({name: gas for name, gas in sorted(GAS.items())})


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
