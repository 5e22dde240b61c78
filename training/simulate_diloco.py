"""The DiLoCo modes of :func:`training.simulate.simulate` ("diloco", "diloco_x"): M replicas, one
:class:`~training.stage_engine.StageEngine` per stage each, contributions exchanged in memory.

Each outer round runs the actions :func:`training.schedule.round_actions` gives, in the node's order
(train, encode, apply the round the delay held back), then records what the round cost and did.
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
from training.data import Corpus
from training.errors import TrainingError
from training.hashing import weights_root
from training.inner_optimizers import begin_round
from training.pipeline import LocalReplicaTrainer
from training.schedule import (
    APPLY,
    ENCODE,
    TRAIN,
    RoundAction,
    inner_lr,
    round_actions,
    set_lr,
    takes_another_step,
    trainer_optimizers,
)
from training.screening import (
    decode_full,
    model_loss_fn,
    screen_contributions,
    screening_batch,
    screening_exclusions,
    screening_steps,
)
from training.simulate_records import RoundRecord, Tamper, now
from training.stage_engine import StageEngine

logger = logging.getLogger(__name__)


def global_state(engines: list[StageEngine]) -> dict[str, torch.Tensor]:
    """One replica's global weights, every stage merged."""
    merged: dict[str, torch.Tensor] = {}
    for engine in engines:
        merged.update(engine.global_weights)
    return merged


def global_root(engines: list[StageEngine]) -> bytes:
    """The root of one replica's stage weights hashes."""
    return weights_root([engine.weights_hash() for engine in engines])


@dataclass
class RoundTally:
    """What one outer round of the simulation measured so far, per replica."""

    replicas: int
    num_stages: int
    train_seconds: list[float] = field(default_factory=list)
    codec_seconds: list[float] = field(default_factory=list)
    outer_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    contributions: list[list[bytes]] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)
    raw: list[int] = field(default_factory=list)
    tensor_stats: list[dict] = field(default_factory=list)
    applied: list[dict] = field(default_factory=list)
    # wall seconds of this round's inner steps (the budget's clock)
    elapsed: list[float] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.train_seconds = [0.0] * self.replicas
        self.codec_seconds = [0.0] * self.replicas
        self.outer_seconds = [0.0] * self.replicas
        self.contributions = [[] for _ in range(self.num_stages)]
        self.sent = [0] * self.replicas
        self.raw = [0] * self.replicas
        self.elapsed = [0.0] * self.replicas
        self.trained = [0] * self.replicas


