"""Simulation mode: M replicas x S stages on one machine, contributions exchanged in memory.

Three modes, same model, same data, same seeds, same tokens per replica:

``"ddp"``
    The centralized baseline: AdamW on the gradient averaged over the M
    replicas every step (what DDP's AllReduce computes). Because the M
    per-replica batches have equal size and every replica holds the same
    weights, the averaged gradient equals the gradient of the mean loss over
    the concatenation of the M batches, so one :class:`LocalReplicaTrainer` on
    the concatenated batch is exactly DDP (gradient clipping included, since
    DDP clips after the AllReduce). Wire bytes per replica and step are those
    of a ring AllReduce of float32 gradients: ``2 (M-1)/M * 4 * num_params``.
``"diloco"``
    Synchronous DiLoCo (arXiv 2311.08105): H inner AdamW steps, pseudo-gradients
    exchanged uncompressed (float32, ``raw`` codec), outer Nesterov step, no
    delay. Forces ``one_step_delay=False`` and ``compression.enabled=False``.
``"diloco_x"``
    DiLoCoX (arXiv 2506.21263): as configured (by default one-step delay and
    adaptive compression with error feedback).

Wire bytes per replica for the DiLoCo modes: the sum over stages of the encoded
contribution sizes it sends each round (what a replica uploads; receiving the
others' contributions is not counted, as for the AllReduce figure, which is
the bytes each replica sends).

The loop of :func:`simulate` is DiLoCo's Algorithm 1 with DiLoCoX's delay;
every replica keeps one :class:`~training.stage_engine.StageEngine` per stage.

Byzantine members (issue 12): ``tamper(outer_round, stage, contributions)``
may replace what replicas send before the round is applied (an attacker
replica trains honestly and sends something else; ``bench/bench_robust_sim.py``).
The simulation holds the whole model, like a one-node cluster, so with
``diloco.screening`` every round is screened (:mod:`training.screening`) before
the robust aggregation (:mod:`training.robust`); each round's record keeps what
happened to every contribution.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig

from training.config_compression import CompressionConfig
from training.data import Corpus, eval_batches, round_batches
from training.screening import (
    decode_full,
    model_loss_fn,
    screen_contributions,
    screening_batch,
    screening_exclusions,
    screening_steps,
)
from training.errors import TrainingError
from training.hashing import stage_weights_hash, weights_root
from training.model import count_params, init_state_dict
from training.pipeline import LocalReplicaTrainer
from training.schedule import (
    APPLY,
    ENCODE,
    TRAIN,
    inner_lr,
    round_actions,
    set_lr,
    takes_another_step,
    trainer_optimizers,
)
from training.stage_engine import StageEngine

logger = logging.getLogger(__name__)

# What the per-round timings measure. Wall time by default; a benchmark on a shared machine
# sets time.process_time (with one torch thread, the CPU seconds of each phase), so other
# jobs' load does not distort the codec's share of a round (bench_diloco.py --cpu-clock).
_clock: Callable[[], float] = time.perf_counter


def set_clock(clock: Callable[[], float]) -> None:
    """Use ``clock`` for the timings of later :func:`simulate` calls (module-level: one benchmark per process)."""
    global _clock
    _clock = clock

MODES = ("ddp", "diloco", "diloco_x")

# (outer_round, stage, contributions in replica order) -> what the replicas actually send.
Tamper = Callable[[int, int, list[bytes]], list[bytes]]


@dataclass
class RoundRecord:
    """One outer round (H inner steps) of a simulation."""

    outer_round: int
    train_loss: float  # mean inner-step loss over replicas and steps
    eval_loss: float | None  # held-out loss of the current global weights
    bytes_sent_per_replica: float  # this round, averaged over replicas
    raw_bytes_per_replica: float  # float32 size of what was compressed (0 for ddp)
    compression_ratio: float  # raw / encoded (1 for diloco, 0 for ddp)
    train_seconds: float  # inner steps, per replica (mean)
    codec_seconds: float  # encode, per replica (mean)
    outer_seconds: float  # decode + average + outer step + correction, per replica (mean)
    weights_root: str = ""  # hex root of the global weights after the last applied round
    tensors: list[dict] = field(default_factory=list)  # codec choices of replica 0 (diloco_x)
    # The rounds applied during this one (they lag by one with the delay), each
    # {"outer_round", "screening": [ScreeningReport], "aggregation": [per stage [ContributionReport]]} as dicts.
    applied: list[dict] = field(default_factory=list)
    # A time-bounded run's (diloco.round_budget_s): the inner steps each replica trained and declared.
    declared_steps: list[int] = field(default_factory=list)


@dataclass
class SimulationResult:
    mode: str
    num_replicas: int
    num_stages: int
    inner_steps: int
    outer_rounds: int
    num_params: int
    tokens_per_replica: int
    rounds: list[RoundRecord]
    final_eval_loss: float
    final_weights_root: str

    @property
    def bytes_per_replica(self) -> float:
        return sum(r.bytes_sent_per_replica for r in self.rounds)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_replica / self.tokens_per_replica

    @property
    def codec_outer_share(self) -> float:
        """(encode + outer step) / (inner steps + encode + outer step), over the run."""
        sync = sum(r.codec_seconds + r.outer_seconds for r in self.rounds)
        total = sync + sum(r.train_seconds for r in self.rounds)
        return sync / total if total else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            bytes_per_replica=self.bytes_per_replica,
            bytes_per_token=self.bytes_per_token,
            codec_outer_share=self.codec_outer_share,
        )
        return out


def mode_configs(
    mode: str, diloco_cfg: DilocoConfig, compression_cfg: CompressionConfig
) -> tuple[DilocoConfig, CompressionConfig]:
    """The DiLoCo and compression configs a mode actually runs with."""
    if mode not in MODES:
        raise TrainingError(f"simulation mode {mode!r}: must be one of {MODES}")
    if mode == "diloco":
        return (
            dataclasses.replace(diloco_cfg, one_step_delay=False),
            dataclasses.replace(compression_cfg, enabled=False),
        )
    return diloco_cfg, compression_cfg


def _global_state(engines: list[StageEngine]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for engine in engines:
        merged.update(engine.global_weights)
    return merged


def _global_root(engines: list[StageEngine]) -> bytes:
    return weights_root([engine.weights_hash() for engine in engines])


def simulate(
    mode: str,
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    compression_cfg: CompressionConfig,
    pipeline_cfg: PipelineConfig,
    outer_rounds: int,
    *,
    eval_every: int = 1,
    num_eval_batches: int | None = None,
    tamper: Tamper | None = None,
) -> SimulationResult:
    """Run ``outer_rounds`` rounds of H = ``diloco_cfg.inner_steps`` steps of ``mode``.

    M = ``diloco_cfg.num_replicas``, S = ``pipeline_cfg.num_stages``; all
    replicas start from ``init_state_dict(model_cfg, training_cfg.seed)``;
    replica r trains in round t on ``round_batches(corpus, seed, r, t, ...)``.
    Held-out loss is measured on the global weights every ``eval_every`` rounds
    and after the last one. ``tamper`` (DiLoCo modes) replaces what the
    replicas send (module docstring).
    """
    if outer_rounds < 1:
        raise TrainingError(f"outer_rounds={outer_rounds}: must be >= 1")
    diloco_cfg, compression_cfg = mode_configs(mode, diloco_cfg, compression_cfg)
    replicas = diloco_cfg.num_replicas
    steps = diloco_cfg.inner_steps
    held_out = eval_batches(
        corpus, num_eval_batches or training_cfg.eval_batches, training_cfg.batch_size, model_cfg.block_size
    )
    initial = init_state_dict(model_cfg, training_cfg.seed)
    tokens_per_round = steps * training_cfg.batch_size * model_cfg.block_size

    def batches(replica: int, outer_round: int):
        return round_batches(
            corpus, training_cfg.seed, replica, outer_round, steps, training_cfg.batch_size, model_cfg.block_size
        )

    if mode == "ddp":
        rounds, trainer_root, final_loss = _simulate_ddp(
            initial, batches, held_out, model_cfg, training_cfg, pipeline_cfg, replicas, outer_rounds, eval_every
        )
    else:
        rounds, trainer_root, final_loss = _simulate_diloco(
            initial, batches, held_out, model_cfg, training_cfg, diloco_cfg, compression_cfg,
            pipeline_cfg, outer_rounds, eval_every, corpus, tamper,
        )
    return SimulationResult(
        mode=mode,
        num_replicas=replicas,
        num_stages=pipeline_cfg.num_stages,
        inner_steps=steps,
        outer_rounds=outer_rounds,
        num_params=count_params(model_cfg),
        tokens_per_replica=tokens_per_round * outer_rounds,
        rounds=rounds,
        final_eval_loss=final_loss,
        final_weights_root=trainer_root,
    )


def _simulate_ddp(initial, batches, held_out, model_cfg, training_cfg, pipeline_cfg, replicas, outer_rounds, eval_every):
    trainer = LocalReplicaTrainer(model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial)
    num_params = count_params(model_cfg)
    allreduce_bytes = 2 * (replicas - 1) / replicas * 4 * num_params
    records: list[RoundRecord] = []
    for outer_round in range(outer_rounds):
        per_replica = [batches(replica, outer_round) for replica in range(replicas)]
        started = _clock()
        losses = []
        steps = len(per_replica[0])
        for step in range(steps):
            set_lr(trainer.optimizers, inner_lr(training_cfg, outer_round * steps + step, outer_rounds * steps))
            x = torch.cat([per_replica[r][step][0] for r in range(replicas)])
            y = torch.cat([per_replica[r][step][1] for r in range(replicas)])
            losses.append(trainer.train_step(x, y))
        elapsed = _clock() - started
        evaluate = (outer_round + 1) % eval_every == 0 or outer_round == outer_rounds - 1
        records.append(
            RoundRecord(
                outer_round=outer_round,
                train_loss=sum(losses) / len(losses),
                eval_loss=trainer.eval_loss(held_out) if evaluate else None,
                bytes_sent_per_replica=allreduce_bytes * len(losses),
                raw_bytes_per_replica=0.0,
                compression_ratio=0.0,
                # One process did the work of M replicas; each replica's share is 1/M of it.
                train_seconds=elapsed / replicas,
                codec_seconds=0.0,
                outer_seconds=0.0,
            )
        )
        logger.info("ddp round %d: train %.4f eval %s", outer_round, records[-1].train_loss, records[-1].eval_loss)
    root = weights_root([stage_weights_hash(m.state_dict()) for m in trainer.stage_modules]).hex()
    return records, root, records[-1].eval_loss


def _simulate_diloco(
    initial, batches, held_out, model_cfg, training_cfg, diloco_cfg, compression_cfg, pipeline_cfg,
    outer_rounds, eval_every, corpus, tamper,
):
    replicas = diloco_cfg.num_replicas
    trainers = [
        LocalReplicaTrainer(model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial)
        for _ in range(replicas)
    ]
    engines = [
        [
            StageEngine(spec.index, dict(module.named_parameters()), diloco_cfg, compression_cfg)
            for spec, module in zip(trainer.specs, trainer.stage_modules)
        ]
        for trainer in trainers
    ]
    evaluator = LocalReplicaTrainer(model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial)
    delayed = diloco_cfg.one_step_delay
    exchanged: dict[int, list[list[bytes]]] = {}  # round -> per stage, the contributions not applied yet
    records: list[RoundRecord] = []

    def screen(outer_round: int, contributions: list[list[bytes]]) -> tuple[dict[int, str], list[dict]]:
        """Screening of round ``outer_round`` (every replica would compute the same; done once)."""
        if not diloco_cfg.screening:
            return {}, []
        shapes = [engine.shapes for engine in engines[0]]
        decoded = [
            decode_full([contributions[stage][replica] for stage in range(len(contributions))], shapes,
                        outer_round=outer_round, refuse_raw=compression_cfg.enabled)
            for replica in range(len(contributions[0]))
        ]
        x, y = screening_batch(corpus, training_cfg.seed, outer_round, diloco_cfg.screen_batch_size,
                               model_cfg.block_size)
        declared = screening_steps(diloco_cfg, [[contributions[stage][replica] for stage in range(len(contributions))]
                                                for replica in range(len(contributions[0]))])
        reports = screen_contributions(model_loss_fn(model_cfg, x, y), _global_state(engines[0]), decoded, diloco_cfg,
                                       declared)
        return screening_exclusions(reports), [r.to_dict() for r in reports]

    def apply(outer_round: int, contributions: list[list[bytes]], outer_seconds: list[float]) -> tuple[list, list]:
        """Every replica applies round ``outer_round``; all must reach the same global weights."""
        excluded, screening = screen(outer_round, contributions)
        hashes, reports = set(), []
        for replica in range(replicas):
            started = _clock()
            results = [
                engines[replica][stage].apply_round(outer_round, contributions[stage], excluded=excluded)
                for stage in range(len(contributions))
            ]
            outer_seconds[replica] += _clock() - started
            hashes.add(b"".join(r.weights_hash for r in results))
            reports = [[c.to_dict() for c in r.contributions] for r in results]
        if len(hashes) != 1:
            raise TrainingError(f"round {outer_round}: replicas disagree on the global weights")
        return screening, reports

    steps = diloco_cfg.inner_steps

    def train(replica: int, outer_round: int, first_step: int, end_step: int, elapsed: list[float]) -> list[float]:
        """Inner steps ``first_step <= k < end_step``; in a time-bounded run only while
        :func:`takes_another_step` says so (``elapsed[replica]``: this round's inner-step wall seconds)."""
        trainer = trainers[replica]
        optimizers = trainer_optimizers(trainer)
        losses = []
        for step, (x, y) in enumerate(batches(replica, outer_round)[first_step:end_step], start=first_step):
            if not takes_another_step(diloco_cfg, step, elapsed[replica]):
                break
            started = time.perf_counter()
            set_lr(optimizers, inner_lr(training_cfg, outer_round * steps + step, outer_rounds * steps))
            losses.append(trainer.train_step(x, y))
            elapsed[replica] += time.perf_counter() - started
        return losses

    for outer_round in range(outer_rounds):
        train_seconds = [0.0] * replicas
        codec_seconds = [0.0] * replicas
        outer_seconds = [0.0] * replicas
        losses = []
        contributions: list[list[bytes]] = [[] for _ in range(pipeline_cfg.num_stages)]
        sent = [0] * replicas
        raw = [0] * replicas
        tensor_stats: list[dict] = []
        applied: list[dict] = []
        elapsed = [0.0] * replicas  # wall seconds of this round's inner steps, per replica (the budget's clock)
        trained = [0] * replicas
        # The round's actions in the order the node runs them (training/schedule.py).
        for action in round_actions(diloco_cfg, outer_round, last=outer_round == outer_rounds - 1):
            if action.kind == TRAIN:
                # H inner steps per replica (one after the other here, in parallel in reality).
                for replica in range(replicas):
                    started = _clock()
                    done = train(replica, outer_round, action.first_step, action.end_step, elapsed)
                    train_seconds[replica] += _clock() - started
                    losses.extend(done)
                    trained[replica] += len(done)
            elif action.kind == ENCODE:
                for replica in range(replicas):
                    for stage, engine in enumerate(engines[replica]):
                        started = _clock()
                        blob, stats = engine.encode_contribution(
                            outer_round, trained[replica] if diloco_cfg.budgeted else None)
                        codec_seconds[replica] += _clock() - started
                        contributions[stage].append(blob)
                        sent[replica] += len(blob)
                        raw[replica] += stats.raw_bytes
                        if replica == 0:
                            tensor_stats.extend(dataclasses.asdict(t) for t in stats.tensors)
                if tamper is not None:
                    contributions = [tamper(outer_round, stage, list(blobs)) for stage, blobs in enumerate(contributions)]
                exchanged[outer_round] = contributions
            elif action.kind == APPLY:
                screening, aggregation = apply(action.outer_round, exchanged.pop(action.outer_round), outer_seconds)
                applied.append({"outer_round": action.outer_round, "screening": screening, "aggregation": aggregation})
        evaluate = (outer_round + 1) % eval_every == 0 or outer_round == outer_rounds - 1
        eval_loss = None
        if evaluate and engines[0][0].last_applied >= 0:
            evaluator.load_state_dict(_global_state(engines[0]))
            eval_loss = evaluator.eval_loss(held_out)
        records.append(
            RoundRecord(
                outer_round=outer_round,
                train_loss=sum(losses) / len(losses),
                eval_loss=eval_loss,
                bytes_sent_per_replica=sum(sent) / replicas,
                raw_bytes_per_replica=sum(raw) / replicas,
                compression_ratio=sum(raw) / sum(sent),
                train_seconds=sum(train_seconds) / replicas,
                codec_seconds=sum(codec_seconds) / replicas,
                outer_seconds=sum(outer_seconds) / replicas,
                weights_root=_global_root(engines[0]).hex(),
                tensors=tensor_stats,
                applied=applied,
                declared_steps=list(trained) if diloco_cfg.budgeted else [],
            )
        )
        logger.info(
            "%s round %d: train %.4f eval %s ratio %.1f",
            "diloco_x" if delayed or compression_cfg.enabled else "diloco",
            outer_round, records[-1].train_loss, eval_loss, records[-1].compression_ratio,
        )
    return records, _global_root(engines[0]).hex(), records[-1].eval_loss


def centralized_reference(
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    pipeline_cfg: PipelineConfig,
    outer_rounds: int,
) -> float:
    """Held-out loss of the centralized baseline on the same tokens as a DiLoCoX run of ``outer_rounds``.

    DDP (one AdamW on the M replicas' concatenated batches, same inner-lr
    schedule over ``outer_rounds * H`` steps, same eval batches), i.e. the
    ``"ddp"`` mode of :func:`simulate`: what the demo prints beside its own
    held-out loss.
    """
    result = simulate(
        "ddp", corpus, model_cfg, training_cfg, diloco_cfg, CompressionConfig(enabled=False), pipeline_cfg,
        outer_rounds, eval_every=outer_rounds,
    )
    return result.final_eval_loss
