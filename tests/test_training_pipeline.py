"""One replica's 2 stages in 2 processes (gloo, loopback) == the single-process run, bit for bit.

The reference is ``LocalReplicaTrainer.train_step`` with the pipeline's micro-batch count at the
workers' thread count (1): the arithmetic re-execution reruns a split replica with
(training/reexec.py), so the two must agree to the bit on every CPU and instruction set.

Not the full-batch step: micro-batching sums the gradients in another order (the mean of two
micro-batch means), and AdamW does not smooth that out, it amplifies it where a gradient is near
zero (its first update is about ``lr * sign(g)``). Under ``ATEN_CPU_CAPABILITY=default`` one weight
of 4096 in ``h.1.mlp.c_fc`` came out 1.9e-5 apart after 3 steps (issue 42), above any tolerance
that an AVX2 run had happened to stay within.
"""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from training.config import ModelConfig, TrainingConfig
from training.data import eval_batches, generated_corpus, round_batches
from training.errors import PipelineError
from training.pipeline import LocalReplicaTrainer
from training.pipeline_group import init_pipeline_group
from training.stages import split_stages

STEPS = 3
SEED = 11

WORKER = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    from training.config import ModelConfig, TrainingConfig
    from training.data import eval_batches, generated_corpus, round_batches
    from training.pipeline_group import group_transport, init_pipeline_group
    from training.pipeline_stage import PipelineStageTrainer
    from training.stages import split_stages

    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    steps, seed, device = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    cfg = ModelConfig(preset="tiny")
    tcfg = TrainingConfig(seed=seed, batch_size=4, device=device)
    corpus = generated_corpus(seed=0, n_bytes=20_000)
    batches = round_batches(corpus, seed, 0, 0, steps, tcfg.batch_size, cfg.block_size)
    group = init_pipeline_group(rank, 2, "127.0.0.1", port, timeout_s=30, device=device)
    spec = split_stages(cfg.n_layer, 2)[rank]
    trainer = PipelineStageTrainer(cfg, spec, rank, 2, micro_batches=2, training_cfg=tcfg, group=group)
    losses = [trainer.train_step(x, y) for x, y in batches]
    eval_loss = trainer.eval_loss(eval_batches(corpus, 2, 4, cfg.block_size))
    torch.save({"losses": losses, "eval": eval_loss, "state": trainer.state_dict(),
                "transport": group_transport()}, out)
    trainer.close()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process(num_stages: int, micro_batches: int = 1, device: str = "cpu"):
    cfg = ModelConfig(preset="tiny")
    tcfg = TrainingConfig(seed=SEED, batch_size=4, device=device)
    corpus = generated_corpus(seed=0, n_bytes=20_000)
    trainer = LocalReplicaTrainer(cfg, tcfg, num_stages=num_stages)
    batches = round_batches(corpus, SEED, 0, 0, STEPS, 4, cfg.block_size)
    losses = [trainer.train_step(x, y, micro_batches) for x, y in batches]
    return losses, trainer.eval_loss(eval_batches(corpus, 2, 4, cfg.block_size)), trainer.state_dict()


def test_local_trainer_is_independent_of_the_stage_count():
    one = _single_process(1)
    two = _single_process(2)
    assert one[0] == two[0] and one[1] == two[1]
    assert all(torch.equal(one[2][k], two[2][k]) for k in one[2])
    assert one[0][-1] < one[0][0]


