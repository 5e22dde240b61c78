"""Rounds bounded by time as well as steps (issue 44): settings, the declared steps on the wire, the
step-weighted aggregation with per-step clipping and screening, and re-execution of exactly the declared
steps (a replica that declares more steps than it trained is caught).

The reexec run: four tiny replicas (H = 6, min 2, 3 rounds, 2 stages, one torch thread) in a
time-bounded run whose step counts are fixed per replica (the count a budget fitted; no clock in a
test): replica 0 trains 6, 1 trains 3, 2 trains 2, 3 trains 3 and declares 5.
"""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest
import torch

from node.config import NodeConfig
from node.runconfig import config_hash, run_document
from training.codec_wire import (
    MAX_DECLARED_STEPS,
    declare_steps,
    decode_contribution,
    decode_declared,
    pack_contribution,
)
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus, round_batches
from training.diloco import aggregate_with_report, average_contributions
from training.errors import ContributionDecodeError, EngineStateError, ReexecError, TrainingConfigError
from training.reexec import EXACT, MISMATCH, data_commitment, reexecute, verify_contribution
from training.reexec_sim import OverDeclaringReplica, SimConfig, SimReplica, SlowReplica, run_with_states
from training.robust import BAD_STEPS
from training.schedule import round_actions, takes_another_step
from training.screening import screen_contributions
from training.stage_engine import StageEngine

SHAPES = {"a": (4, 3), "b": (5,)}


def _raw_blob(tensors: dict[str, torch.Tensor], outer_round: int = 0) -> bytes:
    entries = [{"n": name, "s": list(tensors[name].shape), "c": "raw",
                "d": tensors[name].to(torch.float32).numpy().tobytes()} for name in sorted(tensors)]
    return pack_contribution(0, outer_round, entries)


def _tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: scale * torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def _budgeted(**overrides) -> DilocoConfig:
    fields = dict(inner_steps=8, num_replicas=3, round_budget_s=2.5, min_inner_steps=2, one_step_delay=False,
                  screening=False)
    fields.update(overrides)
    return DilocoConfig(**fields)


# ----------------------------------------------------------------------------- settings


def test_fixed_h_run_document_has_no_budget_settings_and_keeps_its_hash():
    cfg = NodeConfig()
    document = run_document(cfg)
    assert "round_budget_s" not in document["diloco"] and "min_inner_steps" not in document["diloco"]
    timed = dataclasses.replace(cfg, diloco=dataclasses.replace(cfg.diloco, round_budget_s=30.0,
                                                                min_inner_steps=10, exchange="full"))
    timed_document = run_document(timed)
    assert timed_document["diloco"]["round_budget_s"] == 30.0 \
        and timed_document["diloco"]["min_inner_steps"] == 10
    assert config_hash(timed_document) != config_hash(document)
    # Dropping the two keys gives the fixed-H document back, byte for byte.
    del timed_document["diloco"]["round_budget_s"], timed_document["diloco"]["min_inner_steps"]
    assert config_hash(timed_document) == config_hash(document)


@pytest.mark.parametrize("fields, message", [
    ({"min_inner_steps": 3}, "needs diloco.round_budget_s"),
    ({"round_budget_s": -1.0}, "round_budget_s=-1.0"),
    ({"round_budget_s": math.inf}, "round_budget_s=inf"),
    ({"round_budget_s": 10.0, "min_inner_steps": 9}, "must be <= diloco.inner_steps=8"),
    ({"round_budget_s": 10.0, "min_inner_steps": -2}, "min_inner_steps=-2"),
    ({"round_budget_s": 10.0, "min_inner_steps": 2.5}, "min_inner_steps=2.5"),
    ({"round_budget_s": 10.0, "min_inner_steps": 1, "overlap_steps": 2},
     "must be > the steps the exchange overlaps"),
])
def test_bad_budget_settings_are_refused_by_name(fields, message):
    with pytest.raises(TrainingConfigError, match=message):
        DilocoConfig(inner_steps=8, **fields)


def test_min_inner_steps_defaults_to_one_with_a_budget():
    assert DilocoConfig(inner_steps=8, round_budget_s=1.0, overlap_steps=0).min_inner_steps == 1


def test_the_step_rule_reads_the_clock_only_between_min_and_h():
    cfg = _budgeted()
    assert takes_another_step(cfg, 0, 1e9) and takes_another_step(cfg, 1, 1e9)  # below the minimum: always
    assert takes_another_step(cfg, 2, 2.4) and not takes_another_step(cfg, 2, 2.5)
    assert not takes_another_step(cfg, 8, 0.0)  # never past H
    fixed = DilocoConfig(inner_steps=8)
    assert takes_another_step(fixed, 7, 1e9) and not takes_another_step(fixed, 8, 0.0)
    assert [a.end_step for a in round_actions(cfg, 0, steps=5) if a.kind == "train"] == [5]
    with pytest.raises(ValueError, match="steps=9"):
        round_actions(cfg, 0, steps=9)


