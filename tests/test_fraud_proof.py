"""The on-chain fraud proof of a wrong aggregation (issue 43; docs/FRAUD_PROOF.md), on py-evm.

A real aggregation (training/diloco.py) of real encoded contributions (quant and low-rank codecs, one clipped)
is committed in a chunked run; a proof of one chunk recomputes it in the contract's soft-float and either
overturns the round (one element changed) or reverts (the round is right, or the proof is malformed).
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.chunkproof import Factors, StageState, build_proof, chunked_weights_root, first_difference, tree_root
from node.fraudproof import initial_state, stage_state
from tests.ledger_fixtures import deploy, digest
from training.chunks import CHUNK_ELEMENTS, stage_layout
from training.compression import encode_contribution
from training.config import CompressionConfig, DilocoConfig
from training.diloco import aggregate_with_report

SHAPES = {"a.weight": (96, 80), "b.bias": (70,), "c.weight": (40, 130)}
OTHER = {"d.weight": (8, 8)}  # the run's second stage
STAKE = 10**18
DILOCO = DilocoConfig(outer_lr=0.7, outer_momentum=0.9)
PROVER = 6  # a dev account that is no member and stakes nothing


def tensors(seed: int, shapes=SHAPES, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=generator) * scale for name, shape in shapes.items()}


@dataclasses.dataclass
class Round:
    """A stage's state before (round 0's commit) and after (round 1's) a real aggregation."""

    prev: StageState
    honest: StageState
    other: StageState  # stage 1, unchanged in both rounds
    blobs: list[bytes]


@pytest.fixture(scope="module")
def aggregated() -> Round:
    weights, momentum = tensors(1), tensors(2, scale=0.1)
    codec = CompressionConfig(min_compress_numel=512)
    blobs = [encode_contribution(tensors(10 + i, scale=0.01 * (1 + i) * (20 if i == 2 else 1)), codec,
                                 stage_index=0, outer_round=1)[0] for i in range(4)]
    aggregation = aggregate_with_report(weights, momentum, blobs, DILOCO, stage_index=0, outer_round=1)
    assert [r.accepted for r in aggregation.contributions] == [True] * 4
    assert aggregation.contributions[2].scale < 1.0  # the norm rule clipped the large one
    honest = stage_state(0, aggregation, blobs, DILOCO, 1, decode_args={"stage_index": 0, "outer_round": 1})
    other = initial_state(1, tensors(3, OTHER), tensors(4, OTHER, 0.0))
    return Round(initial_state(0, weights, momentum), honest, other, blobs)


def changed(state: StageState, chunk: int, element: int, *, momentum: bool = False) -> StageState:
    """``state`` with one element's lowest mantissa bit flipped (its weight, or its momentum)."""
    leaves = list(state.momentum_leaves if momentum else state.weight_leaves)
    leaf = bytearray(leaves[chunk])
    leaf[24 + 4 * element + 3] ^= 1
    leaves[chunk] = bytes(leaf)
    if momentum:
        return dataclasses.replace(state, momentum_leaves=leaves)
    return dataclasses.replace(state, weight_leaves=leaves)


@dataclasses.dataclass
class Committed:
    deployment: object
    run_id: int
    records: list
    stages: list  # [round][stage] StageLeaf
    states: list  # [round] StageState of stage 0
    attesters: tuple[int, ...]

    def proof(self, chunk: int, state: StageState | None = None):
        return build_proof(self.records[0], self.records[1], self.stages[0], self.stages[1], self.states[0],
                           state or self.states[1], chunk)

    def prover(self):
        return self.deployment.client(PROVER)


def commit(aggregated: Round, new: StageState) -> Committed:
    """A fresh chunked run whose round 0 is ``aggregated.prev`` and round 1 ``new``, signed by members 1, 2."""
    deployment = deploy(connect_pyevm(), min_stake=STAKE)
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE)
    records, stages = [], []
    for state in (aggregated.prev, new):
        leaves = [state.leaf(), aggregated.other.leaf()]
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(leaves))
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
        records.append(record)
        stages.append(leaves)
    return Committed(deployment, run.run_id, records, stages, [aggregated.prev, new], (1, 2))


def piece_codecs(state: StageState, chunk: int) -> set[int]:
    return {leaves[chunk][0] for leaves in state.payload_leaves}


