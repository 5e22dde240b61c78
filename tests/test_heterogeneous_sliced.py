"""The sliced exchange in a run whose rounds are bounded by time (issue 44, docs/DILOCOX.md section 13).

Every slice blob of a replica declares its inner steps (codec_wire version 2) and its bundle's reference
declares them too (``dlx-slices/3``), so an envelope alone says what its contribution weighs; a slice whose
count is not its reference's is not the slice the reference vouches for (an absent input). Aggregator j
checks each slice's count against the run's range and clips per step, as the full exchange does; the
rerun of a sliced contribution trains exactly the count its slices declare (over-declaring is a mismatch).

The reexec run: three tiny replicas of a sliced, time-bounded run (H = 6, min 2, 3 rounds, 2 stages, one
torch thread) with fixed step counts (no clock in a test): 6, 3, and 3 trained but 5 declared.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
from test_sliced_reexec import SlicedReplica

from training.butterfly import aggregate_slice, replay_partial, slice_stage
from training.slice_plan import SliceError, plan_slices
from training.codec_wire import decode_declared, declare_steps, header_steps
from training.compression import encode_contribution
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import TrainingConfigError
from training.fingerprint import EXACT, MISMATCH
from training.reexec import claimed_steps, verify_contribution
from training.reexec_sim import OverDeclaringReplica, SimConfig, SlowReplica, run_with_states
from training.robust import BAD_STEPS
from training.slicebundle import (
    DECLARED_REFERENCE_PREFIX,
    REFERENCE_PREFIX,
    bundle_slices,
    parse_slice_reference,
    read_slice,
    reference_steps,
    rerun_claim,
    slice_bundle,
)
from training.slicemessages import check_partial, inputs_root, parse_partial, partial_payload
from training.stage_engine import StageEngine

SHAPES = {"a": (64, 32), "b": (32, 16)}
CFG = CompressionConfig(min_compress_numel=512)


def _budgeted(**overrides) -> DilocoConfig:
    fields = dict(inner_steps=8, num_replicas=3, round_budget_s=2.5, min_inner_steps=2, one_step_delay=False,
                  screening=False, exchange="sliced")
    fields.update(overrides)
    return DilocoConfig(**fields)


def test_a_sliced_run_may_bound_its_rounds_by_time():
    cfg = _budgeted()
    assert cfg.exchange == "sliced" and cfg.budgeted and cfg.steps_range == (2, 8)
    assert DilocoConfig(inner_steps=8).steps_range is None
    with pytest.raises(TrainingConfigError, match="min_inner_steps=9"):
        _budgeted(min_inner_steps=9)


def _engine(diloco: DilocoConfig) -> tuple[StageEngine, object]:
    generator = torch.Generator().manual_seed(1)
    params = {name: torch.nn.Parameter(torch.randn(shape, generator=generator))
                  for name, shape in SHAPES.items()}
    engine = StageEngine(0, params, diloco, CFG)
    plan = slice_stage(engine, diloco.num_replicas, 256)
    with torch.no_grad():
        for param in params.values():
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    return engine, plan


def test_every_slice_and_the_reference_declare_the_count_in_a_budgeted_run_only():
    engine, plan = _engine(_budgeted())
    assert plan.num_slices == 3
    packed, _stats = engine.encode_contribution(0, 5)
    slices = msgpack.unpackb(packed, raw=False)
    assert slices == engine.compressor.last_slices and [header_steps(blob) for blob in slices] == [5, 5, 5]
    assert claimed_steps(packed) == 5
    bundle, reference = slice_bundle(slices, header_steps(slices[0]))
    assert reference.startswith(DECLARED_REFERENCE_PREFIX) and reference_steps(reference) == 5
    parsed = parse_slice_reference(reference, 3, len(bundle))
    assert parsed.steps == 5 and bundle_slices(bundle, parsed) == slices
    assert rerun_claim(bundle, parsed) == packed

    fixed, _plan = _engine(DilocoConfig(inner_steps=8, num_replicas=3, one_step_delay=False,
                                        exchange="sliced"))
    fixed_packed, _ = fixed.encode_contribution(0)
    fixed_slices = msgpack.unpackb(fixed_packed, raw=False)
    assert [header_steps(blob) for blob in fixed_slices] == [None] * 3 and claimed_steps(fixed_packed) is None
    _bundle, fixed_reference = slice_bundle(fixed_slices, header_steps(fixed_slices[0]))
    assert fixed_reference.startswith(REFERENCE_PREFIX) and len(fixed_reference) == 88  # version 2, unchanged
    assert parse_slice_reference(fixed_reference, 3, 1 << 20).steps is None \
        and reference_steps(fixed_reference) is None


def test_a_slice_that_declares_another_count_than_its_reference_is_not_proven():
    engine, _plan = _engine(_budgeted())
    packed, _ = engine.encode_contribution(0, 5)
    slices = msgpack.unpackb(packed, raw=False)
    mixed = [slices[0], declare_steps(_undeclared(slices[1]), 7), slices[2]]
    bundle, reference = slice_bundle(mixed, 5)
    parsed = parse_slice_reference(reference, 3, len(bundle))
    assert read_slice(bundle, parsed, 0) == slices[0] and read_slice(bundle, parsed, 1) is None
    with pytest.raises(SliceError, match=r"does not prove slices \[1\]"):
        rerun_claim(bundle, parsed)
    # A version-2 reference (no count) over declaring slices, and a version-3 one over undeclared slices.
    bundle, reference = slice_bundle(slices)
    assert bundle_slices(bundle, parse_slice_reference(reference, 3, len(bundle))) == [None] * 3
    plain = [_undeclared(blob) for blob in slices]
    bundle, reference = slice_bundle(plain, 5)
    assert bundle_slices(bundle, parse_slice_reference(reference, 3, len(bundle))) == [None] * 3
    # A claim whose slices declare different counts declares nothing valid.
    assert claimed_steps(msgpack.packb(mixed, use_bin_type=True)) is None


@pytest.mark.parametrize("steps", [0, 1 << 21])
def test_a_reference_declaring_a_count_out_of_bounds_is_refused(steps):
    with pytest.raises(SliceError, match="inner steps"):
        slice_bundle([b"a", b"b"], steps)
    bundle, reference = slice_bundle([b"a", b"b"], 3)
    forged = reference[:-4] + steps.to_bytes(4, "big")
    with pytest.raises(SliceError, match="inner steps"):
        parse_slice_reference(forged, 2, len(bundle))
    assert reference_steps(forged) is None


def _undeclared(blob: bytes) -> bytes:
    message = msgpack.unpackb(blob, raw=False)
    return msgpack.packb({"v": 1, "st": message["st"], "rd": message["rd"], "t": message["t"]},
                         use_bin_type=True)


def _slice_inputs(plan, counts_and_scales):
    """Slice 0 of replicas that trained ``k`` steps of a per-step update of the given size, declared."""
    inputs = []
    for replica, (declared, per_step) in enumerate(counts_and_scales):
        generator = torch.Generator().manual_seed(10 + replica)
        tensors = {name: per_step * declared * torch.randn(shape, generator=generator)
                   for name, shape in plan.slice_shapes(0).items()}
        blob, _decoded, _stats = encode_contribution(tensors, CFG, stage_index=0, outer_round=2)
        inputs.append(declare_steps(blob, declared))
    return inputs


def test_the_aggregator_checks_the_range_and_clips_per_step():
    diloco = _budgeted(norm_clip=2.0)
    plan = plan_slices(SHAPES, 3, min_slice_numel=256)
    # Replica 1 trained a quarter of replica 0's steps (its update about a quarter as long): per step alike.
    # Replica 2 declares 9 > H = 8: excluded. Replica 3 declares 2 steps for a full-length update: clipped.
    inputs = _slice_inputs(plan, [(8, 1e-3), (2, 1e-3), (9, 1e-3), (2, 4e-3)])
    result = aggregate_slice(inputs, plan, 0, CFG, 0, norm_clip=2.0, stage_index=0, outer_round=2,
                             steps_range=diloco.steps_range)
    reports = {report.index: report for report in result.reports}
    assert reports[0].accepted and reports[0].scale == 1.0
    assert reports[1].accepted and reports[1].scale == 1.0
    assert not reports[2].accepted and reports[2].reason == BAD_STEPS
    assert reports[3].accepted and reports[3].scale < 0.6 and "per step" in reports[3].detail
    # Fixed H reads no count: the short honest update would be the norm rule's median, the long one clipped.
    plain = aggregate_slice(inputs, plan, 0, CFG, 0, norm_clip=2.0, stage_index=0, outer_round=2)
    assert [r.accepted for r in plain.reports] == [True] * 4 and plain.partial != result.partial
    # The partial is what the replay gives with the run's range, and check_partial says so.
    assert replay_partial(inputs, plan, 0, CFG, 0, norm_clip=2.0, stage_index=0, outer_round=2,
                          steps_range=diloco.steps_range) == result.partial
    partial = parse_partial(partial_payload(0, plan.num_slices, inputs_root(inputs), 4, result.partial))
    assert check_partial(partial, inputs, plan, CFG, 0, norm_clip=2.0, stage_index=0, outer_round=2,
                         steps_range=diloco.steps_range) == ""
    assert "differ from the replay" in check_partial(partial, inputs, plan, CFG, 0, norm_clip=2.0,
                                                     stage_index=0, outer_round=2)


# ----------------------------------------------------------------------------- re-execution

ROUNDS = 3
FULL, HALF, OVER = range(3)


class SlicedSlow(SlowReplica, SlicedReplica):
    """Honest: trains and declares 3 steps a round, slices out, partials in."""


class SlicedOverDeclaring(OverDeclaringReplica, SlicedReplica):
    """Trains 3 steps a round, declares 5 in every slice."""


def _sim() -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2),
        diloco=DilocoConfig(inner_steps=6, num_replicas=3, round_budget_s=1.0, min_inner_steps=2,
                            overlap_steps=0, screening=False, exchange="sliced"),
        compression=CompressionConfig(min_compress_numel=512),
        num_stages=2,
        rounds=ROUNDS,
    )


@pytest.fixture(scope="module")
def run():
    sim = _sim()
    SlicedReplica.partials = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        replicas = [SlicedReplica(FULL, sim), SlicedSlow(HALF, sim, 3), SlicedOverDeclaring(OVER, sim, 3)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    return sim, records, SlicedReplica.partials


def _check(sim, records, partials, replica, outer_round, claims=None):
    record = records[outer_round]
    return verify_contribution(
        [part.to_bytes() for part in record.states[replica].stages], claims or record.claims[replica],
        sim.corpus, sim.model, sim.training, sim.diloco, sim.compression, outer_round=outer_round,
        replica=replica, run_rounds=sim.rounds, previous_partials=partials.get(outer_round - 1))


def test_each_honest_sliced_replica_reruns_exactly_its_declared_steps(run):
    sim, records, partials = run
    for replica, steps in ((FULL, 6), (HALF, 3)):
        for outer_round in range(ROUNDS):
            claims = records[outer_round].claims[replica]
            assert [claimed_steps(claim.payload) for claim in claims] == [steps, steps]
            check = _check(sim, records, partials, replica, outer_round)
            assert check.verdict == EXACT, (replica, outer_round, check.reason)


def test_a_sliced_replica_that_over_declares_is_a_mismatch(run):
    sim, records, partials = run
    for outer_round in range(ROUNDS):
        assert claimed_steps(records[outer_round].claims[OVER][0].payload) == 5
        check = _check(sim, records, partials, OVER, outer_round)
        assert check.verdict == MISMATCH, check.reason
        assert check.failed_stages == (0, 1)


def test_a_sliced_claim_whose_slices_disagree_is_a_mismatch(run):
    sim, records, partials = run
    claims = records[1].claims[HALF]
    slices = msgpack.unpackb(claims[0].payload, raw=False)
    slices[-1] = declare_steps(_undeclared(slices[-1]), 4)
    mixed = dataclasses.replace(claims[0], payload=msgpack.packb(slices, use_bin_type=True))
    check = _check(sim, records, partials, HALF, 1, claims=[mixed, claims[1]])
    assert check.verdict == MISMATCH and check.failed_stages == (0,), check.reason
    assert decode_declared(slices[0], _slice0_shapes(sim), stage_index=0)[0] == 3


def _slice0_shapes(sim):
    from training.slice_plan import live_plan
    from training.stages import split_stages, stage_param_shapes

    shapes = stage_param_shapes(sim.model, split_stages(sim.model.n_layer, sim.num_stages)[0])
    return live_plan(shapes, sim.diloco.num_replicas, sim.diloco.min_slice_numel).slice_shapes(0)
