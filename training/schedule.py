"""The schedules of a DiLoCoX run: the inner learning rate per step, and the order of train / encode / apply
per round.

Both are pure functions of the configuration, shared by the simulation
(:mod:`training.simulate`) and the node, so the node runs exactly what the
benchmark measures.

Inner learning rate (``training.lr_schedule``), as nanoGPT and the DiLoCo
papers use it (linear warmup, then cosine decay over the whole run, *not*
restarted at each outer round: arXiv 2311.08105 Sec. 3, arXiv 2503.09799
Sec. 3)::

    step s = outer_round * H + k            (k: inner step within the round)
    lr(s)  = inner_lr * (s + 1) / warmup                       s < warmup
           = min + (inner_lr - min) * (1 + cos(pi * p)) / 2     p = (s - warmup) / (T - warmup), clamped to
           [0, 1]
    min    = inner_lr * min_lr_ratio,  T = total inner steps of the run

With ``lr_schedule = "constant"`` (or no known ``T``) the rate is ``inner_lr``
after warmup.

Outer schedule (``diloco.outer_warmup_rounds``, ``outer_decay``,
``outer_decay_rounds`` = D, ``outer_min_lr_ratio``, ``outer_final_momentum``),
per outer round ``t`` (the round whose average the outer step applies; W =
``outer_warmup_rounds``)::

    lr_t = outer_lr * (t + 1) / W                                 t < W
         = outer_lr * (r + (1 - r) * f(p))                         p = (t - W) / (D - W), clamped to [0, 1]
    mu_t = mu_end + (outer_momentum - mu_end) * f(p)               (mu_end = outer_final_momentum; "auto":
    mu_t = outer_momentum) f(p) = 1 (constant) | 1 - p (linear) | (1 + cos(pi * p)) / 2 (cosine)

Both are computed in float64 from the configuration and the round index only,
then rounded to float32 by the outer step (training/diloco.py), so every
replica, a joiner and the auditor use the same two scalars in round ``t``.
"constant" (the default) gives ``outer_lr`` and ``outer_momentum`` in every
round after the warmup. ("linear" is exact IEEE arithmetic; "cosine" goes
through the platform's ``math.cos``, correctly rounded on glibc, whose last-bit
differences would almost always vanish in the float32 rounding.)

Round schedule (DiLoCoX's one-step delay, docs/DILOCOX.md section 4). Per outer
round ``t`` of a run whose last round is ``T-1``::

    no delay:                   train(t); encode(t); apply(t)
    delay, "rebase" / "reset":  train(t); encode(t); apply(t-1)       [+ apply(t) if t = T-1]
    delay, "lookahead"/"eager": train(t); apply(t-1); encode(t)       [+ apply(t) if t = T-1]

``apply(t-1)`` is skipped in round 0; the last round flushes its own apply.
With ``diloco.overlap_steps = tau`` (``0 < tau < H``, or "auto": ``H // 10``; Streaming DiLoCo's overlap,
arXiv 2501.18512) the exchange of round t-1 overlaps only the first tau inner
steps of round t, for every delay correction but "reset"::

    train(t, steps 0..tau-1); apply(t-1); train(t, steps tau..H-1); encode(t)   [+ apply(t) if t = T-1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.config import AUTO, DilocoConfig, TrainingConfig
from training.delay_correction import delay_correction_for

TRAIN = "train"
ENCODE = "encode"
APPLY = "apply"


@dataclass(frozen=True)
class RoundAction:
    """One step of the round schedule: ``kind`` (train / encode / apply) of ``outer_round``.

    A train action covers the inner steps ``first_step <= k < end_step`` of its round.
    """

    kind: str
    outer_round: int
    first_step: int = 0
    end_step: int = 0


def round_actions(diloco_cfg: DilocoConfig, outer_round: int, *, last: bool = False,
                  steps: int | None = None) -> list[RoundAction]:
    """The ordered actions of ``outer_round`` (module docstring); ``last`` flushes the final apply.

    ``steps``: the inner steps the round trains, H by default; a time-bounded run's replica trains
    the count it declared (re-execution and the audit rerun exactly that many; the overlapped first
    part, ``diloco.overlap`` steps, is always whole: ``min_inner_steps`` exceeds it).
    """
    if outer_round < 0:
        raise ValueError(f"outer_round={outer_round}: must be >= 0")
    if steps is None:
        steps = diloco_cfg.inner_steps
    elif not 1 <= steps <= diloco_cfg.inner_steps:
        raise ValueError(f"steps={steps}: must be in [1, diloco.inner_steps={diloco_cfg.inner_steps}]")
    train = RoundAction(TRAIN, outer_round, 0, steps)
    encode = RoundAction(ENCODE, outer_round)
    if not diloco_cfg.one_step_delay:
        return [train, encode, RoundAction(APPLY, outer_round)]
    previous = [RoundAction(APPLY, outer_round - 1)] if outer_round > 0 else []
    flush = [RoundAction(APPLY, outer_round)] if last else []
    overlap = diloco_cfg.overlap  # overlap_steps with "auto" resolved
    if previous and 0 < overlap < steps:
        # Streaming DiLoCo's partial overlap: round t-1's exchange hides behind the first
        # `overlap` inner steps of round t only, then it is applied and round t goes on.
        return [RoundAction(TRAIN, outer_round, 0, overlap), *previous,
                RoundAction(TRAIN, outer_round, overlap, steps), encode, *flush]
    if delay_correction_for(diloco_cfg).jumps_ahead:
        return [train, *previous, encode, *flush]
    return [train, encode, *previous, *flush]


def applies_before_encode(diloco_cfg: DilocoConfig, outer_round: int) -> bool:
    """Whether round ``outer_round``'s actions apply round ``outer_round - 1`` before its encode.

    Then the round's contribution depends on round t-1's result (the overlap trains on it,
    "lookahead"/"eager" encode against it), and it binds that result's stage hash
    (``applied_hash``, docs/PROTOCOL.md "When a node's weights leave the record"); otherwise
    (round 0, no delay, "rebase"/"reset" without the overlap) it depends on no apply inside the round.
    """
    for action in round_actions(diloco_cfg, outer_round):
        if action.kind == ENCODE:
            return False
        if action.kind == APPLY and action.outer_round == outer_round - 1:
            return True
    return False


def takes_another_step(diloco_cfg: DilocoConfig, step: int, elapsed_s: float) -> bool:
    """Whether a replica trains inner step ``step`` (0-based) of a round that used ``elapsed_s`` of its
    budget.

    Fixed H: ``step < H``. Time-bounded (``diloco.round_budget_s`` = B): every step below
    ``min_inner_steps``, none from ``inner_steps`` (H) on, and in between while ``elapsed_s < B`` (the
    step that crosses the budget is finished). ``elapsed_s``: the node's round clock (its work around
    the steps counts, its waits for peers do not: node/live/state/roundclock.py), the steps' own seconds in
    the in-process benchmark. This is the only place timing enters: the count it
    yields is declared in the signed contribution, and everything downstream (aggregation weights,
    the rerun, the data commitment, the audit) reads the declared count, never a clock.
    """
    if step >= diloco_cfg.inner_steps:
        return False
    if not diloco_cfg.budgeted or step < diloco_cfg.min_inner_steps:
        return True
    return elapsed_s < diloco_cfg.round_budget_s


def pending_after_round(diloco_cfg: DilocoConfig) -> int:
    """Rounds encoded but not applied when a round's actions are done (not the last): 1 with delay, else 0."""
    return 1 if diloco_cfg.one_step_delay else 0


