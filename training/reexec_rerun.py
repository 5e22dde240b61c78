"""Rerunning one replica's round from its start state (:mod:`training.reexec` describes the spot check)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from training.butterfly import average_of_partials
from training.compiled import compile_problem, forget_compiled
from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import Corpus, round_batches, windows_key
from training.diloco import step_with_average
from training.errors import ReexecError
from training.fingerprint import PlatformFingerprint
from training.inner_optimizers import begin_round
from training.platform import resolve_device
from training.replica_capture import capture_replica_state
from training.replica_restore import restore_replica
from training.replica_state import ReplicaStartState
from training.schedule import APPLY, ENCODE, TRAIN, inner_lr, round_actions, set_lr

logger = logging.getLogger(__name__)


@dataclass
class Reexecution:
    """What rerunning ``(replica, outer_round)`` produced."""

    outer_round: int
    replica: int
    payloads: dict[int, bytes]  # stage -> contribution bytes
    # start state of round t+1 (None if round t-1 was not applied); a consumed rerun's (``reexecute``'s
    # ``consume``) holds the rerun's live tensors, not copies: read it before anything trains on
    next_state: ReplicaStartState | None
    train_seconds: float
    encode_seconds: float
    threads: int
    platform: PlatformFingerprint | None = None  # where the rerun's inner steps ran
    # stage -> the stage hash of round t-1 the rerun applied before encoding (what an honest contribution
    # binds as ``applied_hash``); empty when the schedule applies nothing before the encode
    applied_hashes: dict[int, bytes] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.train_seconds + self.encode_seconds


def reexecute(
    state: ReplicaStartState,
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
    *,
    previous_contributions: Mapping[int, Sequence[bytes]] | None = None,
    previous_excluded: Mapping[int, Mapping[int, str]] | None = None,
    previous_dropped: Collection[int] = (),
    threads: int | None = None,
    previous_partials: Mapping[int, Sequence[bytes]] | None = None,
    declared_steps: int | None = None,
    processes: int = 1,
    consume: bool = False,
    data_key: bytes | None = None,
) -> Reexecution:
    """Rerun round ``state.meta.outer_round`` of ``state.meta.replica`` from ``state``
    (:mod:`training.reexec`'s module docstring).

    ``declared_steps``: in a run whose rounds are bounded by time (``diloco.round_budget_s``), the
    inner steps the contribution declares (required there): the rerun trains exactly that many and
    encodes them declared, so a contribution that declares more (or fewer) steps than it trained
    does not reproduce.

    ``previous_contributions``: stage -> the contributions of round t-1 in
    canonical order (what the round's apply(t-1) aggregated; public, archived by
    every node). Needed when the schedule applies round t-1 before encoding
    round t (lookahead, eager, ``overlap_steps > 0``) and to obtain the next
    start state; with the default "rebase" and no overlap it may be omitted and
    only the payloads come back. ``previous_excluded``: stage -> the canonical indices
    of round t-1 that screening left out (the sealed round's ``excluded``; the
    engine re-derives every other exclusion itself). ``previous_dropped``: the stages
    whose round t-1 close does not hold this replica's contribution (a straggler's:
    the node put its transmitted update back into the residual when it applied
    round t-1, and so does the rerun). ``threads``: intra-op threads for the rerun,
    default the claimant's (``state.meta.threads``), which makes it bit-exact.
    ``previous_partials``: in a sliced run (``diloco.exchange = "sliced"``), stage -> the A partial
    blobs of round t-1 in slice order (what every holder applied, docs/PROTOCOL.md "Sliced
    exchange"), in place of ``previous_contributions``.
    ``processes``: how many processes this verifier may run the inner steps on (its ``compute.processes``): a
    claim made by a cluster of N <= ``processes`` ranks (its fingerprint's ``cluster``) reruns its inner
    steps on N ranks of its own, bit for bit (training/cluster_rerun.py); any other in this process.
    ``consume``: the caller hands ``state``'s tensors over: the inner optimizer and the engines keep them
    (no copies) and each stage's are dropped from ``state`` once restored, and the next start state holds
    the rerun's live tensors rather than copies of them (a state is about 40 bytes per parameter of the
    replica; a verifier's rerun held it beside the copies it trains, and a copy of the next one at its end).
    The inner steps run on ``training_cfg.device`` (the verifier's) in the claimant's
    precision (``state.meta.platform``; float32 for a state that records none), compiled if the claimant's
    were (:func:`rerun_compiled`), whatever the verifier's own ``training.compile``.
    ``data_key``: in a run whose windows are keyed by account (``training.data_windows = "account"``), the
    replica's 20-byte key, the CONTRIBUTOR's (its first-stage member's account, named by the caller from the
    signed contributions, never the verifier's own); required there, unused otherwise.
    """
    meta = state.meta
    trained = _trained_steps(meta, diloco_cfg, declared_steps)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads or meta.threads)
    precision = meta.platform.precision if meta.platform is not None else "fp32"
    compiled = rerun_compiled(meta.platform, training_cfg.device)
    if compiled:
        forget_compiled()  # graphs compiled under another thread count (training/compiled.py)
    try:
        previous = PreviousRound(previous_contributions, previous_excluded, previous_dropped,
                                 previous_partials)
        key = windows_key(training_cfg, meta.replica, data_key)
        return _rerun(state, corpus, model_cfg, replace(training_cfg, precision=precision, compile=compiled),
                      diloco_cfg, compression_cfg, previous, trained, declared_steps, processes, consume, key)
    finally:
        torch.set_num_threads(previous_threads)
        if compiled:
            forget_compiled()


def _rerun(state: ReplicaStartState, corpus: Corpus, model_cfg: ModelConfig, training_cfg: TrainingConfig,
           diloco_cfg: DilocoConfig, compression_cfg: CompressionConfig, previous: PreviousRound,
           trained: int, declared_steps: int | None, processes: int = 1,
           consume: bool = False, key: int | bytes | None = None) -> Reexecution:
    """:func:`reexecute`'s round, its threads and compiler already set (``training_cfg``: with the
    claimant's precision; ``key``: the windows' key, default the replica index)."""
    from training.cluster_rerun import ClusterSteps, rerun_ranks

    meta = state.meta
    trainer, engines = restore_replica(state, model_cfg, training_cfg, diloco_cfg, compression_cfg,
                                       consume=consume)
    batches = round_batches(corpus, training_cfg.seed, meta.replica if key is None else key, meta.outer_round,
                            trained, training_cfg.batch_size, model_cfg.block_size)
    ranks = rerun_ranks(meta.platform, processes)
    steps = ClusterSteps(trainer, model_cfg, training_cfg, ranks, torch.get_num_threads()) if ranks > 1 \
        else None
    try:
        rerun = RoundRerun(meta, trainer, engines, batches, training_cfg, diloco_cfg, compression_cfg,
                           previous, declared_steps, steps=steps)
        for action in round_actions(diloco_cfg, meta.outer_round, steps=trained):
            rerun.run(action)
        next_state = None
        if rerun.applied_previous:
            if steps is not None:
                steps.sync_optimizer()
            # training.inner_state = "fresh": round t+1 starts from a new inner optimizer (the node clears it
            # before it captures that start state), so the next state holds none
            begin_round(trainer.optimizers, training_cfg)
            # A consumed rerun's next state is only hashed: the live tensors themselves, not copies (40
            # bytes per parameter of the replica); nothing changes them after the rerun.
            next_state = capture_replica_state(replace(meta, outer_round=meta.outer_round + 1), trainer,
                                               engines, copy=not consume)
        platform = (steps.platform if steps is not None else trainer.platform).fingerprint()
    finally:
        if steps is not None:
            steps.close()
    return Reexecution(meta.outer_round, meta.replica, rerun.payloads, next_state, rerun.train_seconds,
                       rerun.encode_seconds, torch.get_num_threads(), platform, rerun.applied_hashes)


def _trained_steps(meta, diloco_cfg: DilocoConfig, declared_steps: int | None) -> int:
    """The inner steps the rerun trains: H, or the count a time-bounded run's contribution declares (checked).
    """
    if meta.inner_steps != diloco_cfg.inner_steps:
        raise ReexecError(
            f"start state has H={meta.inner_steps}, the run's diloco.inner_steps={diloco_cfg.inner_steps}"
        )
    outer_round, steps = meta.outer_round, meta.inner_steps
    if diloco_cfg.budgeted:
        if declared_steps is None:
            raise ReexecError(
                f"round {outer_round}: a time-bounded run's rerun needs the declared inner steps"
            )
        try:
            diloco_cfg.check_declared_steps(declared_steps)
        except ValueError as exc:
            raise ReexecError(f"round {outer_round}: {exc}") from None
    elif declared_steps not in (None, steps):
        raise ReexecError(f"round {outer_round}: a fixed-H run trains H={steps} steps, not {declared_steps}")
    return declared_steps if declared_steps is not None else steps


@dataclass(frozen=True)
class PreviousRound:
    """What the rerun knows of round t-1 (:func:`reexecute`'s ``previous_*`` arguments)."""

    contributions: Mapping[int, Sequence[bytes]] | None
    excluded: Mapping[int, Mapping[int, str]] | None
    dropped: Collection[int]
    partials: Mapping[int, Sequence[bytes]] | None


class RoundRerun:
    """The actions of one rerun round, run as the node runs them (module docstring of :mod:`training.reexec`).
    """

    def __init__(
        self,
        meta,
        trainer,
        engines,
        batches,
        training_cfg: TrainingConfig,
        diloco_cfg: DilocoConfig,
        compression_cfg: CompressionConfig,
        previous: PreviousRound,
        declared_steps: int | None,
        steps=None,
    ) -> None:
        """``steps``: where the inner steps run when not on ``trainer`` (a cluster's rerun on its N ranks,
        :class:`training.cluster_rerun.ClusterSteps`)."""
        self.meta, self.trainer, self.engines, self.batches = meta, trainer, engines, batches
        self.steps = steps
        self.training_cfg, self.diloco_cfg, self.compression_cfg = training_cfg, diloco_cfg, compression_cfg
        self.previous, self.declared_steps = previous, declared_steps
        self.horizon = meta.lr_total_steps or None
        self.payloads: dict[int, bytes] = {}
        self.applied_hashes: dict[int, bytes] = {}
        self.train_seconds = self.encode_seconds = 0.0
        self.applied_previous = meta.outer_round == 0

    def run(self, action) -> None:
        started = time.perf_counter()
        if action.kind == TRAIN:
            self.train(action)
            self.train_seconds += time.perf_counter() - started
        elif action.kind == APPLY:
            if self.apply(action):
                self.encode_seconds += time.perf_counter() - started
        elif action.kind == ENCODE:
            for engine in self.engines:  # as node.live.worker.replica.ReplicaWorker.encode
                engine.skip_to(self.meta.outer_round)
                self.payloads[engine.stage_index], _ = engine.encode_contribution(self.meta.outer_round,
                                                                                  self.declared_steps)
            self.encode_seconds += time.perf_counter() - started

    def train(self, action) -> None:
        outer_round, steps = self.meta.outer_round, self.meta.inner_steps
        stepper = self.steps if self.steps is not None else self.trainer
        if action.first_step == 0 and begin_round(self.trainer.optimizers, self.training_cfg) \
                and self.steps is not None:
            self.steps.reset_inner_state()  # "fresh": whatever the start state holds, as the node's round
        with self.steps.session() if self.steps is not None else contextlib.nullcontext():
            for step in range(action.first_step, action.end_step):
                set_lr(stepper.optimizers,
                       inner_lr(self.training_cfg, outer_round * steps + step, self.horizon))
                x, y = self.batches[step]
                stepper.train_step(x, y, self.meta.micro_batches or 1)

    def apply(self, action) -> bool:
        """Apply round t-1 as the node did; False when there was nothing to apply (timed as nothing)."""
        outer_round, previous = self.meta.outer_round, self.previous
        if action.outer_round == outer_round:
            # No delay: round t itself is applied after its encode, from round t's close,
            # which the rerun is not given; the payloads are done, the next state unknown.
            self.applied_previous = False
            return False
        if previous.contributions is None and previous.partials is None:
            if not self.payloads:
                raise ReexecError(
                    f"round {outer_round}: the schedule applies round {outer_round - 1} before encoding; "
                    "pass previous_contributions"
                )
            return False
        for engine in self.engines:  # as node.live.node applies a round, then hears its own was left out
            if previous.partials is not None:  # as node.live.worker.replica.ReplicaWorker.apply_partials
                _apply_partials(engine, action.outer_round, previous.partials[engine.stage_index],
                                self.diloco_cfg, self.compression_cfg)
            else:
                engine.finish_round(action.outer_round, list(previous.contributions[engine.stage_index]),
                                    excluded=(previous.excluded or {}).get(engine.stage_index))
            if engine.stage_index in previous.dropped and engine.transmitted(action.outer_round):
                engine.contribution_dropped(action.outer_round)
            if not self.payloads:  # applied before the encode: the contribution binds this result
                self.applied_hashes[engine.stage_index] = engine.weights_hash()
        self.applied_previous = True
        return True


def rerun_compiled(claimed: PlatformFingerprint | None, device: str) -> bool:
    """Whether a rerun of a claim made on ``claimed`` runs its inner steps compiled: as the claimant did
    (``training.compile``, training/compiled.py). A compiled claim on a verifier that cannot compile for
    ``device`` is rerun eagerly: its fingerprint is then another platform's, and the rerun is judged as any
    other platform's (:func:`training.fingerprint.compare_rerun`), never bit-exactly."""
    if claimed is None or not claimed.compiled:
        return False
    problem = compile_problem(resolve_device(device).type)
    if problem is not None:
        logger.warning("a compiled claim (%s) is rerun eagerly here: %s", claimed.compiled, problem)
        return False
    return True


def _apply_partials(engine, outer_round: int, partials: Sequence[bytes], diloco_cfg: DilocoConfig,
                    compression_cfg: CompressionConfig) -> None:
    """The sliced exchange's apply of ``outer_round``: the average assembled from its partials, the outer
    step."""
    average = average_of_partials(list(partials), engine.compressor.plan, stage_index=engine.stage_index,
                                  outer_round=outer_round, refuse_raw=compression_cfg.enabled)
    aggregation = step_with_average(engine.global_weights, engine.momentum, average, diloco_cfg, outer_round)
    engine.finish_round(outer_round, [], aggregation=aggregation)
