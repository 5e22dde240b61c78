"""Contribution screening: does a contribution, applied alone, make the model worse?

In the spirit of Templar's Gauntlet (loss before and after applying one
peer's update on a batch the validator chooses): every node holding the whole
model, and the auditor, evaluate the global weights ``theta`` and, for each
contribution ``d_i`` alone, ``theta - outer_lr * d_i`` (the plain outer SGD step
with that contribution as the average; no momentum, no Nesterov term) on the
same seeded held-out batch of the round, and leave out a contribution that does
clearly worse than the median contribution
(docs/DILOCOX.md section 10)::

    L_b   = f32(loss(theta))
    L_i   = f32(loss(theta - f32(outer_lr) * d_i))          float32 weights; +inf if not finite
    med   = lower median of the L_i of the screened contributions
    tol   = max(screen_abs_tol, screen_rel_tol * L_b)                    float64
    excluded_i  <=>  not (L_i <= med + tol)

In a run whose rounds are bounded by time (``diloco.round_budget_s``, issue 44) a contribution without a
valid declared count is not screened (the aggregation excludes it), and the run may opt into version 2,
``diloco.screen_rule = "two_sided"`` (docs/DILOCOX.md section 13, "Screening"): each contribution is also
applied against itself, and what is judged is its slope and its curvature, not its loss alone::

    L+_i  = f32(loss(theta + f32(outer_lr) * d_i))
    D_i   = L+_i - L_i                  (float64)   the slope: > 0 where d_i descends; the even terms cancel
    C_i   = (L+_i + L_i) / 2 - L_b      (float64)   the curvature: what d_i's length costs, whatever its sign
                                                    (under the one-step delay every honest contribution alone
                                                    can land above L_b by it, the longest the furthest)
    excluded_i  <=>  not ( D_i > min(tol, D_med / SLOPE_SHARE) )
                 or  not ( C_i <= CURVATURE_FACTOR * max(C_med, 0) + tol )
    D_med, C_med: the lower medians over the screened contributions

(version 1 of a time-bounded run, ``"one_sided"``, the rule of every run made before it:
``excluded_i <=> not (L_i <= max(L_b, med) + tol)``).

Version 3 (``"paired"``) is version 2 with the slope judged against its own measurement error: the losses are
taken per window ``w`` of the screening batch (:class:`ModelLoss`, ``windows``), ``L = f32(fsum_w / B)`` of
each, and the slope's standard error over the batch's ``B`` windows::

    E_i   = f32(stdev_w(L+_{i,w} - L-_{i,w}) / sqrt(B))      (float64, exact sums; 0 unless B >= 2, every
    value finite) excluded_i  <=>  not ( D_i + min(SLOPE_ERRORS * E_i, tol) > min(tol, D_med / SLOPE_SHARE) )
                 or  not ( C_i <= CURVATURE_FACTOR * max(C_med, 0) + tol )

(docs/DILOCOX.md section 13, "Version 3": in the simulation the honest slopes version 2 found too small were
the 16-window batch's noise, and on the node one exclusion at that margin cost the replica its next round
too).

``f32`` rounds the float64 loss to the nearest float32: the loss is computed in
float64 (:func:`model_loss_fn`), whose order-dependent last bits (thread count,
BLAS kernel) are then far below a float32 step, so two processes record the same
numbers; the exclusion is a pure function of the recorded numbers, which an
auditor can both re-derive and check against its own evaluation.

Screening needs the whole model (one node holding every stage, i.e. a
one-node cluster). In a split cluster no node can evaluate the loss of one
stage's contribution alone, and only the norm rule (:mod:`training.robust`)
applies.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from training.codec_wire import decode_contribution, header_steps
from training.config import DilocoConfig, ModelConfig
from training.data import Corpus, check_corpus
from training.errors import ContributionDecodeError, DataError
from training.model import GPT, lm_loss
from training.screen_rules import ScreeningReport, screen_rule_for

SCREENING_BATCH_DOMAIN = b"dlx-node/screening-batch/v1"
_U64_MAX = 2**64 - 1

LossFn = Callable[[Mapping[str, torch.Tensor]], float]


#: Threads for the screening losses (fixed: the decision must be the same bits everywhere).
SCREENING_THREADS = 1

def screening_offsets(run_seed: int, outer_round: int, batch_size: int, n_start: int) -> list[int]:
    """``offset_b = u64be(sha256(DOMAIN || u64be(run_seed) || u64be(outer_round) || u64be(b))[:8]) %
    n_start``."""
    for name, value in (("run_seed", run_seed), ("outer_round", outer_round)):
        if not 0 <= value <= _U64_MAX:
            raise DataError(f"{name}={value}: must be in [0, 2**64)")
    if batch_size < 1 or n_start < 1:
        raise DataError(f"batch_size={batch_size}, n_start={n_start}: both must be >= 1")
    prefix = SCREENING_BATCH_DOMAIN + struct.pack(">QQ", run_seed, outer_round)
    return [
        int.from_bytes(hashlib.sha256(prefix + struct.pack(">Q", row)).digest()[:8], "big") % n_start
        for row in range(batch_size)
    ]


def screening_batch(
    corpus: Corpus, run_seed: int, outer_round: int, batch_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The screening batch ``(x, y)`` of ``outer_round``: seeded windows of the held-out split.

    ``n_start = len(eval) - block_size``; row ``b`` is the window at
    :func:`screening_offsets` ``[b]`` (a different batch every round, the same on
    every node and for the auditor).
    """
    check_corpus(corpus, block_size)
    n_start = corpus.split_tokens("eval") - block_size
    starts = torch.tensor(screening_offsets(run_seed, outer_round, batch_size, n_start))
    return corpus.windows("eval", starts, block_size)


