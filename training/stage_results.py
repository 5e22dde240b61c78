"""What a stage engine's round returns: a prepared aggregation and a round's result."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from training.diloco import Aggregation
from training.host_tensors import Weights
from training.robust import ContributionReport


@dataclass
class PreparedAggregation:
    """:meth:`StageEngine.prepare_aggregation`'s result: valid while the engine's global state is ``base``."""

    outer_round: int
    base: tuple[Weights, Weights]  # the global weights and momentum it was computed from (the objects)
    aggregation: Aggregation
    seconds: float


@dataclass
class RoundResult:
    """What ``apply_round`` did: the new global weights' hash, each contribution's fate, timings."""

    outer_round: int
    weights_hash: bytes
    num_contributions: int  # given, accepted or not
    aggregate_seconds: float  # decode + average + outer step + hash
    correction_seconds: float  # re-basing the local weights
    stats: dict = field(default_factory=dict)
    contributions: list[ContributionReport] = field(default_factory=list)  # canonical order

    @classmethod
    def of_round(cls, outer_round: int, result, num_contributions: int, started: float,
                 aggregated: float) -> RoundResult:
        """The result of a round whose aggregation (``result``: weights hash, contribution reports) ran from
        ``started`` to ``aggregated`` (perf_counter) and whose correction ran from then until now."""
        return cls(outer_round=outer_round, weights_hash=result.weights_hash,
                   num_contributions=num_contributions, aggregate_seconds=aggregated - started,
                   correction_seconds=time.perf_counter() - aggregated, contributions=result.contributions)

    @property
    def num_accepted(self) -> int:
        return sum(report.accepted for report in self.contributions)