# ----------------------------------------------------------------------------- wire


def test_declared_steps_travel_in_version_2_and_version_1_still_decodes():
    tensors = _tensors(0)
    old = _raw_blob(tensors)
    assert msgpack.unpackb(old)["v"] == 1
    steps, decoded = decode_declared(old, SHAPES, stage_index=0, outer_round=0)
    assert steps is None and all(torch.equal(decoded[n], tensors[n]) for n in SHAPES)
    new = declare_steps(old, 5)
    header = msgpack.unpackb(new)
    assert header["v"] == 2 and header["ns"] == 5
    steps, decoded = decode_declared(new, SHAPES, stage_index=0, outer_round=0)
    assert steps == 5 and all(torch.equal(decoded[n], tensors[n]) for n in SHAPES)
    assert all(torch.equal(decode_contribution(new, SHAPES)[n], tensors[n]) for n in SHAPES)


@pytest.mark.parametrize("ns, message", [
    (0, "must be in"), (-3, "must be in"), (MAX_DECLARED_STEPS + 1, "must be in"), (2**63, "must be in"),
    (2.0, "not a whole number"), (True, "not a whole number"), ("5", "not a whole number"),
    (None, "not a whole"),
])
def test_a_bad_declared_count_is_refused(ns, message):
    header = msgpack.unpackb(_raw_blob(_tensors(0)))
    header.update(v=2, ns=ns)
    with pytest.raises(ContributionDecodeError, match=message):
        decode_declared(msgpack.packb(header, use_bin_type=True), SHAPES)


def test_version_2_without_its_count_is_refused():
    header = msgpack.unpackb(_raw_blob(_tensors(0)))
    header["v"] = 2
    with pytest.raises(ContributionDecodeError, match="without its declared inner steps"):
        decode_declared(msgpack.packb(header, use_bin_type=True), SHAPES)


# ----------------------------------------------------------------------------- aggregation


def _zeros():
    return {name: torch.zeros(shape) for name, shape in SHAPES.items()}


def test_every_inner_step_weighs_the_same():
    """Delta = tau * sum_j (k_j / K) (c_j / k_j) with tau = K / M: the plain mean, bit for bit."""
    per_step = [_tensors(seed, 0.01) for seed in range(3)]
    steps = [8, 4, 2]
    # c_j = k_j x a per-step update
    decoded = [{n: t[n] * k for n in SHAPES} for t, k in zip(per_step, steps)]
    blobs = [declare_steps(_raw_blob(c), k) for c, k in zip(decoded, steps)]
    result = aggregate_with_report(_zeros(), _zeros(), blobs, _budgeted(norm_clip=0), stage_index=0,
                                   outer_round=0)
    total = sum(steps)
    tau = total / len(steps)
    mean = average_contributions(decoded)
    for name in SHAPES:
        normalised = tau * sum((k / total) * (c[name].double() / k) for c, k in zip(decoded, steps))
        assert torch.allclose(result.average[name].double(), normalised, rtol=1e-6, atol=1e-9)
        assert torch.equal(result.average[name], mean[name])
        # Each replica's share of Delta is its share of the steps: k_j / K of the per-step mean, times K / M.
        share = decoded[2][name].double() / len(steps)
        assert torch.allclose(share, tau * (steps[2] / total) * per_step[2][name].double(), rtol=1e-5)


def test_a_slow_honest_replica_is_not_clipped_and_a_bad_count_is_excluded():
    cfg = _budgeted(norm_clip=2.0)
    base = _tensors(1)
    # Replicas 0, 1 trained 8 steps, replica 2 (4x slower) 2 steps: its update is a quarter as long.
    blobs = [declare_steps(_raw_blob({n: 8 * base[n] * (1 + 0.01 * j) for n in SHAPES}), 8) for j in range(2)]
    blobs.append(declare_steps(_raw_blob({n: 2 * base[n] for n in SHAPES}), 2))
    result = aggregate_with_report(_zeros(), _zeros(), blobs, cfg, stage_index=0, outer_round=0)
    assert result.accepted == [0, 1, 2] and all(r.scale == 1.0 for r in result.contributions)
    # Per step the same update claimed over 2 steps is 4x
    # too long: clipped to norm_clip x the median per step.
    inflated = blobs[:2] + [declare_steps(_raw_blob({n: 8 * base[n] for n in SHAPES}), 2)]
    clipped = aggregate_with_report(_zeros(), _zeros(), inflated, cfg, stage_index=0, outer_round=0)
    assert clipped.contributions[2].accepted and 0.45 < clipped.contributions[2].scale < 0.55
    # Out of the run's [2, 8], or no count at all (version 1 in a time-bounded run): excluded, bad_steps.
    for bad in (declare_steps(_raw_blob(base), 1), declare_steps(_raw_blob(base), 9), _raw_blob(base)):
        result = aggregate_with_report(_zeros(), _zeros(), blobs[:2] + [bad], cfg, stage_index=0,
                                       outer_round=0)
        assert result.excluded.keys() == {2} and result.contributions[2].reason == BAD_STEPS


