"""How a life of the node ends: asked to stop, found guilty by the run's quorum, off the run's record, or its
account left the run.

The rooms that learn why a node must stop (the fork repair finding a committed
record that differs from this node's and that it cannot re-base on, the spot
checks seeing an ejection resolved on chain) tell the :class:`Lifecycle`; the node reads it when it
stops, and ``dlx-node start`` starts it again when it must re-enter.

A re-entry waits while the node's fraud prover holds the forked round (or an earlier one) wrong and its proof
or availability game on it is still open (issue 62; docs/FRAUD_PROOF.md, "The late game"): a next life would
hold neither the pending challenge and its walk nor this life's state of the round, so a coalition that
answers each challenge in the last block of its window would win by the re-entry alone. Once the game is over
the node re-enters, unless the round was overturned on chain (then the record it left is gone: there is
nothing to re-enter into, and it signs nothing on top of the round).
"""

from __future__ import annotations

import logging
import threading

from node.errors import DLX_ERRORS
from node.live.peers.membership import Membership
from node.live.state.status import StateFile

logger = logging.getLogger(__name__)

#: How often a held re-entry asks the prover whether its game with the forked round is over.
HOLD_POLL_S = 2.0


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
        #: The run's fraud prover (node/live/fraud/prover.py, set by the assembly where the run is
        #: fraud-provable): a re-entry waits while it holds the forked round wrong (module docstring).
        self.prover = None
        self.held: int | None = None  # the forked round whose re-entry waits for the prover's game
        self._lock = threading.Lock()

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
        the dispute on record. While the fraud prover holds the round (or an earlier one) wrong with its proof
        or game still open, the re-entry waits for it (module docstring).
        """
        with self._lock:
            if self.held is not None:  # a re-entry waits already: it enters from the earliest forked round
                self.held = min(self.held, outer_round)
                return
        done = self.state.get("reentered_for", [])
        if outer_round in done:
            logger.error(
                "round %d: committed roots differ again after re-entering for it; not re-entering twice",
                outer_round)
            return
        why = self.prover.holds_reentry(outer_round) if self.prover is not None else None
        if why is None:
            self._reenter(outer_round)
            return
        logger.error(
            "round %d: this node's weights left the run's committed record, but %s: the re-entry waits until "
            "that game is over (a next life would hold neither it nor this life's state of the round)",
            outer_round, why)
        with self._lock:
            self.held = outer_round
        threading.Thread(target=self._await_game, name="reentry-hold", daemon=True).start()

    def _await_game(self) -> None:
        """Re-enter once the prover's game with the held round is over, unless the round was overturned."""
        while not self.stop_event.wait(HOLD_POLL_S):
            with self._lock:
                held = self.held
            try:
                if self.prover.holds_reentry(held) is not None:
                    continue
                overturned = self.prover.overturned(held)
            except DLX_ERRORS as exc:  # the chain unreachable: asked again
                logger.debug("round %d: the held re-entry's game not read: %s", held, exc)
                continue
            with self._lock:
                held, self.held = self.held, None
            if overturned:
                logger.warning(
                    "round %d was overturned on chain: the record this node left is gone, nothing to "
                    "re-enter into; it signs nothing on top of it", held)
                return
            self._reenter(held)
            return

    def _reenter(self, outer_round: int) -> None:
        self.state.update(reentered_for=[*self.state.get("reentered_for", [])[-15:], outer_round])
        logger.error(
            "round %d: this node's weights left the run's committed record; stopping to re-enter from "
            "the chain's latest checkpoint", outer_round)
        self.reenter_after = outer_round
        self.stop_event.set()
