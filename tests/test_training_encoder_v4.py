"""Encoder "v4" (compression.encoder; issue 16 item 3): v2's selection every few rounds, cheap re-allocations
between.

v4 changes which bytes the encoder picks, never the wire format or the
decoder. It selects as v2 every ``RESELECT_ROUNDS``-th round and keeps
every candidate's estimated relative error; a warm round re-allocates the
budget from those estimates and this round's norms and factorizes each
low-rank winner exactly as v2 does at its rank. So it must: code exactly as
v2 where it has no state, stay within the budget, be a pure function of its
input and its memo, carry the memo (codings and estimates, no bases) through
the engine checkpoint and the replica start state, and refuse a memo that is
not its own. Refactoring v3 into the shared
:class:`training.codec.reselect.ReselectingEncoder` must leave v3's bytes as they were
(the previous ``encode_v3``, step for step, below is the reference).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from codec_fixtures import drift, encoder_sim, rerun_replica0, same_bits, shape_map, stage_like

from training.codec.allocation import allocate, framing_bytes
from training.codec.base import tensor_matrices
from training.codec.coding import BalancedFactors, ColumnQuantizer, Option, candidates, lookup, quant_coded
from training.codec.factorize import factorize_gram, factorize_warm, warm_basis
from training.codec.memo import EncoderMemo
from training.codec.registry import ENCODERS, encoder_for
from training.codec.reselect import RESELECT_ROUNDS
from training.codec_wire import decode_contribution
from training.compression import encode_with_memo, encode_within_bandwidth
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import ContributionEncodeError, EngineStateError
from training.reexec import EXACT, STATE_MISMATCH, restart_state_reason, verify_contribution
from training.reexec_sim import SimReplica, run_with_states
from training.replica_state import StageStartState
from training.stage_engine import StageEngine

V2 = CompressionConfig(encoder="v2")
V3 = CompressionConfig(encoder="v3")
V4 = CompressionConfig(encoder="v4")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/torch_fixtures.py


# --------------------------------------------------------------------------- the previous encode_v3, verbatim


def reference_encode_v3(tensors, cfg, budget, memo, *, stage_index, outer_round):
    shared = encoder_for(cfg)  # its select() and finish(), the shared steps the previous code called
    matrices, norms = tensor_matrices(tensors)
    warm = (memo is not None and outer_round % RESELECT_ROUNDS != 0 and set(memo.choices) == set(matrices))
    if not warm:
        chosen, found = shared.select(tensors, matrices, norms, budget)
        blob, decoded, stats, coded = shared.finish(tensors, matrices, norms, chosen, stage_index=stage_index,
                                                    outer_round=outer_round)
        choices, next_bases = {}, {}
        for name, winner in coded.items():
            candidate = winner.candidate
            choices[name] = (candidate.codec, candidate.rank, candidate.bits)
            if candidate.codec == "lowrank":
                next_bases[name] = warm_basis(found[name].factors, tuple(matrices[name].shape),
                                              candidate.rank)
        return blob, decoded, stats, EncoderMemo(choices, next_bases)
    chosen, next_bases = {}, {}
    for name, matrix in matrices.items():
        codec, rank, bits = memo.choices[name]
        candidate = lookup(tuple(tensors[name].shape), cfg, (codec, rank, bits))
        if candidate is None:
            raise ContributionEncodeError(
                f"{name!r}: encoder memo coding {(codec, rank, bits)} is not a candidate")
        if codec == "quant":
            quantizer = ColumnQuantizer(matrix)
            chosen[name] = Option(candidate, math.nan,
                                  lambda q=quantizer, c=candidate: quant_coded(q, c, math.nan))
        else:
            factors, next_bases[name] = factorize_warm(matrix, rank, memo.bases[name])
            balanced = BalancedFactors(factors, rank)
            chosen[name] = Option(candidate, math.nan, lambda f=balanced, c=candidate: f.coded(c, math.nan))
    blob, decoded, stats, _ = shared.finish(tensors, matrices, norms, chosen, stage_index=stage_index,
                                            outer_round=outer_round)
    return blob, decoded, stats, EncoderMemo(dict(memo.choices), next_bases)


@pytest.mark.parametrize("budget", [6_000, 40_000])
def test_v3_keeps_its_bytes_after_the_refactoring(budget):
    base = stage_like(11)
    memo = reference = None
    for outer_round in range(RESELECT_ROUNDS + 2):
        tensors = drift(base, outer_round)
        blob, decoded, _, memo = encode_with_memo(tensors, V3, budget, memo, stage_index=0,
                                                  outer_round=outer_round)
        want, want_decoded, _, reference = reference_encode_v3(tensors, V3, budget, reference, stage_index=0,
                                                               outer_round=outer_round)
        assert blob == want
        assert all(same_bits(decoded[name], want_decoded[name]) for name in tensors)
        assert memo.choices == reference.choices and set(memo.bases) == set(reference.bases)
        assert all(same_bits(memo.bases[n], reference.bases[n]) for n in memo.bases)


# ----------------------------------------------------------------------------- v4


@pytest.mark.parametrize("budget", [6_000, 40_000, 200_000])
def test_v4_without_state_codes_as_v2(budget):
    tensors = stage_like(0)
    v2 = encode_within_bandwidth(tensors, V2, budget, stage_index=1, outer_round=5)[0]
    # stateless path
    assert encode_within_bandwidth(tensors, V4, budget, stage_index=1, outer_round=5)[0] == v2
    blob, _, _, memo = encode_with_memo(tensors, V4, budget, None, stage_index=1, outer_round=5)
    assert blob == v2
    assert memo.bases == {} and "g.empty" not in memo.choices
    assert budget > 100_000 or any(codec == "lowrank" for codec, _, _ in memo.choices.values())


def _warm_reference(tensors, memo, cfg, budget, outer_round):
    """A warm v4 round built by hand: allocate() on (cost, (estimate * norm)^2), then v2's factorization at
    r."""
    matrices, norms = tensor_matrices(tensors)
    overhead = 32 + sum(framing_bytes(name, tuple(tensors[name].shape)) for name in sorted(tensors))
    codings = {name: candidates(tuple(tensors[name].shape), cfg) for name in matrices}
    options = {name: [(c.cost, (float(e) * norms[name]) ** 2)
                      for c, e in zip(codings[name], memo.estimates[name])]
               for name in matrices}
    choice = allocate(options, budget - overhead)
    chosen = {}
    for name, matrix in matrices.items():
        candidate = codings[name][choice[name]]
        if candidate.codec == "quant":
            quantizer = ColumnQuantizer(matrix)
            chosen[name] = Option(candidate, 0.0, lambda q=quantizer, c=candidate: quant_coded(q, c, 0.0))
        else:
            factors = BalancedFactors(factorize_gram(matrix, candidate.rank), candidate.rank)
            chosen[name] = Option(candidate, 0.0, lambda f=factors, c=candidate: f.coded(c, 0.0))
    return encoder_for(cfg).finish(tensors, matrices, norms, chosen, stage_index=0,
                                   outer_round=outer_round)[0]


@pytest.mark.parametrize("budget", [6_000, 40_000])
def test_v4_rounds_decode_bit_exactly_fit_the_budget_and_reselect(budget):
    base = stage_like(1)
    memo = None
    for outer_round in range(RESELECT_ROUNDS + 2):
        tensors = drift(base, outer_round)
        blob, decoded, stats, next_memo = encode_with_memo(tensors, V4, budget, memo, stage_index=0,
                                                           outer_round=outer_round)
        again = encode_with_memo(tensors, V4, budget, memo, stage_index=0, outer_round=outer_round)
        assert again[0] == blob  # a pure function of the input and the memo
        received = decode_contribution(blob, shape_map(tensors), stage_index=0, outer_round=outer_round,
                                       refuse_raw=True)
        assert all(same_bits(received[name], decoded[name]) for name in tensors)
        v2 = encode_within_bandwidth(tensors, V2, budget, stage_index=0, outer_round=outer_round)[0]
        assert len(blob) <= budget
        if outer_round % RESELECT_ROUNDS == 0:
            assert blob == v2  # a selection round is v2's
        else:
            assert blob == _warm_reference(tensors, memo, V4, budget, outer_round)
            assert next_memo.estimates is memo.estimates  # kept until the next selection
            assert next_memo.choices == {t.name: (t.codec, t.rank, t.bits) for t in stats.tensors if t.name in
                                         next_memo.choices}
        assert next_memo.bases == {}
        memo = next_memo


def test_v4_with_a_memo_without_estimates_selects():
    tensors = stage_like(8)
    _, _, _, memo = encode_with_memo(tensors, V4, 40_000, None, stage_index=0, outer_round=0)
    bare = EncoderMemo(dict(memo.choices), {})
    blob = encode_with_memo(tensors, V4, 40_000, bare, stage_index=0, outer_round=1)[0]
    assert blob == encode_within_bandwidth(tensors, V2, 40_000, stage_index=0, outer_round=1)[0]


def test_v4_warm_round_on_the_selections_input_keeps_its_choices():
    """With the same tensors (same norms) the re-allocation makes the selection's choices again."""
    tensors = stage_like(3)
    blob, _, _, memo = encode_with_memo(tensors, V4, 40_000, None, stage_index=0, outer_round=0)
    _, _, _, warm = encode_with_memo(tensors, V4, 40_000, memo, stage_index=0, outer_round=1)
    assert warm.choices == memo.choices
    scaled = {name: 3.0 * value for name, value in tensors.items()}  # every norm x3: the same choices
    _, _, _, warm = encode_with_memo(scaled, V4, 40_000, memo, stage_index=0, outer_round=1)
    assert warm.choices == memo.choices


