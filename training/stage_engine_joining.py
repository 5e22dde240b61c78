"""Joining and catching up: a :class:`~training.stage_engine.StageEngine` entering a run or following rounds
it did not contribute to (a checkpoint's state, a re-base onto the record, rounds sat out)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from training.diloco import Aggregation
from training.host_tensors import Weights, host_float32_copy
from training.stage_results import PreparedAggregation, RoundResult


class EngineJoining:
    """The :class:`~training.stage_engine.StageEngine` methods that join a run or catch up with it (a mixin:
    the state they move is the engine's)."""

    def can_apply(self, outer_round: int) -> bool:
        """True if ``apply_round(outer_round)`` is the next step (this replica encoded that round)."""
        return self.last_encoded >= outer_round and self.last_applied == outer_round - 1

    def rebase(self, global_weights: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor],
               last_round: int) -> None:
        """Enter after ``last_round`` from global state (e.g. a checkpoint): local = global, nothing pending.

        The live params are overwritten with ``global_weights``; the error-feedback
        residual is kept (it is this replica's own). Round ``last_round + 1`` is
        the next to encode.
        """
        weights = self._checked("global_weights", global_weights)
        momentum = self._checked("momentum", momentum)
        self.global_weights, self.momentum = weights, momentum
        self._round_start = host_float32_copy(weights)
        self._round_end, self._own_decoded, self._others_previous, self._sent = {}, {}, None, {}
        self._park_snapshots()
        self._own_blob = {}
        # a restart's state carries none (training.reexec.restart_state_reason)
        self.compressor.encoder_memo = None
        self.last_encoded = self.last_applied = last_round
        self._prepared = None
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(weights[name])

    def move_global(
        self, global_weights: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]
    ) -> None:
        """Replace the global state of the last applied round with another one of the same round (a re-base).

        A replica whose outer step left the run's record (it aggregated another set than the
        quorum did) takes the record's state instead: the global weights and momentum become
        the given ones, and the live params and every stored snapshot move by the same delta
        (as :meth:`absorb_round` does), so local progress since the round start stays this
        replica's own. The round counters do not change.
        """
        weights = self._checked("global_weights", global_weights)
        momentum = self._checked("momentum", momentum)
        delta = {n: torch.sub(weights[n], self.global_weights[n]) for n in weights}

        def shift(snapshot: Weights) -> Weights:
            return {n: torch.add(t, delta[n]) for n, t in snapshot.items()}

        self._round_start = shift(self._round_start)
        self._round_end = {r: shift(snapshot) for r, snapshot in self._round_end.items()}
        self._others_previous = None  # "eager" falls back to "lookahead" for the next round
        self.global_weights, self.momentum = weights, momentum
        self._park_snapshots()
        with torch.no_grad():
            for name, param in self.params.items():
                param.add_(delta[name])

    def skip_to(self, next_round: int) -> None:
        """Make ``next_round`` the next round to encode, keeping every weight (a replica that sat rounds out).

        Rounds before ``next_round`` that this replica did not encode are
        treated as encoded and applied without it (their snapshots are dropped);
        the local progress since the round start stays in the next pseudo-gradient.
        """
        if self.last_encoded >= next_round - 1:
            return
        self._round_end, self._own_decoded, self._sent, self._own_blob = {}, {}, {}, {}
        self.compressor.encoder_memo = None  # encoders "v3", "v4" select afresh after rounds sat out
        self.last_encoded = next_round - 1
        self.last_applied = max(self.last_applied, next_round - 1)

    def absorb_round(
        self, outer_round: int, contributions: Sequence[bytes], *, excluded: Mapping[int, str] | None = None,
        prepared: PreparedAggregation | None = None, aggregation: Aggregation | None = None,
    ) -> RoundResult:
        """Apply a round this replica did not contribute to: the others' outer step, local progress kept.

        The global state advances with the same pure :func:`aggregate`, and the
        live params and every stored snapshot move by the same global delta
        ``theta^t - theta^{t-1}`` (so the next pseudo-gradient is still this
        replica's own progress).
        """
        started = time.perf_counter()
        old = self.global_weights
        result = self._aggregation(outer_round, contributions, excluded, prepared, aggregation)
        new_global, new_momentum = result.new_global, result.new_momentum
        aggregated = time.perf_counter()
        delta = {n: torch.sub(new_global[n], old[n]) for n in old}

        def shift(snapshot: Weights) -> Weights:
            return {n: torch.add(t, delta[n]) for n, t in snapshot.items()}

        self._round_start = shift(self._round_start)
        self._round_end = {r: shift(snapshot) for r, snapshot in self._round_end.items()}
        self.global_weights, self.momentum = new_global, new_momentum
        self._park_snapshots()
        self.last_applied = max(self.last_applied, min(outer_round, self.last_encoded))
        self._forget_sent_before(min(outer_round, self.last_applied))
        self._own_decoded.pop(outer_round, None)
        self._others_previous = None  # "eager" falls back to "lookahead" for the next round
        with torch.no_grad():
            for name, param in self.params.items():
                param.add_(delta[name].to(param.device))
        return RoundResult.of_round(outer_round, result, len(contributions), started, aggregated)

    def finish_round(
        self, outer_round: int, contributions: Sequence[bytes], *, excluded: Mapping[int, str] | None = None,
        prepared: PreparedAggregation | None = None, aggregation: Aggregation | None = None,
    ) -> RoundResult:
        """:meth:`apply_round` if this replica encoded ``outer_round`` and it is next, else
        :meth:`absorb_round`."""
        if self.can_apply(outer_round):
            return self.apply_round(outer_round, contributions, excluded=excluded, prepared=prepared,
                                    aggregation=aggregation)
        return self.absorb_round(outer_round, contributions, excluded=excluded, prepared=prepared,
                                 aggregation=aggregation)

