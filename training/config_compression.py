"""The codec's configuration (``[compression]``): :class:`CompressionConfig`.

A plain dataclass with no torch import, validated in ``__post_init__`` like the other sections
(training/config.py); the shared checks and enums are in training/config_base.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from training.config_base import (
    AUTO,
    DEFAULT_ENCODER,
    DEFAULT_RANDOM,
    LEGACY_RANDOM,
    EncoderVersion,
    QuantScale,
    RandomSource,
    _int_or_auto,
    _require,
)

# "auto" bandwidth budgets never compress one round's contribution more than this (bytes
# of float32 over bytes sent): at H = 50 the 1000x target asks for about 20.
AUTO_MAX_ROUND_RATIO = 64.0
#: The codec of a new run: what ``dlx-node init``'s node.toml and ``dlx-node demo`` set (issue 66's sixth
#: pass, docs/DILOCOX.md section 14: encoder "v2", the selection every round, with low-bit scales clipped to
#: the smallest squared error and no error feedback beat the fifth pass's default (v4, no feedback) at every
#: seed at both sizes with Muon and at the largest with AdamW, and is the best codec measured at the largest
#: size). ``CompressionConfig()`` and a configuration that names none keep the codec's own defaults
#: (encoder "v4", scales "max", feedback on: the codec's tests and the benchmarks' "node defaults" rows).
NEW_RUN_COMPRESSION = {"encoder": "v2", "quant_scale": "mse", "error_feedback": False}
#: Error feedback in a run document that names none (on: every run document names it, so one without it
#: predates the first new-run default, issue 66's fifth pass).
LEGACY_ERROR_FEEDBACK = True


def new_run_compression_settings() -> list[str]:
    """``NEW_RUN_COMPRESSION`` as ``--set`` settings (``compression.encoder=v2``, ...)."""
    return [f"compression.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in NEW_RUN_COMPRESSION.items()]


@dataclass
class CompressionConfig:
    """Adaptive low-rank + quantization codec for pseudo-gradients."""

    enabled: bool = True
    error_budget: float = 0.4  # max relative Frobenius error per tensor and round
    max_rank: int = 32
    bit_choices: list[int] = field(default_factory=lambda: [2, 4, 8])
    error_feedback: bool = True
    # How much of the error-feedback residual the next round's target carries (training/compression.py):
    # target_t = g_t + error_feedback_decay * e_{t-1}. 1.0: plain error feedback (Seide et al. 2014), and the
    # setting is not in the run document (every older hash unchanged); below 1, a leaky accumulator as in
    # SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): what the codec left out fades instead of arriving
    # whole rounds later (docs/DILOCOX.md section 14).
    error_feedback_decay: float = 1.0
    # How a column's scale is picked at 4 bits or fewer (QuantScale): "max" (its largest magnitude maps to
    # qmax; every run before the setting, which is then not in the run document) or "mse" (the clipped scale
    # with the smallest squared error, training/codec/coding.py; docs/DILOCOX.md section 14). An encoder
    # choice only: the wire format and the decoder are the same.
    quant_scale: str = QuantScale.MAX.value
    min_compress_numel: int = 4096  # smaller tensors are only quantized
    # Bytes one replica may send for one stage per round (training/codec/allocation.py). > 0: the
    # codec spends this budget where it removes the most error (error_budget is then unused);
    # 0: every tensor is coded to error_budget; "auto": the budget that sends target_reduction
    # times fewer bytes than a float32 ring AllReduce of the same inner steps would
    # (stage_bandwidth_budget; about 87 kB per stage of mini at H = 50, M = 2).
    bandwidth_budget: int | str = AUTO
    target_reduction: float = 1000.0
    # Which encoder picks the bytes (EncoderVersion; training/codec/, one module each). Every version
    # writes the same wire format and every decoder reads them all. Part of the run configuration
    # (the run document names it), so a re-executing verifier codes with the run's encoder. A
    # configuration that names none gets DEFAULT_ENCODER ("v4": v2's selection every 4th round, the
    # bytes re-allocated from its error estimates in between; state: the stage engine's encoder
    # memo); a run document that names none, LEGACY_ENCODER ("v1"; node.runconfig.node_config_from_run).
    encoder: str = DEFAULT_ENCODER.value
    # Where the factorizations' fixed Gaussian sketch comes from (RandomSource): "philox" (the same bits on
    # every machine) for a configuration that names none; "torch" (torch.randn, whose float32 kernel differs
    # by CPU instruction set) for a run document that names none (node.runconfig.node_config_from_run).
    sketch: str = DEFAULT_RANDOM.value

    def __post_init__(self) -> None:
        sources = [source.value for source in RandomSource]
        _require(self.sketch in sources, f"compression.sketch={self.sketch!r}: must be one of {sources} "
                                         "(\"philox\": the same sketch on every machine)")
        self.sketch = RandomSource(self.sketch).value
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
        self.bandwidth_budget = _int_or_auto(self.bandwidth_budget, "compression.bandwidth_budget")
        _require(
            self.bandwidth_budget == AUTO or self.bandwidth_budget >= 0,
            f"compression.bandwidth_budget={self.bandwidth_budget}: must be >= 0 bytes (0 = use "
            'error_budget) or "auto"',
        )
        _require(
            1 <= self.target_reduction < float("inf"),
            f"compression.target_reduction={self.target_reduction}: must be a finite factor >= 1",
        )
        _require(
            self.min_compress_numel >= 1,
            f"compression.min_compress_numel={self.min_compress_numel}: must be >= 1",
        )
        decay = self.error_feedback_decay
        _require(isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay <= 1,
                 f"compression.error_feedback_decay={decay!r}: must be a number in (0, 1] (1: plain error "
                 "feedback)")
        self.error_feedback_decay = float(decay)
        scales = [scale.value for scale in QuantScale]
        _require(isinstance(self.quant_scale, str) and self.quant_scale in scales,
                 f"compression.quant_scale={self.quant_scale!r}: must be one of {scales} (\"max\": every run "
                 "before the setting)")
        self.quant_scale = QuantScale(self.quant_scale).value
        versions = [version.value for version in EncoderVersion]
        _require(self.encoder in versions, f"compression.encoder={self.encoder!r}: must be one of {versions}")
        self.encoder = EncoderVersion(self.encoder).value  # a plain str, as TOML and the run document hold it

    def document(self) -> dict:
        """The settings as plain data (the run document's [compression] table); ``sketch`` only when it is not
        the legacy source, so a run document from before ``compression.sketch`` rebuilds to the same bytes;
        ``error_feedback_decay`` only when it is not 1 (plain error feedback, every run before it existed) and
        ``quant_scale`` only when it is not "max" (likewise)."""
        out = dataclasses.asdict(self)
        if self.sketch == LEGACY_RANDOM:
            del out["sketch"]
        if self.error_feedback_decay == 1.0:
            del out["error_feedback_decay"]
        if self.quant_scale == QuantScale.MAX:
            del out["quant_scale"]
        return out

    def stage_bandwidth_budget(self, stage_numel: int, inner_steps: int, num_replicas: int) -> int:
        """Bytes per contribution of a stage of ``stage_numel`` parameters per round (0: code to
        error_budget).

        A number is returned as configured. "auto" sends ``target_reduction``
        times fewer bytes than data-parallel training would for the same H inner
        steps, a float32 ring AllReduce of ``2 (M-1)/M * 4`` bytes per parameter
        and step (M at least 2, the smallest data-parallel group)::

            budget = floor(4 * stage_numel * H * 2 (M-1)/M / target_reduction)

        and never less than the stage's float32 size / AUTO_MAX_ROUND_RATIO (short
        rounds would otherwise ask for more than a useful coding can give; the
        reduction is then below the target). A pure function of the run's
        configuration and the model's shapes, so every replica, a re-executing
        verifier and the benchmark get the same number.
        """
        if self.bandwidth_budget != AUTO:
            return int(self.bandwidth_budget)
        replicas = max(2, num_replicas)
        raw = 4 * stage_numel
        budget = int(raw * inner_steps * 2 * (replicas - 1) / replicas / self.target_reduction)
        return max(budget, int(raw / AUTO_MAX_ROUND_RATIO), 1)
