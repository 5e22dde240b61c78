"""Issue 32, the training side: bf16 autocast (on the CPU here, on CUDA where there is one), the
device boundary of the engine (what must stay exact), and re-execution judged per platform.

The CUDA tests are marked ``gpu`` and skip, saying so, without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus, round_batches
from training.fingerprint import (
    EXACT,
    MISMATCH,
    RULE_CROSS_PLATFORM,
    RULE_SAME_PLATFORM,
    UNDECIDED,
    WITHIN_TOLERANCE,
)
from training.pipeline import LocalReplicaTrainer
from training.reexec import verify_contribution
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica, run_with_states
from training.stage_engine import StageEngine

REPO = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                         reason="no CUDA GPU: torch.cuda.is_available() is false")

MODEL = ModelConfig(preset="llama-tiny")
CORPUS = generated_corpus(seed=0, n_bytes=30_000)


def _trainer(precision: str, device: str = "cpu") -> LocalReplicaTrainer:
    return LocalReplicaTrainer(MODEL, TrainingConfig(seed=1, batch_size=4, device=device,
                                                     precision=precision), 2)


def _train(trainer: LocalReplicaTrainer, steps: int = 4) -> list[float]:
    batches = round_batches(CORPUS, 1, 0, 0, steps, 4, MODEL.block_size)
    return [trainer.train_step(x, y) for x, y in batches]


def _params(trainer: LocalReplicaTrainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for m in trainer.stage_modules for n, t in m.named_parameters()}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- bf16 autocast on the CPU


def test_bf16_keeps_float32_master_weights_and_optimizer_state(one_thread):
    trainer = _trainer("bf16")
    losses = _train(trainer)
    assert all(torch.isfinite(torch.tensor(losses)))
    for module, optimizer in zip(trainer.stage_modules, trainer.optimizers):
        for param in module.parameters():
            assert param.dtype == torch.float32 and param.device.type == "cpu"
            state = optimizer.state[param]
            assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_bf16_computes_in_bfloat16_and_is_deterministic(one_thread):
    fp32, bf16, again = _trainer("fp32"), _trainer("bf16"), _trainer("bf16")
    _train(fp32), _train(bf16), _train(again)
    a, b, c = _params(fp32), _params(bf16), _params(again)
    assert any(not torch.equal(a[n], b[n]) for n in a)  # autocast really ran in bfloat16
    assert all(torch.equal(b[n], c[n]) for n in b)  # and, on one platform, to the bit
    # Same model, same data: bf16 lands close to float32 after a few steps.
    diff = sum(float((a[n] - b[n]).pow(2).sum()) for n in a) ** 0.5
    assert diff / sum(float(t.pow(2).sum()) for t in a.values()) ** 0.5 < 0.05


def test_bf16_eval_snapshot_equals_eval_loss(one_thread):
    trainer = _trainer("bf16")
    _train(trainer, 2)
    batches = round_batches(CORPUS, 1, 9, 0, 2, 4, MODEL.block_size)
    assert trainer.eval_snapshot().eval_loss(batches) == trainer.eval_loss(batches)


# ----------------------------------------------------------------------------- the boundary


def _engines(trainer: LocalReplicaTrainer) -> list[StageEngine]:
    return [StageEngine(spec.index, dict(module.named_parameters()),
                        DilocoConfig(inner_steps=4, num_replicas=2),
                        CompressionConfig(min_compress_numel=512))
            for spec, module in zip(trainer.specs, trainer.stage_modules)]


def test_the_outer_step_does_not_depend_on_the_inner_platform(one_thread):
    """Two replicas, one trained in float32 and one in bf16: the pseudo-gradients leave the device as
    float32 CPU tensors, and applying the same contributions from the same global state gives both
    the same new global weights, bit for bit (the weights root every node derives)."""
    trainers = [_trainer("fp32"), _trainer("bf16")]
    engines = [_engines(t) for t in trainers]
    for trainer in trainers:
        _train(trainer)
    payloads = [[engine.encode_contribution(0)[0] for engine in stage_engines] for stage_engines in engines]
    for stage_engines in engines:
        for engine in stage_engines:
            assert all(t.device.type == "cpu" and t.dtype == torch.float32
                       for t in engine.global_weights.values())
            assert all(t.dtype == torch.float32 for t in engine.compressor.last_decoded.values())
    assert payloads[0] != payloads[1]  # the replicas did train differently
    for stage in range(2):
        closed = [payloads[0][stage], payloads[1][stage]]
        hashes = {stage_engines[stage].finish_round(0, closed).weights_hash for stage_engines in engines}
        assert len(hashes) == 1
    # and the live weights the next round trains from are the rebased ones, on each trainer's device.
    for trainer in trainers:
        assert all(p.dtype == torch.float32 for m in trainer.stage_modules for p in m.parameters())


# ----------------------------------------------------------------------------- re-execution per platform


def _sim(precision: str) -> SimConfig:
    return SimConfig(corpus=CORPUS, model=ModelConfig(preset="tiny"),
                     training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2, precision=precision),
                     diloco=DilocoConfig(inner_steps=3, num_replicas=4),
                     compression=CompressionConfig(min_compress_numel=512), num_stages=2, rounds=2)


class ClaimsAnotherGPU(SimReplica):
    """Honest work, but its start states name a GPU (as a CUDA contributor's do): judged by the tolerance."""

    def start_state(self, outer_round):
        state = super().start_state(outer_round)
        from training.replica_state import ReplicaStartState

        def elsewhere(meta):
            gpu_fp = dataclasses.replace(meta.platform, device_type="cuda",
                                         device_name="NVIDIA H100 80GB HBM3", capability="sm_90", cuda="12.8",
                                         cudnn="91002")
            return dataclasses.replace(meta, platform=gpu_fp)

        return ReplicaStartState(tuple(dataclasses.replace(p, meta=elsewhere(p.meta)) for p in state.stages))


class SlightlyPerturbed(PerturbedReplica):
    """A perturbation 100x smaller than the 1% cheat. Its distance after the bf16 steps and the codec is not
    reliably below the tolerance (a tiny weight change can move a quantization bin: 5e-2 with the portable
    noise of issue 42), so what it shows is that the same-platform rule demands the exact bits, whatever the
    distance."""

    fraction = 1e-4


HONEST, OTHER_GPU, PERTURBED, SLIGHT = range(4)


@pytest.fixture(scope="module")
def bf16_run():
    sim = _sim("bf16")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = run_with_states([SimReplica(HONEST, sim), ClaimsAnotherGPU(OTHER_GPU, sim),
                                   PerturbedReplica(PERTURBED, sim), SlightlyPerturbed(SLIGHT, sim)], sim)
    finally:
        torch.set_num_threads(threads)
    return sim, records


def _check(sim, records, outer_round, replica, threads=None):
    record = records[outer_round]
    return verify_contribution(
        [p.to_bytes() for p in record.states[replica].stages], record.claims[replica], sim.corpus, sim.model,
        sim.training, sim.diloco, sim.compression, outer_round=outer_round, replica=replica,
        run_rounds=sim.rounds, previous_contributions=records[outer_round - 1].contributions if outer_round
        else None, threads=threads)


def test_bf16_start_states_record_the_precision(bf16_run):
    sim, records = bf16_run
    meta = records[1].states[HONEST].stages[0].meta
    assert meta.platform.precision == "bf16" and meta.platform.device_type == "cpu"


@pytest.mark.parametrize("outer_round", [0, 1])
def test_honest_bf16_rerun_on_the_same_platform_is_bit_exact(bf16_run, outer_round):
    sim, records = bf16_run
    check = _check(sim, records, outer_round, HONEST)
    assert (check.verdict, check.rule) == (EXACT, RULE_SAME_PLATFORM)
    assert check.reason.startswith(RULE_SAME_PLATFORM)
    if outer_round == 0:  # the chain: the rerun ends where round 1 starts
        assert check.next_state_hashes == [c.state_hash for c in records[1].claims[HONEST]]


def test_honest_member_on_another_platform_is_not_accused(bf16_run):
    sim, records = bf16_run
    for outer_round in (0, 1):
        check = _check(sim, records, outer_round, OTHER_GPU)
        assert check.rule == RULE_CROSS_PLATFORM and check.verdict in (EXACT, WITHIN_TOLERANCE)
        assert check.next_state_hashes is None  # no chain from a rerun on another platform
    other_threads = _check(sim, records, 1, HONEST, threads=2)
    assert other_threads.rule == RULE_CROSS_PLATFORM and other_threads.honest


def test_cheats_are_caught_in_bf16(bf16_run):
    sim, records = bf16_run
    for outer_round in (0, 1):
        # the 1% perturbation on the claimant's own platform: a mismatch, always
        own = _check(sim, records, outer_round, PERTURBED)
        assert (own.verdict, own.rule) == (MISMATCH, RULE_SAME_PLATFORM)
        # judged across platforms (threads differ) it is far from an honest rerun; its distance (round 1's:
        # 1.2e-2 with issue 42's portable noise) may sit below the bf16 mismatch bound (2e-2), but never
        # passes: the three zones leave it undecided at worst (issue 42's rule), never within tolerance
        check = _check(sim, records, outer_round, PERTURBED, threads=2)
        honest = _check(sim, records, outer_round, HONEST, threads=2)
        assert check.rule == RULE_CROSS_PLATFORM and check.verdict in (MISMATCH, UNDECIDED)
        assert honest.verdict in (EXACT, WITHIN_TOLERANCE)
        assert max(check.distances.values()) > 1000 * max(max(honest.distances.values()), 1e-9)
        # a perturbation 100x smaller, on the claimant's own platform: any difference is a mismatch
        slight = _check(sim, records, outer_round, SLIGHT)
        assert (slight.verdict, slight.rule) == (MISMATCH, RULE_SAME_PLATFORM)
        assert max(slight.distances.values()) > 0


# ----------------------------------------------------------------------------- the benchmark's one command


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_refuses_without_a_gpu(tmp_path):
    refused = subprocess.run([sys.executable, "bench/bench_gpu.py", "--out", str(tmp_path / "no.json")],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "needs a CUDA GPU" in refused.stderr and "--smoke" in refused.stderr
    assert not (tmp_path / "no.json").exists()


@pytest.mark.slow
def test_bench_smoke_runs_on_any_device(tmp_path):
    """The GPU benchmark's code, tiny sizes, on this machine's device (the on-chain run left out: it needs
    anvil)."""
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, "bench/bench_gpu.py", "--smoke", "--skip-chain", "--out",
                           str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    env = result["environment"]
    assert env["torch"] == torch.__version__ and "--smoke" in env["command"] and env["device"]
    assert env["cuda"] == torch.version.cuda
    assert result["smoke"] is True and result["platform"]["precision"] == "bf16"
    throughput = result["throughput"]
    assert throughput["bf16"]["tokens_per_second"] > 0 and throughput["fp32"]["tokens_per_second"] > 0
    share = result["round_share"]
    assert 0 < share["node_share"] < 1 and share["train_seconds"] > 0
    assert set(share["parts"]) == {"capture_and_hash", "data_commitment", "encode", "exchange_decode",
                                   "outer_step"}
    assert "chain_run" not in result


# ----------------------------------------------------------------------------- on a GPU


@gpu
@pytest.mark.gpu
def test_cuda_bf16_trains_with_float32_masters():
    trainer = _trainer("bf16", "cuda")
    losses = _train(trainer)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for m in trainer.stage_modules
               for p in m.parameters())
    assert trainer.state_dict()["model.embed_tokens.weight"].device.type == "cpu"


@gpu
@pytest.mark.gpu
def test_cuda_and_cpu_replicas_derive_the_same_global_weights():
    trainers = [_trainer("bf16", "cpu"), _trainer("bf16", "cuda")]
    engines = [_engines(t) for t in trainers]
    for trainer in trainers:
        _train(trainer)
    payloads = [[engine.encode_contribution(0)[0] for engine in stage_engines] for stage_engines in engines]
    for stage in range(2):
        closed = [payloads[0][stage], payloads[1][stage]]
        assert len({stage_engines[stage].finish_round(0, closed).weights_hash for stage_engines in engines}) \
            == 1


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_rerun_is_exact_on_cuda_and_within_tolerance_on_the_cpu(precision):
    sim = _sim(precision)
    sim = dataclasses.replace(sim, training=dataclasses.replace(sim.training, device="cuda"))
    records = run_with_states([SimReplica(0, sim), PerturbedReplica(1, sim)], sim)
    on_gpu = _check(sim, records, 1, 0)
    assert (on_gpu.verdict, on_gpu.rule) == (EXACT, RULE_SAME_PLATFORM)
    cpu_sim = dataclasses.replace(sim, training=dataclasses.replace(sim.training, device="cpu"))
    on_cpu = _check(cpu_sim, records, 1, 0)
    assert on_cpu.rule == RULE_CROSS_PLATFORM and on_cpu.honest, on_cpu.reason
    assert _check(cpu_sim, records, 1, 1).verdict == MISMATCH