def test_a_fixed_h_run_aggregates_as_before():
    cfg = DilocoConfig(inner_steps=8, num_replicas=3, one_step_delay=False)
    blobs = [_raw_blob(_tensors(seed)) for seed in range(3)]
    result = aggregate_with_report(_zeros(), _zeros(), blobs, cfg, stage_index=0, outer_round=0)
    mean = average_contributions([_tensors(seed) for seed in range(3)])
    assert all(torch.equal(result.average[n], mean[n]) for n in SHAPES)


def test_screening_keeps_a_slow_contribution_that_improves_the_loss():
    """Three replicas, one 4x slower: applied alone it moves a quarter as far, which the plain rule
    would leave out (above the median + tolerance); the time-bounded rule keeps what beats no update."""
    target = {name: torch.full(shape, 1.0) for name, shape in SHAPES.items()}

    def loss(weights):
        return float(sum(((weights[n].double() - target[n].double()) ** 2).sum() for n in SHAPES))

    start = _zeros()
    # one step's update (theta - lr*d moves to target)
    direction = {n: -(target[n] - start[n]) / 8 for n in SHAPES}
    decoded = [{n: 8 * direction[n] * 0.9 for n in SHAPES}, {n: 8 * direction[n] * 0.95 for n in SHAPES},
               {n: 2 * direction[n] * 0.9 for n in SHAPES}]
    cfg = _budgeted(screening=True, screen_rel_tol=0.02, outer_lr=1.0)
    reports = screen_contributions(loss, start, decoded, cfg, [8, 8, 2])
    assert not any(r.excluded for r in reports)
    plain = screen_contributions(loss, start, decoded, DilocoConfig(inner_steps=8, screen_rel_tol=0.02))
    assert [r.excluded for r in plain] == [False, False, True]
    with pytest.raises(ValueError, match="declared steps"):
        screen_contributions(loss, start, decoded, cfg)
    # The wrong way (worse than no update and than the median) is left out; a bad count is not screened.
    flipped = decoded[:2] + [{n: -8 * direction[n] for n in SHAPES}]
    assert [r.excluded for r in screen_contributions(loss, start, flipped, cfg, [8, 8, 8])] == [False, False,
                                                                                                True]
    assert screen_contributions(loss, start, decoded, cfg, [8, 8, 99])[2].loss_after is None


def test_the_engine_declares_in_a_budgeted_run_only():
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}
    compression = CompressionConfig(enabled=False)
    engine = StageEngine(0, params, _budgeted(), compression)
    with pytest.raises(EngineStateError, match="declares its steps"):
        engine.encode_contribution(0)
    with pytest.raises(TrainingConfigError, match="outside the run's"):
        engine.encode_contribution(0, 9)
    blob, _ = engine.encode_contribution(0, 5)
    assert decode_declared(blob, SHAPES)[0] == 5
    fixed = StageEngine(0, params, DilocoConfig(inner_steps=8, one_step_delay=False), compression)
    assert msgpack.unpackb(fixed.encode_contribution(0)[0])["v"] == 1
    fresh = StageEngine(0, params, DilocoConfig(inner_steps=8, one_step_delay=False), compression)
    with pytest.raises(EngineStateError, match="fixed-H"):
        fresh.encode_contribution(0, 5)


# ----------------------------------------------------------------------------- re-execution

ROUNDS = 3
FULL, HALF, SLOWEST, OVER = range(4)


def _sim() -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2),
        diloco=DilocoConfig(inner_steps=6, num_replicas=4, round_budget_s=1.0, min_inner_steps=2,
                            overlap_steps=0, screening=False),
        compression=CompressionConfig(min_compress_numel=512),
        num_stages=2,
        rounds=ROUNDS,
    )


