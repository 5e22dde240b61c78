"""Re-execution of sliced contributions (training/reexec.py with ``diloco.exchange = "sliced"``).

Replicas encode their contributions as slices (the live node's ``slice_stage``) and apply each round
from the partials of its slices (``aggregate_slice``, then the outer step on the assembled average),
as node/live/worker/replica.py does. The rerun compares the claimant's slices, packed, with its own (bit for
bit on the same platform and thread count), and applies round t-1 from the partials every holder
applied; a replica whose slices its state does not produce is a mismatch. The live spot checker's
side (fetching the bundle the signed reference names, the archived partials) is
node/live/checks/sliced_rerun.py, run end to end in tests/test_sliced_spotchecks_e2e.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgpack
import pytest
import torch

from node.live.checks.spotcheck import JOB_FILE, SpotCheckJob
from training.butterfly import aggregate_slice, average_of_partials, encode_slices, slice_stage
from training.slice_plan import live_plan
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.diloco import step_with_average
from training.fingerprint import EXACT, MISMATCH
from training.reexec import check_state_chain, sliced_contribution_distance, verify_contribution
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica, run_with_states
from training.stages import split_stages, stage_param_shapes

ROUNDS = 3
HONEST, PERTURBED = 0, 1


def _sim() -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2),
        diloco=DilocoConfig(inner_steps=3, num_replicas=2, exchange="sliced"),
        compression=CompressionConfig(min_compress_numel=512),
        num_stages=2,
        rounds=ROUNDS,
    )


class SlicedReplica(SimReplica):
    """An honest replica of a sliced run: slices out, partials in (node.live.worker.replica.ReplicaWorker)."""

    # round -> stage -> the partial blobs every holder applies
    partials: dict[int, dict[int, list[bytes]]] = {}

    def __init__(self, replica, sim):
        super().__init__(replica, sim)
        self.plans = [slice_stage(engine, sim.diloco.num_replicas, sim.diloco.min_slice_numel)
                      for engine in self.engines]

    def finish(self, outer_round, contributions):
        for engine, plan in zip(self.engines, self.plans):
            stage = engine.stage_index
            partials = self.partials.setdefault(outer_round, {}).get(stage)
            if partials is None:  # the aggregators' work, once for everyone (a pure function of the inputs)
                slices = [msgpack.unpackb(payload, raw=False) for payload in contributions[stage]]
                partials = [aggregate_slice([blobs[j] for blobs in slices], plan, j, self.sim.compression,
                                            engine.compressor.bandwidth_budget,
                                            norm_clip=self.sim.diloco.norm_clip, stage_index=stage,
                                            outer_round=outer_round,
                                            steps_range=self.sim.diloco.steps_range).partial
                            for j in range(plan.num_slices)]
                self.partials[outer_round][stage] = partials
            average = average_of_partials(partials, plan, stage_index=stage, outer_round=outer_round)
            engine.finish_round(outer_round, [], aggregation=step_with_average(
                engine.global_weights, engine.momentum, average, self.sim.diloco, outer_round))


class SlicedPerturbed(PerturbedReplica, SlicedReplica):
    """Adds noise of 1% of its update's norm before encoding its slices."""


@pytest.fixture(scope="module")
def run():
    sim = _sim()
    SlicedReplica.partials = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the claimants train on one thread (their start states record it)
    try:
        replicas = [SlicedReplica(HONEST, sim), SlicedPerturbed(PERTURBED, sim)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    return sim, records, SlicedReplica.partials


def _check(sim, records, partials, replica, outer_round):
    record = records[outer_round]
    return verify_contribution(
        [part.to_bytes() for part in record.states[replica].stages], record.claims[replica], sim.corpus,
        sim.model, sim.training, sim.diloco, sim.compression, outer_round=outer_round, replica=replica,
        run_rounds=sim.rounds, previous_partials=partials.get(outer_round - 1))


def test_an_honest_sliced_contribution_reruns_bit_exactly_and_chains_through_the_partials(run):
    sim, records, partials = run
    for outer_round in range(ROUNDS):
        check = _check(sim, records, partials, HONEST, outer_round)
        assert check.verdict == EXACT, check.reason
        assert check.distances == {0: 0.0, 1: 0.0}
        # round t-1 applied from its partials: the next state is round t+1's committed one
        if outer_round > 0:
            assert check.next_state_hashes is not None
    first = _check(sim, records, partials, HONEST, 1)
    assert check_state_chain(first.next_state_hashes, [c.state_hash for c in records[2].claims[HONEST]]) \
        == EXACT


def test_a_sliced_contribution_its_state_does_not_produce_is_a_mismatch(run):
    sim, records, partials = run
    check = _check(sim, records, partials, PERTURBED, 1)
    assert check.verdict == MISMATCH, check.reason
    assert all(0.0 < d < math.inf for d in check.distances.values()), check.distances
    assert check.failed_stages == (0, 1)


def test_the_spot_check_job_carries_the_partials_to_the_rerun_process(tmp_path):
    partials = {0: [b"partial zero", b"partial one"], 1: [b"partial of stage one"]}
    SpotCheckJob({}, 2, HONEST, [], [], previous_partials=partials).write(tmp_path)
    doc = json.loads((tmp_path / JOB_FILE).read_text())
    assert {int(stage): [(tmp_path / name).read_bytes() for name in names]
            for stage, names in doc["previous_partials"].items()} == partials


def test_the_sliced_distance_is_zero_for_the_same_slices_finite_for_others_infinite_for_garbage():
    sim = _sim()
    shapes = stage_param_shapes(sim.model, split_stages(sim.model.n_layer, 2)[0])
    engine_plan = live_plan(shapes, sim.diloco.num_replicas, sim.diloco.min_slice_numel)
    generator = torch.Generator().manual_seed(0)
    target = {name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()}
    other = {name: value + torch.randn(value.shape, generator=generator) * 1e-4
                 for name, value in target.items()}

    def packed(values):
        blobs, _decoded, _stats = encode_slices(values, engine_plan, sim.compression, 0, stage_index=0,
                                                outer_round=0)
        return msgpack.packb(blobs, use_bin_type=True)

    ours = packed(target)
    assert sliced_contribution_distance(ours, ours, shapes, sim.diloco, stage_index=0, outer_round=0) == 0.0
    near = sliced_contribution_distance(packed(other), ours, shapes, sim.diloco, stage_index=0, outer_round=0)
    assert 0.0 < near < 1.0
    for garbage in (b"", b"\x90", msgpack.packb([b"x"] * engine_plan.num_slices), msgpack.packb("text"),
                    msgpack.packb(msgpack.unpackb(ours)[:-1])):
        assert sliced_contribution_distance(garbage, ours, shapes, sim.diloco, stage_index=0,
                                            outer_round=0) == math.inf


def test_stable_eigh_is_eigh_where_eigh_converges():
    from training.codec.factorize import stable_eigh

    generator = torch.Generator().manual_seed(1)
    side = torch.randn(24, 40, generator=generator)
    for gram in (side @ side.t(), torch.eye(8) * 3.0, torch.zeros(5, 5)):
        values, vectors = stable_eigh(gram)
        expected_values, expected_vectors = torch.linalg.eigh(gram)
        assert torch.equal(values, expected_values) and torch.equal(vectors, expected_vectors)


def _recorded_nan_gram() -> torch.Tensor:
    """The Gram matrix (32 x 32, float32) of one tensor of a live sliced run's average of two decoded low-rank
    slices (round 5, slice 1 of tests/test_node_sliced_e2e.py's restart run): on the machine that ran it,
    LAPACK's float32 solver returned NaN eigenvectors without raising, the partial's scale was coded as NaN
    and both honest aggregators of that slice published a partial no holder could apply."""
    import numpy as np

    data = (Path(__file__).resolve().parent / "data" / "eigh_nan_gram.f32").read_bytes()
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(32, 32).copy())