def run_two_stages(tmp_path, device: str = "cpu") -> list[dict]:
    """The 2-process pipeline of WORKER, both ranks training on ``device``: each rank's saved results."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port), str(tmp_path / f"r{rank}.pt"),
             str(STEPS), str(SEED), device],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return [torch.load(tmp_path / f"r{rank}.pt") for rank in range(2)]


@pytest.mark.timeout(300)
def test_two_process_pipeline_matches_single_process(tmp_path):
    results = run_two_stages(tmp_path)
    assert [r["transport"] for r in results] == ["host", "host"]  # CPU ranks: gloo alone
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: bit-exact only at the same one
    try:
        losses, eval_loss, state = _single_process(2, micro_batches=2)
    finally:
        torch.set_num_threads(threads)
    for result in results:  # every rank got the loss
        assert result["losses"] == losses
        assert result["eval"] == eval_loss
    merged = {**results[0]["state"], **results[1]["state"]}
    assert list(merged) == list(state)
    specs = split_stages(2, 2)
    first_stage = ("transformer.wte", "transformer.wpe", "transformer.h.0.")
    assert set(results[0]["state"]) == {k for k in state if k.startswith(first_stage)}
    assert specs[1].has_head and "lm_head.weight" in results[1]["state"]
    differ = [name for name, tensor in state.items() if not torch.equal(merged[name], tensor)]
    assert differ == []
    # the weights did move
    init = LocalReplicaTrainer(ModelConfig(preset="tiny"), TrainingConfig(seed=SEED)).state_dict()
    assert not torch.allclose(merged["lm_head.weight"], init["lm_head.weight"])


@pytest.mark.timeout(30)
def test_rendezvous_times_out_with_a_pipeline_error():
    # rank 1 of 2 with nobody hosting the rendezvous: bounded by the timeout, a PipelineError
    with pytest.raises(PipelineError, match="rendezvous"):
        init_pipeline_group(1, 2, "127.0.0.1", _free_port(), timeout_s=2)


FAULT_WORKER = textwrap.dedent(
    """
    import os, sys, time, torch
    torch.set_num_threads(1)
    from training.config import ModelConfig, TrainingConfig
    from training.data import generated_corpus, round_batches
    from training.errors import PipelineError
    from training.pipeline_group import init_pipeline_group
    from training.pipeline_stage import PipelineStageTrainer
    from training.stages import split_stages

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    cfg, tcfg = ModelConfig(preset="tiny"), TrainingConfig(batch_size=4)
    x, y = round_batches(generated_corpus(0, 20_000), 0, 0, 0, 1, 4, cfg.block_size)[0]
    group = init_pipeline_group(rank, 2, "127.0.0.1", port, timeout_s=5)
    trainer = PipelineStageTrainer(cfg, split_stages(2, 2)[rank], rank, 2, 2, tcfg, group=group)
    if rank == 1:
        os._exit(0)  # the last stage dies before the step
    start = time.monotonic()
    try:
        trainer.train_step(x, y)
        print("NO ERROR")
    except PipelineError as exc:
        print(f"PIPELINE_ERROR {time.monotonic() - start:.1f}")
    trainer.close()
    """
)


@pytest.mark.timeout(240)
def test_a_dead_stage_gives_a_bounded_pipeline_error(tmp_path):
    script = tmp_path / "fault.py"
    script.write_text(FAULT_WORKER)
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), str(rank), str(port)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, outputs[0][-3000:]
    line = [row for row in outputs[0].splitlines() if row.startswith(("PIPELINE_ERROR", "NO ERROR"))][0]
    # within the 5 s timeout (+ slack)
    assert line.startswith("PIPELINE_ERROR") and float(line.split()[1]) < 10


REFORM_WORKER = textwrap.dedent(
    """
    import sys, time, torch
    torch.set_num_threads(1)
    from training.config import ModelConfig, TrainingConfig
    from training.data import generated_corpus, round_batches
    from training.errors import PipelineError
    from training.pipeline_group import init_pipeline_group
    from training.pipeline_stage import PipelineStageTrainer
    from training.stages import split_stages

    rank, port, role = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cfg, tcfg = ModelConfig(preset="tiny"), TrainingConfig(batch_size=4)
    batches = round_batches(generated_corpus(0, 20_000), 0, 0, 0, 4, 4, cfg.block_size)
    init_pipeline_group(rank, 2, "127.0.0.1", port, timeout_s=20)
    trainer = PipelineStageTrainer(cfg, split_stages(2, 2)[rank], rank, 2, 2, tcfg)
    print("STEP", trainer.train_step(*batches[2 if role == "restarted" else 0]), flush=True)
    if role == "partner":
        time.sleep(600)  # killed by the test (SIGKILL)
    if role == "restarted":  # its first step is the survivor's first step after re-forming
        trainer.close()
        sys.exit(0)
    weights = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    try:
        while True:
            trainer.train_step(*batches[1])
    except PipelineError as exc:
        print("BROKEN", flush=True)
    trainer.leave_group()
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    for attempt in range(5):
        try:
            trainer.join_group("127.0.0.1", port, timeout_s=20)
            break
        except PipelineError as exc:
            print("RETRY", exc, flush=True)
    kept = all(torch.equal(before[n], p.detach()) for n, p in trainer.module.named_parameters())
    print("REFORMED", trainer.train_step(*batches[2]), "KEPT" if kept else "LOST", flush=True)
    trainer.close()
    """
)


# Slow (out of the default suite) because not yet reliable: on session 9's machine (2-vCPU AMD EPYC,
# torch 2.13.0 CPU) the survivor process aborted in 5 of 30 runs with "terminate called without an
# active exception" (exit -6), once right after the partner's SIGKILL (before its PipelineError) and
# once at exit after re-forming and keeping its weights: gloo's C++ side terminating, not Python code.
# Where the SIGKILL lands in a send/recv decides it. Not seen on the earlier machine.
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("survivor", [0, 1], ids=["survivor-hosts-rendezvous", "partner-hosts-rendezvous"])
def test_a_survivor_reforms_the_pipeline_with_a_restarted_partner(tmp_path, survivor):
    """A stage whose partner is killed (SIGKILL) gets a PipelineError, leaves the group and re-forms it
    with the restarted partner on the same rendezvous port, keeping its weights."""
    script = tmp_path / "reform.py"
    script.write_text(REFORM_WORKER)
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")

    def spawn(rank: int, role: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(rank), str(port), role], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    partner_rank = 1 - survivor
    procs = [spawn(survivor, "survivor"), spawn(partner_rank, "partner")]
    try:
        for proc in procs:  # both stages finished a step: the pipeline formed
            assert proc.stdout.readline().startswith("STEP"), "the pipeline did not form"
        procs[1].kill()  # SIGKILL mid-run: the survivor's next step fails
        procs[1].wait(timeout=10)
        procs.append(spawn(partner_rank, "restarted"))  # the same rank comes back on the same port
        outputs = [procs[0].communicate(timeout=90)[0], procs[2].communicate(timeout=90)[0]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode == 0, outputs[0][-3000:]
    lines = outputs[0].splitlines()
    assert "BROKEN" in lines, outputs[0][-3000:]
    reformed = [row for row in lines if row.startswith("REFORMED")]
    assert reformed and reformed[0].endswith("KEPT"), outputs[0][-3000:]
    assert float(reformed[0].split()[1]) > 0
    assert procs[2].returncode == 0 and "STEP" in outputs[1], outputs[1][-3000:]


ENTRY_WORKER = textwrap.dedent(
    """
    import os, sys, time, types
    from training.errors import PipelineError
    from training.pipeline_group import init_pipeline_group
    from node.live.worker.replica import ReplicaWorker

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    init_pipeline_group(rank, 2, "127.0.0.1", port, timeout_s=5)
    if rank == 1:
        os._exit(0)  # the partner dies while the cluster agrees on its entry round
    time.sleep(1.0)
    try:
        print("AGREED", ReplicaWorker.agree_on_round(types.SimpleNamespace(pipelined=True), 5), flush=True)
    except PipelineError as exc:
        print("PIPELINE_ERROR", str(exc)[:200], flush=True)
    except Exception as exc:
        print("OTHER", type(exc).__name__, exc, flush=True)
    """
)


@pytest.mark.timeout(240)
def test_a_partner_dying_at_entry_gives_a_pipeline_error_not_a_traceback(tmp_path):
    """Issue 30: the entry round's all_reduce raised gloo's RuntimeError, uncaught, when the partner died
    during entry; it is a PipelineError, which the node answers by waiting for the pipeline to re-form."""
    script = tmp_path / "entry.py"
    script.write_text(ENTRY_WORKER)
    port = _free_port()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=200)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    lines = [row for row in outputs[0].splitlines() if row.startswith(("AGREED", "PIPELINE_ERROR", "OTHER"))]
    assert lines and lines[0].startswith("PIPELINE_ERROR"), outputs[0][-3000:]


def test_transport_is_nccl_only_when_every_rank_has_its_own_gpu():
    from training.pipeline_group import choose_transport, device_identity

    assert device_identity("cpu") == "cpu" and device_identity(None) == "cpu"
    assert choose_transport(["cpu", "cpu"]) == "host"
    # one GPU under two processes: NCCL refuses it ("invalid usage"), so through the host
    assert choose_transport(["cuda:GPU-a", "cuda:GPU-a"]) == "host"
    # a stage on a GPU beside a stage on a CPU: NCCL cannot reach the CPU rank
    assert choose_transport(["cuda:GPU-a", "cpu"]) == "host"
    nccl = "nccl" if torch.distributed.is_nccl_available() else "host"
    assert choose_transport(["cuda:GPU-a", "cuda:GPU-b"]) == nccl


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_two_stages_on_one_gpu_train_through_the_host(tmp_path):
    """A replica's two stage processes on one GPU (the demo on a one-GPU machine; NCCL refused it on an
    H200): the activations go through the host over gloo, and the run is the one-process run's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    results = run_two_stages(tmp_path, device="cuda")
    assert [r["transport"] for r in results] == ["host", "host"]
    losses, eval_loss, state = _single_process(2, micro_batches=2, device="cuda")
    merged = {**results[0]["state"], **results[1]["state"]}
    for result in results:
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        assert result["eval"] == pytest.approx(eval_loss, rel=1e-5)
    for name, tensor in state.items():
        torch.testing.assert_close(merged[name], tensor.cpu(), rtol=1e-4, atol=1e-6)
    exact = [name for name, tensor in state.items() if torch.equal(merged[name], tensor.cpu())]
    print(f"bit-equal to the one-process run on the GPU: {len(exact)} of {len(state)} tensors; "
          f"losses {results[0]['losses']} vs {losses}")
