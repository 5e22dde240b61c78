"""A node's whole replica whose inner steps run on N processes under FSDP2 (issue 75; docs/CLUSTER.md).

The node process is rank 0: :class:`ClusterReplicaTrainer` starts ranks 1..N-1 as child processes
(``python -m training.cluster_replica``, each handed the model and training settings on its stdin), joins
one gloo group with them, and from then on drives them: before each call it broadcasts a command, which
every rank then carries out together (a collective), in the order rank 0 issued them. A worker does
nothing else.

What the node sees is a one-stage replica trainer whose live weights are the FSDP2 shards themselves
(:class:`training.cluster_engine.ClusterTrainer`: each rank the rank-th of N equal slices of the batch;
parameters, gradients and AdamW state 1/N per rank). No process keeps a whole copy of the weights: a reader
of the whole weights gathers them one tensor at a time (:meth:`ClusterReplicaTrainer.live_weights`: the
start state's trainer part, :meth:`capture_part`, which also gathers the inner optimizer's state); the
held-out eval's snapshot is each rank's copy of its shards, evaluated a block at a time on rank 0
(training/cluster_eval.py); the outer commands gather and write back only each rank's own tensors. The inner
optimizer's state stays sharded for the whole run; :meth:`reset_inner_state` clears it on every rank.

The outer state (global weights, momentum, round start, error-feedback residual, the delay correction's
snapshots) is sharded over the same ranks: :meth:`ClusterReplicaTrainer.outer_engine` sets up each rank's
:class:`training.cluster_outer.OuterShard` and gives the node a :class:`training.cluster_node_engine.
ShardedStageEngine`, whose calls are ``outer`` commands. The contribution is the one-process contribution
byte for byte (training/cluster_outer.py), so it does not depend on N, while the inner steps do (their float
sums), which the fingerprint's ``cluster`` field records.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from training.cluster_eval import snapshot_command
from training.cluster_launch import free_port
from training.cluster_memory import memory_row, peak_rss
from training.cluster_plan import cluster_identity
from training.errors import EngineStateError, TrainingError
from training.host_tensors import host_float32
from training.muon import state_kind
from training.spilled import SpillWriter

logger = logging.getLogger(__name__)

#: Seconds a worker gets to leave after "stop" before it is terminated, then killed.
STOP_GRACE_S = 20.0
#: glibc's mmap threshold of the worker ranks (bytes; the node's own, node/arenas.py LARGE_BLOCK_BYTES).
WORKER_MMAP_THRESHOLD = 1 << 20


def _stage_module(model_cfg):
    from training.stages import StageModule, split_stages

    return StageModule(model_cfg, split_stages(model_cfg.n_layer, 1)[0], seed=None)


class _Rank:
    """What every rank holds: the FSDP2-sharded replica and its data-parallel trainer."""

    def __init__(self, model_cfg, training_cfg) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from training.cluster_engine import ClusterTrainer, shard_stage_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.module = shard_stage_module(_stage_module(model_cfg), mesh)
        self.trainer = ClusterTrainer(self.module, training_cfg)
        self.outer = None  # the rank's OuterShard (training/cluster_outer.py), once "outer_init" ran
        self.snapshots: dict[int, dict] = {}  # eval snapshots' copies of the rank's shards (cluster_eval.py)

    def run(self, command: tuple, private=None):
        """Carry out ``command`` (the same on every rank); ``private``: rank 0's whole-stage inputs (the
        weights of a ``load``, an outer command's)."""
        kind = command[0]
        if kind == "outer":
            if self.outer is None:
                raise EngineStateError("cluster outer command before the outer state was set up")
            return self.outer.run(command[1], command[2:], private)
        if kind == "outer_init":
            from training.cluster_outer import OuterShard

            self.outer = OuterShard(*command[1:], dict(self.module.named_parameters()))
            return self.outer
        if kind.startswith("snapshot"):
            return snapshot_command(self, command)
        if kind == "step":
            x, y = command[2], command[3]
            for group in self.trainer.optimizer.param_groups:
                group["lr"] = command[1]
            return self.trainer.train_step(x, y)
        if kind == "load":
            return self._load(private)
        if kind == "weights":
            return self._weights(private)
        if kind == "capture":
            return self._capture(private)
        if kind == "reset":
            self.trainer.optimizer.state.clear()
            return None
        if kind == "load_optimizer":
            return self._load_optimizer(command[1], private)
        if kind == "accounting":
            return self._accounting()
        if kind == "memory":
            return self._memory(command[1])
        raise EngineStateError(f"cluster command {kind!r}: unknown")

    def _load(self, whole) -> None:
        """Rank 0's whole weights (``whole``, by name) into every rank's shards, one tensor at a time."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, param in self.module.named_parameters():
                source = (whole[name].detach() if whole is not None
                          else torch.empty(tuple(param.shape), dtype=param.dtype))
                placed = distribute_tensor(source.to(param.dtype), param.device_mesh, param.placements,
                                           src_data_rank=0)
                param.to_local().copy_(placed.to_local())

    def _load_optimizer(self, steps: dict[str, float], whole) -> None:
        """The inner AdamW state of the parameters in ``steps`` (name -> its step count, on every rank):
        each moment distributed from rank 0's whole tensor (``whole``: name -> {field: tensor}) into the
        parameter's shards; the others' state cleared (a rerun from a start state:
        training/cluster_rerun.py)."""
        from torch.distributed.tensor import distribute_tensor

        optimizer = self.trainer.optimizer
        optimizer.state.clear()
        for name, param in self.module.named_parameters():
            if name not in steps:
                continue
            state = {"step": torch.tensor(float(steps[name]), dtype=torch.float32)}
            for field in ("exp_avg", "exp_avg_sq"):
                source = (whole[name][field].detach().to(param.dtype) if whole is not None
                          else torch.empty(tuple(param.shape), dtype=param.dtype))
                state[field] = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=0)
            optimizer.state[param] = state

    def _weights(self, sink) -> None:
        """Each parameter gathered whole from the shards, one at a time (every rank takes part in each
        gather), handed to rank 0's ``sink(name, tensor)`` (a fresh float32 tensor) and dropped."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                full = param.full_tensor()
                if sink is not None:
                    sink(name, host_float32(full))
                del full

    def _capture(self, sink) -> None:
        """:func:`training.replica_capture.capture_trainer_part` of the whole replica: the weights and each
        inner-optimizer state tensor gathered from the shards one at a time, each handed to rank 0's
        ``sink(name, tensor)`` (a fresh float32 tensor) and dropped."""
        optimizer = self.trainer.optimizer
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                full = param.full_tensor()
                if sink is not None:
                    sink(f"param/{name}", host_float32(full))
                del full
                state = optimizer.state.get(param, {})
                prefix, _fields = state_kind(optimizer, param)
                for field_name, value in state.items():
                    full = value.full_tensor() if hasattr(value, "full_tensor") else torch.as_tensor(value)
                    if sink is not None:
                        sink(f"{prefix}.{field_name}/{name}", host_float32(full))
                    del full

    def _accounting(self) -> list[dict] | None:
        """Each rank's training state in bytes (tensor accounting, not RSS), on rank 0: the FSDP shards of
        the parameters and gradients, the inner AdamW state, a rank's copy of its tensors' live weights
        (held only while an outer command runs: 0 here), the outer state by kind
        (training.cluster_outer.outer_state_bytes), the earlier global states the rank keeps for the node's
        handles (``kept``: its shards of them, not counting the current state's, which are the engine's), and
        the process's peak RSS (VmHWM) beside it."""
        from training.cluster_outer import kept_state_bytes, outer_state_bytes

        def size(tensors) -> int:
            total = 0
            for tensor in tensors:
                tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                total += tensor.numel() * tensor.element_size()
            return total

        params = list(self.module.parameters())
        outer = self.outer
        row = {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
               "inner_optimizer": size(v for state in self.trainer.optimizer.state.values() for v in
                                       state.values() if isinstance(v, torch.Tensor) and v.dim() > 0),
               "live_copy": size(outer.live.values()) if outer is not None else 0,
               "outer": outer_state_bytes(outer.engine) if outer is not None else {},
               "kept": kept_state_bytes(outer) if outer is not None else 0,
               "tensors": len(outer.own) if outer is not None else 0, "peak_rss_bytes": peak_rss()}
        return _on_zero(row)

    @staticmethod
    def _memory(reset: bool) -> list[dict] | None:
        """Each rank's resident set and peak (training.cluster_memory.memory_row), on rank 0."""
        return _on_zero(memory_row(reset))