def _assert_eigendecomposition(gram: torch.Tensor, values: torch.Tensor, vectors: torch.Tensor) -> None:
    """Finite, and ``V diag(w) V^T`` within a backward-stable float32 solver's error of ``gram`` (n eps
    ||gram||_F, with a factor 2 of room): what LAPACK promises on every CPU, not what one CPU's float32 kernel
    happens to give (an AMD EPYC's is 3.3e-9 here, an Intel's below 1.9e-9; the bound is 1.3e-7)."""
    assert values.dtype == gram.dtype and vectors.dtype == gram.dtype
    assert bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all())
    rebuilt = (vectors.double() * values.double()) @ vectors.double().t()
    bound = 2 * gram.shape[0] * 2.0**-24 * float(torch.linalg.matrix_norm(gram.double()))
    assert float((rebuilt - gram.double()).abs().max()) <= bound


def test_stable_eigh_is_finite_where_float32_eigh_returns_nan():
    """The regression, forced on every CPU: a float32 solver that returns NaN vectors without raising (what
    LAPACK did on the recorded matrix) or that raises, and then a float64 one that raises too. Whether the
    real float32 solver fails on the recorded matrix depends on the CPU, so the failure is injected at the
    solver (the boundary), and stable_eigh must come back finite through its float64 fallbacks."""
    from training.codec.factorize import stable_eigh

    gram = _recorded_nan_gram()
    calls: list[torch.dtype] = []

    def nan_in_float32(matrix: torch.Tensor):
        calls.append(matrix.dtype)
        values, vectors = torch.linalg.eigh(matrix)
        return (values, torch.full_like(vectors, math.nan)) if matrix.dtype == torch.float32 \
            else (values, vectors)

    def raises_in_float32(matrix: torch.Tensor):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("failed to converge")
        return torch.linalg.eigh(matrix)

    float64 = torch.linalg.eigh(gram.double())
    for solver in (nan_in_float32, raises_in_float32):
        calls.clear()
        values, vectors = stable_eigh(gram, eigh=solver)
        assert calls == [torch.float32, torch.float64]  # the fallback ran, in float64
        assert torch.equal(values, float64[0].float()) and torch.equal(vectors, float64[1].float())
        _assert_eigendecomposition(gram, values, vectors)

    def raises_until_shifted(matrix: torch.Tensor):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32 or torch.equal(matrix, gram.double()):
            raise torch.linalg.LinAlgError("failed to converge")
        return torch.linalg.eigh(matrix)

    calls.clear()
    values, vectors = stable_eigh(gram, eigh=raises_until_shifted)
    assert calls == [torch.float32, torch.float64, torch.float64]  # float32, float64, float64 shifted
    _assert_eigendecomposition(gram, values, vectors)


def test_stable_eigh_on_the_recorded_matrix_is_finite_on_this_cpu():
    """The real solver on the recorded matrix, single-threaded as the partial's encoder runs
    (training.butterfly.single_thread): finite whichever path this CPU's LAPACK takes, and within a float32
    solver's error bound."""
    from training.codec.factorize import stable_eigh

    gram = _recorded_nan_gram()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values, vectors = stable_eigh(gram)
    finally:
        torch.set_num_threads(threads)
    _assert_eigendecomposition(gram, values, vectors)
