"""The fraud proof of a wrong clip scale (issue 43, docs/FRAUD_PROOF.md "The clip scales"), each adversary's
move on py-evm and on a real anvil (tests/chain_backends.py).

A version-3 (``diloco.commitments = "normed"``) round commits each accepted contribution's exact sum of
squares and its sum tree. A quorum that commits scale 1.0 for a contribution the norm rule clips, with weights
consistent with it (no chunk proof can catch that), is proven wrong from the committed sums; a quorum that
also lies about the sums is proven wrong at the chunk whose sum is not its piece's squares, or by the tree's
total; each time the prover is paid half of each attester's stake, its gas included. The integer binary64
arithmetic behind it (NormRule.sol) is in tests/test_norm_proof_arith.py, the run's version in
tests/test_norm_proof_versions.py, the availability of the sum trees in tests/test_norm_proof_availability.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

import pytest
from eth_abi import encode

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.chunkproof import NORMED_FACTORS_TYPES, StageLeaf, chunked_weights_root
from ledger.normproof import SumTree, clip_scales, first_wrong_sum, scale_proof, sum_proof
from tests.fraud_fixtures import (
    DILOCO,
    Committed,
    aggregated_round,
    commit,
    contribution,
    lied_sum,
    with_scale,
)
from tests.chain_backends import assert_paid, chain, each_on_both
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: the py-evm / anvil fixture)
from training.chunks import float64_bits, stage_layout

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


# ----------------------------------------------------------------------------------------------- the proofs


def on_chain(round_, new, w3=None, **params):
    """A run on ``w3`` (a fresh py-evm if None) whose round 1 commits ``new``."""
    return commit(deploy(w3 or connect_pyevm(), min_stake=STAKE), round_, new, stake=STAKE, **params)


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


def overturn(committed, receipt_of):
    """``receipt_of(prover)`` overturns round 1: the prover is paid half of each attester's stake, gas
    included, the attesters lose theirs, member 3 (who signed nothing) keeps its (tests/chain_backends.py)."""
    return assert_paid(committed.deployment, committed.run_id, committed.prover(), receipt_of, stake=STAKE,
                       slashed=committed.attesters, kept=(3,))


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


_LOOSE: list = []


def unclipped_round(honest):
    """What a colluding quorum commits: the same contributions aggregated with scale 1.0 for all (norm_clip
    off), so the weights are consistent with the scales, but the norm commitment says the run's norm_clip =
    2 (the aggregation cached: each test runs on both backends)."""
    if not _LOOSE:
        _LOOSE.append(aggregated_round(SHAPES, blobs(), UNCLIPPED))
    loose = _LOOSE[0]
    state = loose.honest
    assert set(state.factors.scale_bits) == {0x3FF0000000000000}
    norms = dataclasses.replace(state.factors.norms, clip_bits=float64_bits(2.0))
    return dataclasses.replace(loose, honest=dataclasses.replace(
        state, factors=dataclasses.replace(state.factors, norms=norms)))


def test_scale_one_for_a_contribution_the_rule_clips_is_proven_and_slashes(chain_w3, honest):
    loose = unclipped_round(honest)
    committed = on_chain(loose, loose.honest, chain_w3)
    prover = committed.prover()
    # the chunk proof cannot see it: the weights follow the scales
    with pytest.raises(errors.ProverRoundCorrect):
        prover.prove_wrong_aggregation(committed.proof(1))
    receipt = overturn(committed, lambda prover: prover.prove_wrong_norm(proof_of_scales(committed)))
    GAS["wrong scale (M=3)"] = receipt["gasUsed"]
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


def test_lied_chunk_sums_are_proven_at_a_lied_chunk(chain_w3, honest):
    lied = lied_sum_round(unclipped_round(honest), 2)
    committed = on_chain(lied, lied.honest, chain_w3)
    prover = committed.prover()
    with pytest.raises(errors.ProverNormCorrect):  # the scales follow from the (lied) sums
        prover.prove_wrong_norm(proof_of_scales(committed))
    chunk = first_wrong_sum(honest.honest.sum_trees[2].sums, committed.states[1].sum_trees[2])
    assert chunk == 0
    receipt = overturn(committed, lambda prover: prover.prove_wrong_norm(proof_of_sum(committed, 2, chunk)))
    GAS["wrong chunk sum (raw piece)"] = receipt["gasUsed"]


def test_a_lied_total_is_proven_by_any_chunk(chain_w3, honest):
    lied = lied_sum_round(unclipped_round(honest), 2, total_only=True)
    committed = on_chain(lied, lied.honest, chain_w3)
    prover = committed.prover()
    with pytest.raises(errors.ProverNormCorrect):
        prover.prove_wrong_norm(proof_of_scales(committed))
    assert first_wrong_sum(honest.honest.sum_trees[2].sums, committed.states[1].sum_trees[2]) is None
    receipt = overturn(committed, lambda prover: prover.prove_wrong_norm(proof_of_sum(committed, 2, 5)))
    GAS["wrong total"] = receipt["gasUsed"]


def test_a_lied_low_rank_chunk_sum_is_proven(chain_w3, honest):
    wrong = lied_sum(honest.honest, 0, 3)  # one unit (2**-298) off
    committed = on_chain(honest, wrong, chain_w3)
    # the scales follow from the sums; the other chunks are right
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.scale_proof())
    with pytest.raises(errors.ProverNormCorrect):
        committed.prover().prove_wrong_norm(committed.sum_proof(0, 4))
    receipt = overturn(committed, lambda prover: prover.prove_wrong_norm(committed.sum_proof(0, 3)))
    GAS["wrong chunk sum (low-rank piece)"] = receipt["gasUsed"]


def test_a_scale_other_than_the_rules_is_proven(chain_w3, honest):
    # 0.5 for an unclipped one
    committed = on_chain(honest, with_scale(honest.honest, 0, float64_bits(0.5)), chain_w3)
    receipt = overturn(committed, lambda prover: prover.prove_wrong_norm(committed.scale_proof()))
    GAS["wrong scale, one changed (M=3)"] = receipt["gasUsed"]


CHANGES = ["clip below one", "clip infinite", "a zero step", "steps of another length", "a trailing word"]


@pytest.mark.parametrize("backend, change", each_on_both(CHANGES, ids=CHANGES))
def test_a_norm_commitment_no_honest_round_makes_is_wrong(request, backend, honest, change):
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
    committed = commit_leaf(chain(request, backend), honest, state, leaf)
    overturn(committed, lambda prover: prover.prove_wrong_norm(scale_proof(
        committed.records[1], stage_leaves(committed), 0, encoded)))


def commit_leaf(w3, round_, state, leaf: StageLeaf) -> Committed:
    """A new run on ``w3`` whose round 1 commits an explicit stage-0 leaf (whose factors hash the test
    chose)."""
    deployment = deploy(w3, min_stake=STAKE)
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


def test_hostile_norm_proofs_revert_with_their_errors(chain_w3, honest):
    """False proofs against a right round: each reverts with its error and the round stands."""
    right = on_chain(honest, honest.honest, chain_w3)
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
        wrong = on_chain(loose, loose.honest, chain_w3)
        wrong.prover().prove_wrong_norm(proof_of_scales(wrong), attesters=[])
    assert prover.invalid_from(right.run_id) is None


def test_zz_gas_figures():
    """Prints the gas the proofs above used (no assertion on it: figures for docs/LEDGER.md)."""
    print({name: gas for name, gas in sorted(GAS.items())})


