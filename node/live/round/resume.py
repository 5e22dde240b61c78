"""Picking a run up after a restart: what a node said and sealed before is said and applied again.

After a restart of the whole run nobody holds the earlier gossip, and a node
never signs a second, different message for a round it handled before. Its
archive kept exactly what it signed and what it aggregated, so:

- rounds it had sealed are re-applied from the archive (the same signed set);
- its own contributions of the rounds it catches up are served and announced
  again (peers that kept the first announce drop the re-signed one as a
  replay), and it declares itself a contributor from the first of those that run
  without a gap up to its entry round (:func:`first_contributed_round`), so a
  peer that had not sealed one of those rounds closes it with the same replicas;
  an earlier one is still waited for by its announce (RoundCoordinator.expects).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

from node import protocol as msg
from node.errors import StateError
from node.fsutil import serve_when_space
from node.live.state.base import NodeBase
from node.live.rooms import Rooms
from node.live.state.closesteps import close_steps
from node.live.state.roundbook import Announced
from p2p.envelope import decode_envelope

if TYPE_CHECKING:  # the worker's module imports torch; only its type is read here
    from node.live.worker.replica import ReplicaWorker

logger = logging.getLogger(__name__)


def first_contributed_round(start_round: int, reannounced: set[int]) -> int:
    """The first round a restarted node declares in its hellos: ``start_round``, or the first of the
    re-announced rounds that lead up to it without a gap.

    A hello names one first round and coordinators wait for the node in every round from there on
    (RoundCoordinator.expects). A node killed during a round's exchange re-announces that round's
    contribution and enters some rounds later (its partner applied the rounds between while it
    sat them out); declaring that round as its first made the other replicas' coordinators wait
    a whole round deadline in each round between, which it contributes to in no life (bench_chaos.py
    --split, issue 30: up to 3 rounds missed after it was ready). After a whole-run restart the
    re-announced rounds run up to the entry round, and it is declared from the first of them as before.
    """
    first = start_round
    while first - 1 in reannounced:
        first -= 1
    return first


class RestartRecovery:
    """See module docstring. ``previous_life_finished``: the last round finished before the restart."""

    def __init__(self, base: NodeBase, rooms: Rooms, worker: ReplicaWorker) -> None:
        self.archive = base.archive
        self.contributions = rooms.exchange.pool
        self.announce_parts = rooms.exchange.announced  # a parts run: its parts announced first
        self.host = rooms.host
        self.book = base.book
        self.peer_id = base.peer_id
        self.replica = worker.replica
        self.stages = worker.stages
        self.max_bytes = base.cfg.p2p.max_blob_bytes
        self.gossip = rooms.messenger.gossip
        self.previous_life_finished = rooms.coordinator.previous_life_finished
        # A time-bounded run's: its closes name the declared steps (closesteps).
        self.steps_range = base.cfg.diloco.steps_range

    def reannounce(self, rounds: list[int]) -> set[int]:
        """Serve and announce again this node's archived contributions of the catch-up ``rounds``."""
        done = set()
        for outer_round in rounds:
            # Also rounds this node sealed: a peer that had not sealed them before the restart
            # must close them with this node's contribution too (it expects it from first_round).
            # Not one the round's close left out (kept for the audit only, node/store/archive.py): that close
            # stands, and was made without it.
            left_out = {c.envelope_hash for c in self.archive.left_out_own(outer_round)}
            for envelope in self.archive.envelopes(outer_round):
                if hashlib.sha256(envelope).digest() in left_out:
                    continue
                env = decode_envelope(envelope, self.max_bytes)
                if (env.kind, env.sender_peer_id, env.replica) != (msg.CONTRIBUTION, self.peer_id,
                                                                   self.replica):
                    continue
                if env.stage not in self.stages:
                    continue
                digest = self.contributions.serve_own(outer_round, envelope)
                self.contributions.add(outer_round, env.stage, digest, envelope)
                self.book.add_announce(outer_round, env.stage, Announced(self.peer_id, env.replica, digest,
                                                                         len(envelope)))
                self.announce_parts(outer_round, env.stage, digest, envelope)
                self.gossip(outer_round, msg.ANNOUNCE, msg.Announce(digest, len(envelope)), env.stage)
                done.add(outer_round)
        if done:
            logger.info("announced again this node's archived contributions of rounds %s", sorted(done))
        return done

    def sealed_closes(self, outer_round: int) -> dict[int, msg.Close] | None:
        """The closes of a round sealed before the restart, rebuilt from the archive; None if not sealed
        here."""
        if outer_round > self.previous_life_finished:
            return None
        sealed = self.archive.sealed(outer_round)
        if not sealed:
            return None
        closes: dict[int, list] = {stage: [] for stage in self.stages}
        held: dict[bytes, bytes] = {}
        try:
            for item in sealed:
                if item.stage not in closes:
                    continue
                envelope = self.archive.get(outer_round, item.envelope_hash)
                self.contributions.add(outer_round, item.stage, item.envelope_hash, envelope)
                # Its sender announced it.
                serve_when_space(self.host, envelope, what=f"round {outer_round}'s sealed contribution",
                                 stop=self.contributions.stop)
                closes[item.stage].append([item.replica, item.peer_id, item.envelope_hash, len(envelope)])
                held[item.envelope_hash] = envelope
        except StateError as exc:
            logger.warning("round %d: archive incomplete (%s); waiting for the peers' close", outer_round,
                           exc)
            return None
        if not all(closes.values()):
            return None
        logger.info("round %d: re-applying the contributions sealed in the archive before the restart",
                    outer_round)
        ordered = {stage: sorted(entries, key=lambda e: (e[0], e[1], e[2]))
                       for stage, entries in closes.items()}
        return {stage: msg.Close(entries, close_steps(entries, held, self.steps_range))
                for stage, entries in ordered.items()}
