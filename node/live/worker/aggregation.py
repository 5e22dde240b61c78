"""Aggregating a stage's round on the worker: the screen, the outer step, the sliced exchange's slices
and partials (ReplicaWorker's)."""

from __future__ import annotations

import logging

import torch

from training.butterfly import SliceAggregate, aggregate_slice, average_of_partials
from training.diloco import aggregate_with_report, step_with_average
from training.screening import (
    decode_full,
    model_loss_fn,
    screen_contributions,
    screening_batch,
    screening_exclusions,
    screening_steps,
)
from training.stage_engine import RoundResult

logger = logging.getLogger(__name__)


class StageAggregation:
    """A worker\'s aggregation of its stages (see the module docstring)."""

    @property
    def screens(self) -> bool:
        """Whether rounds are screened (docs/DILOCOX.md section 10): a run of one stage, so that every
        holder evaluates whole-model losses; otherwise only the norm rule applies, the same at every node."""
        return self.cfg.diloco.screening and self.cfg.pipeline.num_stages == 1

    def screen(self, outer_round: int, contributions: list[bytes],
               global_weights: dict[str, torch.Tensor] | None = None) -> tuple[dict[int, str], list]:
        """(excluded index -> reason, reports) of screening ``outer_round``'s contributions; ({}, []) if off.

        ``global_weights``: the state screened against (default: the engine's current one)."""
        if not self.screens:
            return {}, []
        engine = self.engines[0]
        x, y = screening_batch(self.corpus, self.cfg.training.seed, outer_round,
                               self.cfg.diloco.screen_batch_size, self.cfg.model.block_size)
        base = engine.global_weights if global_weights is None else global_weights
        steps = screening_steps(self.cfg.diloco, [[b] for b in contributions])
        refuse_raw = self.cfg.compression.enabled
        on_ranks = getattr(engine, "screen_on_ranks", None)
        if on_ranks is not None:  # a cluster: the weights stay on its ranks (training/cluster_screen.py)
            reports = on_ranks(outer_round, contributions, base, (x, y), self.cfg.model, steps,
                               refuse_raw=refuse_raw)
            return screening_exclusions(reports), reports
        decoded = [decode_full([blob], [engine.shapes], outer_round=outer_round, refuse_raw=refuse_raw)
                   for blob in contributions]
        reports = screen_contributions(model_loss_fn(self.cfg.model, x, y), base, decoded, self.cfg.diloco,
                                       steps)
        return screening_exclusions(reports), reports

    def prepare_aggregation(self, stage: int, outer_round: int, contributions: list[bytes],
                            excluded: dict[int, str] | None = None):
        """The pure part of :meth:`apply` (decode, average, outer step, hash), computable while the next
        round trains (:meth:`training.stage_engine.StageEngine.prepare_aggregation`)."""
        return self.engines[stage].prepare_aggregation(outer_round, contributions, excluded=excluded)

    def prepared_valid(self, stage: int, prepared, outer_round: int) -> bool:
        return self.engines[stage].prepared_valid(prepared, outer_round)

    def apply(self, stage: int, outer_round: int, contributions: list[bytes],
              excluded: dict[int, str] | None = None, prepared=None) -> RoundResult:
        """Aggregate ``outer_round`` of ``stage`` (canonical order) without the ``excluded`` indices.

        Contributions that fail to decode or break the run's codec are left out, the
        rest clipped by the norm rule (:mod:`training.robust`). A round this node encoded
        goes through the engine's outer step with the one-step-delay correction; a round
        it did not encode (it joined late or sat the round out) is absorbed, local
        progress kept (:meth:`training.stage_engine.StageEngine.finish_round`).
        """
        return self.engines[stage].finish_round(outer_round, contributions, excluded=excluded,
                                                prepared=prepared)

    # -- a re-base on the run's record (node/live/record/forkrepair.py) ---------------------------
    def derive(self, stage: int, outer_round: int, base: tuple[dict, dict], contributions: list[bytes],
               others: dict[int, tuple[str, str]] | None = None):
        """The :class:`training.diloco.Aggregation` of ``contributions`` (the round's canonical order) on
        ``base`` (the global weights and momentum before the round): what every holder that aggregated
        that set computed, screening included, and without ``others`` (built on another result of the
        round before: node.binding.other_result_exclusions). Pure: neither ``base`` nor the engine changes."""
        excluded, _reports = self.screen(outer_round, contributions, global_weights=base[0])
        excluded.update(others or {})
        on_ranks = getattr(self.engines[stage], "aggregate_on_ranks", None)
        if on_ranks is not None:  # a cluster: its kept base's shards aggregated on its ranks
            return on_ranks(outer_round, base, contributions, excluded)
        return aggregate_with_report(base[0], base[1], contributions, self.cfg.diloco, stage_index=stage,
                                     outer_round=outer_round, compression_cfg=self.cfg.compression,
                                     excluded=excluded)

    def move_global(self, stage: int, weights: dict[str, torch.Tensor],
                    momentum: dict[str, torch.Tensor]) -> None:
        """Take another global state of the last applied round, local progress kept
        (StageEngine.move_global)."""
        self.engines[stage].move_global(weights, momentum)

    # -- the sliced exchange (docs/PROTOCOL.md, "Sliced exchange") ------------------------
    def last_slices(self, stage: int) -> list[bytes]:
        """The slice blobs of the contribution :meth:`encode` just made (sliced exchange)."""
        return list(self.engines[stage].compressor.last_slices)

    def aggregate_slice(self, stage: int, outer_round: int, slice_index: int,
                        blobs: list[bytes | None]) -> SliceAggregate:
        """Aggregator's work on one slice: :func:`training.butterfly.aggregate_slice` (pure, replayable)."""
        return aggregate_slice(blobs, self.plans[stage], slice_index, self.cfg.compression,
                               self.engines[stage].compressor.bandwidth_budget,
                               norm_clip=self.cfg.diloco.norm_clip, stage_index=stage,
                               outer_round=outer_round, steps_range=self.cfg.diloco.steps_range)

    def apply_partials(self, stage: int, outer_round: int, partials: list[bytes]) -> RoundResult:
        """The outer step of ``outer_round`` on the average assembled from the A partial blobs."""
        engine = self.engines[stage]
        average = average_of_partials(partials, self.plans[stage], stage_index=stage, outer_round=outer_round,
                                      refuse_raw=self.cfg.compression.enabled)
        aggregation = step_with_average(engine.global_weights, engine.momentum, average, self.cfg.diloco,
                                        outer_round)
        return engine.finish_round(outer_round, [], aggregation=aggregation)

    def contribution_dropped(self, stage: int, outer_round: int) -> None:
        """This node's contribution of ``outer_round`` was not aggregated: send its update again later."""
        if self.engines[stage].contribution_dropped(outer_round):
            logger.info("round %d stage %d: our contribution was not in the close; its update goes back into "
                        "the error-feedback residual", outer_round, stage)