@pytest.fixture(scope="module")
def run():
    sim = _sim()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        replicas = [SimReplica(FULL, sim), SlowReplica(HALF, sim, 3), SlowReplica(SLOWEST, sim, 2),
                    OverDeclaringReplica(OVER, sim, 3)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    return sim, records


def _check(sim, records, replica, outer_round, **kwargs):
    record = records[outer_round]
    previous = records[outer_round - 1].contributions if outer_round > 0 else None
    return verify_contribution(
        [part.to_bytes() for part in record.states[replica].stages],
        kwargs.pop("claims", record.claims[replica]), sim.corpus, sim.model, sim.training, sim.diloco,
        sim.compression, outer_round=outer_round, replica=replica, run_rounds=sim.rounds,
        previous_contributions=previous, **kwargs,
    )


def test_each_honest_replica_reruns_exactly_its_declared_steps(run):
    sim, records = run
    for replica, steps in ((FULL, 6), (HALF, 3), (SLOWEST, 2)):
        for outer_round in range(ROUNDS):
            assert decode_declared(records[outer_round].claims[replica][0].payload,
                                   _stage_shapes(sim, 0), stage_index=0)[0] == steps
            check = _check(sim, records, replica, outer_round)
            assert check.verdict == EXACT, (replica, outer_round, check.reason)


def test_declaring_more_steps_than_trained_is_a_mismatch(run):
    sim, records = run
    for outer_round in range(ROUNDS):
        check = _check(sim, records, OVER, outer_round)
        assert check.verdict == MISMATCH, check.reason
        assert check.failed_stages == (0, 1)


def test_the_data_commitment_covers_the_declared_steps_only(run):
    sim, records = run
    claim = records[1].claims[HALF][0]
    assert claim.data_commitment == data_commitment(sim.corpus, sim.training, sim.model, sim.diloco, HALF, 1,
                                                    3)
    assert claim.data_commitment != data_commitment(sim.corpus, sim.training, sim.model, sim.diloco, HALF, 1,
                                                    6)
    # Batch k of a round does not depend on how many steps the round trained.
    short = round_batches(sim.corpus, sim.training.seed, HALF, 1, 3, sim.training.batch_size,
                          sim.model.block_size)
    full = round_batches(sim.corpus, sim.training.seed, HALF, 1, 6, sim.training.batch_size,
                         sim.model.block_size)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(short, full[:3]))


def test_stages_that_declare_different_counts_or_out_of_range_are_refused(run):
    sim, records = run
    claims = records[0].claims[HALF]
    other = dataclasses.replace(claims[1], payload=_redeclare(claims[1].payload, 4))
    check = _check(sim, records, HALF, 0, claims=[claims[0], other])
    assert check.verdict == MISMATCH and "different inner steps" in check.reason
    huge = dataclasses.replace(claims[1], payload=_redeclare(claims[1].payload, 10**6))
    check = _check(sim, records, HALF, 0, claims=[claims[0], huge])
    assert check.verdict == MISMATCH and check.failed_stages == (1,)
    state = records[0].states[HALF]
    for bad in (None, 0, 7, -1):
        with pytest.raises(ReexecError):
            reexecute(state, sim.corpus, sim.model, sim.training, sim.diloco, sim.compression,
                      declared_steps=bad)


def _redeclare(payload: bytes, steps: int) -> bytes:
    header = msgpack.unpackb(payload)
    header["ns"] = steps
    return msgpack.packb(header, use_bin_type=True)


def _stage_shapes(sim, stage):
    from training.stages import split_stages, stage_param_shapes

    return stage_param_shapes(sim.model, split_stages(sim.model.n_layer, sim.num_stages)[stage])


def test_the_wire_vectors_of_declared_steps():
    """tests/vectors/wire.json "contribution_payloads": version 1 and 2 decode to their declared steps, each
    refused payload is refused (the file itself is checked against tests/vectors/make_vectors.py by
    tests/test_wire_vectors.py)."""
    import json
    from pathlib import Path

    vectors = json.loads((Path(__file__).parent / "vectors" / "wire.json").read_text())[
        "contribution_payloads"]
    shapes = {name: tuple(shape) for name, shape in vectors["shapes"].items()}
    decoded = []
    for case in vectors["accepted"]:
        steps, tensors = decode_declared(bytes.fromhex(case["payload_hex"]), shapes,
                                         stage_index=vectors["stage"], outer_round=vectors["round"])
        assert steps == case["declared_steps"], case["name"]
        decoded.append(tensors)
    assert all(torch.equal(decoded[0][n], decoded[1][n]) for n in shapes)
    assert declare_steps(bytes.fromhex(vectors["accepted"][0]["payload_hex"]), 7).hex() == \
        vectors["accepted"][1]["payload_hex"]
    for case in vectors["rejected"]:
        with pytest.raises(ContributionDecodeError):
            decode_declared(bytes.fromhex(case["payload_hex"]), shapes)


