"""The on-chain fraud proof of a wrong aggregation (issue 43; docs/FRAUD_PROOF.md), on py-evm.

A real aggregation (training/diloco.py) of real encoded contributions (quant and low-rank codecs, one clipped)
is committed in a chunked run; a proof of one chunk recomputes it in the contract's soft-float and either
overturns the round (one element changed) or reverts (the round is right, or the proof is malformed).
"""

from __future__ import annotations

import dataclasses

import pytest

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.chunkproof import Factors, first_difference, tree_root
from node.errors import RoundDisputed
from node.tools.pull import round_standing
from tests.fraud_fixtures import Committed, Round, aggregated_round, changed, commit, contribution
from tests.ledger_fixtures import deploy, digest
from training.chunks import CHUNK_ELEMENTS, stage_layout

SHAPES = {"a.weight": (16, 80), "b.bias": (70,), "c.weight": (12, 20)}
STAKE = 10**18


@pytest.fixture(scope="module")
def aggregated() -> Round:
    """Three contributions, one per codec (low-rank, quant, raw), the raw one large enough to be clipped."""
    blobs = [contribution(SHAPES, "lowrank", 10, rank=4), contribution(SHAPES, "quant", 11),
             contribution(SHAPES, "raw", 12, scale=0.5)]
    round_ = aggregated_round(SHAPES, blobs)
    scales = [bits for bits in round_.honest.factors.scale_bits]
    assert scales[0] == scales[1] == 0x3FF0000000000000 != scales[2]  # the norm rule clipped the raw one
    return round_


def on_chain(round_: Round, new) -> object:
    return commit(deploy(connect_pyevm(), min_stake=STAKE), round_, new, stake=STAKE)


def piece_codecs(state, chunk: int) -> set[int]:
    return {leaves[chunk][0] for leaves in state.payload_leaves}


def test_the_chunk_leaves_cover_every_codec_and_tensor(aggregated):
    layout = stage_layout(SHAPES)
    assert len(aggregated.honest.weight_leaves) == len(layout) == 20 + 2 + 4  # ceil(numel / 64) per tensor
    assert piece_codecs(aggregated.honest, 0) == {0, 1, 2}  # a.weight: low-rank, quant and raw pieces
    bias = next(p.index for p in layout if p.name == "b.bias")
    assert piece_codecs(aggregated.honest, bias) == {0, 1}  # a 1-D tensor: the low-rank one codes it quant
    assert all(place.count <= CHUNK_ELEMENTS for place in layout)


def test_a_proof_of_a_one_element_change_overturns_the_round_slashes_and_pays(aggregated):
    # a.weight's rows 0..1: low-rank (the integer product and two roundings), quant and a clipped raw
    chunk = 1
    wrong = changed(aggregated.honest, chunk, 17)
    committed = on_chain(aggregated, wrong)
    assert first_difference(aggregated.honest, wrong) == chunk
    prover = committed.prover()
    proof = committed.proof(chunk)
    assert prover.proof_holds(proof)
    prover.commit_proof(proof)  # (issue 62) a block before the proof: the reward is paid at once
    before = prover.balance()
    receipt = prover.prove_wrong_aggregation(proof)
    reader = committed.deployment.client(3)
    assert reader.invalid_from(committed.run_id) == 1
    assert not reader.is_final(committed.run_id, 1)
    for index in committed.attesters:
        member = reader.member(committed.run_id, committed.deployment.client(index).address)
        assert member.status == "slashed"
    assert reader.member(committed.run_id, committed.deployment.client(3).address).status == "active"
    fee = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    # half of what was slashed
    assert prover.balance() - before + fee == len(committed.attesters) * STAKE // 2
    with pytest.raises(errors.LedgerRunHalted):  # the round is invalid already: no second reward
        prover.prove_wrong_aggregation(proof)
    # pull refuses the proven round (and what descends from it), not the round before it
    history = reader.history(committed.run_id)
    assert history.dispute_outcomes == {1: "proven wrong"}
    standing = round_standing(history, reader.chain_id, reader.ledger_address)
    assert standing[0] is None
    assert isinstance(standing[1], RoundDisputed) and "fraud proof" in str(standing[1])


def test_a_changed_momentum_element_is_provable_too(aggregated):
    wrong = changed(aggregated.honest, 5, 0, momentum=True)
    committed = on_chain(aggregated, wrong)
    committed.prover().prove_wrong_aggregation(committed.proof(5))
    assert committed.prover().invalid_from(committed.run_id) == 1


@pytest.fixture(scope="module")
def honest(aggregated) -> Committed:
    return on_chain(aggregated, aggregated.honest)


@pytest.mark.parametrize("where", ["first", "bias", "last"])
def test_a_proof_against_a_correct_round_reverts(honest, aggregated, where):
    layout = stage_layout(SHAPES)
    chunk = {"first": 0, "bias": next(p.index for p in layout if p.name == "b.bias"),
             "last": len(layout) - 1}[where]
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
    assert prover.invalid_from(honest.run_id) is None


def test_the_proof_against_a_wrong_round_needs_the_attesters_as_committed(aggregated):
    chunk = 2
    committed = on_chain(aggregated, changed(aggregated.honest, chunk, 1))
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
    committed = on_chain(aggregated, wrong)
    committed.prover().prove_wrong_aggregation(committed.proof(chunk))
    assert committed.prover().invalid_from(committed.run_id) == 1


def test_a_round_that_left_every_contribution_out_keeps_the_weights(aggregated):
    nothing = Factors(aggregated.honest.factors.lr_bits, aggregated.honest.factors.mu_bits, True, (), (), ())
    kept = dataclasses.replace(aggregated.prev, factors=nothing)
    committed = on_chain(aggregated, kept)
    with pytest.raises(errors.ProverRoundCorrect):
        committed.prover().prove_wrong_aggregation(committed.proof(0))
    wrong = on_chain(aggregated, changed(kept, 0, 0))
    wrong.prover().prove_wrong_aggregation(wrong.proof(0))


def test_the_deployed_contracts_stay_under_eip_170_and_the_ledger_trusts_only_its_prover():
    import contracts

    for name in ("TrainingLedger", "AggregationProver"):
        size = (len(contracts.artifact(name)["deployedBytecode"]) - 2) // 2
        assert size <= 24_576, f"{name}: {size} bytes of deployed code, EIP-170 allows 24,576"
    deployment = deploy(connect_pyevm(), min_stake=STAKE)
    run = deployment.member_run((1, 2), quorum=2, min_stake=STAKE)
    run.commit()
    client = deployment.client(1)
    prover = client.w3.eth.contract(address=client.prover_address,
                                    abi=contracts.artifact("AggregationProver")["abi"])
    assert prover.functions.ledger().call() == client.ledger_address
    attesters = list(client.commit_record(run.run_id, 0).attesters)
    with pytest.raises(errors.LedgerNotProver):  # a member cannot overturn a round by calling the hook itself
        client.sender.transact(client.ledger_contract, "invalidateByProof",
                                (run.run_id, 0, attesters, client.address))
    assert client.invalid_from(run.run_id) is None
