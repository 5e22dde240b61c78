"""The training side of a node: the stages it holds, their trainers and DiLoCoX engines.

A node holds either every stage of its replica (a cluster of one: the stages
run chained in this process) or one stage (a cluster of ``num_stages`` nodes
joined by a torch.distributed gloo pipeline). Either way, each held stage has
its own :class:`training.stage_engine.StageEngine`; this class is the node's only
door into ``training/``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from node.config import OUTER_STATE_DIR, NodeConfig
from training.codec_wire import decode_contribution
from training.data import corpus_from_config, eval_batches, round_batches, windows_key
from training.butterfly import slice_for_exchange
from training.slice_plan import SlicePlan
from training.diloco import Aggregation
from training.errors import PipelineError
from training.platform import resolve_device
from training.hashing import stage_weights_hash, weights_root
from training.model import init_state_dict
from training.reexec import data_commitment, round_meta
from training.replica_capture import StartStateCapture
from training.pipeline import LocalReplicaTrainer
from training.pipeline_group import close_pipeline_group, init_pipeline_group
from training.pipeline_stage import PipelineStageTrainer
from training.schedule import inner_lr, set_lr, takes_another_step, trainer_optimizers
from training.stage_engine import StageEngine
from training.stages import split_stages, stage_param_names
from node.live.worker.aggregation import StageAggregation
from node.live.worker import cluster

logger = logging.getLogger(__name__)


#: A time-bounded round builds its batches this many steps at a time (it does not know its count ahead).
BATCH_CHUNK = 16


@dataclass
class TrainStats:
    mean_loss: float
    tokens: int
    seconds: float
    cpu_seconds: float = 0.0  # the training thread's CPU seconds in the part's inner steps


class ReplicaWorker(StageAggregation):
    """Trainers and engines of the stages one node holds (see module docstring)."""

    def __init__(self, cfg: NodeConfig, replica: int, stages: tuple[int, ...], rank: int,
                 data_key: bytes | None = None) -> None:
        self.cfg = cfg
        self.replica = replica
        # What the windows of the replica's batches are drawn by (training.data.windows_key): the replica
        # index, or in a run with training.data_windows = "account" ``data_key``, the 20-byte account of the
        # replica's first-stage member (every stage of a split replica reads the same batch:
        # node/live/assembly.py).
        self.windows_key = windows_key(cfg.training, replica, data_key)
        self.stages = stages
        self.rank = rank
        self.specs = split_stages(cfg.model.n_layer, cfg.pipeline.num_stages)
        training_cfg = cfg.training
        if training_cfg.data_path:
            # Resolve the data path against data_dir without mutating the caller's config.
            from dataclasses import replace

            training_cfg = replace(training_cfg, data_path=str(cfg.path(training_cfg.data_path)))
        self.corpus = corpus_from_config(training_cfg, cfg.model)
        self._eval = eval_batches(self.corpus, cfg.training.eval_batches, cfg.training.batch_size,
                                  cfg.model.block_size)
        self.pipelined = len(stages) < cfg.pipeline.num_stages
        self.trainer: LocalReplicaTrainer | PipelineStageTrainer | None = None
        self.engines: dict[int, StageEngine] = {}
        self.plans: dict[int, SlicePlan] = {}  # stage -> slice plan (diloco.exchange = "sliced" only)
        # round -> (inner steps trained, their wall seconds): a time-bounded run's count to declare
        self._trained: dict[int, tuple[int, float]] = {}

    # -- set-up ---------------------------------------------------------------------
    def start(self, rendezvous_timeout: float, op_timeout: float,
              mark: Callable[[str], object] | None = None) -> None:
        """Build the trainer (joining the cluster's pipeline group if the replica is split); ``mark(phase)``
        is told when the model is initialised and the group joined (node/live/startup.py)."""
        mark = mark or (lambda _phase: None)
        if self.cfg.torch_threads > 0:
            torch.set_num_threads(self.cfg.torch_threads)
        if self.pipelined:
            spec = self.specs[self.stages[0]]
            # only this stage's weights are drawn (the same bits as the whole model's draw: issue 75)
            own = init_state_dict(self.cfg.model, self.cfg.training.seed,
                                  names=stage_param_names(self.cfg.model, spec))
            mark("model initialised")
            host, _, port = self.cfg.cluster_master.rpartition(":")
            init_pipeline_group(self.rank, self.cfg.pipeline.num_stages, host, int(port),
                                timeout_s=max(rendezvous_timeout, op_timeout),
                                device=resolve_device(self.cfg.training.device))
            mark("pipeline group joined")
            self.trainer = PipelineStageTrainer(
                self.cfg.model, spec, self.rank, self.cfg.pipeline.num_stages,
                self.cfg.pipeline.micro_batches, self.cfg.training, state_dict=own,
            )
            modules = {spec.index: self.trainer.module}
        else:
            full = init_state_dict(self.cfg.model, self.cfg.training.seed)
            mark("model initialised")
            # one process, or rank 0 of a cluster of compute.processes (node/live/worker/cluster.py)
            self.trainer = cluster.replica_trainer(self.cfg, full, max(rendezvous_timeout, op_timeout))
            modules = {spec.index: m for spec, m in zip(self.specs, self.trainer.stage_modules)}
        for stage in self.stages:
            params = dict(modules[stage].named_parameters())
            # a cluster's: its outer state sharded over the ranks (node/live/worker/cluster.py)
            self.engines[stage] = cluster.stage_engine(self.trainer, stage, params, self.cfg)
            # docs/PROTOCOL.md, "Sliced exchange"
            plan = slice_for_exchange(self.engines[stage], self.cfg.diloco)
            if plan is not None:
                self.plans[stage] = plan
            if self.cfg.storage.outer_state == "disk" and isinstance(self.engines[stage], StageEngine):
                # between its outer steps in files, not RAM (issue 75; a cluster's shards stay on its ranks)
                self.engines[stage].keep_outer_state_in(self.cfg.path(OUTER_STATE_DIR))

    def leave_pipeline(self) -> None:
        """Drop the cluster's broken pipeline (a partner died); weights, optimizer and engines are kept."""
        if isinstance(self.trainer, PipelineStageTrainer):
            self.trainer.leave_group()

    def rejoin_pipeline(self, timeout: float) -> None:
        """Re-form the cluster's pipeline with the same ranks; PipelineError if the partners are not back."""
        host, _, port = self.cfg.cluster_master.rpartition(":")
        self.trainer.join_group(host, int(port), timeout)

    def close(self) -> None:
        if isinstance(self.trainer, PipelineStageTrainer):
            self.trainer.close()
            close_pipeline_group()
        elif cluster.is_cluster(self.trainer):
            self.trainer.close()  # the worker ranks stopped, the group left
        self.trainer = None

    def agree_on_round(self, proposal: int) -> int:
        """Pipeline members agree on the next round to train (the max of their proposals)."""
        if not self.pipelined:
            return proposal
        import torch.distributed as dist

        value = torch.tensor([proposal], dtype=torch.int64)
        try:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer", a torn-down group
            raise PipelineError(f"agreeing on the entry round failed: {exc}") from exc
        return int(value.item())

    # -- state ----------------------------------------------------------------------
    def stage_names(self, stage: int) -> list[str]:
        return stage_param_names(self.cfg.model, self.specs[stage])

    def global_state(self, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        engine = self.engines[stage]
        return engine.global_weights, engine.momentum

    def global_hash(self, stage: int) -> bytes:
        return self.engines[stage].weights_hash()

    def load_global(self, stage: int, weights: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor],
                    last_round: int) -> None:
        """Enter at ``last_round + 1`` from global state (a checkpoint): local = global, no pending rounds."""
        names = self.engines[stage].shapes
        self.engines[stage].rebase({n: weights[n].to(torch.float32) for n in names},
                                   {n: momentum[n].to(torch.float32) for n in names}, last_round)

    def restart_from(self, stage: int, weights: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor],
                     last_round: int) -> None:
        """Hold exactly the state a process restarted from a checkpoint of ``last_round`` holds for ``stage``:
        local = global = ``weights``, ``momentum``, nothing pending, a zero error-feedback residual and a
        fresh inner optimizer (training.reexec.restart_state_reason). A survivor that sat rounds out re-enters
        so (node/live/round/entry.py, RunEntry.await_partner): its start state then follows from the record
        alone, like its restarted partner's."""
        self.load_global(stage, weights, momentum, last_round)
        self.engines[stage].compressor.reset_feedback()
        cluster.reset_inner_state(self.trainer, self._optimizers()[stage])  # AdamW keeps nothing else: as new

    def _optimizers(self) -> dict:
        """Stage -> the inner optimizer of each stage this node's trainer holds."""
        if isinstance(self.trainer, PipelineStageTrainer):
            return {self.stages[0]: self.trainer.optimizer}
        return {spec.index: opt for spec, opt in zip(self.specs, self.trainer.optimizers)}

    def begin_round(self, outer_round: int) -> bool:
        """``outer_round``'s start, before its start state is captured and its first inner step: under
        ``training.inner_state = "fresh"`` every held stage's inner optimizer is new (on every rank of a
        cluster), as the rerun's is (training.inner_optimizers.begin_round); nothing under "carry". True when
        it cleared them."""
        if not self.cfg.training.fresh_inner_state:
            return False
        for stage in self.stages:
            cluster.reset_inner_state(self.trainer, self._optimizers()[stage])
        logger.debug("round %d: a fresh inner optimizer (training.inner_state = \"fresh\")", outer_round)
        return True

    def absorb_held(self, stage: int, outer_round: int, weights: dict[str, torch.Tensor],
                    momentum: dict[str, torch.Tensor]) -> None:
        """Absorb ``outer_round`` again from the global state this node already computed after it
        (``weights``,
        ``momentum``): the same outer step :meth:`apply` takes for a round it did not encode, without
        fetching or aggregating that round a second time (a survivor's re-entry, RunEntry.await_partner)."""
        aggregation = Aggregation(weights, momentum, stage_weights_hash(weights), None, [])
        self.engines[stage].absorb_round(outer_round, [], aggregation=aggregation)

    def skip_to(self, stage: int, next_round: int) -> None:
        """Make ``next_round`` the next round to encode, keeping weights (a node that sat rounds out)."""
        self.engines[stage].skip_to(next_round)

    # -- one outer round --------------------------------------------------------------
    def train_round(self, outer_round: int, on_step: Callable[[int, float], None] | None = None,
                    first_step: int = 0, end_step: int | None = None,
                    budget_elapsed: Callable[[], float] | None = None) -> TrainStats:
        """Inner steps ``first_step <= k < end_step`` (default: all H) on this replica's batches of
        ``outer_round``.

        A round may be trained in two parts (the schedule's partial overlap applies the
        previous round between them); the batches are the same deterministic ones either way.
        In a time-bounded run (``diloco.round_budget_s``) a step is taken only while
        :func:`training.schedule.takes_another_step` says so, on the seconds of the round's budget
        used so far: ``budget_elapsed()`` (the node's round clock, node/live/state/roundclock.py: its own
        work around the steps counts, its waits for peers do not), or without it the wall seconds of
        the round's inner steps so far; a split replica's first stage decides and its pipeline
        partners follow (one broadcast per step), so every stage trains, and declares, the same count
        (:meth:`declared_steps`). Its batches are built a few steps at a time (BATCH_CHUNK), not for
        all H steps it will not take.
        """
        h = self.cfg.diloco.inner_steps
        end_step = h if end_step is None else end_step
        budgeted = self.cfg.diloco.budgeted
        if first_step == 0:
            self._trained[outer_round] = (0, 0.0)
        done, elapsed = self._trained.get(outer_round, (first_step, 0.0))
        started = time.perf_counter()
        cpu_started = time.thread_time()
        losses = []
        # The inner learning rate follows the run's schedule over its global inner step, as the
        # simulation does (training.schedule.inner_lr; open-ended runs have no decay horizon).
        total_steps = self.cfg.rounds * h if self.cfg.rounds > 0 else None
        optimizers = trainer_optimizers(self.trainer)
        with cluster.inner_steps(self.trainer):
            for step, (x, y) in zip(range(first_step, end_step),
                                    self._batches(outer_round, first_step, end_step)):
                if budgeted and not self._another_step(step, elapsed if budget_elapsed is None
                                                       else budget_elapsed()):
                    break
                step_started = time.perf_counter()
                set_lr(optimizers, inner_lr(self.cfg.training, outer_round * h + step, total_steps))
                losses.append(self.trainer.train_step(x, y))
                elapsed += time.perf_counter() - step_started
                done = step + 1
                if on_step is not None:
                    on_step(step + 1, losses[-1])
        self._trained[outer_round] = (done, elapsed)
        self._trained = {r: v for r, v in self._trained.items() if r >= outer_round - 2}
        tokens = len(losses) * self.cfg.training.batch_size * self.cfg.model.block_size
        mean = sum(losses) / len(losses) if losses else float("nan")
        return TrainStats(mean, tokens, time.perf_counter() - started, time.thread_time() - cpu_started)

    def _batches(self, outer_round: int, first_step: int, end_step: int):
        """The batches of steps ``first_step .. end_step - 1`` of the round, in order: all at once with fixed
        H, BATCH_CHUNK at a time in a time-bounded run (the same batches: each step's is its own)."""
        chunk = BATCH_CHUNK if self.cfg.diloco.budgeted else max(1, end_step - first_step)
        for start in range(first_step, end_step, chunk):
            stop = min(end_step, start + chunk)
            yield from round_batches(self.corpus, self.cfg.training.seed, self.windows_key, outer_round, stop,
                                     self.cfg.training.batch_size, self.cfg.model.block_size,
                                     first_step=start)

    def _another_step(self, step: int, elapsed: float) -> bool:
        """:func:`takes_another_step`, decided by the replica's first stage and followed by the others."""
        decision = takes_another_step(self.cfg.diloco, step, elapsed)
        if self.pipelined and step >= self.cfg.diloco.min_inner_steps:
            decision = self.trainer.follow_first_stage(decision)
        return decision

    def declared_steps(self, outer_round: int) -> int | None:
        """The inner steps this replica trained in ``outer_round`` and its contributions declare; None in a
        fixed-H run (its contributions declare nothing: H)."""
        if not self.cfg.diloco.budgeted:
            return None
        if outer_round not in self._trained:
            raise PipelineError(f"round {outer_round}: not trained here, no step count to declare")
        return self._trained[outer_round][0]

    # -- what a contribution binds (re-execution spot checks, docs/DILOCOX.md section 11) ------
    def capture_start_states(self, outer_round: int) -> dict[int, bytes]:
        """Stage -> canonical bytes of the start state of ``outer_round`` (call before its first inner
        step)."""
        return self.start_state_capture(outer_round)()

    def start_state_capture(self, outer_round: int,
                            spill_dir: Path | None = None) -> Callable[[], dict[int, bytes]]:
        """:meth:`capture_start_states` in two parts: copies of what the inner steps change now, and
        a function that adds the engines' state and serialises, to call (on any thread) before the
        engines change (the next encode or apply) and after the previous encode finished (a
        :class:`~training.replica_capture.StartStateCapture`, whose ``write`` puts them in files instead).
        ``spill_dir``: the copies wait in a file there rather than in RAM (training/spilled.py)."""
        meta = round_meta(outer_round, self.replica, self.cfg.model, self.cfg.diloco,
                          run_rounds=self.cfg.rounds, num_stages=self.cfg.pipeline.num_stages,
                          micro_batches=self.cfg.pipeline.micro_batches if self.pipelined else 0,
                          platform=cluster.platform_of(self.trainer))
        if self.pipelined:
            held = {self.stages[0]: (self.trainer.module, self.trainer.optimizer)}
        else:
            held = {spec.index: (module, optimizer) for spec, module, optimizer in
                    zip(self.specs, self.trainer.stage_modules, self.trainer.optimizers)}
        parts = {stage: cluster.trainer_part(self.trainer, *held[stage], spill_dir=spill_dir)
                 for stage in self.stages}
        return StartStateCapture(meta, lambda stage: self.engines[stage], parts)

    def data_commitment(self, outer_round: int) -> bytes:
        """sha256 of the token ids this replica's H inner steps of ``outer_round`` consume."""
        key = self.windows_key if isinstance(self.windows_key, bytes) else None
        return data_commitment(self.corpus, self.cfg.training, self.cfg.model, self.cfg.diloco, self.replica,
                               outer_round, self.declared_steps(outer_round), key)

    def eval_loss(self) -> float:
        return self.trainer.eval_loss(self._eval)

    def eval_snapshot(self) -> Callable[[], float] | None:
        """A function returning :meth:`eval_loss` of the weights now, bit for bit, callable on another
        thread while training goes on; None for a split replica (its eval runs the pipeline)."""
        if self.pipelined:
            return None
        snapshot = self.trainer.eval_snapshot()
        return lambda: snapshot.eval_loss(self._eval)

    def prepare_encode(self, stage: int, outer_round: int) -> bool:
        """Take the part of :meth:`encode` that reads the live weights now; False if the delay
        variant cannot split it (then :meth:`encode` does everything, on this thread)."""
        engine = self.engines[stage]
        if not engine.can_prepare:
            return False
        self.skip_to(stage, outer_round)
        engine.prepare_encode(outer_round)
        return True

    def encode(self, stage: int, outer_round: int):
        """(contribution bytes, compression stats) of ``stage`` for ``outer_round``.

        After :meth:`prepare_encode`, only the compression is left (it may run on another thread).
        """
        self.skip_to(stage, outer_round)
        return self.engines[stage].encode_contribution(outer_round, self.declared_steps(outer_round))

    def stage_shapes(self, stage: int) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape of a held stage."""
        return {name: tuple(shape) for name, shape in self.engines[stage].shapes.items()}

    def check_contribution(self, stage: int, outer_round: int, payload: bytes) -> None:
        """Raise ContributionDecodeError unless ``payload`` decodes strictly for (stage, round)."""
        shapes = self.stage_shapes(stage)
        decode_contribution(payload, shapes, stage_index=stage, outer_round=outer_round,
                            refuse_raw=self.cfg.compression.enabled)

    def weights_root_of(self, full_weights: dict) -> bytes:
        """The record's ``weights_root`` of a full model's weights (every stage, not only the held ones)."""
        hashes = [stage_weights_hash({n: full_weights[n] for n in self.stage_names(s)})
                  for s in range(self.cfg.pipeline.num_stages)]
        return weights_root(hashes)

    def initial_hashes(self) -> dict[int, bytes]:
        full = init_state_dict(self.cfg.model, self.cfg.training.seed)
        return {s: stage_weights_hash({n: full[n] for n in self.stage_names(s)}) for s in self.stages}


def warm_up_imports() -> None:
    """Import what building a stage's trainer imports on first use: torch.optim's first optimizer imports
    torch._dynamo, seconds of CPU (a minute on a loaded machine). Run on a thread while the node starts its
    network side (chain, host, peers, placement: mostly waiting), so the import overlaps those waits."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - thread boundary; only a warm-up: the trainer imports it again.
        # Also what a node that exits during the import (an error at start) meets as the interpreter shuts
        # down: a traceback printed after the node's one-line error would hide it.
        try:
            logger.debug("warming up torch._dynamo failed: %s", exc)
        except Exception:  # noqa: BLE001 - thread boundary: logging torn down at exit
            pass


class PipelineRejoin:
    """Re-forms a split cluster's pipeline in the background until the partners are back (or stop).

    The node keeps finishing (absorbing) the rounds the other replicas close meanwhile,
    so its stage stays current and it keeps attesting and signing; ``done`` is set once
    the group is formed again.
    """

    def __init__(self, worker: ReplicaWorker, timeout: float, stop: threading.Event) -> None:
        self.worker = worker
        self.timeout = timeout
        self.stop = stop
        self.done = threading.Event()
        self.attempts = 0
        self._thread = threading.Thread(target=self._run, name="pipeline-rejoin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.attempts += 1
            try:
                self.worker.rejoin_pipeline(self.timeout)
            except PipelineError as exc:
                logger.info("pipeline not re-formed yet (attempt %d): %s", self.attempts, exc)
                self.stop.wait(1.0)
                continue
            self.done.set()
            return