# ----------------------------------------------------------------------------- the data order, in the node


@pytest.mark.parametrize("budget,overlap,expected", [(1e-9, 0, 2), (1e-9, 1, 2), (1e9, 0, 6), (1e9, 1, 6)])
def test_the_node_consumes_the_first_declared_batches_of_each_slot_and_nothing_else(budget, overlap,
                                                                                    expected):
    """ReplicaWorker.train_round under a budget (the smallest: every round trains min_inner_steps; the
    largest: H), in one part or two (an overlapped exchange): the batches its trainer gets in round t are
    batches 0 .. k_t - 1 of the slot (replica, t), k_t the count it declares, and round t+1 starts at batch 0
    of slot (replica, t+1): batches k_t .. H-1 of slot t go to nobody, no batch twice."""
    from node.config import load_config
    from node.live.worker.replica import ReplicaWorker

    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=6", "training.batch_size=2", "rounds=3",
                             "torch_threads=1", f"diloco.overlap_steps={overlap}",
                             f"diloco.round_budget_s={budget}", "diloco.min_inner_steps=2",
                             "pipeline.num_stages=1"])
    worker = ReplicaWorker(cfg, 1, (0,), 0)
    worker.start(10, 10)
    seen: list[torch.Tensor] = []
    step = worker.trainer.train_step
    worker.trainer.train_step = lambda x, y, *rest: (seen.append(x.clone()), step(x, y, *rest))[1]
    consumed = {}
    for outer_round in range(3):
        before = len(seen)
        if overlap:
            worker.train_round(outer_round, end_step=overlap)
            worker.train_round(outer_round, first_step=overlap)
        else:
            worker.train_round(outer_round)
        consumed[outer_round] = seen[before:]
        declared = worker.declared_steps(outer_round)
        assert declared == len(consumed[outer_round]) == expected
        slot = round_batches(worker.corpus, cfg.training.seed, 1, outer_round, 6, 2, cfg.model.block_size)
        assert all(torch.equal(got, want) for got, want in zip(consumed[outer_round], [x for x, _y in slot]))
        assert worker.data_commitment(outer_round) == data_commitment(
            worker.corpus, cfg.training, cfg.model, cfg.diloco, 1, outer_round, declared)
    every = [batch for batches in consumed.values() for batch in batches]
    assert len({bytes(batch.numpy().tobytes()) for batch in every}) == len(every)  # none consumed twice


def test_the_node_stops_where_its_round_clock_says_and_its_chunked_batches_are_the_slots():
    """ReplicaWorker.train_round with the node's round clock (``budget_elapsed``,
    node/live/state/roundclock.py): the steps stop at the first decision past the minimum that finds the
    budget used, whatever the inner steps themselves took, and the batches, built BATCH_CHUNK steps at a time,
    are the slot's, across the chunks' edges."""
    from node.config import load_config
    from node.live.worker.replica import BATCH_CHUNK, ReplicaWorker

    steps = BATCH_CHUNK + 5
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=64", "training.batch_size=2",
                             "rounds=2", "torch_threads=1", "diloco.overlap_steps=0",
                             "diloco.round_budget_s=10.0", "diloco.min_inner_steps=2",
                             "pipeline.num_stages=1"])
    worker = ReplicaWorker(cfg, 0, (0,), 0)
    worker.start(10, 10)
    seen: list[torch.Tensor] = []
    step = worker.trainer.train_step
    worker.trainer.train_step = lambda x, y, *rest: (seen.append(x.clone()), step(x, y, *rest))[1]
    asked = []

    def budget_elapsed() -> float:  # the budget is used up once `steps` steps were taken
        asked.append(len(seen))
        return 0.0 if len(seen) < steps else 10.0

    worker.train_round(1, budget_elapsed=budget_elapsed)
    assert worker.declared_steps(1) == len(seen) == steps
    assert asked == list(range(steps + 1))  # asked before every step, and once more (then it stops)
    slot = round_batches(worker.corpus, cfg.training.seed, 0, 1, 64, 2, cfg.model.block_size)
    assert all(torch.equal(got, want) for got, (want, _y) in zip(seen, slot))
    fixed_part = round_batches(worker.corpus, cfg.training.seed, 0, 1, 64, 2, cfg.model.block_size,
                               first_step=17)
    assert all(torch.equal(a, b) for a, b in zip(fixed_part[0], slot[17]))
