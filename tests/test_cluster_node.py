"""A node of ``compute.processes`` > 1 (issue 75; docs/CLUSTER.md "Started how"): the setting's validation,
the cluster trainer against one process, and its worker ranks' shutdown on every exit path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from node.config import config_from_dict, load_config
from node.errors import ConfigError
from training.cluster_plan import cluster_identity

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = {"compute": {"processes": 2}, "training": {"batch_size": 4}, "pipeline": {"num_stages": 1}}


@pytest.mark.parametrize("value, match", [
    (0, r"compute.processes=0: must be in \[1, 256\]"),
    (-2, r"compute.processes=-2: must be in \[1, 256\]"),
    (1000, r"compute.processes=1000: must be in \[1, 256\]"),
    (True, r"compute.processes=True: must be an integer"),
    ("two", r"compute.processes='two': must be an integer"),
    (2.0, r"compute.processes=2.0: must be an integer"),
])
def test_processes_must_be_a_positive_integer(value, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"compute": {"processes": value}})


def test_processes_is_a_table_setting_and_an_override(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('cluster = "cluster-0"\n[compute]\nprocesses = 2\n[training]\nbatch_size = 4\n'
                    '[pipeline]\nnum_stages = 1\n')
    cfg = load_config(path)
    assert cfg.compute.processes == 2 and cfg.training.device == "cpu"
    assert load_config(path, ["compute.processes=1"]).compute.processes == 1
    with pytest.raises(ConfigError, match="compute.nodes: unknown setting"):
        config_from_dict({"compute": {"nodes": 2}})
    with pytest.raises(ConfigError, match=r"\[compute\] must be a table"):
        config_from_dict({"compute": 2})


@pytest.mark.parametrize("extra, match", [
    ({"pipeline": {"num_stages": 2}}, "a cluster node trains a whole replica"),
    ({"training": {"batch_size": 5}}, "batch_size=5 does not split into 2 equal slices"),
    ({"training": {"precision": "bf16"}}, "trains in float32, eagerly"),
    ({"training": {"device": "cuda"}}, "GPUs are not wired into the node yet"),
    ({"training": {"optimizer": "muon"}}, "inner optimizer is \"adamw\""),
])
def test_a_cluster_node_refuses_what_it_cannot_train(extra, match):
    table = {key: dict(value) for key, value in CLUSTER.items()}
    for key, value in extra.items():
        table[key] = {**table.get(key, {}), **value}
    with pytest.raises(ConfigError, match=match):
        config_from_dict(table)


def test_the_declared_platform_records_the_processes():
    """A node of 2 processes declares the platform whose fingerprint says ``fsdp2;ranks=2``, not the
    one-process platform of the same machine."""
    import dataclasses

    from node.platforms import own_platforms
    from training.declaration import declares
    from training.platform import prepare_platform

    cfg = config_from_dict(CLUSTER)
    alone = prepare_platform("cpu", "fp32").fingerprint()
    ranks = dataclasses.replace(alone, cluster=cluster_identity(2))
    assert ranks.cluster == "fsdp2;ranks=2"
    declared = own_platforms(cfg.training, 2)[0]
    assert declares(declared, ranks) and not declares(declared, alone)
    assert declares(own_platforms(cfg.training, 1)[0], alone)


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            if "State:\tZ" in status:  # exited, not yet reaped by its (dead) parent's reaper
                return True
        except OSError:
            return True
        time.sleep(0.5)
    return False


def test_two_processes_train_as_one_and_stop_their_worker():
    """The cluster's inner steps (FSDP2 over 2 processes) against one process on the same batches: the same
    losses and weights up to float sums; the start state's trainer part gathered whole; close() stops
    the worker rank; a worker that dies makes the next command fail with a clear error."""
    from training.cluster_replica import ClusterReplicaTrainer
    from training.config import ModelConfig
    from training.config_training import TrainingConfig
    from training.errors import EngineStateError
    from training.model import init_state_dict
    from training.pipeline import LocalReplicaTrainer
    from training.replica_capture import capture_trainer_part

    model, training = ModelConfig(), TrainingConfig(device="cpu", batch_size=4)
    full = init_state_dict(model, 0)
    cluster = ClusterReplicaTrainer(model, training, 2, full, timeout_s=300, threads=1)
    try:
        assert cluster.platform.fingerprint().cluster == "fsdp2;ranks=2"
        plain = LocalReplicaTrainer(model, training, 1, state_dict=full)
        generator = torch.Generator().manual_seed(0)
        with pytest.raises(EngineStateError, match="between begin_steps"):
            cluster.train_step(torch.zeros(4, 32, dtype=torch.long), torch.zeros(4, 32, dtype=torch.long))
        before = cluster.capture_part()  # a round's start state is taken before its first step
        reference = capture_trainer_part(plain.stage_modules[0], plain.optimizers[0])
        assert sorted(before) == sorted(reference)
        assert all(torch.equal(before[k], reference[k]) for k in reference)
        cluster.begin_steps()
        for _ in range(3):
            tokens = torch.randint(0, model.vocab_size, (4, model.block_size + 1), generator=generator)
            x, y = tokens[:, :-1], tokens[:, 1:]
            losses = cluster.train_step(x, y), plain.train_step(x, y)
            assert abs(losses[0] - losses[1]) < 1e-5
        cluster.end_steps()
        ours, theirs = (dict(t.stage_modules[0].named_parameters()) for t in (cluster, plain))
        assert max(float((ours[n] - theirs[n]).detach().abs().max()) for n in ours) < 1e-4
        assert any(float((ours[n] - full[n]).detach().abs().max()) > 1e-3 for n in ours)  # it trained
        part = cluster.capture_part()
        reference = capture_trainer_part(plain.stage_modules[0], plain.optimizers[0])
        assert sorted(part) == sorted(reference)
        assert max(float((part[k] - reference[k]).abs().max()) for k in reference) < 1e-4
        (worker,) = cluster.worker_pids()
        os.kill(worker, signal.SIGKILL)
        assert _gone(worker, 30)
        with pytest.raises(EngineStateError, match=f"cluster worker process\\(es\\) \\[{worker}\\] exited"):
            cluster.capture_part()
    finally:
        cluster.close()
    cluster.close()  # idempotent


ORPHAN = """
import sys, time, torch
from training.cluster_replica import ClusterReplicaTrainer
from training.config import ModelConfig
from training.config_training import TrainingConfig
from training.model import init_state_dict
m = ModelConfig()
c = ClusterReplicaTrainer(m, TrainingConfig(device="cpu", batch_size=4), 3, init_state_dict(m, 0), threads=1)
print(" ".join(map(str, c.worker_pids())), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_node_leaves_no_worker_rank_behind():
    """SIGKILL of rank 0 (no clean-up runs): the worker ranks leave by themselves (parent-death signal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    node = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        pids = [int(p) for p in node.stdout.readline().split()]
        assert len(pids) == 2
        node.kill()
        node.wait()
        assert all(_gone(pid, 30) for pid in pids)
    finally:
        if node.poll() is None:
            node.kill()
