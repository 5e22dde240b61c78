"""A node of ``compute.processes`` > 1 (issue 75; docs/CLUSTER.md "Started how"): the setting's validation,
the cluster trainer against one process, and its worker ranks' shutdown on every exit path."""

from __future__ import annotations

import gc
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
    ({"diloco": {"exchange": "sliced"}}, "the sliced exchange is not wired for it"),
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


def test_two_processes_train_as_one_and_stop_their_worker(tmp_path):
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
    from training.spilled import SpilledTensors

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
        spilled = cluster.capture_part(spill_dir=tmp_path)  # written to a file a tensor at a time
        assert isinstance(spilled, SpilledTensors) and sorted(spilled) == sorted(reference)
        assert all(torch.equal(spilled[k], reference[k]) for k in reference)
        cluster.begin_steps()
        for _ in range(3):
            tokens = torch.randint(0, model.vocab_size, (4, model.block_size + 1), generator=generator)
            x, y = tokens[:, :-1], tokens[:, 1:]
            losses = cluster.train_step(x, y), plain.train_step(x, y)
            assert abs(losses[0] - losses[1]) < 1e-5
        cluster.end_steps()
        ours, theirs = cluster.live_weights(), dict(plain.stage_modules[0].named_parameters())
        assert list(ours) == list(theirs)
        assert max(float((ours[n] - theirs[n]).detach().abs().max()) for n in ours) < 1e-4
        assert any(float((ours[n] - full[n]).detach().abs().max()) > 1e-3 for n in ours)  # it trained
        # the held-out eval reads the shards: the one-process eval's bits on the same weights
        evals = [(tokens[:, :-1], tokens[:, 1:]) for tokens in
                 torch.randint(0, model.vocab_size, (2, 4, model.block_size + 1), generator=generator)]
        cluster.load_weights(theirs)
        assert all(torch.equal(t, theirs[n]) for n, t in cluster.live_weights().items())
        assert cluster.eval_loss(evals) == plain.eval_loss(evals) == cluster.eval_snapshot().eval_loss(evals)
        # a snapshot keeps the weights it was taken of while the live ones move on (each rank its shards),
        # serves one eval, and is dropped on every rank after it
        snapshot = cluster.eval_snapshot()
        cluster.load_weights(ours)
        assert snapshot.eval_loss(evals) == plain.eval_loss(evals)
        with pytest.raises(EngineStateError, match="serves one eval"):
            snapshot.eval_loss(evals)
        assert cluster._rank.snapshots == {}
        cluster.load_weights(ours)
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


