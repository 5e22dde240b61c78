"""How a replica's local weights follow a delayed outer step (``diloco.delay_correction``).

One :class:`DelayCorrection` per kind, a registry keyed by the config's spelling
(:data:`DELAY_CORRECTION_KINDS`) and :func:`delay_correction_for`, which also gives the run without the
one-step delay its kind (:class:`NoDelay`). :class:`~training.stage_engine.StageEngine` keeps the
snapshots, the kind says what to do with them.

``"rebase"`` (the default, :class:`Rebase`) is the rule :mod:`training.stage_engine`'s module docstring
derives, ``theta_i <- theta^t + (L - E_t)``. The others:

* ``"lookahead"``: right after encoding round t (which then requires round
  t-1 to be applied already), the replica moves its local weights to its own
  estimate of the next global weights, ``S^{t+1} = OuterSGDNesterov(theta^{t-1},
  m^{t-1}, decode(own contribution))``, trains round t+1 from there, and
  ``apply_round(t)`` re-bases with ``theta_i <- theta^t + (L - S^{t+1})``. The
  pseudo-gradient of round t+1 is ``S^{t+1} - E^{t+1}``, again exactly the
  round's local progress, taken relative to ``theta^t`` after the re-basing;
  the start is only off by ``lr (1 + mu) (own - average)`` instead of the whole
  outer step (with momentum the outer step extrapolates far from ``E_t``).
  With one replica and lossless coding this is synchronous DiLoCo.
* ``"eager"`` (Kale, Douillard, Donchev 2025, arXiv 2502.12996, "eager updates"):
  as ``"lookahead"``, but the estimate of round t's average uses the others'
  contributions of round t-1 as a proxy for their round t ones,
  ``S^{t+1} = OuterSGDNesterov(theta^{t-1}, m^{t-1}, (own_t + sum_{j != i} c_j^{t-1}) / M)``
  (round t-1 was applied just before; in round 0, ``own_0`` alone). The start
  is then off only by how much the others' progress changed in one round.
* ``"reset"``: ``theta_i <- theta^t``: the progress of round t+1 is kept only
  through its pseudo-gradient, applied one round later (delayed-gradient SGD).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from training.config import DELAY_CORRECTIONS, DilocoConfig
from training.errors import RoundOrderError
from training.host_tensors import Weights, float32_scalar, host_float32, host_float32_copy

#: ``(sum of the others' decoded contributions, M)`` of the last applied round ("eager"'s proxy).
OthersPrevious = tuple[Weights, int]


class DelayCorrection:
    """One correction: the round order it needs and how the local weights follow an applied round."""

    #: The name ``diloco.delay_correction`` gives it ("" for the run without the delay).
    name = ""
    #: Rounds encoded but not applied that may be pending when the next round is encoded.
    pending_encodes = 1
    #: Whether, right after encoding, the replica starts the next round from its own estimate of the next
    #: global weights (then round t-1 is applied before round t is encoded, and the encode cannot be split).
    jumps_ahead = False
    #: Whether :meth:`others_after_apply` reads the round's average (only "eager"'s does): an engine whose
    #: correction does not lets a prepared aggregation's average go (4 bytes per parameter, issue 75).
    uses_average = False

    def check_apply(self, stage_index: int, outer_round: int, last_encoded: int,
                    params: Mapping[str, torch.Tensor], round_end: Mapping[int, Weights]) -> None:
        """Refuse an apply the correction cannot do now (before anything changes)."""

    def estimate_input(self, own: Weights, others_previous: OthersPrevious | None) -> Weights:
        """The pseudo-gradient the jump ahead steps with: this replica's own decoded contribution."""
        return own

    def others_after_apply(self, average: Weights | None, own: Weights | None, accepted: int,
                           previous: OthersPrevious | None) -> OthersPrevious | None:
        """What the next estimate knows of the others once a round is applied (nothing but "eager" keeps it).
        """
        return previous

    def follow(self, params: Mapping[str, torch.Tensor], new_global: Weights, round_end: Weights,
               round_start: Weights, pending: dict[int, Weights]) -> tuple[Weights, dict[int, Weights]]:
        """Move the live ``params`` after the global weights became ``new_global``; returns the new
        ``(round_start, pending round ends)`` snapshots. ``round_end``: ``E_t`` of the applied round."""
        raise NotImplementedError


