"""The DiLoCoX state of one pipeline stage on one replica (arXiv 2506.21263; DiLoCo, arXiv 2311.08105).

:mod:`training.diloco` holds the outer loop's arithmetic (the average, the outer step, the
robust aggregation); :class:`StageEngine` is one replica's side of it: it forms the
pseudo-gradients, keeps the global weights, the outer momentum, the error-feedback
residuals and the local snapshots, and applies each round to the live parameters.

One-step-delay overlap (DiLoCoX, abstract: "one-step-delay overlap of
communication and local training"). Round t's pseudo-gradients are exchanged
while round t+1 already trains, so ``apply_round(t)`` runs after the inner steps
of round t+1. Let ``E_t`` be the local weights when round t ended (its
contribution was encoded) and ``L`` the local weights now. The correction is::

    theta_i <- theta^t + (L - E_t)

i.e. the progress made during round t+1 is kept and re-based on the new global
weights, as if round t+1 had started from ``theta^t``. Every other stored local
snapshot (the start of the current round, and ``E_{t+1}`` if round t+1 was
already encoded) is re-based the same way, ``X <- theta^t + (X - E_t)``.

Pseudo-gradient under the delay: ``Delta_i^{t+1} = (start of round t+1) - E_{t+1}``
measured in one consistent frame, i.e. exactly the local progress of round
t+1, whichever of ``encode_contribution(t+1)`` and ``apply_round(t)`` runs first.
After the re-basing the start of round t+1 is ``theta^t``, so
``Delta^{t+1}`` is relative to ``theta^t``, and ``theta^{t+1} =
OuterSGDNesterov(theta^t, Delta^{t+1})`` applies it to the weights it belongs
to. It was computed from a start that did not yet include round t's outer
step: that one-round staleness is the price of the overlap. Without the delay,
``apply_round(t)`` runs before round t+1 trains, ``L = E_t`` and the rule
reduces to DiLoCo's ``theta_i <- theta^t`` (done as a plain copy).

The variants (``diloco.delay_correction``: ``"rebase"``, the rule above, ``"lookahead"``, ``"eager"``,
``"reset"``) are :mod:`training.delay_correction`'s kinds, whose docstring writes each out.

The engine's other concerns live beside it: joining and catching up (:mod:`training.stage_engine_joining`),
its checkpoint state (:mod:`training.stage_engine_state`) and what a round returns
(:mod:`training.stage_results`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from training.compression import CompressionStats, ErrorFeedbackCompressor
from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.delay_correction import delay_correction_for
from training.diloco import (
    Aggregation,
    aggregate_unchecked,
    aggregate_with_report,
    outer_step,
    zero_outer_state,
)
from training.errors import EngineStateError, RoundOrderError
from training.hashing import stage_weights_hash
from training.host_tensors import Weights, host_float32_copy
from training.spilled import spill_float32
from training.stage_engine_joining import EngineJoining
from training.stage_engine_outer import EngineOuterState
from training.stage_engine_state import EngineState
from training.stage_results import PreparedAggregation, RoundResult

logger = logging.getLogger(__name__)



class StageEngine(EngineJoining, EngineState, EngineOuterState):
    """DiLoCoX state of one stage on one replica; no networking.

    ``params`` are the live parameters of the stage module (updated in place by
    the inner optimizer); the engine reads them to form pseudo-gradients and
    writes them when a round is applied. They may live on a GPU; everything the
    engine keeps and computes is float32 on the CPU (:func:`training.diloco.host_float32`, docs/GPU.md). It
    keeps the global weights, the outer momentum, the error-feedback residuals and the local snapshots the
    delay correction needs, in RAM or, once :meth:`keep_outer_state_in` names a directory, in files there
    (training/stage_engine_outer.py). Call order per round t (module docstring)::

        no delay:  train(t); encode_contribution(t); apply_round(t, ...)
        delay:     train(t); encode_contribution(t); apply_round(t-1, ...); train(t+1) ...
                   ...; finally apply_round(last, ...)
                   "rebase": either order of encode(t) / apply(t-1) (same result);
                   "reset": encode(t) first; "lookahead", "eager": apply(t-1) first
                   (training.schedule.round_actions gives the order).
    """

    def __init__(
        self,
        stage_index: int,
        params: Mapping[str, torch.Tensor],
        diloco_cfg: DilocoConfig,
        compression_cfg: CompressionConfig,
        *,
        exact: int = 0,
    ) -> None:
        self.stage_index = stage_index
        self.params = dict(params)
        self.diloco_cfg = diloco_cfg
        self.compression_cfg = compression_cfg
        self.shapes = {name: tuple(value.shape) for name, value in self.params.items()}
        self.global_weights = host_float32_copy(self.params)
        self.momentum = zero_outer_state(diloco_cfg, self.global_weights)  # outer Adam: (2, *shape)
        # "auto" budgets follow the stage's size
        numel = sum(math.prod(shape) for shape in self.shapes.values())
        budget = compression_cfg.stage_bandwidth_budget(
            numel, diloco_cfg.inner_steps, diloco_cfg.num_replicas
        )
        self.compressor = ErrorFeedbackCompressor(self.shapes, compression_cfg, bandwidth_budget=budget,
                                                 exact=exact)  # training.reproducible: a fixed-order codec
        # local weights when the current round began
        self._round_start: Weights = host_float32_copy(self.params)
        self._round_end: dict[int, Weights] = {}  # E_t for rounds encoded but not applied yet
        # "eager": own decoded contributions of unapplied rounds, and (sum of the others'
        # decoded contributions, M) of the last applied round.
        self._own_decoded: dict[int, Weights] = {}
        self._others_previous: tuple[Weights, int] | None = None
        # What this replica transmitted (decoded), for rounds not applied yet and the last applied
        # one: contribution_dropped() puts it back into the error-feedback residual.
        self._sent: dict[int, Weights] = {}
        # (bytes, decoded) of own contributions not applied yet; not state: only saves a decode.
        self._own_blob: dict[int, tuple[bytes, Weights]] = {}
        self.last_encoded = -1
        self.last_applied = -1
        self._prepared: tuple[int, Weights] | None = None  # (round, pseudo-gradient) of prepare_encode()
        # Where the transmitted updates wait (training/spilled.py: a file without a name) rather than in RAM:
        # read back only when a contribution is dropped or a start state is written (issue 75: 4 bytes per
        # parameter a round, two rounds held). None (the default): kept in RAM. The node sets it.
        self.spill_dir: Path | None = None
        self.correction = delay_correction_for(diloco_cfg)  # how the local weights follow an applied round

    @property
    def delayed(self) -> bool:
        return self.diloco_cfg.one_step_delay

    @property
    def lookahead(self) -> bool:
        """True for the corrections that jump to an estimate of theta^t after encoding ("lookahead", "eager").
        """
        return self.correction.jumps_ahead

    def _check_encode_order(self, outer_round: int) -> None:
        if outer_round != self.last_encoded + 1:
            raise RoundOrderError(
                f"stage {self.stage_index}: encode round {outer_round}, expected {self.last_encoded + 1}"
            )
        pending = outer_round - 1 - self.last_applied  # rounds encoded but not applied
        if pending > self.correction.pending_encodes:
            raise RoundOrderError(
                f"stage {self.stage_index}: round {self.last_applied + 1} must be applied before encoding "
                f"round {outer_round} ({'one-step delay' if self.delayed else 'no delay'})"
            )

    @property
    def can_prepare(self) -> bool:
        """Whether :meth:`prepare_encode` may split the encode (not for "lookahead"/"eager": their jump
        to the estimate needs the compressed contribution before the next round trains)."""
        return not self.lookahead

    def prepare_encode(self, outer_round: int) -> None:
        """The part of :meth:`encode_contribution` that reads the live params, done now.

        It snapshots the local weights ``E_t``, forms the pseudo-gradient and moves the
        round counters and snapshots exactly as the whole encode does; the following
        ``encode_contribution(outer_round)`` only compresses (the costly part) and may run on
        another thread while the next round trains, since the compressor's residual and the
        transmitted updates are touched by nothing else until then (the caller orders
        :meth:`contribution_dropped` and the next encode after it). The result is bit for bit
        the one of a whole encode: the same operations on the same values, in the same order
        for every tensor the encode writes.
        """
        if not self.can_prepare:
            raise RoundOrderError(f"stage {self.stage_index}: delay_correction="
                                  f"{self.diloco_cfg.delay_correction!r} cannot split its encode")
        self._check_encode_order(outer_round)
        if self._prepared is not None:
            raise RoundOrderError(
                f"stage {self.stage_index}: round {self._prepared[0]} was prepared and not encoded"
            )
        local = host_float32_copy(self.params)
        pseudo_gradient = {name: torch.sub(self._round_start[name], local[name]) for name in self.shapes}
        self._round_end[outer_round] = local
        self._round_start = local
        self._park_snapshots()
        self.last_encoded = outer_round
        self._prepared = (outer_round, pseudo_gradient)

    def _check_declared(self, declared_steps: int | None) -> None:
        """Refuse, before anything changes, a count the run does not allow (or a missing one)."""
        if not self.diloco_cfg.budgeted:
            if declared_steps not in (None, self.diloco_cfg.inner_steps):
                raise EngineStateError(f"stage {self.stage_index}: a fixed-H run trains H="
                                       f"{self.diloco_cfg.inner_steps} steps, not {declared_steps}")
            return
        if declared_steps is None:
            raise EngineStateError(
                f"stage {self.stage_index}: a time-bounded run's contribution declares its steps"
            )
        self.diloco_cfg.check_declared_steps(declared_steps)

    def _declared(self, blob: bytes, declared_steps: int | None) -> bytes:
        """``blob`` with the inner steps it declares: a time-bounded run's contributions carry the count
        the replica trained (codec_wire version 2); a fixed-H run's stay version 1, byte for byte."""
        if not self.diloco_cfg.budgeted:
            return blob
        return self.compressor.declare(blob, declared_steps)  # the sliced encoder: in every slice blob

    def encode_contribution(
        self, outer_round: int, declared_steps: int | None = None
    ) -> tuple[bytes, CompressionStats]:
        """Pseudo-gradient of ``outer_round`` (start-of-round minus current local weights), compressed.

        After :meth:`prepare_encode` of the same round, only the compression is left to do.
        ``declared_steps``: the inner steps the replica trained this round, required in a run whose
        rounds are bounded by time (``diloco.round_budget_s``), where the contribution declares them.
        """
        self._check_declared(declared_steps)
        if self._prepared is None:
            self._check_encode_order(outer_round)
        elif self._prepared[0] != outer_round:
            raise RoundOrderError(f"stage {self.stage_index}: encode round {outer_round}, round "
                                  f"{self._prepared[0]} was prepared")
        started = time.perf_counter()
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] == outer_round:
            # prepare_encode() already took the snapshot and moved the round counters.
            pseudo_gradient = prepared[1]
            blob, stats = self.compressor.compress(
                pseudo_gradient, stage_index=self.stage_index, outer_round=outer_round
            )
            blob = self._declared(blob, declared_steps)
            self._park_residual()
            self._sent[outer_round] = self._transmitted()
            stats.encode_seconds = time.perf_counter() - started
            return blob, stats
        local = host_float32_copy(self.params)
        pseudo_gradient = {name: torch.sub(self._round_start[name], local[name]) for name in self.shapes}
        blob, stats = self.compressor.compress(
            pseudo_gradient, stage_index=self.stage_index, outer_round=outer_round
        )
        blob = self._declared(blob, declared_steps)
        if self.lookahead:
            # Start the next round from this replica's own estimate of theta^t: the outer
            # step applied to its own (decoded) contribution instead of the average.
            step_input = self.correction.estimate_input(self.compressor.last_decoded, self._others_previous)
            estimate, _ = outer_step(
                self.global_weights, self.momentum, step_input, self.diloco_cfg, outer_round
            )
            self._own_decoded[outer_round] = self.compressor.last_decoded
            with torch.no_grad():
                for name, param in self.params.items():
                    param.copy_(estimate[name])
            local = estimate
        self._round_end[outer_round] = local
        self._round_start = local
        del local
        self._park_snapshots()
        self._park_residual()
        self._sent[outer_round] = self._transmitted()
        self._own_blob = {r: own for r, own in self._own_blob.items() if r > self.last_applied}
        self._own_blob[outer_round] = (blob, self._sent[outer_round])
        self.last_encoded = outer_round
        stats.encode_seconds = time.perf_counter() - started
        return blob, stats

    def _transmitted(self) -> Mapping[str, torch.Tensor]:
        """The update just encoded (the compressor's ``last_decoded``), in a file under :attr:`spill_dir` when
        set (the compressor then holds the file's view too, not the tensors); in RAM where that fails."""
        decoded = self.compressor.last_decoded
        if self.spill_dir is None:
            return decoded
        try:
            spilled = spill_float32(decoded, self.spill_dir)
        except OSError as exc:
            logger.warning("stage %d: the transmitted update kept in RAM: not written to %s (%s)",
                           self.stage_index, self.spill_dir, exc)
            return decoded
        self.compressor.last_decoded = spilled
        return spilled

    def prepare_aggregation(
        self, outer_round: int, contributions: Sequence[bytes], *, excluded: Mapping[int, str] | None = None
    ) -> PreparedAggregation | None:
        """The pure part of applying ``outer_round`` (decode, clip, average, outer step, hash), now.

        It reads only the global weights and momentum, which change only when a round is
        applied, so it may run on another thread while the next round trains; give the
        result to :meth:`apply_round` / :meth:`absorb_round` (with the same contributions and
        exclusions), which use it if the global state is still the one it was computed from.
        None for an empty list (each of them treats that case itself).
        """
        if not contributions:
            return None
        started = time.perf_counter()
        base = (self.global_weights, self.momentum)
        aggregation = aggregate_with_report(
            base[0], base[1], contributions, self.diloco_cfg, stage_index=self.stage_index,
            outer_round=outer_round, compression_cfg=self.compression_cfg, excluded=excluded,
        )
        if not self.correction.uses_average:
            # Nothing reads it once the outer step is made: not held until the apply (4 bytes per parameter
            # from the prefetch on, issue 75).
            aggregation.average = None
        # The next global state waits for the apply in its files when the outer state is kept on disk.
        aggregation.new_global = self._parked(aggregation.new_global)
        aggregation.new_momentum = self._parked(aggregation.new_momentum)
        return PreparedAggregation(outer_round, base, aggregation, time.perf_counter() - started)

    def prepared_valid(self, prepared: PreparedAggregation | None, outer_round: int) -> bool:
        """Whether ``prepared`` is ``outer_round``'s aggregation of the current global state."""
        return (prepared is not None and prepared.outer_round == outer_round and prepared.base is not None
                and prepared.base[0] is self.global_weights and prepared.base[1] is self.momentum)

    def _aggregation(self, outer_round, contributions, excluded, prepared, aggregation=None,
                     checked: bool = True, known=()) -> Aggregation:
        if aggregation is not None:
            return aggregation  # computed elsewhere (the sliced exchange), used as is
        if self.prepared_valid(prepared, outer_round):
            # The same pure function of the same inputs. Used once: the prepared object lets go of the old
            # global state and the result (a caller may keep it past the apply: 8 to 12 bytes per parameter).
            aggregation, prepared.aggregation, prepared.base = prepared.aggregation, None, None
            return aggregation
        if checked:
            return aggregate_with_report(
                self.global_weights, self.momentum, contributions, self.diloco_cfg,
                stage_index=self.stage_index, outer_round=outer_round, compression_cfg=self.compression_cfg,
                excluded=excluded,
            )
        return aggregate_unchecked(
            self.global_weights, self.momentum, contributions, self.diloco_cfg,
            stage_index=self.stage_index, outer_round=outer_round, compression_cfg=self.compression_cfg,
            excluded=excluded, known=known,
        )

    def apply_round(
        self, outer_round: int, contributions: Sequence[bytes], *, excluded: Mapping[int, str] | None = None,
        prepared: PreparedAggregation | None = None, aggregation: Aggregation | None = None,
    ) -> RoundResult:
        """Aggregate round ``outer_round`` and update global and local weights (module docstring).

        ``excluded``: canonical indices screening left out (:func:`aggregate_with_report`).
        ``prepared``: :meth:`prepare_aggregation` of the same inputs, used if still valid.
        ``aggregation``: the round's result computed elsewhere (the sliced exchange), used as is.
        """
        if outer_round != self.last_applied + 1 or outer_round > self.last_encoded:
            raise RoundOrderError(
                f"stage {self.stage_index}: apply round {outer_round}, expected {self.last_applied + 1} "
                f"(last encoded {self.last_encoded})"
            )
        self.correction.check_apply(
            self.stage_index, outer_round, self.last_encoded, self.params, self._round_end
        )
        started = time.perf_counter()
        # This replica's own contribution, if among them, is not decoded again: the encoder
        # returned exactly the decoder's output for those bytes (compression.encode_tensor).
        own = self._own_blob.pop(outer_round, None)
        result = self._aggregation(outer_round, contributions, excluded, prepared, aggregation, checked=False,
                                   known=() if own is None else (own,))
        new_global, new_momentum, average = result.new_global, result.new_momentum, result.average
        aggregated = time.perf_counter()
        # The snapshots the correction re-bases, read (from their files, if kept there) before anything
        # changes: a file that cannot be read leaves the engine as it was.
        round_end, round_start, pending = self._snapshots_in_ram(self._round_end[outer_round])
        del self._round_end[outer_round], pending[outer_round]
        own = self._own_decoded.pop(outer_round, None)
        self._others_previous = self.correction.others_after_apply(average, own, len(result.accepted),
                                                                   self._others_previous)
        # The new global state is taken before the local weights follow it: the old one (8 bytes per
        # parameter) goes before the correction makes its new snapshots.
        self.global_weights, self.momentum = new_global, new_momentum
        del average, new_momentum
        if aggregation is None:  # this engine's own result (an aggregation given in is the caller's)
            result.average = None
            if self.outer_state_dir is not None:  # the engine's copy is in its file now
                result.new_global, result.new_momentum = self.global_weights, self.momentum
                new_global = self.global_weights
        with torch.no_grad():
            self._round_start, self._round_end = self.correction.follow(
                self.params, new_global, round_end, round_start, pending)
        del round_end, round_start, pending, new_global
        self._park_snapshots()
        self.last_applied = outer_round
        self._forget_sent_before(outer_round)
        return RoundResult.of_round(outer_round, result, len(contributions), started, aggregated)

    def weights_hash(self) -> bytes:
        """Hash of the current global weights of the stage."""
        return stage_weights_hash(self.global_weights)

    def contribution_dropped(self, outer_round: int) -> bool:
        """Tell the engine its contribution of ``outer_round`` was not aggregated (it came too late).

        The decoded update it transmitted goes back into the error-feedback
        residual (:meth:`ErrorFeedbackCompressor.restore_undelivered`), so the
        next contribution sends it again instead of losing that round's
        progress. Call it before or after that round is applied, and before the
        next round is encoded for the progress to ride along with it. Returns
        False (and does nothing) if the round's update is no longer known or was
        already restored, and under ``diloco.put_back = false``, where the update
        is dropped (forgotten, not put back: the next contribution codes its own
        round alone).
        """
        sent = self._sent.pop(outer_round, None)
        if not self.diloco_cfg.put_back:
            logger.info("stage %d: the update of round %d was left out and is dropped (diloco.put_back = "
                        "false)", self.stage_index, outer_round)
            return False
        if sent is None:
            logger.warning(
                "stage %d: no transmitted update of round %d to restore", self.stage_index, outer_round
            )
            return False
        self.compressor.restore_undelivered(sent)
        self._park_residual()
        return True

    def transmitted(self, outer_round: int) -> bool:
        """True if this replica encoded ``outer_round`` and its transmitted update is still known."""
        return outer_round in self._sent

    def _forget_sent_before(self, outer_round: int) -> None:
        for old in [r for r in list(self._sent) if r < outer_round]:  # list(): another thread may add one
            del self._sent[old]
