"""Closing a round: which contributions of (round, stage) every holder aggregates.

docs/PROTOCOL.md, "Closing a round". A deterministic rotation over the
holders of a stage names the round's coordinator. It closes as soon as every
expected replica's contribution is here, or at the round deadline with at
least ``quorum`` replicas; everyone aggregates exactly the set of the first
valid close of the highest-ranked live coordinator, so all holders keep
bit-identical weights. Owns the accepted closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ledger.merkle import merkle_root
from node.errors import NodeError
from node.live import protocol as msg
from node.live.exchange import ContributionPool
from node.live.membership import Membership
from node.live.roundbook import RoundBook
from node.live.topology import committer_order

logger = logging.getLogger(__name__)

#: Each next coordinator in the rotation waits this much longer before closing.
CLOSE_FALLBACK_S = 6.0
#: While waiting for a close, pull recent run messages from every peer this often (gossip is best effort).
RESYNC_EVERY_S = 5.0


class RoundCoordinator:
    """Closes of the rounds this node finishes (see module docstring).

    ``contributed(t)``: whether this node trained and encoded round ``t``;
    ``gossip(t, kind, message, stage)`` signs and publishes a message and returns
    its envelope bytes; ``resync()`` pulls recent messages from the peers.
    ``previous_life_finished``: the last round this node finished before a restart
    (it never signs a second, different close for those).
    """

    def __init__(self, peer_id: str, quorum: int, round_timeout: float, book: RoundBook,
                 membership: Membership, contributions: ContributionPool,
                 contributed: Callable[[int], bool], gossip: Callable[..., bytes], resync: Callable[[], None],
                 previous_life_finished: int) -> None:
        self.peer_id = peer_id
        self.quorum = quorum
        self.round_timeout = round_timeout
        self.book = book
        self.membership = membership
        self.contributions = contributions
        self.contributed = contributed
        self.gossip = gossip
        self.resync = resync
        self.previous_life_finished = previous_life_finished
        self._accepted: dict[tuple[int, int], msg.Close] = {}
        self._lock = threading.Lock()

    # -- what was decided ---------------------------------------------------------------
    def accepted(self, outer_round: int, stage: int) -> msg.Close | None:
        """The close this node aggregated for (round, stage), if it did."""
        with self._lock:
            return self._accepted.get((outer_round, stage))

    def stage_root(self, outer_round: int, stage: int) -> bytes:
        """Merkle root of the envelope hashes of the accepted close of (round, stage)."""
        return merkle_root([entry[2] for entry in self._accepted[(outer_round, stage)].contributions])

    def forget_before(self, outer_round: int) -> None:
        with self._lock:
            for key in [k for k in self._accepted if k[0] < outer_round]:
                del self._accepted[key]

    # -- waiting for the decision -------------------------------------------------------
    def await_close(self, outer_round: int, stage: int) -> msg.Close:
        """Wait for the round's close decision; close it ourselves when we are the coordinator."""
        order = committer_order(outer_round * 1000 + stage, self.membership.holders(stage))
        started = time.monotonic()
        deadline = started + self.round_timeout
        alive = self.membership.alive()

        def decide() -> msg.Close | None:
            now = time.monotonic()
            closes = self.book.snapshot_closes(outer_round, stage)
            # Coordinators that are gone (Membership.alive) are skipped at once.
            ranked = [c for c in order if c == self.peer_id or c in alive]
            for rank, coordinator in enumerate(order):
                if coordinator in closes and (rank == 0 or now >= started + rank * CLOSE_FALLBACK_S
                                              or coordinator in ranked[:1]):
                    return closes[coordinator][0]
            if self.peer_id in ranked and outer_round > self.previous_life_finished:
                rank = ranked.index(self.peer_id)
                if rank == 0 or now >= deadline + rank * CLOSE_FALLBACK_S:
                    return self._try_close(outer_round, stage, final=now >= deadline, alive=alive)
            return None

        last_resync = started
        while True:
            self.contributions.prefetch(outer_round, stage)
            alive = self.membership.alive()
            close = self.book.wait_for(decide, timeout=1.0, stop=None)
            if close is not None:
                with self._lock:
                    self._accepted[(outer_round, stage)] = close
                return close
            if time.monotonic() - last_resync > RESYNC_EVERY_S:
                last_resync = time.monotonic()
                self.resync()
            if time.monotonic() > deadline + (len(order) + 2) * CLOSE_FALLBACK_S:
                raise NodeError(f"round {outer_round} stage {stage}: no coordinator closed the round within "
                                f"{self.round_timeout:.0f}s (+fallbacks); is a quorum of replicas alive?")

    def _try_close(self, outer_round: int, stage: int, final: bool, alive: set[str]) -> msg.Close | None:
        """As coordinator: close when every expected replica's contribution is here, or at the deadline.

        Expected: every present holder of the stage that entered the run at or before this
        round, or has not yet decided where it enters (first round -1: it is still joining;
        at a fresh start that is everyone for a moment). A node that is catching up (first
        round > this round) will not contribute to it.
        """
        announced = self.book.snapshot_announces(outer_round, stage)
        have = self.contributions.have(outer_round, stage)
        ready = {a.peer_id: a for a in announced.values() if a.envelope_hash in have}
        placements = self.membership.placements
        expected = set()
        for peer, placement in placements.items():
            if stage not in placement.stages:
                continue
            if peer == self.peer_id:
                if self.contributed(outer_round):
                    expected.add(peer)
                continue
            first_round = self.membership.first_round_of(peer)
            if peer in alive and first_round is not None and first_round <= outer_round:
                expected.add(peer)
        replicas = {a.replica for a in ready.values()}
        if not (expected <= set(ready) or (final and len(replicas) >= self.quorum)):
            return None
        entries = sorted([[a.replica, a.peer_id, a.envelope_hash, a.size] for a in ready.values()],
                         key=lambda e: (e[0], e[1], e[2]))
        close = msg.Close(entries)
        data = self.gossip(outer_round, msg.CLOSE, close, stage)
        self.book.add_close(outer_round, stage, self.peer_id, close, data)
        late = {placements[p].replica for p in expected - set(ready)}
        logger.info("round %d stage %d closed with replicas %s%s", outer_round, stage, sorted(replicas),
                    f" (missing {sorted(late)})" if late else "")
        return close
