"""Configuration of the model, the local training, DiLoCoX and compression.

Plain dataclasses with no torch import, validated in ``__post_init__`` with
messages that name the TOML field and say how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.errors import TrainingConfigError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise TrainingConfigError(message)


MODEL_PRESETS: dict[str, dict[str, int]] = {
    # ~43k parameters: unit and integration tests.
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=32),
    # ~0.87M parameters: demo runs on 2 CPU cores.
    "mini": dict(n_layer=4, n_head=4, n_embd=128, block_size=64),
    # ~2.8M parameters: benchmarks.
    "small": dict(n_layer=6, n_head=6, n_embd=192, block_size=128),
}


@dataclass
class ModelConfig:
    """A GPT-2 shaped decoder. ``preset`` fills the size fields left at 0."""

    preset: str = "tiny"
    vocab_size: int = 256  # byte-level tokenizer
    n_layer: int = 0
    n_head: int = 0
    n_embd: int = 0
    block_size: int = 0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.preset in MODEL_PRESETS,
            f"model.preset={self.preset!r}: must be one of {sorted(MODEL_PRESETS)}",
        )
        for name, value in MODEL_PRESETS[self.preset].items():
            if getattr(self, name) == 0:
                setattr(self, name, value)
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            _require(getattr(self, name) >= 1, f"model.{name}={getattr(self, name)}: must be >= 1")
        _require(
            self.n_embd % self.n_head == 0,
            f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
            "pick n_embd as a multiple of n_head",
        )
        _require(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout}: must be in [0, 1)")


@dataclass
class TrainingConfig:
    """Local (inner) training of one replica."""

    data_path: str = ""  # empty: a small corpus the project generates itself
    seed: int = 0
    batch_size: int = 8
    inner_lr: float = 3e-3
    weight_decay: float = 0.1  # on matrices only (nanoGPT; bench/results/diloco_abl_ddp_*)
    beta1: float = 0.9
    beta2: float = 0.99  # 0.95 -> 0.99: held-out 2.023 -> 1.767 at 1.536 M tokens (docs/DILOCOX.md section 9)
    grad_clip: float = 1.0
    # Inner learning-rate schedule across the whole run (training/schedule.py): linear warmup,
    # then cosine decay to inner_lr * min_lr_ratio over lr_decay_steps inner steps (0: the
    # run's total, rounds * H, when the caller knows it). "constant" keeps inner_lr.
    lr_schedule: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    lr_decay_steps: int = 0
    eval_fraction: float = 0.1  # tail of the corpus held out for evaluation
    eval_batches: int = 4

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, f"training.batch_size={self.batch_size}: must be >= 1")
        _require(self.inner_lr > 0, f"training.inner_lr={self.inner_lr}: must be > 0")
        _require(self.weight_decay >= 0, f"training.weight_decay={self.weight_decay}: must be >= 0")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "training.beta1/beta2: must be in [0, 1)")
        _require(self.grad_clip >= 0, f"training.grad_clip={self.grad_clip}: must be >= 0 (0 = off)")
        _require(
            self.lr_schedule in ("cosine", "constant"),
            f"training.lr_schedule={self.lr_schedule!r}: must be 'cosine' or 'constant'",
        )
        _require(self.warmup_steps >= 0, f"training.warmup_steps={self.warmup_steps}: must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, f"training.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        _require(self.lr_decay_steps >= 0, f"training.lr_decay_steps={self.lr_decay_steps}: must be >= 0 (0 = run length)")
        _require(
            0.0 < self.eval_fraction < 0.5,
            f"training.eval_fraction={self.eval_fraction}: must be in (0, 0.5)",
        )
        _require(self.eval_batches >= 1, f"training.eval_batches={self.eval_batches}: must be >= 1")


DELAY_CORRECTIONS = ("rebase", "lookahead", "eager", "reset")


@dataclass
class DilocoConfig:
    """The outer loop (arXiv 2311.08105, 2506.21263)."""

    inner_steps: int = 20  # H
    outer_lr: float = 1.0  # measured best at 30 rounds (docs/DILOCOX.md section 9); DiLoCo used 0.7
    outer_momentum: float = 0.5  # DiLoCo used 0.9, too slow for tens of rounds
    nesterov: bool = True
    one_step_delay: bool = True
    num_replicas: int = 2  # M, replicas expected per stage
    # How local weights follow a delayed outer step (docs/DILOCOX.md): "rebase" keeps the
    # local progress of the round that overlapped the exchange, theta^t + (L - E_t);
    # "lookahead" also starts that round from the replica's own estimate of theta^t and
    # re-bases from there; "reset" restarts from theta^t (that progress still arrives as
    # the next pseudo-gradient); "eager" is "lookahead" with the others' previous-round
    # contributions standing in for their current ones (arXiv 2502.12996).
    delay_correction: str = "rebase"
    # Inner steps of round t+1 that round t's exchange overlaps before it is applied
    # (Streaming DiLoCo, arXiv 2501.18512); 0 = the whole round (DiLoCoX's one-step delay).
    overlap_steps: int = 0
    # Byzantine tolerance (training/robust.py; docs/DILOCOX.md section 10). Norm rule, every
    # stage: a contribution whose L2 norm exceeds norm_clip x the lower median of the round's
    # norms is scaled down to that bound (0 = off).
    norm_clip: float = 2.0
    # Screening (training/screening.py), only where one node holds every stage: contribution i
    # is excluded when the loss of (theta - outer_lr * c_i) on a seeded held-out batch of
    # screen_batch_size windows exceeds min(loss of theta, median over i) + max(screen_abs_tol,
    # screen_rel_tol * loss of theta).
    screening: bool = True
    screen_rel_tol: float = 0.02
    screen_abs_tol: float = 0.0
    screen_batch_size: int = 16

    def __post_init__(self) -> None:
        _require(self.inner_steps >= 1, f"diloco.inner_steps={self.inner_steps}: must be >= 1")
        _require(self.outer_lr > 0, f"diloco.outer_lr={self.outer_lr}: must be > 0")
        _require(
            0 <= self.outer_momentum < 1,
            f"diloco.outer_momentum={self.outer_momentum}: must be in [0, 1)",
        )
        _require(self.num_replicas >= 1, f"diloco.num_replicas={self.num_replicas}: must be >= 1")
        _require(
            0 <= self.overlap_steps < self.inner_steps,
            f"diloco.overlap_steps={self.overlap_steps}: must be in [0, diloco.inner_steps={self.inner_steps}) "
            "(0 = the whole round)",
        )
        _require(
            not (self.overlap_steps and self.delay_correction == "reset"),
            "diloco.overlap_steps > 0 needs a delay_correction that keeps local progress (not 'reset')",
        )
        _require(
            self.delay_correction in DELAY_CORRECTIONS,
            f"diloco.delay_correction={self.delay_correction!r}: must be one of {', '.join(DELAY_CORRECTIONS)}",
        )
        _require(
            self.norm_clip == 0 or 1 <= self.norm_clip < float("inf"),
            f"diloco.norm_clip={self.norm_clip}: must be 0 (off) or a finite factor >= 1 (below 1 every "
            "contribution above the median would be cut; 2.0 is the default)",
        )
        for name in ("screen_rel_tol", "screen_abs_tol"):
            value = getattr(self, name)
            _require(0 <= value < float("inf"), f"diloco.{name}={value}: must be a finite number >= 0")
        _require(self.screen_batch_size >= 1, f"diloco.screen_batch_size={self.screen_batch_size}: must be >= 1")


@dataclass
class CompressionConfig:
    """Adaptive low-rank + quantization codec for pseudo-gradients."""

    enabled: bool = True
    error_budget: float = 0.4  # max relative Frobenius error per tensor and round
    max_rank: int = 32
    bit_choices: list[int] = field(default_factory=lambda: [2, 4, 8])
    error_feedback: bool = True
    min_compress_numel: int = 4096  # smaller tensors are only quantized
    # Bytes one replica may send for one stage per round (training/bandwidth.py). > 0: the
    # codec spends this budget where it removes the most error (error_budget is then unused);
    # 0: every tensor is coded to error_budget.
    bandwidth_budget: int = 0

    def __post_init__(self) -> None:
        _require(
            0 < self.error_budget <= 1,
            f"compression.error_budget={self.error_budget}: must be in (0, 1]",
        )
        _require(self.max_rank >= 1, f"compression.max_rank={self.max_rank}: must be >= 1")
        _require(
            len(self.bit_choices) > 0 and all(b in (2, 4, 8, 16) for b in self.bit_choices),
            f"compression.bit_choices={self.bit_choices}: must be a non-empty subset of [2, 4, 8, 16]",
        )
        self.bit_choices = sorted(set(self.bit_choices))
        _require(
            self.bandwidth_budget >= 0,
            f"compression.bandwidth_budget={self.bandwidth_budget}: must be >= 0 bytes (0 = use error_budget)",
        )
        _require(
            self.min_compress_numel >= 1,
            f"compression.min_compress_numel={self.min_compress_numel}: must be >= 1",
        )


@dataclass
class PipelineConfig:
    """How one replica is split into pipeline stages."""

    num_stages: int = 2
    micro_batches: int = 2

    def __post_init__(self) -> None:
        _require(self.num_stages >= 1, f"pipeline.num_stages={self.num_stages}: must be >= 1")
        _require(self.micro_batches >= 1, f"pipeline.micro_batches={self.micro_batches}: must be >= 1")
