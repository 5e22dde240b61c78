"""The DiLoCoX outer loop of one pipeline stage (arXiv 2506.21263; DiLoCo, arXiv 2311.08105).

DiLoCo's Algorithm 1, per stage ``s`` and replica ``i``, with ``theta`` the
global (outer) weights of the stage::

    for outer round t = 0, 1, ...:
        for H inner steps: inner AdamW step on the local weights theta_i   # the trainer
        Delta_i^t = theta_i^{start of round t} - theta_i                       # encode_contribution(t)
        Delta^t   = (1/M) sum_i decode(encode(Delta_i^t))                     # apply_round(t) -> aggregate
        theta^t   = OuterSGDNesterov(theta^{t-1}, Delta^t)
        theta_i  <- theta^t  (plus the delayed correction below)

Outer step (SGD with Nesterov momentum, PyTorch's convention; DiLoCo defaults
``lr = 0.7``, ``mu = 0.9``; here ``lr`` and ``mu`` may follow a schedule over the
rounds, a pure function of ``t``: :func:`training.schedule.outer_lr`), every
operation elementwise in float32, in this order, never fused::

    Delta   = (((c_0 + c_1) + c_2) + ... + c_{M-1}) / M      contributions in the given order
    m_t     = mu * m_{t-1} + Delta
    u_t     = Delta + mu * m_t         (Nesterov)   |   u_t = m_t   (plain momentum)
    theta^t = theta^{t-1} - lr_g * u_t

with ``lr_g = lr`` for the hidden weight matrices and ``lr_g = float32(lr * diloco.outer_lr_other_scale)``
for every other tensor (embeddings, head, norms, biases: :func:`training.muon.is_hidden_matrix`), a
decoupled outer learning rate per parameter group (1.0, the default, is the plain outer step).

Outer Adam (``diloco.outer_optimizer = "adam"``; FedAdam, Reddi et al., "Adaptive Federated
Optimization", arXiv 2003.00295, Algorithm 2: no bias correction, so the step is a pure function
of the state, with no step count), with ``b1, b2, eps`` the ``diloco.outer_adam_*`` settings and
``lr_g`` as above, every operation elementwise in float32, in this order, never fused::

    m_t     = b1 * m_{t-1} + (1 - b1) * Delta
    v_t     = b2 * v_{t-1} + (1 - b2) * (Delta * Delta)
    theta^t = theta^{t-1} - lr_g * (m_t / (sqrt(v_t) + eps))

(``1 - b`` taken in float64 and rounded once). Its state is both moments, stacked: the momentum
tensor of a weight of shape ``S`` has shape ``(2, *S)``, ``[m, v]`` (:func:`outer_state_shape`).

The replica's side of the loop (the one-step-delay overlap and its corrections, the
local snapshots they need) is :class:`training.stage_engine.StageEngine`.

Bit-exact aggregation: :func:`aggregate` is a pure function of the previous
global weights, the momentum, the contribution bytes in canonical order and the
config; the decoder computes its integer matrix product exactly
(:func:`training.codec_exact.reconstruct_lowrank`) and the outer step only elementwise IEEE float32
operations, so another process (the auditor) gets the same
:func:`~training.hashing.stage_weights_hash`.

Byzantine tolerance (issue 12; :mod:`training.robust`, docs/DILOCOX.md section
10): before the average, a contribution that does not decode, has the wrong
shapes, non-finite values, the raw codec in a compressed run, or was screened
out (:mod:`training.screening`) is left out with a reason, and each remaining
one is scaled to at most ``diloco.norm_clip`` times the lower median of their
exactly computed norms. :func:`aggregate_with_report` returns what happened to
each contribution.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from training.config import DilocoConfig
from training.config_compression import CompressionConfig
from training.errors import AggregationError
from training.hashing import stage_weights_hash
from training.host_tensors import Weights, float32_scalar, host_float32_copy
from training.outer_optimizers import outer_optimizer_for
from training.config_base import LISTING_SCHEMES, MAX_LISTED
from training.robust import OVER_LIMIT, ContributionReport, robust_contributions
from training.schedule import outer_lr as scheduled_outer_lr
from training.schedule import outer_momentum as scheduled_outer_momentum
from training.schedule import outer_schedule_is_constant
from training.spilled import shapes_of, unheld

logger = logging.getLogger(__name__)

def average_contributions(decoded: Sequence[Mapping[str, torch.Tensor]], *, consume: bool = False) -> Weights:
    """``(((c_0 + c_1) + ...) + c_{M-1}) / M`` per tensor, float32, in the given order.

    ``consume``: ``decoded`` are the caller's own dicts, done with once averaged: each tensor is dropped
    from them as soon as its average is made, so the contributions and their average are not all held at
    once (issue 75; the same values)."""
    if not decoded:
        raise AggregationError("no contributions to average")
    count = float32_scalar(float(len(decoded)))
    average = {}
    for name in sorted(decoded[0]):
        first = decoded[0][name].to(torch.float32)
        if len(decoded) == 1:
            average[name] = torch.div(first, count)
            if consume:
                del first, decoded[0][name]
            continue
        # The first sum is a fresh tensor: the later sums and the division are written into it (out=),
        # the same ops in the same order.
        total = torch.add(first, decoded[1][name])
        for contribution in decoded[2:]:
            torch.add(total, contribution[name], out=total)
        average[name] = torch.div(total, count, out=total)
        if consume:
            del first, total
            for contribution in decoded:
                del contribution[name]
    return average


def outer_state_shape(diloco_cfg: DilocoConfig, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the outer state ("momentum") of a weight of ``shape``: the same (Nesterov), or ``(2,
    *shape)`` (outer Adam's first and second moments, stacked)."""
    return outer_optimizer_for(diloco_cfg).state_shape(shape)