class ModelLoss:
    """``weights -> mean cross-entropy of the full model on (x, y)``, evaluated in float64 (no grad, eval
    mode); :meth:`windows` gives the mean of each window (row of ``x``) instead, which version 3 judges."""

    def __init__(self, model_cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model = GPT(model_cfg, seed=None).to(torch.float64).eval()
        self.x, self.y = x, y

    def logits(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's logits on ``x`` at ``weights`` (float64)."""
        self.model.load_state_dict({name: value.to(torch.float64) for name, value in weights.items()})
        with torch.no_grad():
            return self.model(self.x)[0]

    def __call__(self, weights: Mapping[str, torch.Tensor]) -> float:
        return float(lm_loss(self.logits(weights), self.y))

    def windows(self, weights: Mapping[str, torch.Tensor]) -> list[float]:
        """The mean cross-entropy of each window, in the batch's order (float64)."""
        logits = self.logits(weights)
        per_token = F.cross_entropy(logits.reshape(-1, logits.size(-1)), self.y.reshape(-1), reduction="none")
        return [float(value) for value in per_token.reshape(self.y.shape).mean(dim=1)]


def model_loss_fn(model_cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor) -> ModelLoss:
    """The screening loss of the full model on the batch ``(x, y)`` (:class:`ModelLoss`)."""
    return ModelLoss(model_cfg, x, y)


def window_mean(values: Sequence[float]) -> float:
    """``f32`` of the exact mean of per-window losses (``math.fsum``: the same bits in any order)."""
    return _f32(math.fsum(values) / len(values)) if all(math.isfinite(v) for v in values) else math.inf


def slope_error(after: Sequence[float], against: Sequence[float]) -> float:
    """Version 3's ``E``: ``f32`` of the standard error of the per-window slopes ``against - after`` (0 when
    there are fewer than two windows or a value is not finite: the slope is then judged as version 2 judges
    it)."""
    slopes = [b - a for a, b in zip(after, against, strict=True)]
    if len(slopes) < 2 or not all(math.isfinite(v) for v in slopes):
        return 0.0
    error = _f32(statistics.stdev(slopes) / math.sqrt(len(slopes)))  # statistics: exact sums of the floats
    return error if math.isfinite(error) else 0.0


def _f32(value: float) -> float:
    """The nearest float32 (as a Python float); NaN and overflow become +inf."""
    rounded = float(np.float32(value)) if math.isfinite(value) else math.inf
    return rounded if math.isfinite(rounded) else math.inf


def decode_full(
    contribution_by_stage: Sequence[bytes],
    shapes_by_stage: Sequence[Mapping[str, tuple[int, ...]]],
    *,
    outer_round: int,
    refuse_raw: bool = False,
) -> dict[str, torch.Tensor] | None:
    """One replica's contributions to every stage, decoded and merged into full-model tensors (None if any
    fails)."""
    merged: dict[str, torch.Tensor] = {}
    for stage, (blob, shapes) in enumerate(zip(contribution_by_stage, shapes_by_stage, strict=True)):
        try:
            merged.update(
                decode_contribution(
                    blob, shapes, stage_index=stage, outer_round=outer_round, refuse_raw=refuse_raw
                )
            )
        except ContributionDecodeError:
            return None
    return merged


def declared_steps_full(contribution_by_stage: Sequence[bytes]) -> int | None:
    """The inner steps one replica's contributions to every stage declare (they must agree), else None
    (also for version-1, fixed-H, contributions and for bytes that are no contribution)."""
    steps = {header_steps(blob) for blob in contribution_by_stage}
    return steps.pop() if len(steps) == 1 else None


def screening_steps(
    diloco_cfg: DilocoConfig, contributions_by_replica: Sequence[Sequence[bytes]]
) -> list | None:
    """The ``declared_steps`` argument of :func:`screen_contributions`: each replica's declared count in a
    time-bounded run (``contributions_by_replica[i]``: replica i's contribution to every stage), None with
    fixed H (nothing to read)."""
    if not diloco_cfg.budgeted:
        return None
    return [declared_steps_full(blobs) for blobs in contributions_by_replica]


def screen_contributions(
    loss_fn: LossFn,
    global_weights: Mapping[str, torch.Tensor],
    contributions: Sequence[Mapping[str, torch.Tensor] | None],
    diloco_cfg: DilocoConfig,
    declared_steps: Sequence[int | None] | None = None,
    shift: Callable[..., Mapping[str, torch.Tensor]] | None = None,
) -> list[ScreeningReport]:
    """Screen each (decoded, full-model) contribution alone against ``global_weights`` (module docstring).

    ``loss_fn`` maps full-model float32 weights to the loss on the round's
    :func:`screening_batch` (:func:`model_loss_fn`). ``None`` entries (did not
    decode) are reported, not screened. In a time-bounded run (``diloco_cfg.budgeted``)
    ``declared_steps`` gives each contribution's declared inner steps (:func:`declared_steps_full`);
    one with no valid count is not screened (the aggregation excludes it, ``bad_steps``), and
    :func:`judge` applies the time-bounded rule. ``shift``: :func:`shifted` unless given (a node that is a
    cluster passes one whose weights stay on its ranks: training/cluster_screen.py).
    """
    shift = shifted if shift is None else shift
    if diloco_cfg.budgeted and (declared_steps is None or len(declared_steps) != len(contributions)):
        raise ValueError("a time-bounded run screens with each contribution's declared steps")
    lr = torch.tensor(diloco_cfg.outer_lr, dtype=torch.float32)
    factors = [lr] * len(contributions)
    if diloco_cfg.budgeted:
        factors = [
            lr if isinstance(k, int) and diloco_cfg.min_inner_steps <= k <= diloco_cfg.inner_steps else None
            for k in declared_steps
        ]
    # Every member and the audit must reach the same decision bit for bit, whatever thread count
    # they train with: torch splits float reductions (matmuls) by thread count, so the losses are
    # computed on SCREENING_THREADS threads. (Two members on 1 and 2 threads disputed a round.)
    rule = screen_rule_for(diloco_cfg)
    windows = getattr(loss_fn, "windows", None) if rule.per_window else None
    if rule.per_window and windows is None:
        raise ValueError("version-3 screening judges per-window losses: pass a ModelLoss (model_loss_fn)")
    threads = torch.get_num_threads()
    torch.set_num_threads(SCREENING_THREADS)
    try:
        loss_before = window_mean(windows(global_weights)) if windows else _f32(loss_fn(global_weights))
        after: dict[int, float] = {}
        against: dict[int, float] = {}
        errors: dict[int, float] = {}
        for index, (contribution, factor) in enumerate(zip(contributions, factors)):
            if contribution is None or factor is None:
                continue
            stepped = shift(global_weights, contribution, factor, -1)
            opposed = shift(global_weights, contribution, factor, 1) if rule.against else None
            if windows:  # version 3: the same losses, per window, and the slope's standard error over them
                alone, opposite = windows(stepped), windows(opposed)
                after[index], against[index] = window_mean(alone), window_mean(opposite)
                errors[index] = slope_error(alone, opposite)
                continue
            after[index] = _f32(loss_fn(stepped))
            if opposed is not None:
                against[index] = _f32(loss_fn(opposed))
    finally:
        torch.set_num_threads(threads)
    return judge(loss_before, after, len(contributions), diloco_cfg, against if rule.against else None,
                 errors if windows else None)


def shifted(global_weights: Mapping[str, torch.Tensor], contribution: Mapping[str, torch.Tensor],
            factor: torch.Tensor, sign: int) -> dict[str, torch.Tensor]:
    """The weights a contribution is screened at: ``theta - factor * d`` (``sign`` -1) or
    ``theta + factor * d`` (``sign`` 1), float32, tensor by tensor."""
    op = torch.sub if sign < 0 else torch.add
    return {name: op(value, torch.mul(contribution[name], factor)) for name, value in global_weights.items()}


def judge(
    loss_before: float, loss_after: Mapping[int, float], count: int, diloco_cfg: DilocoConfig,
    loss_against: Mapping[int, float] | None = None, slope_errors: Mapping[int, float] | None = None,
) -> list[ScreeningReport]:
    """The exclusion rule on recorded losses (pure; what an auditor re-derives from a round's record): the
    run's :class:`~training.screen_rules.ScreenRule`.

    ``loss_against``: the losses of each contribution applied against itself (the same keys as
    ``loss_after``), which a run screened by version 2 or 3 needs; ``slope_errors``: version 3's standard
    errors of the slopes (:func:`slope_error`, the same keys)."""
    return screen_rule_for(diloco_cfg).judge(
        loss_before, loss_after, count, diloco_cfg, loss_against, slope_errors
    )


def screening_exclusions(reports: Sequence[ScreeningReport]) -> dict[int, str]:
    """``{index: detail}`` of the excluded contributions: the ``excluded`` argument of ``aggregate``."""
    return {report.index: report.detail for report in reports if report.excluded}
