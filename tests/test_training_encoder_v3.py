"""Encoder "v3" (compression.encoder; issue 16 item 3): v2's selection every few rounds, warm starts between.

v3 changes which bytes the encoder picks, never the wire format or the
decoder. It keeps state (each tensor's coding and a Ritz basis), so besides
decoding bit for bit to what the encoder returned it must: code exactly as v2
where it has no state (selection rounds, the stateless sliced path), keep the
byte count of its selection between selections, be a pure function of its input
and its state, carry that state through the engine checkpoint and the replica
start state (a re-execution of a warm round gives the same bytes and the next
state it claims), and refuse a malformed state with a clear error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from codec_fixtures import drift, encoder_sim, rerun_replica0, same_bits, shape_map, stage_like

from training.codec.factorize import factorize_gram, factorize_warm, warm_basis
from training.codec.registry import encoder_for
from training.codec.reselect import RESELECT_ROUNDS
from training.codec_wire import decode_contribution
from training.compression import encode_with_memo, encode_within_bandwidth
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import EngineStateError
from training.reexec import EXACT, STATE_MISMATCH, restart_state_reason, verify_contribution
from training.reexec_sim import SimReplica, run_with_states
from training.replica_state import StageStartState, parse_stage_state
from training.stage_engine import StageEngine

V2 = CompressionConfig(encoder="v2")
V3 = CompressionConfig(encoder="v3")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/torch_fixtures.py


@pytest.mark.parametrize("budget", [6_000, 40_000, 200_000])
def test_v3_without_state_codes_as_v2(budget):
    tensors = stage_like(0)
    v2 = encode_within_bandwidth(tensors, V2, budget, stage_index=1, outer_round=5)[0]
    # stateless path
    assert encode_within_bandwidth(tensors, V3, budget, stage_index=1, outer_round=5)[0] == v2
    # no memo: selects
    blob, _, _, memo = encode_with_memo(tensors, V3, budget, None, stage_index=1, outer_round=5)
    assert blob == v2
    lowrank = {name for name, (codec, _, _) in memo.choices.items() if codec == "lowrank"}
    assert set(memo.bases) == lowrank and "g.empty" not in memo.choices


@pytest.mark.parametrize("budget", [6_000, 40_000])
def test_v3_rounds_decode_bit_exactly_keep_the_bytes_and_reselect(budget):
    base = stage_like(1)
    memo = None
    sizes = []
    for outer_round in range(RESELECT_ROUNDS + 2):
        tensors = drift(base, outer_round)
        blob, decoded, stats, next_memo = encode_with_memo(tensors, V3, budget, memo, stage_index=0,
                                                           outer_round=outer_round)
        again = encode_with_memo(tensors, V3, budget, memo, stage_index=0, outer_round=outer_round)
        assert again[0] == blob  # a pure function of the input and the memo
        received = decode_contribution(blob, shape_map(tensors), stage_index=0, outer_round=outer_round,
                                       refuse_raw=True)
        assert all(same_bits(received[name], decoded[name]) for name in tensors)
        v2 = encode_within_bandwidth(tensors, V2, budget, stage_index=0, outer_round=outer_round)[0]
        if outer_round % RESELECT_ROUNDS == 0:
            assert blob == v2  # a selection round is v2's
        else:
            assert next_memo.choices == memo.choices  # codings kept between selections
            assert len(blob) == sizes[-1]  # hence the same bytes (the selection fitted the budget)
            assert all(t.rel_error < 1.0 for t in stats.tensors if t.codec == "lowrank")
        sizes.append(len(blob))
        memo = next_memo


def test_warm_power_iteration_tracks_the_top_subspace():
    """From last round's factor of a nearby matrix, one iteration is about as good as the full
    factorization."""
    generator = torch.Generator().manual_seed(3)
    for m, n in ((128, 384), (512, 128)):
        k = min(m, n)
        u, _ = torch.linalg.qr(torch.randn(m, k, generator=generator, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(n, k, generator=generator, dtype=torch.float64))
        spectrum = torch.logspace(0, -3, k, dtype=torch.float64)
        matrix = ((u * spectrum) @ v.t()).to(torch.float32)
        rank = 16
        moved = matrix + 1e-3 * torch.randn(m, n, generator=generator)
        previous = factorize_gram(moved, rank)
        basis = warm_basis(previous, (m, n), rank)
        assert basis.shape == (max(m, n), rank)
        (left, sigma, right), next_basis = factorize_warm(matrix, rank, basis)
        assert next_basis.shape == (max(m, n), rank)
        approx = ((left * sigma) @ right.t()).double()
        optimal = float(torch.sum(spectrum[rank:] ** 2))
        assert float(torch.sum((matrix.double() - approx) ** 2)) <= 1.05 * optimal + 1e-9
        # Repeated on the same matrix it converges to the top subspace.
        for _ in range(3):
            (left, sigma, right), next_basis = factorize_warm(matrix, rank, next_basis)
        approx = ((left * sigma) @ right.t()).double()
        assert float(torch.sum((matrix.double() - approx) ** 2)) <= 1.01 * optimal + 1e-9
    (left, sigma, right), _ = factorize_warm(torch.zeros(64, 96), 4, torch.ones(96, 4))
    assert not torch.any(sigma) and not torch.any(left @ right.t()) and torch.isfinite(right).all()


def test_engine_checkpoint_carries_the_memo():
    """An engine restored from state_dict() codes the next (warm) round with the same bytes."""
    diloco_cfg = DilocoConfig(inner_steps=2, num_replicas=1, one_step_delay=False)
    cfg = dataclasses.replace(V3, bandwidth_budget=20_000)
    start = {name: value for name, value in stage_like(4).items() if value.numel()}
    engine = StageEngine(0, {n: v.clone() for n, v in start.items()}, diloco_cfg, cfg)
    with torch.no_grad():
        for name, param in engine.params.items():
            param.sub_(stage_like(5)[name])
    blob = engine.encode_contribution(0)[0]
    engine.apply_round(0, [blob])
    state = engine.state_dict()
    assert state["encoder_memo"] is not None
    assert any(codec == "lowrank" for codec, _, _ in engine.compressor.encoder_memo.choices.values())
    twin = StageEngine(0, {n: p.detach().clone() for n, p in engine.params.items()}, diloco_cfg, cfg)
    twin.load_state_dict(state)
    # Without the memo the round is a selection (v2's bytes): the memo is what makes the difference.
    blank = StageEngine(0, {n: p.detach().clone() for n, p in engine.params.items()}, diloco_cfg, cfg)
    blank.load_state_dict({**state, "encoder_memo": None})
    for one in (engine, twin, blank):
        with torch.no_grad():
            for name, param in one.params.items():
                param.sub_(stage_like(6)[name])
    warm = engine.encode_contribution(1)[0]
    assert twin.encode_contribution(1)[0] == warm
    assert blank.encode_contribution(1)[0] != warm
    bad = dict(state)
    bad["encoder_memo"] = {"choice": {"a.weight": torch.tensor([1.0, 3.0, 4.0])}, "basis": {}}
    with pytest.raises(EngineStateError, match="encoder memo"):
        blank.load_state_dict(bad)
    engine.rebase(engine.global_weights, engine.momentum, 1)
    assert engine.state_dict()["encoder_memo"] is None  # a restart carries none


def test_v3_contributions_reexecute_bit_exactly_and_chain_their_memo():
    """Warm rounds depend on the memo in the start state: a rerun from it gives the same bytes and next
    state."""
    sim = encoder_sim("v3", 3)
    records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    assert any(name.startswith("encoder.basis/") for name in records[1].states[0].stages[0].tensors)
    for outer_round in range(3):
        check = rerun_replica0(sim, records, outer_round)
        assert check.verdict == EXACT, check.reason
        if outer_round + 1 < 3 and check.next_state_hashes is not None:
            assert check.next_state_hashes == [claim.state_hash
                                               for claim in records[outer_round + 1].claims[0]]
    # A state that carries a memo is not one a restart rebuilds from the record alone.
    parts = [part.to_bytes() for part in records[1].states[0].stages]
    why = restart_state_reason(parts, [claim.state_hash for claim in records[1].claims[0]])
    assert why is not None


def test_a_malformed_memo_in_a_served_state_is_a_state_mismatch():
    sim = encoder_sim("v3", 2)
    records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    record = records[1]
    parts = list(record.states[0].stages)
    for name in sorted(parts[0].tensors):
        if name.startswith("encoder.basis/"):
            break
    else:
        pytest.fail("no encoder basis in the state")
    for broken in ({name: torch.zeros(3, 2)},
                   {name.replace("basis", "choice"): torch.tensor([7.0, 1.0, 4.0])},
                   {name.replace("basis", "other"): torch.zeros(2)}):
        tensors = {**parts[0].tensors, **broken}
        forged = StageStartState(parts[0].meta, parts[0].stage_index, parts[0].engine_counters, tensors)
        assert parse_stage_state(forged.to_bytes()).tensors.keys() == tensors.keys()
        claims = [dataclasses.replace(record.claims[0][0], state_hash=forged.state_hash()),
                  record.claims[0][1]]
        check = verify_contribution(
            [forged.to_bytes(), parts[1].to_bytes()], claims, sim.corpus, sim.model, sim.training, sim.diloco,
            sim.compression, outer_round=1, replica=0, run_rounds=sim.rounds,
            previous_contributions=records[0].contributions,
        )
        assert check.verdict == STATE_MISMATCH, check.reason


def test_memo_tensors_round_trip_and_refuse_nonsense():
    tensors = stage_like(7)
    _, _, _, memo = encode_with_memo(tensors, V3, 40_000, None, stage_index=0, outer_round=0)
    shapes = shape_map(tensors)
    again = encoder_for(V3).load_memo(memo.to_tensors(), shapes)
    assert again.choices == memo.choices
    assert all(torch.equal(again.bases[n], memo.bases[n]) for n in memo.bases)
    state = memo.to_tensors()
    name = next(iter(memo.bases))
    for broken in (
        # rank 5 is no candidate
        {**state, "choice": {**state["choice"], name: torch.tensor([1.0, 5.0, 4.0])}},
        {**state, "choice": {**state["choice"], name: torch.tensor([1.0, 2.5, 4.0])}},
        {**state, "basis": {**state["basis"], name: torch.full_like(state["basis"][name], float("nan"))}},
        {**state, "basis": {}},
        {"choice": state["choice"]},
    ):
        with pytest.raises(ValueError):
            encoder_for(V3).load_memo(broken, shapes)