def zero_outer_state(diloco_cfg: DilocoConfig, weights: Mapping[str, torch.Tensor]) -> Weights:
    """The outer state of a run's first round: zeros of :func:`outer_state_shape`, float32."""
    return {name: torch.zeros(outer_state_shape(diloco_cfg, value.shape), dtype=torch.float32)
            for name, value in weights.items()}


def outer_step(
    global_weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    pseudo_gradient: Mapping[str, torch.Tensor],
    diloco_cfg: DilocoConfig,
    outer_round: int | None = None,
) -> tuple[Weights, Weights]:
    """The outer step (``diloco.outer_optimizer``): ``(new_weights, new_momentum)``.

    "nesterov" (the default), SGD with (Nesterov) momentum, below; "adam", outer Adam, whose "momentum"
    holds both moments stacked (:func:`outer_state_shape`); each kind is a
    :class:`training.outer_optimizers.OuterOptimizer`.

    ``m_t = mu*m + Delta``; ``u = Delta + mu*m_t`` (Nesterov) or ``m_t``;
    ``theta_t = theta - lr*u``; each an unfused float32 elementwise op. ``lr``
    and ``mu`` are those of ``outer_round`` under the configured outer schedule
    (:func:`training.schedule.outer_lr`, :func:`~training.schedule.outer_momentum`);
    ``outer_round`` may be None only when that schedule is constant.
    """
    if outer_round is None:
        if not outer_schedule_is_constant(diloco_cfg):
            raise AggregationError(
                "the outer schedule (diloco.outer_warmup_rounds / outer_decay) needs the outer round"
            )
        mu, lr64 = float32_scalar(diloco_cfg.outer_momentum), diloco_cfg.outer_lr
    else:
        mu, lr64 = (
            float32_scalar(scheduled_outer_momentum(diloco_cfg, outer_round)),
            scheduled_outer_lr(diloco_cfg, outer_round),
        )
    # Per-group outer lr (diloco.outer_lr_other_scale): the hidden matrices step with lr, every other tensor
    # (embeddings, head, norms, biases) with lr * scale, the product taken in float64 and rounded once.
    lr, lr_other = float32_scalar(lr64), float32_scalar(lr64 * diloco_cfg.outer_lr_other_scale)
    return outer_optimizer_for(diloco_cfg).step(global_weights, momentum, pseudo_gradient, diloco_cfg, mu, lr,
                                                 lr_other)


