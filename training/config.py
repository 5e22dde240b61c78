"""Configuration of the local training, DiLoCoX and the pipeline.

Plain dataclasses with no torch import, validated in ``__post_init__`` with
messages that name the TOML field and say how to fix it. The shared checks and enums are in
training/config_base.py, the model's section in training/model_config.py and the [training] section in
training/config_training.py; all are re-exported here.
The codec's section is in training/config_compression.py (not re-exported: import it from there).
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config_base import (  # re-exported: training.config is these settings' address
    AUTO,
    CHECKPOINT_HASHES,
    DEFAULT_ENCODER,
    DEFAULT_MIN_SLICE_NUMEL,
    DEFAULT_RANDOM,
    DELAY_CORRECTIONS,
    EXCHANGES,
    LEGACY_ENCODER,
    LEGACY_RANDOM,
    MAX_EXCHANGE_PARTS,
    MAX_MIN_SLICE_NUMEL,
    OUTER_ADAM_ONLY,
    OUTER_DECAYS,
    OUTER_NESTEROV_ONLY,
    OUTER_OPTIMIZERS,
    OUTER_STATE_TENSORS,
    PRECISIONS,
    SCREEN_RULES,
    SLICED_FROM_REPLICAS,
    EncoderVersion,
    RandomSource,
    _float_or_auto,
    _int_or_auto,
    _require,
    check_device_spec,
    check_precision,
)
from training.config_training import (
    DEFAULT_OPTIMIZER,
    INNER_OPTIMIZERS,
    LEGACY_OPTIMIZER,
    MUON_ONLY,
    NODE_ONLY_TRAINING,
    TrainingConfig,
)
from training.errors import TrainingConfigError
from training.model_config import (
    BYTES_TOKENIZER,
    DEFAULT_ROPE_THETA,
    FAMILIES,
    LLAMA_ONLY,
    MODEL_PRESETS,
    ModelConfig,
    preset_family,
)

__all__ = [
    "AUTO", "BYTES_TOKENIZER", "CHECKPOINT_HASHES", "DEFAULT_ENCODER", "DEFAULT_MIN_SLICE_NUMEL",
    "DEFAULT_OPTIMIZER", "DEFAULT_RANDOM", "DEFAULT_ROPE_THETA", "DELAY_CORRECTIONS", "EXCHANGES", "FAMILIES",
    "INNER_OPTIMIZERS", "LEGACY_ENCODER", "LEGACY_OPTIMIZER", "LEGACY_RANDOM", "LLAMA_ONLY",
    "MAX_EXCHANGE_PARTS", "MAX_MIN_SLICE_NUMEL", "MODEL_PRESETS", "MUON_ONLY", "NODE_ONLY_TRAINING",
    "OUTER_ADAM_ONLY",
    "OUTER_DECAYS", "OUTER_NESTEROV_ONLY", "OUTER_OPTIMIZERS", "OUTER_STATE_TENSORS", "PRECISIONS",
    "SCREEN_RULES", "SLICED_FROM_REPLICAS", "DilocoConfig", "EncoderVersion", "ModelConfig", "PipelineConfig",
    "RandomSource", "TrainingConfig", "check_device_spec", "check_precision", "preset_family",
]


@dataclass
class DilocoConfig:
    """The outer loop (arXiv 2311.08105, 2506.21263)."""

    inner_steps: int = 50  # H (the benchmark's best at 1.536 M tokens: docs/DILOCOX.md section 9)
    outer_lr: float = 1.0  # measured best at 30 rounds (docs/DILOCOX.md section 9); DiLoCo used 0.7
    outer_momentum: float = 0.5  # DiLoCo used 0.9, too slow for tens of rounds
    nesterov: bool = True
    # The outer lr of every tensor that is not a hidden weight matrix (embeddings, head, norms, biases) is
    # outer_lr times this (a decoupled outer lr per parameter group; training/diloco.py outer_step,
    # docs/DILOCOX.md section 14). 1.0: one outer lr, and the setting is not in the run document (older hashes
    # unchanged).
    outer_lr_other_scale: float = 1.0
    # The outer optimizer (OUTER_OPTIMIZERS; training/diloco.py outer_step). "adam": per element
    # m = b1*m + (1-b1)*Delta, v = b2*v + (1-b2)*Delta^2, theta -= lr * m / (sqrt(v) + eps) (FedAdam, no bias
    # correction), its lr outer_lr (and the schedule's); its state, both moments, is the run's outer momentum
    # tensor stacked on a leading axis of 2. Not fraud-provable on chain (the contract recomputes Nesterov):
    # an outer-Adam run commits "hashed". "nesterov" and the outer_adam_* settings are in the run document
    # only when the optimizer is "adam" (every older hash unchanged).
    outer_optimizer: str = "nesterov"
    outer_adam_beta1: float = 0.9
    outer_adam_beta2: float = 0.99
    outer_adam_eps: float = 1e-8
    # Outer schedule across rounds (training/schedule.py outer_lr / outer_momentum; a pure
    # function of the round index and these fields, so the auditor replays it). Linear warmup of
    # the outer lr over outer_warmup_rounds rounds, then (outer_decay "linear" or "cosine") a
    # decay over the rounds up to outer_decay_rounds of the lr to outer_lr * outer_min_lr_ratio
    # and of the momentum to outer_final_momentum. "constant" (the default): no decay.
    outer_warmup_rounds: int = 0
    outer_decay: str = "constant"
    outer_decay_rounds: int = 0  # the horizon in rounds (the run's length); needed by a decay
    outer_min_lr_ratio: float = 1.0
    outer_final_momentum: float | str = AUTO  # "auto": outer_momentum throughout (no momentum decay)
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
    # "auto" = H // 10 (5 at H = 50, the benchmark's best; 0 below H = 10, where a tenth
    # of a round is less than one step, and with "reset" or without the delay): see
    # overlap (the resolved number every caller uses).
    overlap_steps: int | str = AUTO
    # Byzantine tolerance (training/robust.py; docs/DILOCOX.md section 10). Norm rule, every
    # stage: a contribution whose L2 norm exceeds norm_clip x the lower median of the round's
    # norms is scaled down to that bound (0 = off).
    norm_clip: float = 2.0
    # Screening (training/screening.py), only where one node holds every stage: contribution i
    # is excluded when the loss of (theta - outer_lr * c_i) on a seeded held-out batch of
    # screen_batch_size windows exceeds the median over i (with fixed H; in a time-bounded run under
    # version 1, max(loss of theta, that median)) + max(screen_abs_tol, screen_rel_tol * loss of theta);
    # version 2 (screen_rule, below) judges its slope and its curvature instead.
    screening: bool = True
    screen_rel_tol: float = 0.02
    screen_abs_tol: float = 0.0
    screen_batch_size: int = 16
    # Screening's rule (SCREEN_RULES). "auto" resolves to "one_sided" (the rule above, as before);
    # "two_sided" (version 2) is a time-bounded run's option: measured on the node under the one-step delay
    # it screened out more honest contributions than version 1 (docs/DILOCOX.md section 13); "paired"
    # (version 3), the same rule with each slope judged within its measurement error, is another. "one_sided"
    # is in the run document by its absence (every run made without an option: their hashes unchanged).
    screen_rule: str = AUTO
    # How a round's pseudo-gradients travel (docs/PROTOCOL.md "Sliced exchange", docs/DILOCOX.md
    # section 12): "full", every holder fetches every closed contribution ((R - 1) x C bytes in);
    # "sliced", each stage is cut into slices, aggregator j averages slice j of every replica and
    # publishes a signed partial, every holder fetches the partials (~2 C whatever R). Part of
    # the run document only when "sliced", so the hash of every "full" run is unchanged. "auto"
    # (the node template's) is resolved here, from num_replicas: "sliced" from SLICED_FROM_REPLICAS,
    # else "full"; the run document names what it resolved to, never "auto".
    exchange: str = "full"
    # The sliced exchange's smallest slice, in elements: a stage is cut into
    # A = min(num_replicas, elements // min_slice_numel) slices (training.slice_plan.live_plan). A
    # run setting (every node and the auditor derive the same plan), in the run document only
    # when "sliced". Small slices code worse (docs/DILOCOX.md section 12, "Minimum slice"); a
    # larger minimum also caps A, so only A of the R holders aggregate a slice each round.
    min_slice_numel: int = 1024
    # The full exchange's parts (docs/SCALE.md, "The per-shard exchange"): a contribution travels as P parts,
    # P = min(exchange_parts, the stage's tensors), cut by whole tensors in chunk order
    # (training.cluster_parts.exchange_plan; the same cut on every node whatever its processes), each part a
    # blob of its own, verifiable alone against the envelope's parts root (envelope version 2, p2p/parts.py).
    # 1 (the default): whole contributions in version-1 envelopes, and the setting is not in the run document
    # (every older hash unchanged). Only the full exchange cuts parts.
    exchange_parts: int = 1
    # Rounds bounded by time as well as steps (issue 44, docs/DILOCOX.md section 13): with
    # round_budget_s > 0 each replica trains as many inner steps of a round as fit in that many
    # seconds of wall time (the node's: less its waits for peers, node/live/state/roundclock.py), at least
    # min_inner_steps and at most inner_steps (H, then the maximum and the slot width of the lr schedule), and
    # its contribution declares the count; the aggregation weights every inner step equally. 0 (the default) =
    # fixed H: both settings are then absent from the run document, whose hash stays what it was.
    round_budget_s: float = 0.0
    min_inner_steps: int = 0  # with a budget: 0 means 1
    # How the run's records commit the stages' states: the name of a commitment scheme (node/commitments/,
    # which validates it; docs/FRAUD_PROOF.md, "Where the scheme lives"). "auto" resolves to "normed" (version
    # 3: a wrong aggregation or clip scale is provable on chain; norm_clip = 0 too) wherever the contract's
    # outer step is this run's (contract_outer_step), else "hashed". The document names what "auto" gave: a
    # "chunked" run stays chunked, a document without it stays hashed.
    commitments: str = AUTO
    # What a record's checkpointHash commits (CHECKPOINT_HASHES; docs/PROTOCOL.md, "Archive and retention"):
    # "file", the sha256 of the whole checkpoint file; "header" (a chunked run's), a hash of the file's
    # header alone, whose metadata holds every stage leaf (and the leaves every tensor's chunks), so a
    # committer signs with its own stages checked, never downloading the others'. "auto" is resolved with the
    # model's size (node.runconfig.checkpoint_hash_rule): "header" where the run is chunked and its checkpoint
    # 512 MiB or more (where its nodes keep it split by default), else "file". In the run document only when
    # "header" (every other run's document and hash stay what they were).
    checkpoint_hash: str = AUTO
    # A contribution of this replica left out of its round (it came too late for the close): true (the
    # default, every run made before the setting) puts its transmitted update back, so the next contribution
    # carries it (v = fl(g + u): training/stage_engine.py contribution_dropped); false drops it, and that
    # round's progress of the replica is lost, so each contribution codes its own round alone (what the plain
    # end rule needs: docs/FRAUD_PROOF.md "The claim's end"). In the run document only when false (older
    # hashes unchanged).
    put_back: bool = True

    def __post_init__(self) -> None:
        _require(self.inner_steps >= 1, f"diloco.inner_steps={self.inner_steps}: must be >= 1")
        self.overlap_steps = _int_or_auto(self.overlap_steps, "diloco.overlap_steps")
        _require(self.outer_lr > 0, f"diloco.outer_lr={self.outer_lr}: must be > 0")
        _require(
            0 <= self.outer_momentum < 1,
            f"diloco.outer_momentum={self.outer_momentum}: must be in [0, 1)",
        )
        _require(
            isinstance(self.outer_lr_other_scale, (int, float))
            and not isinstance(self.outer_lr_other_scale, bool)
            and 0 < self.outer_lr_other_scale < float("inf"),
            f"diloco.outer_lr_other_scale={self.outer_lr_other_scale!r}: must be a finite factor > 0 "
            "(1.0: one outer lr)",
        )
        _require(self.outer_warmup_rounds >= 0,
                 f"diloco.outer_warmup_rounds={self.outer_warmup_rounds}: must be >= 0")
        _require(
            self.outer_decay in OUTER_DECAYS,
            f"diloco.outer_decay={self.outer_decay!r}: must be one of {', '.join(OUTER_DECAYS)}",
        )
        _require(self.outer_decay_rounds >= 0,
                 f"diloco.outer_decay_rounds={self.outer_decay_rounds}: must be >= 0")
        _require(
            self.outer_decay == "constant" or self.outer_decay_rounds > self.outer_warmup_rounds,
            f"diloco.outer_decay={self.outer_decay!r} needs diloco.outer_decay_rounds (the run's rounds, "
            f"{self.outer_decay_rounds} now) > diloco.outer_warmup_rounds={self.outer_warmup_rounds}",
        )
        _require(
            0 <= self.outer_min_lr_ratio <= 1,
            f"diloco.outer_min_lr_ratio={self.outer_min_lr_ratio}: must be in [0, 1]",
        )
        self.outer_final_momentum = _float_or_auto(self.outer_final_momentum, "diloco.outer_final_momentum")
        _require(
            self.outer_final_momentum == AUTO or 0 <= self.outer_final_momentum < 1,
            f"diloco.outer_final_momentum={self.outer_final_momentum}: must be in [0, 1) or \"auto\" "
            "(no decay)",
        )
        _require(self.num_replicas >= 1, f"diloco.num_replicas={self.num_replicas}: must be >= 1")
        if self.overlap_steps != AUTO:
            _require(
                0 <= self.overlap_steps < self.inner_steps,
                f"diloco.overlap_steps={self.overlap_steps}: must be in "
                f"[0, diloco.inner_steps={self.inner_steps}) (0 = the whole round) or \"auto\"",
            )
            _require(
                not (self.overlap_steps and self.delay_correction == "reset"),
                "diloco.overlap_steps > 0 needs a delay_correction that keeps local progress (not 'reset')",
            )
        _require(
            self.delay_correction in DELAY_CORRECTIONS,
            f"diloco.delay_correction={self.delay_correction!r}: must be one of "
            f"{', '.join(DELAY_CORRECTIONS)}",
        )
        _require(
            self.norm_clip == 0 or 1 <= self.norm_clip < float("inf"),
            f"diloco.norm_clip={self.norm_clip}: must be 0 (off) or a finite factor >= 1 (below 1 every "
            "contribution above the median would be cut; 2.0 is the default)",
        )
        for name in ("screen_rel_tol", "screen_abs_tol"):
            value = getattr(self, name)
            _require(0 <= value < float("inf"), f"diloco.{name}={value}: must be a finite number >= 0")
        _require(self.screen_batch_size >= 1,
                 f"diloco.screen_batch_size={self.screen_batch_size}: must be >= 1")
        _require(isinstance(self.put_back, bool), f"diloco.put_back={self.put_back!r}: must be true or false")
        self._check_exchange()
        self._check_outer_optimizer()
        self._check_round_budget()
        self._check_commitments()
        self._check_screen_rule()

    def _check_exchange(self) -> None:
        if self.exchange == AUTO:
            self.exchange = "sliced" if self.num_replicas >= SLICED_FROM_REPLICAS else "full"
        _require(
            self.exchange in EXCHANGES,
            f"diloco.exchange={self.exchange!r}: must be one of {', '.join(EXCHANGES)} or \"auto\" "
            f"(sliced from {SLICED_FROM_REPLICAS} replicas)",
        )
        _require(
            type(self.min_slice_numel) is int and 1 <= self.min_slice_numel <= MAX_MIN_SLICE_NUMEL,
            f"diloco.min_slice_numel={self.min_slice_numel!r}: must be a whole number of elements in "
            f"[1, {MAX_MIN_SLICE_NUMEL}] (1024 is the default)",
        )
        _require(
            self.exchange == "sliced" or self.min_slice_numel == DEFAULT_MIN_SLICE_NUMEL,
            f"diloco.min_slice_numel={self.min_slice_numel}: only the sliced exchange cuts slices; "
            f"set diloco.exchange = \"sliced\" or leave it at {DEFAULT_MIN_SLICE_NUMEL}",
        )
        _require(
            type(self.exchange_parts) is int and 1 <= self.exchange_parts <= MAX_EXCHANGE_PARTS,
            f"diloco.exchange_parts={self.exchange_parts!r}: must be a whole number in "
            f"[1, {MAX_EXCHANGE_PARTS}] (1: whole contributions)",
        )
        _require(
            self.exchange == "full" or self.exchange_parts == 1,
            f"diloco.exchange_parts={self.exchange_parts}: only the full exchange moves contributions in "
            "parts; "
            "set diloco.exchange = \"full\" or leave it at 1",
        )

    def _check_screen_rule(self) -> None:
        if self.screen_rule == AUTO:
            self.screen_rule = "one_sided"
        _require(self.screen_rule in SCREEN_RULES,
                 f"diloco.screen_rule={self.screen_rule!r}: must be one of {', '.join(SCREEN_RULES)} or "
                 "\"auto\"")
        _require(self.budgeted or self.screen_rule == "one_sided",
                 f"diloco.screen_rule=\"{self.screen_rule}\" needs diloco.round_budget_s > 0 (a fixed-H run "
                 "screens by version 1, its run documents unchanged)")

    def _check_outer_optimizer(self) -> None:
        _require(self.outer_optimizer in OUTER_OPTIMIZERS,
                 f"diloco.outer_optimizer={self.outer_optimizer!r}: must be one of "
                 f"{', '.join(OUTER_OPTIMIZERS)}")
        if self.outer_optimizer != "adam":
            for name, neutral in OUTER_ADAM_ONLY.items():
                _require(getattr(self, name) == neutral,
                         f"diloco.{name}={getattr(self, name)!r} is a setting of "
                         "diloco.outer_optimizer = \"adam\": remove it or set the optimizer")
            return
        for name, neutral in OUTER_NESTEROV_ONLY.items():
            _require(getattr(self, name) == neutral,
                     f"diloco.{name}={getattr(self, name)!r} is a setting of the Nesterov outer step, which "
                     "diloco.outer_optimizer = \"adam\" does not take (its first moment decays by "
                     "diloco.outer_adam_beta1): remove it")
        for name in ("outer_adam_beta1", "outer_adam_beta2"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1,
                     f"diloco.{name}={value!r}: must be in [0, 1)")
        eps = self.outer_adam_eps
        _require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < float("inf"),
                 f"diloco.outer_adam_eps={eps!r}: must be a finite number > 0 (0 divides 0 by 0 where a "
                 "weight never moved)")

    @property
    def outer_moments(self) -> int:
        """Tensors of outer state per weight: 1 (the Nesterov momentum) or 2 (outer Adam's two moments,
        stacked)."""
        return OUTER_STATE_TENSORS[self.outer_optimizer]

    def _check_commitments(self) -> None:
        # Only "auto" is resolved here: which names exist, and what each needs of the outer loop, is the
        # registry's of commitment schemes (node/commitments/),
        # checked when the node's configuration is built.
        if self.commitments == AUTO:
            self.commitments = "normed" if self.contract_outer_step else "hashed"
        _require(isinstance(self.commitments, str) and self.commitments != "",
                 f"diloco.commitments={self.commitments!r}: must name a commitment scheme or be \"auto\"")
        _require(self.checkpoint_hash in (AUTO, *CHECKPOINT_HASHES),
                 f"diloco.checkpoint_hash={self.checkpoint_hash!r}: must be one of "
                 f"{', '.join(CHECKPOINT_HASHES)} or \"auto\"")

    @property
    def contract_outer_step(self) -> bool:
        """Whether the contract's outer step (a fraud proof recomputes it) is this run's: the full exchange,
        one outer lr, Nesterov. Only such a run's records can commit chunks (docs/FRAUD_PROOF.md)."""
        return self.exchange == "full" and self.outer_lr_other_scale == 1.0 \
            and self.outer_optimizer == "nesterov"

    def _check_round_budget(self) -> None:
        budget, least = self.round_budget_s, self.min_inner_steps
        _require(
            isinstance(budget, (int, float)) and not isinstance(budget, bool) and 0 <= budget < float("inf"),
            f"diloco.round_budget_s={budget!r}: must be a finite number of seconds >= 0 (0 = fixed H)",
        )
        _require(
            type(least) is int and least >= 0,
            f"diloco.min_inner_steps={least!r}: must be a whole number >= 1 (or 0 with no round budget)",
        )
        if budget == 0:
            _require(least == 0, f"diloco.min_inner_steps={least} needs diloco.round_budget_s > 0 "
                                 "(without a time budget every round trains exactly diloco.inner_steps)")
            return
        if least == 0:
            self.min_inner_steps = least = 1
        _require(least <= self.inner_steps, f"diloco.min_inner_steps={least}: must be <= diloco.inner_steps="
                                            f"{self.inner_steps} (the most steps a round may train)")
        _require(least > self.overlap, f"diloco.min_inner_steps={least}: must be > the steps the exchange "
                                       f"overlaps ({self.overlap}, diloco.overlap_steps), so that every "
                                       "round trains at least one step after applying the previous one")

    @property
    def sliced(self) -> bool:
        """Whether the exchange cuts each stage into slices (docs/PROTOCOL.md, "Sliced exchange"): the one
        place training/ reads the exchange's kind (the node's registry of kinds:
        node/live/exchange/registry.py)."""
        return self.exchange == "sliced"

    @property
    def budgeted(self) -> bool:
        """Whether rounds are bounded by time (``round_budget_s > 0``): contributions then declare their
        steps."""
        return self.round_budget_s > 0

    @property
    def steps_range(self) -> tuple[int, int] | None:
        """``(min_inner_steps, inner_steps)``, the declared counts a time-bounded run accepts; None with fixed
        H."""
        return (self.min_inner_steps, self.inner_steps) if self.budgeted else None

    def check_declared_steps(self, steps: object) -> int:
        """A contribution's declared inner steps, checked against the run's range, or TrainingConfigError."""
        if type(steps) is not int:
            raise TrainingConfigError(f"declared inner steps {steps!r}: not a whole number")
        low, high = self.steps_range or (self.inner_steps, self.inner_steps)
        if not low <= steps <= high:
            raise TrainingConfigError(f"declared inner steps {steps}: outside the run's [{low}, {high}]")
        return steps

    @property
    def overlap(self) -> int:
        """The inner steps round t's exchange overlaps (``overlap_steps`` with "auto" resolved).

        "auto" is ``H // 10``: Streaming DiLoCo's tau of about a tenth of the round
        (5 of 50 steps is the benchmark's best, docs/DILOCOX.md section 9), which keeps
        the delay's cost small while leaving the exchange several steps of compute to
        hide behind. Below H = 10 that is less than one step, so the exchange overlaps
        the whole round (0); "reset" cannot overlap partially and without the delay
        there is nothing to overlap.
        """
        if self.overlap_steps != AUTO:
            return int(self.overlap_steps)
        if not self.one_step_delay or self.delay_correction == "reset":
            return 0
        return self.inner_steps // 10


@dataclass
class PipelineConfig:
    """How one replica is split into pipeline stages."""

    num_stages: int = 2
    micro_batches: int = 2

    def __post_init__(self) -> None:
        _require(self.num_stages >= 1, f"pipeline.num_stages={self.num_stages}: must be >= 1")
        _require(self.micro_batches >= 1, f"pipeline.micro_batches={self.micro_batches}: must be >= 1")