class Rebase(DelayCorrection):
    """``theta_i <- theta^t + (L - E_t)``: the progress of the overlapped round is kept, re-based."""

    name = "rebase"

    def follow(self, params, new_global, round_end, round_start, pending):
        for name, param in params.items():
            progress = torch.sub(host_float32(param), round_end[name])
            param.copy_(torch.add(new_global[name], progress))

        # A snapshot held twice (the round start is the pending round's end once that round is encoded) is
        # re-based once and stays one copy: the same values, 4 bytes per parameter less held.
        rebased: dict[int, torch.Tensor] = {}

        def rebase(snapshot: Weights) -> Weights:
            out = {}
            for n, tensor in snapshot.items():
                if id(tensor) not in rebased:
                    rebased[id(tensor)] = torch.add(new_global[n], torch.sub(tensor, round_end[n]))
                out[n] = rebased[id(tensor)]
            return out

        return rebase(round_start), {r: rebase(snapshot) for r, snapshot in pending.items()}


class Reset(DelayCorrection):
    """``theta_i <- theta^t``: the overlapped round's progress arrives only through its pseudo-gradient."""

    name = "reset"

    def check_apply(self, stage_index, outer_round, last_encoded, params, round_end):
        if last_encoded != outer_round:
            return
        # Resetting now would throw away the progress of round t+1 before it is encoded.
        if any(not torch.equal(host_float32(p), round_end[outer_round][n]) for n, p in params.items()):
            raise RoundOrderError(
                f"stage {stage_index}: delay_correction='reset' needs round {outer_round + 1} "
                f"encoded before round {outer_round} is applied"
            )

    def follow(self, params, new_global, round_end, round_start, pending):
        for name, param in params.items():
            param.copy_(new_global[name])
        return host_float32_copy(new_global), pending


class NoDelay(Reset):
    """No one-step delay: every round is applied before the next trains, so ``L = E_t`` and DiLoCo's
    ``theta_i <- theta^t`` is a plain copy."""

    name = ""
    pending_encodes = 0

    def check_apply(self, stage_index, outer_round, last_encoded, params, round_end):
        pass


class Lookahead(Rebase):
    """Start the next round from the replica's own estimate of the next global weights, re-base from there."""

    name = "lookahead"
    pending_encodes = 0
    jumps_ahead = True


class Eager(Lookahead):
    """"lookahead" with the others' previous-round contributions standing in for their current ones
    (Kale, Douillard, Donchev 2025, arXiv 2502.12996, "eager updates")."""

    name = "eager"
    uses_average = True

    def estimate_input(self, own, others_previous):
        if others_previous is None:
            return own
        others, count = others_previous
        divisor = float32_scalar(float(count))
        return {name: torch.div(torch.add(own[name], others[name]), divisor) for name in own}

    def others_after_apply(self, average, own, accepted, previous):
        if own is None:
            return previous
        total = float32_scalar(float(accepted))
        # (With its own contribution left out, "others" is approximate; the next estimate only.)
        return None if average is None else (
            {n: torch.sub(torch.mul(average[n], total), own[n]) for n in own}, accepted
        )


#: Every correction a run can name, by ``diloco.delay_correction`` (the config checks the name against
#: :data:`training.config.DELAY_CORRECTIONS`, the same names, at load).
DELAY_CORRECTION_KINDS: dict[str, DelayCorrection] = {
    kind.name: kind for kind in (Rebase(), Lookahead(), Eager(), Reset())
}
assert tuple(DELAY_CORRECTION_KINDS) == DELAY_CORRECTIONS, (
    "training.config.DELAY_CORRECTIONS names every kind"
)
NO_DELAY = NoDelay()


def delay_correction_for(diloco_cfg: DilocoConfig) -> DelayCorrection:
    """The correction ``diloco_cfg`` runs: the one it names under the one-step delay, else :data:`NO_DELAY`.
    """
    return DELAY_CORRECTION_KINDS[diloco_cfg.delay_correction] if diloco_cfg.one_step_delay else NO_DELAY