def test_the_chunk_leaves_cover_every_codec_and_tensor(aggregated):
    layout = stage_layout(SHAPES)
    assert len(aggregated.honest.weight_leaves) == len(layout) == sum((-(-96 * 80 // 64), -(-70 // 64),
                                                                       -(-40 * 130 // 64)))
    codecs = {entry["n"]: entry["c"] for entry in msgpack.unpackb(aggregated.blobs[0])["t"]}
    assert codecs == {"a.weight": "quant", "b.bias": "quant", "c.weight": "lowrank"}
    assert piece_codecs(aggregated.honest, 0) == {1} and piece_codecs(aggregated.honest, len(layout) - 1) == {2}
    assert all(place.count <= CHUNK_ELEMENTS for place in layout)


def test_a_proof_of_a_one_element_change_overturns_the_round_slashes_and_pays(aggregated):
    chunk = len(aggregated.honest.weight_leaves) - 3  # a low-rank chunk: the integer product and two roundings
    wrong = changed(aggregated.honest, chunk, 17)
    committed = commit(aggregated, wrong)
    assert first_difference(aggregated.honest, wrong) == chunk
    prover = committed.prover()
    before = prover.balance()
    proof = committed.proof(chunk)
    assert prover.proof_holds(proof)
    receipt = prover.prove_wrong_aggregation(proof)
    reader = committed.deployment.client(3)
    assert reader.invalid_from(committed.run_id) == 1
    assert not reader.is_final(committed.run_id, 1)
    for index in committed.attesters:
        member = reader.member(committed.run_id, committed.deployment.client(index).address)
        assert member.status == "slashed"
    assert reader.member(committed.run_id, committed.deployment.client(3).address).status == "active"
    fee = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    assert prover.balance() - before + fee == len(committed.attesters) * STAKE // 2  # half of what was slashed
    with pytest.raises(errors.LedgerRunHalted):  # the round is invalid already: no second reward
        prover.prove_wrong_aggregation(proof)


def test_a_changed_momentum_element_is_provable_too(aggregated):
    wrong = changed(aggregated.honest, 5, 0, momentum=True)
    committed = commit(aggregated, wrong)
    committed.prover().prove_wrong_aggregation(committed.proof(5))
    assert committed.prover().invalid_from(committed.run_id) == 1


@pytest.fixture(scope="module")
def honest(aggregated) -> Committed:
    return commit(aggregated, aggregated.honest)


@pytest.mark.parametrize("where", ["first", "bias", "last"])
def test_a_proof_against_a_correct_round_reverts(honest, aggregated, where):
    layout = stage_layout(SHAPES)
    chunk = {"first": 0, "bias": next(p.index for p in layout if p.name == "b.bias"), "last": len(layout) - 1}[where]
    with pytest.raises(errors.ProverRoundCorrect):
        honest.prover().prove_wrong_aggregation(honest.proof(chunk))
    assert honest.prover().invalid_from(honest.run_id) is None


def test_malformed_proofs_revert_with_their_errors(honest, aggregated):
    prover = honest.prover()
    proof = honest.proof(3)
    bad_path = list(proof.prev_weights_path)
    bad_path[0] = bytes(32)
    with pytest.raises(errors.ProverBadPath) as caught:
        prover.prove_wrong_aggregation(dataclasses.replace(proof, prev_weights_path=bad_path))
    assert caught.value.values["which"] == 0
    with pytest.raises(errors.ProverBadPath) as caught:  # the leaves of chunk 3 named as chunk 4
        prover.prove_wrong_aggregation(dataclasses.replace(proof, chunk=4))
    assert caught.value.values["which"] == 0
    with pytest.raises(errors.ProverBadChunk):
        prover.prove_wrong_aggregation(dataclasses.replace(proof, chunk=len(aggregated.honest.weight_leaves)))
    pieces = list(proof.pieces)
    pieces[1] = pieces[1][:-2]  # a truncated payload piece
    with pytest.raises(errors.ProverBadPath) as caught:
        prover.prove_wrong_aggregation(dataclasses.replace(proof, pieces=pieces))
    assert caught.value.values["which"] == 4 + 1
    with pytest.raises(errors.ProverBadFactors):  # a piece left out
        prover.prove_wrong_aggregation(dataclasses.replace(proof, pieces=proof.pieces[:-1],
                                                           piece_paths=proof.piece_paths[:-1]))
    with pytest.raises(errors.ProverBadRecords):  # round 1 against itself: not consecutive
        prover.prove_wrong_aggregation(dataclasses.replace(proof, prev_record=proof.record))
    forged = dataclasses.replace(honest.records[1], weights_root=digest("forged"))
    with pytest.raises(errors.ProverNotCommitted):  # a record the round did not commit
        prover.prove_wrong_aggregation(dataclasses.replace(proof, record=forged.fields()))
    with pytest.raises(errors.ProverBadStagePath):
        prover.prove_wrong_aggregation(dataclasses.replace(proof, stage_leaf=proof.prev_stage_leaf))
    with pytest.raises(errors.ProverBadStage):
        prover.prove_wrong_aggregation(dataclasses.replace(proof, stage=2))
    with pytest.raises(errors.LedgerNotAttesters):
        prover.prove_wrong_aggregation(dataclasses.replace(proof, new_weights=proof.new_weights), attesters=[])
    assert prover.invalid_from(honest.run_id) is None


def test_the_proof_against_a_wrong_round_needs_the_attesters_as_committed(aggregated):
    chunk = 2
    committed = commit(aggregated, changed(aggregated.honest, chunk, 1))
    with pytest.raises(errors.LedgerNotAttesters):
        committed.prover().prove_wrong_aggregation(committed.proof(chunk), attesters=[])
    committed.prover().prove_wrong_aggregation(committed.proof(chunk))
    assert committed.prover().invalid_from(committed.run_id) == 1


def test_a_committed_piece_that_does_not_decode_is_a_wrong_round(aggregated):
    chunk = 4
    pieces = [list(leaves) for leaves in aggregated.honest.payload_leaves]
    pieces[0][chunk] = pieces[0][chunk][:-2]  # the committers' own tree holds a truncated piece
    roots = tuple(tree_root(leaves) for leaves in pieces)
    factors = dataclasses.replace(aggregated.honest.factors, payload_roots=roots)
    wrong = dataclasses.replace(aggregated.honest, payload_leaves=pieces, factors=factors)
    committed = commit(aggregated, wrong)
    committed.prover().prove_wrong_aggregation(committed.proof(chunk))
    assert committed.prover().invalid_from(committed.run_id) == 1


def test_a_round_that_left_every_contribution_out_keeps_the_weights(aggregated):
    nothing = Factors(aggregated.honest.factors.lr_bits, aggregated.honest.factors.mu_bits, True, (), (), ())
    kept = dataclasses.replace(aggregated.prev, factors=nothing)
    committed = commit(aggregated, kept)
    with pytest.raises(errors.ProverRoundCorrect):
        committed.prover().prove_wrong_aggregation(committed.proof(0))
    wrong = commit(aggregated, changed(kept, 0, 0))
    wrong.prover().prove_wrong_aggregation(wrong.proof(0))