def _on_zero(row):
    """Every rank's ``row``, gathered on rank 0 (None elsewhere)."""
    rows: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows


def _watch_parent(parent: int) -> None:
    """Leave at once when the parent (rank 0, the node) is gone, however it ended (SIGKILL included): its
    children are then re-parented. (Not Linux's parent-death signal: that follows the thread that started
    the child, and the node builds its trainer on a thread that may end.)"""
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main() -> int:
    """A worker rank: read its settings from stdin, join the group, follow rank 0's commands."""
    settings = pickle.load(sys.stdin.buffer)
    parent = settings["parent"]
    # Ctrl-C in a terminal reaches the whole process group: rank 0 (the node) decides when a worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != parent:  # the parent died already
        return 3
    _watch_parent(parent)
    if settings["threads"] > 0:
        torch.set_num_threads(settings["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{settings['port']}",
                            rank=settings["rank"], world_size=settings["world"],
                            timeout=timedelta(seconds=settings["timeout_s"]))
    try:
        rank = _Rank(settings["model"], settings["training"])
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0][0] == "stop":
                return 0
            try:
                rank.run(box[0])
            except Exception:  # noqa: BLE001 - an outer command refused on every rank alike: rank 0 reports it
                if box[0][0] != "outer":
                    raise
    finally:
        dist.destroy_process_group()


