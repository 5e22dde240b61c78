"""Taking over a round's close from a coordinator ranked above (docs/PROTOCOL.md, "Closing a round").

A lower-ranked coordinator's turn (its deadline + ``CLOSE_FALLBACK_S`` x rank) is a reading of its own clock,
and each node's deadline runs from its own apply: at load 40 two nodes' deadlines were 7 s apart, and a
backup closed, and aggregated its own close, while the live leader's was on its way (the 60-minute soak,
round 12). So a turn only lets a coordinator *ask*: it signs a takeover of (round, stage) once it could
close, and closes only when every coordinator ranked above it answered (its close, used as ever, being
ranked higher; or a signed yield, "I will not close this round", after which none of its closes counts),
is gone (``Membership.present``) or refused, or stayed silent for :meth:`TakingOver.answer_limit` after
the ask (a leader connected but mute: Byzantine, or starved past the limit). A coordinator asked by one
ranked below it answers by its own deadline: with its close, or, having none to sign then, with a yield.
A mixin of :class:`node.live.exchange.coordination.RoundCoordinator` (its book, gossip and close rules).
"""

from __future__ import annotations

import logging

from node import protocol as msg

logger = logging.getLogger(__name__)


class TakingOver:
    """The takeover rules of :class:`~node.live.exchange.coordination.RoundCoordinator` (module docstring)."""

    def answer_limit(self) -> float:
        """Seconds a coordinator whose turn came waits for the live coordinators ranked above it to close or
        yield before it closes without their answer (a leader that is connected but answers nothing)."""
        return self.stall_limit()

    def _asked_by_lower(self, outer_round: int, stage: int, order: list[str]) -> bool:
        """Whether a coordinator ranked below this node asked to take over (round, stage)."""
        below = order[order.index(self.peer_id) + 1:] if self.peer_id in order else []
        return any(c in below for c in self.book.takeovers_of(outer_round, stage))

    def _yield(self, outer_round: int, stage: int) -> None:
        """Sign that this node will not close (round, stage); from then on it only takes another's close."""
        logger.info(
            "round %d stage %d: no close here at the deadline; yielding to the coordinator that asked",
            outer_round, stage)
        self.gossip(outer_round, msg.YIELD, msg.Yield(), stage)
        self.book.add_yield(outer_round, stage, self.peer_id)

    def _take_over(self, outer_round: int, stage: int, above: list[str], now: float,
                   alive: set[str]) -> msg.Close | None:
        """This node's turn to close (round, stage) came while coordinators ranked above it are present.

        It closes only once each of them has answered: with a close (used, being ranked higher) or a yield
        (it then ranks above them); it asks them with a signed takeover once it could close. Only where
        they stay silent for :meth:`answer_limit` after the ask does it close without them. Its own
        deadline alone never lets it close before a live leader: deadlines run from each node's own apply
        and differ between nodes by the load (the 60-minute soak's fork of round 12)."""
        if self.ready_close(outer_round, stage, True, alive, log=False) is None:
            return None  # nothing to close with yet: nobody is asked
        asked = self._asked.get((outer_round, stage))
        if asked is None:
            self._asked[(outer_round, stage)] = asked = now
            logger.info("round %d stage %d: asking %s to close or yield before taking over", outer_round,
                        stage, ", ".join(c[-8:] for c in above))
            self.gossip(outer_round, msg.TAKEOVER, msg.Takeover(), stage)
            self.book.add_takeover(outer_round, stage, self.peer_id)
            return None
        if now - asked < self.answer_limit():
            return None
        logger.warning(
            "round %d stage %d: %s neither closed nor yielded within %.0fs of the takeover: closing "
            "without them", outer_round, stage, ", ".join(c[-8:] for c in above), now - asked)
        return self.try_close(outer_round, stage, final=True, alive=alive)
