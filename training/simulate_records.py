"""What a simulation returns (one record per outer round, the run's result) and the clock its timings use."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# What the per-round timings measure. Wall time by default; a benchmark on a shared machine
# sets time.process_time (with one torch thread, the CPU seconds of each phase), so other
# jobs' load does not distort the codec's share of a round (bench_diloco.py --cpu-clock).
_clock: Callable[[], float] = time.perf_counter


def set_clock(clock: Callable[[], float]) -> None:
    """Use ``clock`` for the timings of later :func:`~training.simulate.simulate` calls (module-level: one
    benchmark per process)."""
    global _clock
    _clock = clock


def now() -> float:
    """The simulation's clock (:func:`set_clock`)."""
    return _clock()


# (outer_round, stage, contributions in replica order) -> what the replicas actually send.
Tamper = Callable[[int, int, list[bytes]], list[bytes]]


@dataclass
class RoundRecord:
    """One outer round (H inner steps) of a simulation."""

    outer_round: int
    train_loss: float  # mean inner-step loss over replicas and steps
    eval_loss: float | None  # held-out loss of the current global weights
    bytes_sent_per_replica: float  # this round, averaged over replicas
    raw_bytes_per_replica: float  # float32 size of what was compressed (0 for ddp)
    compression_ratio: float  # raw / encoded (1 for diloco, 0 for ddp)
    train_seconds: float  # inner steps, per replica (mean)
    codec_seconds: float  # encode, per replica (mean)
    outer_seconds: float  # decode + average + outer step + correction, per replica (mean)
    weights_root: str = ""  # hex root of the global weights after the last applied round
    tensors: list[dict] = field(default_factory=list)  # codec choices of replica 0 (diloco_x)
    # The rounds applied during this one (they lag by one with the delay), each
    # {"outer_round", "screening": [ScreeningReport], "aggregation": [per stage [ContributionReport]]} as
    # dicts.
    applied: list[dict] = field(default_factory=list)
    # A time-bounded run's (diloco.round_budget_s): the inner steps each replica trained and declared.
    declared_steps: list[int] = field(default_factory=list)


@dataclass
class SimulationResult:
    mode: str
    num_replicas: int
    num_stages: int
    inner_steps: int
    outer_rounds: int
    num_params: int
    tokens_per_replica: int
    rounds: list[RoundRecord]
    final_eval_loss: float
    final_weights_root: str

    @property
    def bytes_per_replica(self) -> float:
        return sum(r.bytes_sent_per_replica for r in self.rounds)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_replica / self.tokens_per_replica

    @property
    def codec_outer_share(self) -> float:
        """(encode + outer step) / (inner steps + encode + outer step), over the run."""
        sync = sum(r.codec_seconds + r.outer_seconds for r in self.rounds)
        total = sync + sum(r.train_seconds for r in self.rounds)
        return sync / total if total else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            bytes_per_replica=self.bytes_per_replica,
            bytes_per_token=self.bytes_per_token,
            codec_outer_share=self.codec_outer_share,
        )
        return out