class ClusterReplicaTrainer:
    """Rank 0 of a cluster node's replica (module docstring): the node's trainer for ``world`` processes."""

    def __init__(self, model_cfg, training_cfg, world: int, state_dict: dict[str, torch.Tensor], *,
                 timeout_s: float = 300.0, threads: int = 0) -> None:
        from training.platform import prepare_platform

        if not isinstance(world, int) or isinstance(world, bool) or world < 2:
            raise EngineStateError(f"a cluster replica of {world!r} processes: must be at least 2")
        if dist.is_initialized():
            raise EngineStateError("a cluster replica needs this process's torch.distributed group to itself")
        self.world = world
        self.platform = prepare_platform(training_cfg.device, training_cfg.precision, training_cfg.compile,
                                         cluster=cluster_identity(world))
        self.model_cfg, self.training_cfg = model_cfg, training_cfg
        self._lock = threading.RLock()
        self._workers: list[subprocess.Popen] = []
        self._closed = False
        self._in_steps = False
        self._snapshot_ids = itertools.count()
        self._released_snapshots: list[int] = []  # eval snapshots dropped unevaluated (cluster_eval.py)
        port = free_port()
        try:
            self._spawn(port, timeout_s, threads)
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
            self._rank = _Rank(model_cfg, training_cfg)
            # the shards start as the node's weights (a module is built empty); ``state_dict`` is the
            # caller's: this trainer keeps no whole copy of the weights
            self._command(("load",), private=state_dict)
        except BaseException:
            self.close()
            raise
        self.optimizer = self._rank.trainer.optimizer  # set_lr sets rank 0's; each step sends it along

    def _spawn(self, port: int, timeout_s: float, threads: int) -> None:
        env = dict(os.environ)
        # as the node maps its large blocks on their own (node.arenas.map_large_blocks): a worker's freed
        # tensors go back at once, not into an arena's resident high-water mark (unless the caller chose)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(WORKER_MMAP_THRESHOLD))
        for rank in range(1, self.world):
            settings = {"rank": rank, "world": self.world, "port": port, "timeout_s": timeout_s,
                        "threads": threads, "parent": os.getpid(), "model": self.model_cfg,
                        "training": self.training_cfg}
            worker = subprocess.Popen([sys.executable, "-m", "training.cluster_replica"],
                                      stdin=subprocess.PIPE, env=env)
            self._workers.append(worker)
            worker.stdin.write(pickle.dumps(settings))
            worker.stdin.close()

    # -- what the node calls (LocalReplicaTrainer's surface) --------------------------------------------
    @property
    def stage_modules(self) -> list:
        """The replica's one stage module as rank 0 holds it: FSDP2-sharded (its parameters are DTensors
        whose local part is rank 0's shard). The whole weights are :meth:`live_weights` (gathered)."""
        return [self._rank.module]

    @property
    def optimizers(self) -> list:
        return [self.optimizer]

    @property
    def identity(self) -> str:
        return cluster_identity(self.world)

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    def _command(self, command: tuple, private=None):
        with self._lock:
            if self._closed:
                raise EngineStateError("the cluster's worker ranks were stopped")
            self._check_workers()
            try:
                dist.broadcast_object_list([command], src=0)
                return self._rank.run(command, private=private)
            except TrainingError:  # the engine's own refusal (a round out of order): the same on every rank
                raise
            except (RuntimeError, ValueError) as exc:  # gloo: a rank left ("Connection reset by peer")
                self._check_workers(wait_s=5.0)
                raise EngineStateError(
                    f"the cluster's process group failed in {command[0]!r}: {exc}") from exc

    def _check_workers(self, wait_s: float = 0.0) -> None:
        """Raise EngineStateError naming the worker ranks that exited (waiting up to ``wait_s`` for one)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [w.pid for w in self._workers if w.poll() is not None]
            if dead:
                raise EngineStateError(f"cluster worker process(es) {dead} exited")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def begin_steps(self) -> None:
        """Before a run of inner steps (the live weights are the shards': nothing moves)."""
        self._in_steps = True

    def end_steps(self) -> None:
        """After a run of inner steps."""
        self._in_steps = False

    def live_weights(self, sink=None) -> dict[str, torch.Tensor] | None:
        """The whole live weights gathered from the shards, one tensor at a time: each handed to
        ``sink(name, tensor)`` as it arrives (rank 0 then never holds more than one), or, without a sink,
        returned as a dict (a transient whole copy, for a reader that needs it: a test)."""
        whole: dict[str, torch.Tensor] = {}
        self._command(("weights",), private=sink if sink is not None else whole.__setitem__)
        return None if sink is not None else whole

    def load_optimizer(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """The inner AdamW state of a whole replica (name -> {"step", "exp_avg", "exp_avg_sq"}, rank 0's)
        distributed into every rank's shards; parameters not named start without state."""
        steps = {name: float(fields["step"]) for name, fields in state.items()}
        self._command(("load_optimizer", steps), private=state)

    def load_weights(self, weights) -> None:
        """Whole weights (by name, rank 0's) into every rank's shards, one tensor at a time."""
        self._command(("load",), private=weights)

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        if not self._in_steps:
            raise EngineStateError("cluster inner steps run between begin_steps() and end_steps()")
        return self._command(("step", float(self.optimizer.param_groups[0]["lr"]), x, y))

    def capture_part(self, spill_dir: Path | None = None) -> Mapping[str, torch.Tensor]:
        """The whole replica's weights and inner-optimizer state, gathered from the shards a tensor at a
        time (the start state's trainer part): with ``spill_dir`` each written to a file there as it
        arrives (:class:`training.spilled.SpillWriter`: rank 0 never holds them whole; read back one at a
        time when the start state is written), else kept in RAM (also where the file cannot be written)."""
        if spill_dir is not None:
            try:
                return self._capture_spilled(spill_dir)
            except OSError as exc:
                logger.warning("start state's weights and optimizer state kept in RAM: not written to %s "
                               "(%s)", spill_dir, exc)
        live: dict[str, torch.Tensor] = {}
        self._command(("capture",), private=live.__setitem__)
        return live

    def _capture_spilled(self, spill_dir: Path):
        writer = SpillWriter(spill_dir)
        failed: list[OSError] = []

        def sink(name: str, tensor: torch.Tensor) -> None:
            if not failed:  # an error must not break off the ranks' gathers: raised after the command
                try:
                    writer.add(name, tensor)
                except OSError as exc:
                    failed.append(exc)

        try:
            self._command(("capture",), private=sink)
        except BaseException:
            writer.abandon()
            raise
        if failed:
            writer.abandon()
            raise failed[0]
        return writer.done()

    def outer_engine(self, stage_index: int, diloco_cfg, compression_cfg, exact: int = 0):
        """The node's engine of the replica's one stage, its outer state sharded over the ranks
        (:class:`training.cluster_node_engine.ShardedStageEngine`; every rank sets up its shard now)."""
        from training.cluster_node_engine import ShardedStageEngine

        shapes = {name: tuple(p.shape) for name, p in self._rank.module.named_parameters()}
        shard = self._command(("outer_init", stage_index, shapes, diloco_cfg, compression_cfg, int(exact)))
        return ShardedStageEngine(self, shard)

    def outer(self, command: tuple, private=None):
        """One outer command (training/cluster_outer.py) on every rank; rank 0's result."""
        return self._command(("outer", *command), private=private)

    def accounting(self) -> list[dict]:
        """Every rank's training state in bytes, rank by rank (:meth:`_Rank._accounting`)."""
        return self._command(("accounting",))

    def memory(self, reset: bool = False) -> list[dict]:
        """Every rank's resident set and peak in bytes, rank by rank; ``reset``: each rank's free pages given
        back and its peak reset first (training/cluster_memory.py: the bench's measure of a round's part)."""
        return self._command(("memory", bool(reset)))

    def reset_inner_state(self) -> None:
        """A fresh inner optimizer on every rank (a restart from a checkpoint)."""
        self._command(("reset",))

    def eval_loss(self, batches) -> float:
        """:meth:`training.pipeline.LocalReplicaTrainer.eval_loss` of the live weights (on a snapshot)."""
        return self.eval_snapshot().eval_loss(batches)

    def eval_snapshot(self):
        """A :class:`training.pipeline.EvalSnapshot` of the live weights for one eval: each rank copies its
        shards, rank 0 evaluates a block at a time as the forward reaches it (training/cluster_eval.py: no
        whole copy on rank 0)."""
        from training.cluster_eval import StreamedEvalSnapshot

        snapshot_id = next(self._snapshot_ids)
        released = []
        while self._released_snapshots:
            released.append(self._released_snapshots.pop())
        self._command(("snapshot", snapshot_id, released))
        return StreamedEvalSnapshot(_stage_module, self.model_cfg, self.platform, self._command, snapshot_id,
                                    self._released_snapshots)

    def close(self) -> None:
        """Stop the worker ranks (told to, then terminated, then killed) and leave the group; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if dist.is_initialized():
                try:
                    if all(w.poll() is None for w in self._workers):
                        dist.broadcast_object_list([("stop",)], src=0)
                except (RuntimeError, ValueError):  # a broken group: the workers are ended below
                    pass
                dist.destroy_process_group()
            stop_workers(self._workers)


def stop_workers(workers: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Wait up to ``grace_s`` for ``workers`` to leave, then terminate, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.terminate()
    for worker in workers:
        try:
            worker.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


if __name__ == "__main__":
    sys.exit(worker_main())
