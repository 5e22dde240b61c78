"""A node whose replica is trained by ``compute.processes`` > 1 processes (issue 75, docs/CLUSTER.md).

:class:`node.live.worker.replica.ReplicaWorker` asks :func:`replica_trainer` for its trainer: for one
process the plain :class:`training.pipeline.LocalReplicaTrainer`; for N it starts the cluster
(:class:`training.cluster_replica.ClusterReplicaTrainer`: this process is rank 0 and spawns ranks 1..N-1).
The node's exchange, record and checks see the cluster as a one-stage replica whose live weights are the
ranks' FSDP2 shards (gathered one tensor at a time by a reader of the whole weights: the held-out eval, the
start state's trainer part) and whose engine (:func:`stage_engine`) keeps the outer state sharded over the
ranks; the helpers here are the few places where the worker treats it differently (the engine, the inner
steps' session, the start state's trainer part, a restart's fresh optimizer).
"""

from __future__ import annotations

import contextlib
import logging

from training.cluster_replica import ClusterReplicaTrainer
from training.pipeline import LocalReplicaTrainer
from training.replica_capture import capture_trainer_part
from training.stage_engine import StageEngine

logger = logging.getLogger(__name__)


def replica_trainer(cfg, full: dict, timeout_s: float):
    """The trainer of a node that holds every stage of its replica (one process or a cluster of N)."""
    processes = cfg.compute.processes
    if processes == 1:
        return LocalReplicaTrainer(cfg.model, cfg.training, cfg.pipeline.num_stages, state_dict=full)
    trainer = ClusterReplicaTrainer(cfg.model, cfg.training, processes, full, timeout_s=timeout_s,
                                    threads=max(0, cfg.torch_threads))
    logger.info("cluster of %d processes: rank 0 is this node, ranks 1..%d are processes %s", processes,
                processes - 1, trainer.worker_pids())
    return trainer


def stage_engine(trainer, stage: int, params: dict, cfg):
    """The engine of a held stage: a one-process StageEngine, or for a cluster its outer state sharded over
    the ranks (training.cluster_node_engine.ShardedStageEngine: rank 0 holds its shard only)."""
    if is_cluster(trainer):
        engine = trainer.outer_engine(stage, cfg.diloco, cfg.compression, cfg.training.codec_kernels)
        logger.info("outer state of stage %d sharded over %d ranks: rank 0 holds %d of its %d tensors (%d of "
                    "%d elements)", stage, trainer.world, len(engine.plan.names[0]), len(engine.plan.order),
                    engine.plan.numel(0), engine.plan.numel())
        return engine
    return StageEngine(stage, params, cfg.diloco, cfg.compression, exact=cfg.training.codec_kernels)


def is_cluster(trainer) -> bool:
    return isinstance(trainer, ClusterReplicaTrainer)


def inner_steps(trainer):
    """The context a run of inner steps takes place in: for a cluster, ClusterReplicaTrainer.begin_steps /
    end_steps (its train_step is refused outside them)."""
    if not is_cluster(trainer):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def session():
        trainer.begin_steps()
        try:
            yield
        finally:
            trainer.end_steps()

    return session()


def trainer_part(trainer, module, optimizer, spill_dir=None):
    """The start state's trainer part (weights and inner-optimizer state), in a file under ``spill_dir`` when
    given (else in RAM): for a cluster, gathered from the ranks' shards a tensor at a time."""
    if is_cluster(trainer):
        return trainer.capture_part(spill_dir=spill_dir)
    return capture_trainer_part(module, optimizer, spill_dir=spill_dir)


def platform_of(trainer):
    """The fingerprint a cluster's start states record (``cluster = fsdp2;ranks=N``); None for one process
    (round_meta then takes the process's training platform, as it always has)."""
    return trainer.platform.fingerprint() if is_cluster(trainer) else None


def reset_inner_state(trainer, optimizer) -> None:
    """A fresh inner optimizer: on every rank for a cluster."""
    if is_cluster(trainer):
        trainer.reset_inner_state()
    else:
        optimizer.state.clear()
