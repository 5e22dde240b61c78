"""How far a node's training may run ahead of the run's commits (``max_rounds_ahead``).

A round's record goes on chain only once a quorum of members signed it, and the chain
takes round t only after round t-1; the committer waits for both on its own thread
(node/live/record/committer.py), not on the training one. Without a bound a replica trained round 38 while
round 25 was the last committed: everything it did past that is at risk if a record goes another
way, and peers judge a member's round claims only within
``8 + 2 * checkpoint_every`` rounds of the last commit (RunEntry.round_window). So a node
does not begin training round t while ``t - last_committed > max_rounds_ahead``
(:func:`may_begin`); it waits, says "waiting for commits" in status.json, and goes on
once the chain catches up.

This never holds back the commits it waits for: with the one-step delay a node begins
round t having finished (attested) round t-2, and round t-2's commit needs only the
rounds' exchanges up to t-2; ``max_rounds_ahead >= 2`` (node/config.py) keeps the round
it waits for at or before t-2.
"""

from __future__ import annotations

import logging
import threading
import time

from node.config import NodeConfig
from node.errors import DLX_ERRORS
from node.live.exchange.coordination import RoundStopped
from node.live.state.roundclock import RoundClock
from node.live.state.status import Progress, Reporter

logger = logging.getLogger(__name__)

#: How often a waiting node looks at the chain's last round again.
POLL_S = 2.0
#: How often a wait says what it waits for.
REPORT_EVERY_S = 60.0
#: The state status.json shows while a node waits.
WAITING = "waiting for commits"


def may_begin(outer_round: int, last_committed: int, max_rounds_ahead: int) -> bool:
    """Whether training of ``outer_round`` may begin with ``last_committed`` the last round on chain (-1:
    none)."""
    return outer_round - last_committed <= max_rounds_ahead


class CommitPace:
    """Holds the training thread at the start of a round that would run too far ahead (module docstring)."""

    def __init__(self, *, cfg: NodeConfig, chain, progress: Progress, reporter: Reporter, clock: RoundClock,
                 stop: threading.Event) -> None:
        self.cfg = cfg
        self.run_id = cfg.ledger.run_id
        self.chain = chain  # node.live.chain.onchain.NodeChain: last_round
        self.progress = progress
        self.reporter = reporter
        self.clock = clock
        self.stop = stop
        self._chain_last = -1  # the chain's last round as last read here
        self.waited_s = 0.0  # over this life

    def last_committed(self, read_chain: bool) -> int:
        """The newest committed round known here: this node's confirmed commits, or the chain's last round."""
        if read_chain:
            try:
                self._chain_last = max(self._chain_last, self.chain.last_round(self.run_id))
            except DLX_ERRORS as exc:  # an RPC outage: what was seen stands
                logger.debug("the chain's last round not read: %s", exc)
        return max(self.progress.last_commit, self._chain_last)

    def await_room(self, outer_round: int) -> None:
        """Return once round ``outer_round`` may begin; raise RoundStopped if the node is asked to stop."""
        limit = self.cfg.max_rounds_ahead
        if may_begin(outer_round, self.last_committed(read_chain=False), limit):
            return
        last = self.last_committed(read_chain=True)
        if may_begin(outer_round, last, limit):
            return
        logger.warning("round %d: waiting for commits: the last committed round is %d, %d rounds behind "
                       "(max_rounds_ahead = %d)", outer_round, last, outer_round - last, limit)
        self.reporter.set_state(WAITING)
        started = reported = time.monotonic()
        with self.clock.phase("commit_wait"):
            while not may_begin(outer_round, last, limit):
                if self.stop.wait(POLL_S):
                    raise RoundStopped(f"stopped while round {outer_round} waited for commits")
                last = self.last_committed(read_chain=True)
                if self.progress.state != WAITING:  # the prefetch thread said "finishing" meanwhile
                    self.reporter.set_state(WAITING)
                if time.monotonic() - reported >= REPORT_EVERY_S:
                    reported = time.monotonic()
                    logger.info("round %d: still waiting for commits (last committed %d, %.0fs so far)",
                                outer_round, last, reported - started)
        waited = time.monotonic() - started
        self.waited_s += waited
        logger.info("round %d: commits caught up (last committed %d) after %.1fs; training goes on",
                    outer_round, last, waited)