@dataclass
class Aggregation:
    """One round of one stage, aggregated: the new state and what happened to each contribution.

    ``contributions`` holds one :class:`~training.robust.ContributionReport` per
    input contribution, in canonical order (the node records the exclusions in
    the round's record; the auditor re-derives them). ``average`` is the
    averaged pseudo-gradient, None when nothing was accepted (the round is then
    a no-op: weights and momentum unchanged).
    """

    new_global: Weights
    new_momentum: Weights
    weights_hash: bytes
    average: Weights | None
    contributions: list[ContributionReport]

    @property
    def accepted(self) -> list[int]:
        """Canonical indices of the contributions that entered the average."""
        return [report.index for report in self.contributions if report.accepted]

    @property
    def excluded(self) -> dict[int, str]:
        """``{index: reason}`` of the contributions left out."""
        return {report.index: report.reason for report in self.contributions if not report.accepted}


def aggregate(
    global_weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    contributions: Sequence[bytes],
    diloco_cfg: DilocoConfig,
    *,
    stage_index: int | None = None,
    outer_round: int | None = None,
    compression_cfg: CompressionConfig | None = None,
    excluded: Mapping[int, str] | None = None,
) -> tuple[Weights, Weights, bytes]:
    """The auditable aggregation of one round of one stage: ``(new_global, new_momentum, weights_hash)``.

    :func:`aggregate_with_report` without the report (the keyword arguments are
    the same).
    """
    result = aggregate_with_report(
        global_weights, momentum, contributions, diloco_cfg, stage_index=stage_index, outer_round=outer_round,
        compression_cfg=compression_cfg, excluded=excluded,
    )
    return result.new_global, result.new_momentum, result.weights_hash


def aggregate_with_report(
    global_weights: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    contributions: Sequence[bytes],
    diloco_cfg: DilocoConfig,
    *,
    stage_index: int | None = None,
    outer_round: int | None = None,
    compression_cfg: CompressionConfig | None = None,
    excluded: Mapping[int, str] | None = None,
) -> Aggregation:
    """Decode, screen out, clip, average and step one round of one stage (docs/DILOCOX.md sections 2, 10).

    ``contributions`` in the given (canonical) order go through
    :func:`training.robust.robust_contributions`: one that does not decode, has
    the wrong shapes, non-finite values, or (``compression_cfg.enabled``) the
    raw codec, or whose index is in ``excluded`` (screening), is left out with
    a reason; the rest are clipped to ``diloco.norm_clip`` x their lower median
    norm, averaged and applied by :func:`outer_step`. Pure: the inputs are not
    modified. Bit-exact across processes and IEEE-754 platforms (module
    docstring). Raises :class:`AggregationError` only for an empty list or
    mismatched weights and momentum; with every contribution excluded the round
    is a no-op (same weights, same momentum).
    """
    if not contributions:
        raise AggregationError("no contributions to aggregate")
    names = set(global_weights)
    if set(momentum) != names:
        raise AggregationError("momentum names differ from the global weights' names")
    weights_kinds, momentum_kinds = _kinds(global_weights), _kinds(momentum)
    for name in names:
        (weights_dtype, weights_shape), (momentum_dtype, momentum_shape) = (weights_kinds[name],
                                                                            momentum_kinds[name])
        if weights_dtype != torch.float32 or momentum_dtype != torch.float32:
            raise AggregationError(f"{name!r}: global weights and momentum must be float32")
        if momentum_shape != outer_state_shape(diloco_cfg, weights_shape):
            raise AggregationError(f"{name!r}: momentum shape {momentum_shape} is not the outer "
                                   f"state's of the weights' shape {weights_shape} "
                                   f"(diloco.outer_optimizer={diloco_cfg.outer_optimizer!r})")
    return aggregate_unchecked(
        global_weights, momentum, contributions, diloco_cfg, stage_index=stage_index, outer_round=outer_round,
        compression_cfg=compression_cfg, excluded=excluded,
    )