def test_v4_warm_rounds_code_closer_than_v3s_single_power_iteration():
    """The point of v4: its warm low-rank codings are at least as accurate as v3's (v2's factorization)."""
    base = stage_like(2)
    memos = {"v3": None, "v4": None}
    errors = {"v3": [], "v4": []}
    for outer_round in range(RESELECT_ROUNDS):
        tensors = drift(base, outer_round)
        for version, cfg in (("v3", V3), ("v4", V4)):
            _, _, stats, memos[version] = encode_with_memo(tensors, cfg, 40_000, memos[version],
                                                           stage_index=0, outer_round=outer_round)
            if outer_round:
                errors[version] += [t.rel_error for t in stats.tensors if t.codec == "lowrank"]
    assert errors["v4"] and len(errors["v4"]) == len(errors["v3"])
    assert sum(errors["v4"]) <= sum(errors["v3"]) * (1 + 1e-6)


def test_v4_engine_checkpoint_carries_the_memo_and_refuses_a_v3_memo():
    diloco_cfg = DilocoConfig(inner_steps=2, num_replicas=1, one_step_delay=False)
    cfg = dataclasses.replace(V4, bandwidth_budget=20_000)
    start = {name: value for name, value in stage_like(4).items() if value.numel()}
    engine = StageEngine(0, {n: v.clone() for n, v in start.items()}, diloco_cfg, cfg)
    with torch.no_grad():
        for name, param in engine.params.items():
            param.sub_(stage_like(5)[name])
    blob = engine.encode_contribution(0)[0]
    engine.apply_round(0, [blob])
    state = engine.state_dict()
    assert state["encoder_memo"] is not None and state["encoder_memo"]["basis"] == {}
    assert set(state["encoder_memo"]["estimate"]) == set(state["encoder_memo"]["choice"])
    twin = StageEngine(0, {n: p.detach().clone() for n, p in engine.params.items()}, diloco_cfg, cfg)
    twin.load_state_dict(state)
    blank = StageEngine(0, {n: p.detach().clone() for n, p in engine.params.items()}, diloco_cfg, cfg)
    blank.load_state_dict({**state, "encoder_memo": None})
    for one in (engine, twin, blank):
        with torch.no_grad():
            for name, param in one.params.items():
                param.sub_(stage_like(6)[name])
    warm = engine.encode_contribution(1)[0]
    assert twin.encode_contribution(1)[0] == warm
    assert blank.encode_contribution(1)[0] != warm  # without the memo round 1 selects afresh
    lowrank = next(n for n, (codec, _, _) in engine.compressor.encoder_memo.choices.items()
                   if codec == "lowrank")
    v3_like = {"choice": state["encoder_memo"]["choice"], "basis": {lowrank: torch.zeros(512, 4)},
               "estimate": state["encoder_memo"]["estimate"]}
    with pytest.raises(EngineStateError, match="encoder memo"):
        blank.load_state_dict({**state, "encoder_memo": v3_like})


