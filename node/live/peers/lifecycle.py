"""How a life of the node ends: asked to stop, found guilty by the run's quorum, off the run's record, or its
account left the run.

The rooms that learn why a node must stop (the fork repair finding a committed
record that differs from this node's and that it cannot re-base on, the spot
checks seeing an ejection resolved on chain) tell the :class:`Lifecycle`; the node reads it when it
stops, and ``dlx-node start`` starts it again when it must re-enter.
"""

from __future__ import annotations

import logging
import threading

from node.live.peers.membership import Membership
from node.live.state.status import StateFile

logger = logging.getLogger(__name__)


class Lifecycle:
    """The end of this node's life in the run (see module docstring)."""

    def __init__(self, *, run_id: int, peer_id: str, state: StateFile, membership: Membership,
                 stop: threading.Event) -> None:
        self.run_id = run_id
        self.peer_id = peer_id
        self.state = state
        self.membership = membership
        self.stop_event = stop
        self.ejected = False  # this node was found guilty on chain and removed from the run
        #: A round whose committed record differs from this node's: the node stops, and ``dlx-node start``
        #: starts it again in the same process, entering from
        #: the chain's latest checkpoint (:meth:`diverged`).
        self.reenter_after: int | None = None
        self.left = False  # its account left the run (dlx-node leave): it finishes what it owes, then stops

    def member_ejected(self, peer_id: str, account: bytes) -> None:
        """A member was found guilty on chain: stop counting it; if it is this node, stop."""
        self.membership.eject(peer_id)
        if peer_id == self.peer_id:
            logger.error(
                "this node (account 0x%s) was found guilty by the run's quorum and removed from run %d; "
                "stopping", account.hex(), self.run_id)
            self.ejected = True
            self.stop_event.set()
        else:
            logger.warning("member %s (account 0x%s) removed from the run: its messages no longer count",
                           peer_id[-8:], account.hex())

    def seat_ended(self, status: str) -> None:
        """This node's account no longer holds an active seat (``status``: "unbonding" after ``dlx-node
        leave``, or "withdrawn"): it trains no further round; what it owes its peers of the rounds it
        contributed to is finished, then it stops (it no longer waits for the run's end)."""
        if self.left:
            return
        self.left = True
        logger.warning("this node's account left run %d (its seat is %s): finishing the rounds it "
                       "contributed to, then stopping", self.run_id, status)

    def diverged(self, outer_round: int) -> None:
        """The chain's record of ``outer_round`` (a quorum's) is not what this node computed: re-enter from
        it.

        This node aggregated another set than the quorum did (a fork: docs/PROTOCOL.md, "When a
        node's weights leave the record"), so every later round of its would disagree as well, and
        node/live/record/forkrepair.py could not re-base it in place (it applied later rounds before the
        chain's record came, the record is not what its contributions give, or the sliced exchange
        holds only its slices). It stops, and the command starts it again, which enters after the chain's
        latest checkpoint as any restart does. Once per round in any life: if the same round diverges again (a
        checkpoint older than it, whose catch-up forks the same way), the node keeps going with
        the dispute on record.
        """
        done = self.state.get("reentered_for", [])
        if outer_round in done:
            logger.error(
                "round %d: committed roots differ again after re-entering for it; not re-entering twice",
                outer_round)
            return
        self.state.update(reentered_for=[*done[-15:], outer_round])
        logger.error(
            "round %d: this node's weights left the run's committed record; stopping to re-enter from "
            "the chain's latest checkpoint", outer_round)
        self.reenter_after = outer_round
        self.stop_event.set()
