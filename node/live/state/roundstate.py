"""What this process keeps per outer round, in one place, forgotten in one call.

The rooms keep their own per-round books (the round book, the contribution
pool, the coordinator's closes, the exchange's partial announces); this is the
node's: the training figures and the held-out eval of each round it trained,
the start states it served, the apply prefetches, and the stage weights hashes
it computed. :meth:`RoundState.forget_before` drops all of it for old rounds,
so memory stays flat on long runs.

It also names what a round's gathering yields (:class:`StageInputs`,
:class:`Gathered`): the close of each held stage and what the exchange fetched
and prepared for it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from node import protocol as msg
from node.live.state.station import Station
from training.reexec import start_global_round

#: Rounds of stage weights hashes kept behind the forgotten ones (the spot checks replay round t-1 from
#: the hashes of rounds t-3..t-1).
STAGE_HASH_ROUNDS_KEPT = 8


@dataclass
class StageInputs:
    """One stage of a round, gathered: its close and what the exchange fetched and prepared for it.

    The full exchange fills every field; the sliced exchange only the close (its partials are
    fetched at the apply).
    """

    close: msg.Close
    envelopes: list[bytes] | None = None  # the closed envelopes, in the close's order
    payloads: list[bytes] | None = None  # their decoded contribution blobs
    screened: dict[int, str] = field(default_factory=dict)  # excluded index -> reason
    # the pure part of the outer step, computed ahead (StageEngine.prepare_aggregation)
    prepared: object = None


@dataclass
class Gathered:
    """A round's closes, contributions and prepared aggregations, stage by stage."""

    sealed_before: dict[int, msg.Close] | None  # RestartRecovery.sealed_closes() of the round
    stages: dict[int, StageInputs]
    waited: dict[str, float]  # seconds the gathering spent waiting and aggregating
    joined_s: float = 0.0  # seconds the training thread waited for it
    last_arrival: float | None = None


@dataclass
class TrainFigures:
    """What this node attests of a round it trained (the held-out loss comes later: RoundState.evals)."""

    train_loss: float
    eval_loss: float
    tokens: int


class RoundState:
    """The node's per-round state (see module docstring)."""

    def __init__(self, station: Station) -> None:
        self.station = station
        self.trained: dict[int, TrainFigures] = {}  # rounds this process trained
        self.parts: dict[int, list] = {}  # round -> TrainStats of its parts trained so far
        self.reannounced: set[int] = set()  # rounds whose archived contribution this life announced again
        self.start_states: dict[int, dict[int, bytes]] = {}  # round -> stage -> start-state hash served
        self.evals: dict[int, Future] = {}  # round -> future of its held-out loss
        # With the delay, round t-1's close, fetch and aggregation
        # while round t trains (RoundFinisher.prefetch).
        self.prefetched: dict[int, Future] = {}
        self.apply_reached: dict[int, float] = {}  # round -> when the training thread reached its apply
        # round -> stage -> weights hash after its outer step
        self.stage_hashes: dict[int, dict[int, bytes]] = {}
        # Rounds trained (in part) on a global state this node re-based away from: never announced
        # (docs/PROTOCOL.md, "When a node's weights leave the record"): withhold_on, starting.
        self.withheld: set[int] = set()
        # rounds whose re-base on the record is queued, not taken yet (ForkRepair)
        self.rebasing: set[int] = set()

    def contributed(self, outer_round: int) -> bool:
        """Whether this node trained and encoded ``outer_round`` (in this life, or announced it again)."""
        return outer_round in self.trained or outer_round in self.reannounced

    def mark_reannounced(self, rounds: set[int]) -> None:
        """This life announced its archived contributions of ``rounds`` again (RestartRecovery.reannounce)."""
        self.reannounced = set(rounds)

    def withhold_on(self, rebased: int, diloco_cfg) -> list[int]:
        """Rounds begun (start state taken) and not announced whose start state holds this node's result of
        ``rebased``, which leaves for the record's: withheld from now on. Returns the rounds newly
        withheld."""
        begun = set(self.start_states) | set(self.parts)  # copies in one C call: the lane adds start states
        marked = sorted(r for r in begun if start_global_round(diloco_cfg, r) >= rebased
                        and r not in self.withheld)
        self.withheld.update(marked)
        return marked

    def starting(self, outer_round: int, diloco_cfg) -> bool:
        """``outer_round``'s start state is being taken: withhold the round if it holds a result whose re-base
        is queued (it came before the round began, and is taken only at the next apply). Whether it is
        withheld."""
        if any(start_global_round(diloco_cfg, outer_round) >= r for r in set(self.rebasing)):
            self.withheld.add(outer_round)
        return outer_round in self.withheld

    def stage_hashes_of(self, outer_round: int) -> dict[int, bytes]:
        """Stage -> weights hash of ``outer_round`` as this node computed it (round -1: the initial
        weights)."""
        if outer_round < 0:
            return self.station.worker().initial_hashes()
        return dict(self.stage_hashes.get(outer_round, {}))

    def forget_before(self, outer_round: int) -> None:
        """Drop the state of rounds before ``outer_round`` (stage hashes: STAGE_HASH_ROUNDS_KEPT more)."""
        for old in [r for r in self.trained if r < outer_round]:
            del self.trained[old]
        self.withheld = {r for r in self.withheld if r >= outer_round}
        for old in [r for r in self.stage_hashes if r < outer_round - STAGE_HASH_ROUNDS_KEPT]:
            del self.stage_hashes[old]
        for old in [r for r in list(self.start_states) if r < outer_round]:  # list(): the lane adds rounds
            self.start_states.pop(old, None)
        for old in [r for r in self.evals if r < outer_round]:
            del self.evals[old]
