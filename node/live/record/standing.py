"""How a round stands with this node's result: the chain's verdict, else a quorum of the attestations
heard (ForkRepair's)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping

from node import protocol as msg
from node.errors import DLX_ERRORS
from training.reexec import start_global_round

logger = logging.getLogger(__name__)


#: The chain's quorum (signatures a commit needs) is read again at most this often while rounds are judged.
QUORUM_READ_EVERY_S = 30.0

#: How often a wait for a round's standing looks at the attestations heard.
STANDING_POLL_S = 0.25

#: How the attestations heard of one stage of a round stand with this node's result (attested_standing).
CONFIRMED, CONTESTED, PENDING = "confirmed", "contested", "pending"

#: How a round stands (ForkRepair.standing): the chain's verdict, else the attestations, else nothing of ours.
AGREED, FORKED, NOT_OURS = "agreed", "forked", "not ours"

def attested_standing(own: tuple[bytes, bytes], votes: Mapping[tuple[bytes, bytes], int],
                      threshold: int) -> str:
    """How the attestations heard of one stage of a round stand with this node's result ``own``.

    ``votes``: (weights hash, contributions root) -> how many members attested it (this node
    included); ``threshold``: the attesters a result needs to be relied on before the chain's
    verdict (:meth:`ForkRepair.threshold`: the chain's quorum, at most the round's expected
    attesters). :data:`CONFIRMED`: ``own`` has that many and no other result has: no record but
    ours can gather a quorum from what the members attested (unless a quorum forked alike, a
    fork of the quorum itself, which only the chain decides). :data:`CONTESTED`: another result
    is attested as often as ours, or by that many. :data:`PENDING`: not yet a quorum either way.
    """
    own_count = votes.get(own, 0)
    others = [count for result, count in votes.items() if result != own]
    if own_count >= threshold and all(count < threshold for count in others):
        return CONFIRMED
    if any(count >= min(threshold, max(1, own_count)) for count in others):
        return CONTESTED
    return PENDING


class RoundStanding:
    """How a round stands (see the module docstring)."""

    def announceable(self, outer_round: int) -> bool:
        """Whether this node may announce its contribution of ``outer_round``: the round its start state holds
        (:func:`training.reexec.start_global_round`) stands as agreed or confirmed. Waits (at most a round
        timeout) for that; a round begun on a forked result, or on one still unsettled when the wait runs out,
        is not announced: its start state's global weights may be off the record, and a rerun of it from the
        record would find a mismatch and accuse an honest member."""
        base = start_global_round(self.cfg.diloco, outer_round)
        if base < 0:
            return True
        outcome = self.standing(base, f"announcing round {outer_round}")
        if outcome in (AGREED, CONFIRMED, NOT_OURS):
            return True
        logger.warning("round %d: begun on our result of round %d, which %s; our contribution of it is not "
                       "announced", outer_round, base, "left the committed record" if outcome == FORKED else
                       "neither the chain nor a quorum of attestations settled within "
                       f"{self.cfg.round_timeout:.0f}s")
        return False

    def standing(self, outer_round: int, before: str) -> str:
        """How ``outer_round`` stands: :data:`AGREED` / :data:`FORKED` (the chain's verdict),
        :data:`CONFIRMED` (attestations), :data:`NOT_OURS` (no held stage of it computed here), else the
        attestations' standing once a round timeout passed (or the node stops). Waits for one of the first
        four; ``before`` names what waits, for the log."""
        started = time.monotonic()
        deadline, said = started + self.cfg.round_timeout, None
        while True:
            outcome = self._standing_now(outer_round)
            if outcome in (AGREED, FORKED, CONFIRMED, NOT_OURS) or self.stop.is_set() or \
                    time.monotonic() >= deadline:
                break
            if said is None:
                said = outcome
                log = logger.warning if outcome == CONTESTED else logger.info
                log("round %d: %s; waiting for the chain's record before %s", outer_round,
                    "peers attested another result than ours" if outcome == CONTESTED else
                    "not yet a quorum of attestations of our result", before)
            with self._cond:
                self._cond.wait(STANDING_POLL_S)
        if said is not None:
            logger.info("round %d: %s after %.2fs of waiting before %s", outer_round, outcome,
                        time.monotonic() - started, before)
        return outcome

    def _standing_now(self, outer_round: int) -> str:
        with self._cond:
            if outer_round in self._settled:
                return FORKED if outer_round in self._forked else AGREED
        if outer_round < self.station.first_round:
            # Caught up after a restart or a join, not computed with the peers: their attestations of it went
            # out long ago, and the committer's check of it re-enters from the chain on a fork, as ever.
            return NOT_OURS
        standings = []
        for stage in self.station.held_stages():
            own_hash = self.rounds.stage_hashes.get(outer_round, {}).get(stage)
            close = self.coordinator.accepted(outer_round, stage)
            if own_hash is None or close is None:
                continue  # not computed in this life (restored from a checkpoint): nothing of ours to judge
            votes = Counter((a.weights_hash, a.contributions_root)
                            for a in self.book.snapshot_attestations(outer_round, stage).values())
            standings.append(attested_standing((own_hash, self._root(close)), votes, self.threshold(close)))
        if not standings:
            return NOT_OURS
        for outcome in (CONTESTED, PENDING):
            if outcome in standings:
                return outcome
        return CONFIRMED

    def threshold(self, close: msg.Close) -> int:
        """The attesters a result of a stage needs before the chain's verdict: the chain's quorum, at most the
        round's expected attesters (this node, and the close's contributors still present: a member that left
        attests nothing, and the survivor of a gone partner must not wait on it)."""
        present = self.membership.alive()
        expected = {self.membership.peer_id} | {peer for _replica, peer, _digest, _size in close.contributions
                                                if peer in present}
        return max(1, min(self._chain_quorum(len(expected)), len(expected)))

    def _chain_quorum(self, fallback: int) -> int:
        """The chain's quorum as last read (``fallback`` if never: the RPC was down since the start). Read on
        the committer thread only (:meth:`_read_quorum`): the training thread never waits on the chain's
        RPC."""
        with self._cond:
            quorum = self._quorum
        return quorum[0] if quorum is not None else fallback

    def _read_quorum(self) -> None:
        """Read the chain's quorum again if the last read is QUORUM_READ_EVERY_S old (on the committer thread:
        it just read the chain; the quorum grows and shrinks with the members in force)."""
        now = time.monotonic()
        with self._cond:
            if self._quorum is not None and now - self._quorum[1] < QUORUM_READ_EVERY_S:
                return
        try:
            quorum = self.chain.quorum_of(self.cfg.ledger.run_id)
        except DLX_ERRORS as exc:
            logger.debug("quorum not read (%s); using the last known", exc)
            return
        with self._cond:
            self._quorum = (quorum, now)