def _same(a, b) -> bool:
    """Bitwise equality of nested engine states (dicts in any order: the start state sorts its names)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("budget, encoder", [("auto", "v4"), pytest.param(0, "v4", marks=pytest.mark.slow),
                                             pytest.param("auto", "v3", marks=pytest.mark.slow)])
def test_the_outer_state_is_sharded_over_the_ranks_and_rounds_equal_one_process(budget, encoder):
    """Behind a cluster node the outer state lives on the ranks (training/cluster_outer.py): rank 0 holds
    only its shard's global weights, momentum, round start, residual and snapshots (tensor accounting), the
    ranks together exactly one process's. Given the same live weights, three rounds (one-step delay, the
    "auto" byte budget with encoder v4's memo (each rank codes its shard, the allocation on rank 0 from the
    ranks' numbers; the workers on another thread count) or v3's (rank 0 encodes the gathered targets), or
    coded to the error budget (each rank its shard), a contribution that does not decode) give the
    one-process engine's
    bits: the contribution bytes, the reports, the weights hash, the global weights and momentum gathered,
    the live weights after each apply, the engine state a start state records, and a re-base."""
    from training.cluster_replica import ClusterReplicaTrainer
    from training.cluster_node_engine import KeptState
    from training.cluster_outer import outer_state_bytes
    from training.compression import encode_contribution
    from training.config import DilocoConfig, ModelConfig
    from training.config_compression import CompressionConfig
    from training.config_training import TrainingConfig
    from training.errors import EngineStateError, RoundOrderError
    from training.model import init_state_dict
    from training.pipeline import LocalReplicaTrainer
    from training.replica_capture import start_state_bytes
    from training.reexec_rules import round_meta
    from training.stage_engine import StageEngine

    model, training = ModelConfig(), TrainingConfig(device="cpu", batch_size=4)
    diloco = DilocoConfig(inner_steps=2)
    compression = CompressionConfig(bandwidth_budget=budget, encoder=encoder)
    full = init_state_dict(model, 0)
    cluster = ClusterReplicaTrainer(model, training, 2, full, timeout_s=300, threads=1)
    try:
        engine = cluster.outer_engine(0, diloco, compression)
        plain = LocalReplicaTrainer(model, training, 1, state_dict=full)
        live = dict(plain.stage_modules[0].named_parameters())
        ref = StageEngine(0, live, diloco, compression)
        plan = engine.plan
        assert list(engine.shapes) == list(ref.shapes)
        assert engine.compressor.bandwidth_budget == ref.compressor.bandwidth_budget
        assert (ref.compressor.bandwidth_budget > 0) == (budget == "auto")
        # rank 0's engine holds its own tensors only; the ranks together hold one process's outer state
        assert set(engine.shard.engine.global_weights) == set(plan.names[0]) and 0 < len(plan.names[0]) \
            < len(ref.shapes)
        per_rank = engine.rank_outer_bytes()
        whole = outer_state_bytes(ref)
        assert {k: sum(r[k] for r in per_rank) for k in whole} == whole
        assert per_rank[0]["global"] == 4 * plan.numel(0) < whole["global"]
        assert sum(per_rank[0].values()) < 0.75 * sum(whole.values())
        generator = torch.Generator().manual_seed(1)
        pending = None
        for outer_round in range(3):
            cluster.begin_steps()
            for _ in range(2):
                tokens = torch.randint(0, model.vocab_size, (4, model.block_size + 1), generator=generator)
                cluster.train_step(tokens[:, :-1], tokens[:, 1:])
            cluster.end_steps()
            trained = cluster.live_weights()  # gathered from the shards
            with torch.no_grad():
                for name, param in live.items():
                    param.copy_(trained[name])
            ours, stats = engine.encode_contribution(outer_round)
            theirs, ref_stats = ref.encode_contribution(outer_round)
            assert ours == theirs and stats.encoded_bytes == ref_stats.encoded_bytes == len(ours)
            noise = {n: torch.randn(s, generator=generator) * 1e-3 for n, s in ref.shapes.items()}
            other = encode_contribution(noise, compression, stage_index=0, outer_round=outer_round)[0]
            if pending is not None:  # the one-step delay: round t-1 applied after round t was encoded
                _check_apply(cluster, engine, ref, live, *pending)
            pending = (outer_round, [ours, other, b"\x93junk"])
        _check_apply(cluster, engine, ref, live, *pending)
        assert _same(dict(engine.momentum), ref.momentum)
        assert any(float(m.abs().max()) > 0 for m in ref.momentum.values())
        assert _same(engine.state_dict(), ref.state_dict())
        meta = round_meta(3, 0, model, diloco, run_rounds=4, num_stages=1)
        part = {f"param/{n}": p.detach() for n, p in live.items()}
        # the engine part streamed from the ranks a tensor at a time (ShardedStageEngine.streamed_state)
        assert start_state_bytes(meta, engine, part) == start_state_bytes(meta, ref, part)
        counters, tensors = engine.streamed_state()
        engine.skip_to(4)  # a change of the engine: the streamed state is refused, not torn
        ref.skip_to(4)
        with pytest.raises(EngineStateError, match="the engine changed"):
            tensors[next(iter(tensors))]
        per_rank = engine.rank_outer_bytes()
        whole = outer_state_bytes(ref)
        assert {k: sum(r[k] for r in per_rank) for k in whole} == whole and whole["residual"] > 0
        rows = cluster.accounting()  # each rank's whole training state (bench/bench_cluster_memory.py)
        assert [row["outer"] for row in rows] == per_rank and "mirror" not in rows[0]
        # no rank keeps a copy of the live weights between commands: they are the FSDP shards only
        assert [row["live_copy"] for row in rows] == [0, 0]
        assert sum(row["params"] for row in rows) == 4 * plan.numel()  # the FSDP shards
        assert rows[0]["params"] < 0.6 * 4 * plan.numel()  # rank 0: about half of them
        # a re-base (a checkpoint's entry) on every rank, and the live weights follow
        weights = {n: t + 0.5 for n, t in ref.global_weights.items()}
        before, before_momentum = engine.global_weights, engine.momentum
        held_weights, held_momentum = dict(ref.global_weights), dict(ref.momentum)
        assert isinstance(before, KeptState) and before.shape_of(next(iter(before))) == \
            tuple(next(iter(held_weights.values())).shape)
        engine.rebase(weights, ref.momentum, 2)
        ref.rebase(weights, ref.momentum, 2)
        assert engine.global_weights is not before and _same(dict(engine.global_weights), ref.global_weights)
        # a kept state reads its own round's values after the engine moved on (the ranks keep their shards)
        assert _same(dict(before), held_weights) and _same(dict(before_momentum), held_momentum)
        assert engine.weights_hash() == ref.weights_hash()
        assert _same(cluster.live_weights(), {n: p.detach() for n, p in live.items()})
        # a state whose handles are gone is dropped by the ranks at the next state kept
        kept_id = before.state_id
        assert kept_id in engine.shard.kept
        kept = [row["kept"] for row in cluster.accounting()]  # each rank its shard of the kept state
        whole = sum(t.numel() * 4 for group in (held_weights, held_momentum) for t in group.values())
        assert sum(kept) == whole and 0 < kept[0] < whole
        del before, before_momentum
        gc.collect()
        engine.move_global(dict(ref.global_weights), dict(ref.momentum))  # a change: a new state
        assert engine.global_weights.state_id not in (kept_id, None) and kept_id not in engine.shard.kept
        with pytest.raises(RoundOrderError, match="encode round 5, expected 3"):
            engine.encode_contribution(5)  # refused alike on every rank: the cluster carries on
        assert engine.weights_hash() == ref.weights_hash()
    finally:
        cluster.close()


def _check_apply(cluster, engine, ref, live, outer_round, contributions):
    from ledger.chunkproof import tree_root
    from training.chunks import tensor_leaves

    ours = engine.finish_round(outer_round, contributions, excluded={})
    theirs = ref.finish_round(outer_round, contributions, excluded={})
    assert ours.weights_hash == theirs.weights_hash == engine.weights_hash() == ref.weights_hash()
    assert [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in ours.contributions] == \
        [(r.index, r.accepted, r.reason, r.norm, r.scale) for r in theirs.contributions]
    assert [r.accepted for r in ours.contributions] == [True, True, False]
    assert _same(dict(engine.global_weights), ref.global_weights)
    assert engine.global_weights is engine.global_weights  # one handle per state (the node keeps them)
    # the fraud proof's chunk roots from the ranks' frontiers: the one-process roots (no tensor gathered)
    assert engine.chunk_roots() == (tree_root(tensor_leaves(ref.global_weights)),
                                    tree_root(tensor_leaves(ref.momentum)))
    # the delay correction's live weights, written into the shards
    assert _same(cluster.live_weights(), {n: p.detach() for n, p in live.items()})