def test_v4_memo_tensors_round_trip_and_refuse_nonsense():
    tensors = stage_like(7)
    _, _, _, memo = encode_with_memo(tensors, V4, 40_000, None, stage_index=0, outer_round=0)
    shapes = shape_map(tensors)
    state = memo.to_tensors()
    again = encoder_for(V4).load_memo(state, shapes)
    assert again.choices == memo.choices and again.bases == {}
    assert all(same_bits(again.estimates[n], memo.estimates[n]) for n in memo.estimates)
    name = next(n for n, (codec, _, _) in memo.choices.items() if codec == "lowrank")
    rank = memo.choices[name][1]
    estimate = state["estimate"][name]
    for broken in (
        # rank 5 is no candidate
        {**state, "choice": {**state["choice"], name: torch.tensor([1.0, 5.0, 4.0])}},
        {**state, "basis": {name: torch.zeros(max(shapes[name]), rank)}},  # a basis: v3's memo, not v4's
        {"choice": state["choice"], "basis": {}},  # no estimates
        {**state, "estimate": {n: v for n, v in state["estimate"].items() if n != name}},
        {**state, "estimate": {**state["estimate"], name: estimate[:-1]}},
        {**state, "estimate": {**state["estimate"], name: torch.full_like(estimate, float("nan"))}},
        {**state, "estimate": {**state["estimate"], name: -estimate - 1.0}},
        {**state, "estimate": {**state["estimate"], name: estimate.double()}},
    ):
        with pytest.raises(ValueError):
            encoder_for(V4).load_memo(broken, shapes)
    with pytest.raises(ValueError):  # and v3 refuses v4's memo (no bases)
        encoder_for(V3).load_memo(state, shapes)
    with pytest.raises(ContributionEncodeError):
        encode_with_memo(tensors, V2, 40_000, None, stage_index=0, outer_round=0)


