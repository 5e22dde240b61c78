"""A dlx-node contributor: joins a run, then trains, exchanges and finishes rounds until the end.

The outer loop is DiLoCo's Algorithm 1 (arXiv 2311.08105) with DiLoCoX's
one-step-delay overlap (arXiv 2506.21263), in the order
:func:`training.schedule.round_actions` gives for the configured delay
variant (the same order the simulation and the benchmark run). With the
default delay ("rebase")::

    for outer_round in rounds:
        train(outer_round)      # H local AdamW steps
        encode(outer_round)     # encode, sign, archive, serve, announce the pseudo-gradients
        apply(outer_round - 1)  # close, fetch, aggregate, attest round t-1 (fetched while round t trained)

:meth:`Node.run` is that loop: assemble the parts, enter the run, then act out
each round's schedule. The parts (node/live/assembly.py builds them all):
:class:`~node.live.worker.contributor.Contributor` (train, encode, publish),
:class:`~node.live.round.finisher.RoundFinisher` (close, fetch, aggregate, attest),
:class:`~node.live.round.entry.RunEntry` (where to enter, and re-enter after a broken
pipeline), and the rooms they use: :class:`~node.live.peers.membership.Membership`
(placement, liveness), :class:`~node.live.exchange.coordination.RoundCoordinator`
(closes, quorum, rotation), :class:`~node.live.inbox.GossipInbox` (parses and
dispatches what peers send), the :class:`~node.live.exchange.protocol.Exchange` (full or
sliced), :class:`~node.live.record.committer.Committer` (the chain side) and
:class:`~node.live.worker.replica.ReplicaWorker` (the training side). The wire
protocol is specified in docs/PROTOCOL.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ledger.errors import ChainWaitStopped, LedgerError
from node.config import NodeConfig
from node.errors import NotRegistered, RunOver
from node.live.assembly import HONEST, Kinds, NodeParts
from node.live.worker.contributor import PipelineBroken, RoundAbandoned
from node.live.exchange.coordination import RoundStopped
from node.live.round.resume import first_contributed_round
from node.live.startup import StartupClock
from node.live.state.status import Progress
from p2p.errors import P2PError
from training.schedule import APPLY, ENCODE, TRAIN, RoundAction, pending_after_round, round_actions

logger = logging.getLogger(__name__)

#: With the one-step delay, round t-1's close, fetch and aggregation run on a prefetch thread while
#: round t trains (RoundFinisher.prefetch). Safe because the close decision does not depend on the moment
#: it is taken: an ejection (learnt at different moments by different nodes) moves neither the rotation
#: nor which closes count (RoundCoordinator.await_close, Membership.present; it made honest nodes
#: aggregate different closes of a round in test_reexec_e2e before).
PREFETCH_APPLY = True


class Node:
    """One contributor process (see module docstring).

    ``kinds``: the classes of its variable parts (default: the honest ones; tests/adversary.py
    passes subclasses). ``parts``: its parts, from a subclass of :class:`NodeParts` (a unit test's,
    with fakes at the host and chain boundary); built from ``cfg``, ``kinds`` and ``on_progress`` otherwise.
    """

    def __init__(self, cfg: NodeConfig, on_progress: Callable[[Progress], None] | None = None,
                 kinds: Kinds | None = None, parts: NodeParts | None = None,
                 startup: StartupClock | None = None) -> None:
        self.cfg = cfg
        if parts is None:
            parts = NodeParts(cfg, stop=threading.Event(), kinds=kinds or HONEST, on_progress=on_progress,
                              startup=startup)
        self.parts = parts
        self.stop_event = parts.stop
        self.progress = self.parts.progress
        self.run_id = self.parts.run_id
        self.peer_id = self.parts.peer_id

    @property
    def ejected(self) -> bool:
        """This node was found guilty on chain and removed from the run."""
        return self.parts.lifecycle is not None and self.parts.lifecycle.ejected

    @property
    def reenter_after(self) -> int | None:
        """A round whose committed record differs from this node's: ``dlx-node start`` starts it again."""
        return self.parts.lifecycle.reenter_after if self.parts.lifecycle is not None else None

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> Progress:
        """Join, train until ``cfg.rounds`` (or stop), finish pending rounds, shut down."""
        try:
            try:
                self.parts.assemble()
                start_round, unfinished = self._enter()
            except ChainWaitStopped as exc:  # a stop (SIGTERM, Ctrl-C) while waiting for the chain
                logger.info("stopped before the chain answered: %s", exc)
                return self.progress
            except RoundStopped as exc:  # a stop while the cluster's pipeline re-formed at entry
                logger.info("%s", exc)
                return self.progress
            self._train_loop(start_round, unfinished)
        finally:
            self.close()
        if self.reenter_after is not None:  # what this life sealed from the forked round on is not the record
            aside = self.parts.archive.set_aside_from(self.reenter_after)
            logger.warning("rounds %s of the archive set aside (sealed off the record); re-entering", aside)
        coordinator = self.parts.coordinator
        if coordinator is not None and coordinator.run_over_seen:
            raise RunOver(
                f"run {self.run_id} is over: its last round was committed on chain while this node still "
                "waited for a round's close (it entered too late, or its replicas finished without it); "
                "stopped (its model: dlx-node pull <run link> OUT; its stake: dlx-node leave, then withdraw)")
        if self.ejected:
            raise NotRegistered(
                f"this node was found guilty on a spot check by run {self.run_id}'s quorum: its "
                "stake was slashed and its seat removed (evidence under evidence/ of its peers)")
        return self.progress

    def stop(self) -> None:
        """Ask the node to stop: the current round is abandoned, pending work flushed."""
        self.stop_event.set()

    def close(self) -> None:
        self.parts.close()

    # ------------------------------------------------------------------ entering
    def _enter(self) -> tuple[int, list[int]]:
        """Agree with the cluster where to enter; announce again what an earlier life contributed."""
        parts = self.parts
        proposal, unfinished = parts.entry.entry_point()
        parts.startup.mark("entry point")
        start_round = parts.entry.agree(proposal)
        parts.startup.mark("entry round agreed with the partner")
        if start_round is None:
            raise RoundStopped("stopped while the cluster's pipeline re-formed at entry")
        # Every round before the agreed entry that this node has not applied is caught up, also
        # those between its own proposal and a partner's higher one: skipping them left this
        # node's stage without the rounds its partner had finished, and the partner's record
        # waiting forever for this stage's attestations (the split-cluster survivor race).
        unfinished = list(range(unfinished[0] if unfinished else proposal, start_round))
        reannounced = parts.recovery.reannounce(unfinished)
        parts.rounds.mark_reannounced(reannounced)
        parts.station.contribute_from(first_contributed_round(start_round, reannounced))
        parts.validator.advance(min([start_round, *unfinished]))
        self._say_hello()
        logger.info("entering at round %d (catching up %s)", start_round, unfinished or "nothing")
        return start_round, unfinished

    def _say_hello(self) -> None:
        """Tell the peers now (not at the next heartbeat) the first round this node contributes to: their
        coordinators wait for it in that round only once they know (RunEntry.open_round)."""
        try:
            self.parts.messenger.hello(self.parts.heartbeat.hello())
        except P2PError as exc:
            logger.debug("hello not sent at entry (the heartbeat sends it): %s", exc)

    # ------------------------------------------------------------------ the loop
    def _train_loop(self, start_round: int, unfinished: list[int]) -> None:
        """Run the rounds; a split cluster whose partner died waits for it and re-enters with it. A run
        with a round limit then ends here only once its last round is committed or provably cannot be
        (node/live/round/ending.py); until then this node keeps serving what its peers need."""
        while True:
            try:
                self._run_rounds(start_round, unfinished)
                break
            except PipelineBroken as broken:
                self.parts.finisher.settle()  # the last round's attestation is out before the entry reads it
                resumed = self.parts.entry.await_partner(broken, unfinished)
            if resumed is None:
                break  # asked to stop while waiting, or the run's last round was finished meanwhile
            start_round, unfinished = resumed
            self._say_hello()
        self.parts.committer.drain(timeout=self.cfg.round_timeout)
        if self.cfg.rounds > 0 and not self.stop_event.is_set() and not self.parts.lifecycle.left:
            self.parts.ending.await_last_commit()
            self._finish_spot_checks()

    def _seat_ended(self) -> bool:
        """Whether this node's account left the run (its seat is no longer active: ``dlx-node leave``), asked
        of the chain once a round; a chain that does not answer leaves the node training."""
        try:
            status = self.parts.chain.own_seat_status(self.run_id)
        except LedgerError as exc:
            logger.debug("own seat not read (%s): training on", exc)
            return False
        if status == "active":
            return False
        self.parts.lifecycle.seat_ended(status)
        return True

    def _finish_spot_checks(self) -> None:
        """At the run's normal end: the queued spot checks get up to ``spot_check_drain_s`` more (the node
        still serves its peers); a stop never waits for them. What is left is logged when they close."""
        checks = self.parts.spot_checks
        if self.stop_event.is_set() or self.cfg.spot_check_drain_s <= 0 or checks.idle():
            return
        self.parts.reporter.set_state("finishing spot checks")
        left = checks.drain(self.cfg.spot_check_drain_s)
        if left:
            logger.warning("%d queued spot check(s) not reached within spot_check_drain_s = %.0fs", left,
                           self.cfg.spot_check_drain_s)

    def _run_rounds(self, start_round: int, unfinished: list[int]) -> None:
        """Run the rounds in the order of :func:`training.schedule.round_actions`.

        ``unfinished``: rounds encoded (or caught up) and not applied yet, oldest first.
        """
        diloco, finisher = self.cfg.diloco, self.parts.finisher
        # A joiner first replays the catch-up rounds that have closed already; with the
        # delay, the last one closes only after the peers' next round, so it waits.
        try:
            while len(unfinished) > pending_after_round(diloco) and not self.stop_event.is_set():
                finisher.finish(unfinished.pop(0))
        except RoundStopped as exc:
            logger.info("%s", exc)
            return
        self.parts.startup.mark("caught up")
        outer_round = start_round
        end = self.cfg.rounds if self.cfg.rounds > 0 else None
        while not self.stop_event.is_set() and (end is None or outer_round < end):
            if self._seat_ended():
                break
            try:
                for action in round_actions(diloco, outer_round, last=end is not None
                                            and outer_round == end - 1):
                    self._act(action, unfinished)
            except (RoundAbandoned, RoundStopped):
                logger.info("round %d abandoned on request", outer_round)
                break
            outer_round += 1
        self.parts.finisher.settle()  # the last round's seal and attestation, then the contribution still
        self.parts.lane.join()  # being encoded goes out (or a failure of either is raised here)
        # Finish what was exchanged; a stopping node waits only briefly.
        try:
            for r in unfinished:
                if self.stop_event.is_set():
                    break
                finisher.finish(r)
        except RoundStopped as exc:
            logger.info("%s", exc)

    # ------------------------------------------------------------------ a round's actions
    def _act(self, action: RoundAction, unfinished: list[int]) -> None:
        {TRAIN: self._train, ENCODE: self._encode, APPLY: self._apply}[action.kind](action, unfinished)

    def _train(self, action: RoundAction, unfinished: list[int]) -> None:
        if PREFETCH_APPLY and self.cfg.diloco.one_step_delay and action.first_step == 0 and unfinished:
            self.parts.finisher.prefetch(unfinished[0])  # applied after (part of) this round's steps
        if action.first_step == 0:  # not too far ahead of the chain's commits (node/live/round/pacing.py)
            self.parts.pace.await_room(action.outer_round)
        self.parts.contributor.train(action.outer_round, action.first_step, action.end_step)

    def _encode(self, action: RoundAction, unfinished: list[int]) -> None:
        with self.parts.clock.phase("encode"):
            self.parts.contributor.encode(action.outer_round)
        if "first contribution" not in self.parts.startup.marks:
            logger.info("first contribution of this process: round %d", action.outer_round)
            self.parts.startup.mark("first contribution")
        unfinished.append(action.outer_round)

    def _apply(self, action: RoundAction, unfinished: list[int]) -> None:
        # The seal and attestation of what is applied here run while the next round trains.
        while unfinished and unfinished[0] <= action.outer_round:
            self.parts.finisher.finish(unfinished.pop(0), overlap_tail=True)