def inner_lr(training_cfg: TrainingConfig, step: int, total_steps: int | None) -> float:
    """Inner AdamW learning rate at global inner step ``step`` (0-based; module docstring).

    ``total_steps`` is the run's number of inner steps per replica
    (``rounds * H``); ``training.lr_decay_steps > 0`` overrides it, and with
    neither the rate stays at ``inner_lr`` after warmup.
    """
    peak = training_cfg.inner_lr
    warmup = training_cfg.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    horizon = training_cfg.lr_decay_steps or total_steps or 0
    if training_cfg.lr_schedule == "constant" or horizon <= warmup:
        return peak
    floor = peak * training_cfg.min_lr_ratio
    progress = min(1.0, (step - warmup) / (horizon - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _outer_decay_factor(diloco_cfg: DilocoConfig, outer_round: int) -> float:
    """``f(p)`` of the module docstring: 1 before and without a decay, falling to 0 at ``p = 1``."""
    if diloco_cfg.outer_decay == "constant":
        return 1.0
    warmup = diloco_cfg.outer_warmup_rounds
    progress = min(1.0, max(0.0, (outer_round - warmup) / (diloco_cfg.outer_decay_rounds - warmup)))
    if diloco_cfg.outer_decay == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def outer_lr(diloco_cfg: DilocoConfig, outer_round: int) -> float:
    """Outer learning rate of ``outer_round`` (module docstring): warmup, then the decay, else
    ``diloco.outer_lr``."""
    if outer_round < 0:
        raise ValueError(f"outer_round={outer_round}: must be >= 0")
    peak = diloco_cfg.outer_lr
    if outer_round < diloco_cfg.outer_warmup_rounds:
        return peak * (outer_round + 1) / diloco_cfg.outer_warmup_rounds
    ratio = diloco_cfg.outer_min_lr_ratio
    return peak * (ratio + (1.0 - ratio) * _outer_decay_factor(diloco_cfg, outer_round))


def outer_momentum(diloco_cfg: DilocoConfig, outer_round: int) -> float:
    """Outer (Nesterov) momentum of ``outer_round``: ``outer_momentum`` decayed towards
    ``outer_final_momentum``."""
    if outer_round < 0:
        raise ValueError(f"outer_round={outer_round}: must be >= 0")
    start, end = diloco_cfg.outer_momentum, diloco_cfg.outer_final_momentum
    if end == AUTO:
        return start
    return end + (start - end) * _outer_decay_factor(diloco_cfg, outer_round)


def outer_schedule_is_constant(diloco_cfg: DilocoConfig) -> bool:
    """True if every round uses ``outer_lr`` and ``outer_momentum`` (no warmup, no decay)."""
    return diloco_cfg.outer_warmup_rounds == 0 and (
        diloco_cfg.outer_decay == "constant" or (
            diloco_cfg.outer_min_lr_ratio == 1.0
            and diloco_cfg.outer_final_momentum in (AUTO, diloco_cfg.outer_momentum)
        )
    )


def set_lr(optimizers, lr: float) -> None:
    """Set ``lr`` on every parameter group of every optimizer in ``optimizers``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


def trainer_optimizers(trainer) -> list:
    """The inner optimizers of a :class:`~training.pipeline.LocalReplicaTrainer` or ``PipelineStageTrainer``.
    """
    optimizers = getattr(trainer, "optimizers", None)
    return list(optimizers) if optimizers is not None else [trainer.optimizer]