def test_v4_contributions_reexecute_bit_exactly_and_chain_their_memo():
    """Warm rounds depend on the memo in the start state: a rerun from it gives the same bytes and next
    state."""
    sim = encoder_sim("v4", 3)
    records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    names = records[1].states[0].stages[0].tensors
    assert any(name.startswith("encoder.choice/") for name in names)
    assert any(name.startswith("encoder.estimate/") for name in names)
    assert not any(name.startswith("encoder.basis/") for name in names)
    for outer_round in range(3):
        check = rerun_replica0(sim, records, outer_round)
        assert check.verdict == EXACT, check.reason
        if outer_round + 1 < 3 and check.next_state_hashes is not None:
            assert check.next_state_hashes == [claim.state_hash
                                               for claim in records[outer_round + 1].claims[0]]
    parts = [part.to_bytes() for part in records[1].states[0].stages]
    assert restart_state_reason(parts, [claim.state_hash for claim in records[1].claims[0]]) is not None


def test_memo_encoders_are_the_ones_with_state():
    assert tuple(version for version, kind in ENCODERS.items() if kind.keeps_memo) == ("v3", "v4")


def test_a_malformed_v4_memo_in_a_served_state_is_a_state_mismatch():
    sim = encoder_sim("v4", 2)
    records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    record = records[1]
    parts = list(record.states[0].stages)
    name = next(n for n in sorted(parts[0].tensors) if n.startswith("encoder.estimate/"))
    value = parts[0].tensors[name]
    for broken in ({name: value[:-1]}, {name: torch.full_like(value, float("inf"))},
                   {name.replace("estimate", "basis"): torch.zeros(3, 2)}):
        tensors = {**parts[0].tensors, **broken}
        forged = StageStartState(parts[0].meta, parts[0].stage_index, parts[0].engine_counters, tensors)
        claims = [dataclasses.replace(record.claims[0][0], state_hash=forged.state_hash()),
                  record.claims[0][1]]
        check = verify_contribution(
            [forged.to_bytes(), parts[1].to_bytes()], claims, sim.corpus, sim.model, sim.training, sim.diloco,
            sim.compression, outer_round=1, replica=0, run_rounds=sim.rounds,
            previous_contributions=records[0].contributions,
        )
        assert check.verdict == STATE_MISMATCH, check.reason