class DilocoSimulation:
    """DiLoCo's Algorithm 1 with DiLoCoX's delay over M in-memory replicas (:mod:`training.simulate`)."""

    def __init__(self, initial: dict[str, torch.Tensor], batches: Callable[[int, int], list], held_out: list,
                 model_cfg: ModelConfig, training_cfg: TrainingConfig, diloco_cfg: DilocoConfig,
                 compression_cfg: CompressionConfig, pipeline_cfg: PipelineConfig, outer_rounds: int,
                 eval_every: int, corpus: Corpus, tamper: Tamper | None) -> None:
        self.batches, self.held_out, self.corpus, self.tamper = batches, held_out, corpus, tamper
        self.model_cfg, self.training_cfg, self.diloco_cfg = model_cfg, training_cfg, diloco_cfg
        self.compression_cfg, self.num_stages = compression_cfg, pipeline_cfg.num_stages
        self.outer_rounds, self.eval_every = outer_rounds, eval_every
        self.replicas = diloco_cfg.num_replicas
        self.trainers = [
            LocalReplicaTrainer(model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial)
            for _ in range(self.replicas)
        ]
        self.engines = [
            [
                StageEngine(spec.index, dict(module.named_parameters()), diloco_cfg, compression_cfg,
                            exact=training_cfg.codec_kernels)
                for spec, module in zip(trainer.specs, trainer.stage_modules)
            ]
            for trainer in self.trainers
        ]
        self.evaluator = LocalReplicaTrainer(
            model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial
        )
        # round -> per stage, the contributions not applied yet
        self.exchanged: dict[int, list[list[bytes]]] = {}
        self.records: list[RoundRecord] = []

    def run(self) -> tuple[list[RoundRecord], str, float | None]:
        """Every round: ``(records, hex root of the final global weights, final held-out loss)``."""
        for outer_round in range(self.outer_rounds):
            self.records.append(self.round(outer_round))
            logger.info(
                "%s round %d: train %.4f eval %s ratio %.1f",
                "diloco_x" if self.diloco_cfg.one_step_delay or self.compression_cfg.enabled else "diloco",
                outer_round, self.records[-1].train_loss, self.records[-1].eval_loss,
                self.records[-1].compression_ratio,
            )
        return self.records, global_root(self.engines[0]).hex(), self.records[-1].eval_loss

    def round(self, outer_round: int) -> RoundRecord:
        """One outer round: the round's actions in the order the node runs them (training/schedule.py)."""
        tally = RoundTally(self.replicas, self.num_stages)
        for action in round_actions(self.diloco_cfg, outer_round, last=outer_round == self.outer_rounds - 1):
            if action.kind == TRAIN:
                self.train_all(outer_round, action, tally)
            elif action.kind == ENCODE:
                self.encode_all(outer_round, tally)
            elif action.kind == APPLY:
                screening, aggregation = self.apply(
                    action.outer_round, self.exchanged.pop(action.outer_round), tally.outer_seconds
                )
                tally.applied.append({"outer_round": action.outer_round, "screening": screening,
                                      "aggregation": aggregation})
        return self.record(outer_round, tally)

    def train_all(self, outer_round: int, action: RoundAction, tally: RoundTally) -> None:
        """The action's inner steps per replica (one after the other here, in parallel in reality)."""
        for replica in range(self.replicas):
            started = now()
            done = self.train(replica, outer_round, action.first_step, action.end_step, tally.elapsed)
            tally.train_seconds[replica] += now() - started
            tally.losses.extend(done)
            tally.trained[replica] += len(done)

    def train(self, replica: int, outer_round: int, first_step: int, end_step: int,
              elapsed: list[float]) -> list[float]:
        """Inner steps ``first_step <= k < end_step``; in a time-bounded run only while
        :func:`takes_another_step` says so (``elapsed[replica]``: this round's inner-step wall seconds)."""
        steps = self.diloco_cfg.inner_steps
        trainer = self.trainers[replica]
        optimizers = trainer_optimizers(trainer)
        if first_step == 0:
            begin_round(optimizers, self.training_cfg)  # training.inner_state = "fresh": a new optimizer
        losses = []
        for step, (x, y) in enumerate(
            self.batches(replica, outer_round)[first_step:end_step], start=first_step
        ):
            if not takes_another_step(self.diloco_cfg, step, elapsed[replica]):
                break
            started = time.perf_counter()
            set_lr(
                optimizers, inner_lr(self.training_cfg, outer_round * steps + step, self.outer_rounds * steps)
            )
            losses.append(trainer.train_step(x, y))
            elapsed[replica] += time.perf_counter() - started
        return losses

    def encode_all(self, outer_round: int, tally: RoundTally) -> None:
        """Every replica encodes every stage; ``tamper`` may replace what they send."""
        for replica in range(self.replicas):
            for stage, engine in enumerate(self.engines[replica]):
                started = now()
                blob, stats = engine.encode_contribution(
                    outer_round, tally.trained[replica] if self.diloco_cfg.budgeted else None)
                tally.codec_seconds[replica] += now() - started
                tally.contributions[stage].append(blob)
                tally.sent[replica] += len(blob)
                tally.raw[replica] += stats.raw_bytes
                if replica == 0:
                    tally.tensor_stats.extend(dataclasses.asdict(t) for t in stats.tensors)
        if self.tamper is not None:
            tally.contributions = [self.tamper(outer_round, stage, list(blobs))
                                   for stage, blobs in enumerate(tally.contributions)]
        self.exchanged[outer_round] = tally.contributions

    def screen(self, outer_round: int, contributions: list[list[bytes]]) -> tuple[dict[int, str], list[dict]]:
        """Screening of round ``outer_round`` (every replica would compute the same; done once)."""
        diloco_cfg = self.diloco_cfg
        if not diloco_cfg.screening:
            return {}, []
        shapes = [engine.shapes for engine in self.engines[0]]
        decoded = [
            decode_full([contributions[stage][replica] for stage in range(len(contributions))], shapes,
                        outer_round=outer_round, refuse_raw=self.compression_cfg.enabled)
            for replica in range(len(contributions[0]))
        ]
        x, y = screening_batch(self.corpus, self.training_cfg.seed, outer_round, diloco_cfg.screen_batch_size,
                               self.model_cfg.block_size)
        declared = screening_steps(
            diloco_cfg,
            [
                [contributions[stage][replica] for stage in range(len(contributions))]
                for replica in range(len(contributions[0]))
            ],
        )
        reports = screen_contributions(
            model_loss_fn(self.model_cfg, x, y), global_state(self.engines[0]), decoded, diloco_cfg, declared
        )
        return screening_exclusions(reports), [r.to_dict() for r in reports]

    def apply(self, outer_round: int, contributions: list[list[bytes]],
              outer_seconds: list[float]) -> tuple[list, list]:
        """Every replica applies round ``outer_round``; all must reach the same global weights."""
        excluded, screening = self.screen(outer_round, contributions)
        hashes, reports = set(), []
        for replica in range(self.replicas):
            started = now()
            results = [
                self.engines[replica][stage].apply_round(outer_round, contributions[stage], excluded=excluded)
                for stage in range(len(contributions))
            ]
            outer_seconds[replica] += now() - started
            hashes.add(b"".join(r.weights_hash for r in results))
            reports = [[c.to_dict() for c in r.contributions] for r in results]
        if len(hashes) != 1:
            raise TrainingError(f"round {outer_round}: replicas disagree on the global weights")
        return screening, reports

    def record(self, outer_round: int, tally: RoundTally) -> RoundRecord:
        """The round's record, with the held-out loss of the global weights every ``eval_every`` rounds."""
        replicas = self.replicas
        evaluate = (outer_round + 1) % self.eval_every == 0 or outer_round == self.outer_rounds - 1
        eval_loss = None
        if evaluate and self.engines[0][0].last_applied >= 0:
            self.evaluator.load_state_dict(global_state(self.engines[0]))
            eval_loss = self.evaluator.eval_loss(self.held_out)
        return RoundRecord(
            outer_round=outer_round,
            train_loss=sum(tally.losses) / len(tally.losses),
            eval_loss=eval_loss,
            bytes_sent_per_replica=sum(tally.sent) / replicas,
            raw_bytes_per_replica=sum(tally.raw) / replicas,
            compression_ratio=sum(tally.raw) / sum(tally.sent),
            train_seconds=sum(tally.train_seconds) / replicas,
            codec_seconds=sum(tally.codec_seconds) / replicas,
            outer_seconds=sum(tally.outer_seconds) / replicas,
            weights_root=global_root(self.engines[0]).hex(),
            tensors=tally.tensor_stats,
            applied=tally.applied,
            declared_steps=list(tally.trained) if self.diloco_cfg.budgeted else [],
        )