def _kinds(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape); an outer state kept in a file (float32 by construction) is not read for it."""
    if unheld(tensors):
        return {name: (torch.float32, shape) for name, shape in shapes_of(tensors).items()}
    return {name: (value.dtype, tuple(value.shape)) for name, value in tensors.items()}


def aggregate_unchecked(global_weights, momentum, contributions, diloco_cfg, *, stage_index, outer_round,
               compression_cfg=None, excluded=None, known=()) -> Aggregation:
    shapes = shapes_of(global_weights)
    accepted, reports = capped_contributions(
        contributions,
        shapes,
        diloco_cfg,
        stage_index=stage_index,
        outer_round=outer_round,
        refuse_raw=compression_cfg is not None and compression_cfg.enabled,
        excluded=excluded,
        known=known,
    )
    for report in reports:
        if not report.accepted or report.scale != 1.0:
            logger.warning(
                "stage %s round %s: contribution %d %s: %s",
                stage_index,
                outer_round,
                report.index,
                f"scaled by {report.scale:.3g}" if report.accepted else f"excluded ({report.reason})",
                report.detail,
            )
    # A time-bounded run weights every inner step the same (docs/DILOCOX.md section 13): with c_j the
    # sum of the k_j steps replica j declared, K = sum k_j over the M accepted ones, the per-step
    # pseudo-gradients c_j / k_j averaged with weights k_j / K (what each processed) and scaled to the
    # mean round, tau = K / M steps (FedNova's normalised averaging, arXiv 2007.07481), is
    #     Delta = tau * sum_j (k_j / K) (c_j / k_j) = (1/M) sum_j c_j,
    # the plain mean: the same function, the same bits, whatever the counts. The counts enter through
    # the per-step norm rule and screening, which must not take a slow replica's shorter update for an
    # outlier.
    # robust_contributions' accepted dicts are this call's own (shallow copies of any known tensors).
    average = average_contributions(accepted, consume=True) if accepted else None
    del accepted
    return step_with_average(global_weights, momentum, average, diloco_cfg, outer_round, reports)


def capped_contributions(contributions, shapes, diloco_cfg, *, excluded=None, **options):
    """:func:`training.robust.robust_contributions` with the accepted set capped at the most contributions a
    fraud-provable run's round may list (issue 62: ``RunParams.maxContributions``, :data:`MAX_LISTED`;
    more would make the round provably wrong): the accepted ones past the first ``MAX_LISTED`` in canonical
    order are left out (``over_limit``) and the rest re-clipped among themselves. A hashed run lists nothing:
    no cap."""
    options.update(norm_clip=diloco_cfg.norm_clip, steps_range=diloco_cfg.steps_range)
    accepted, reports = robust_contributions(contributions, shapes, excluded=excluded, **options)
    listed = [report.index for report in reports if report.accepted]
    if diloco_cfg.commitments not in LISTING_SCHEMES or len(listed) <= MAX_LISTED:
        return accepted, reports
    over = {index: (OVER_LIMIT, f"past the {MAX_LISTED} contributions a round of this run may list")
            for index in listed[MAX_LISTED:]}
    return robust_contributions(contributions, shapes, excluded={**(excluded or {}), **over}, **options)


def step_with_average(global_weights, momentum, average, diloco_cfg, outer_round, reports=()) -> Aggregation:
    """The :class:`Aggregation` of an average computed elsewhere (the sliced exchange assembles it
    from partials, training/butterfly.py); None: nothing accepted, the round is a no-op."""
    if average is None:
        new_global, new_momentum = host_float32_copy(global_weights), host_float32_copy(momentum)
    else:
        new_global, new_momentum = outer_step(global_weights, momentum, average, diloco_cfg, outer_round)
    return Aggregation(new_global, new_momentum, stage_weights_hash(new_global), average, list(reports))
