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

The loop of :func:`simulate` is DiLoCo's Algorithm 1 with DiLoCoX's delay
(:class:`training.simulate_diloco.DilocoSimulation`); every replica keeps one
:class:`~training.stage_engine.StageEngine` per stage. The records and the clock of the timings are
:mod:`training.simulate_records`.

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
from collections.abc import Callable

import torch

from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import Corpus, eval_batches, round_batches
from training.errors import TrainingError
from training.hashing import stage_weights_hash, weights_root
from training.model import count_params, init_state_dict
from training.pipeline import LocalReplicaTrainer
from training.schedule import (
    inner_lr,
    set_lr,
)
from training.simulate_diloco import DilocoSimulation
from training.simulate_records import RoundRecord, SimulationResult, Tamper, now

logger = logging.getLogger(__name__)

MODES = ("ddp", "diloco", "diloco_x")

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
    progress: Callable[[int, int], None] | None = None,
) -> SimulationResult:
    """Run ``outer_rounds`` rounds of H = ``diloco_cfg.inner_steps`` steps of ``mode``.

    M = ``diloco_cfg.num_replicas``, S = ``pipeline_cfg.num_stages``; all
    replicas start from ``init_state_dict(model_cfg, training_cfg.seed)``;
    replica r trains in round t on ``round_batches(corpus, seed, r, t, ...)``.
    Held-out loss is measured on the global weights every ``eval_every`` rounds
    and after the last one. ``tamper`` (DiLoCo modes) replaces what the
    replicas send (module docstring). ``progress(done, outer_rounds)`` (the DDP mode) is called after
    each round, for a caller that shows how far a long run has got.
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
            corpus,
            training_cfg.seed,
            replica,
            outer_round,
            steps,
            training_cfg.batch_size,
            model_cfg.block_size,
        )

    if mode == "ddp":
        rounds, trainer_root, final_loss = _simulate_ddp(
            initial,
            batches,
            held_out,
            model_cfg,
            training_cfg,
            pipeline_cfg,
            replicas,
            outer_rounds,
            eval_every,
            progress,
        )
    else:
        rounds, trainer_root, final_loss = DilocoSimulation(
            initial, batches, held_out, model_cfg, training_cfg, diloco_cfg, compression_cfg,
            pipeline_cfg, outer_rounds, eval_every, corpus, tamper,
        ).run()
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


def _simulate_ddp(
    initial, batches, held_out, model_cfg, training_cfg, pipeline_cfg, replicas, outer_rounds, eval_every,
    progress=None,
):
    trainer = LocalReplicaTrainer(model_cfg, training_cfg, pipeline_cfg.num_stages, state_dict=initial)
    num_params = count_params(model_cfg)
    allreduce_bytes = 2 * (replicas - 1) / replicas * 4 * num_params
    records: list[RoundRecord] = []
    for outer_round in range(outer_rounds):
        per_replica = [batches(replica, outer_round) for replica in range(replicas)]
        started = now()
        losses = []
        steps = len(per_replica[0])
        for step in range(steps):
            set_lr(
                trainer.optimizers, inner_lr(training_cfg, outer_round * steps + step, outer_rounds * steps)
            )
            x = torch.cat([per_replica[r][step][0] for r in range(replicas)])
            y = torch.cat([per_replica[r][step][1] for r in range(replicas)])
            losses.append(trainer.train_step(x, y))
        elapsed = now() - started
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
        logger.info(
            "ddp round %d: train %.4f eval %s", outer_round, records[-1].train_loss, records[-1].eval_loss
        )
        if progress is not None:
            progress(outer_round + 1, outer_rounds)
    root = weights_root([stage_weights_hash(m.state_dict()) for m in trainer.stage_modules]).hex()
    return records, root, records[-1].eval_loss


def centralized_reference(
    corpus: Corpus,
    model_cfg: ModelConfig,
    training_cfg: TrainingConfig,
    diloco_cfg: DilocoConfig,
    pipeline_cfg: PipelineConfig,
    outer_rounds: int,
    progress: Callable[[int, int], None] | None = None,
) -> float:
    """Held-out loss of the centralized baseline on the same tokens as a DiLoCoX run of ``outer_rounds``.

    DDP (one AdamW on the M replicas' concatenated batches, same inner-lr
    schedule over ``outer_rounds * H`` steps, same eval batches), i.e. the
    ``"ddp"`` mode of :func:`simulate`: what the demo prints beside its own
    held-out loss.
    """
    result = simulate(
        "ddp", corpus, model_cfg, training_cfg, diloco_cfg, CompressionConfig(enabled=False), pipeline_cfg,
        outer_rounds, eval_every=outer_rounds, progress=progress,
    )
    return result.final_eval_loss
