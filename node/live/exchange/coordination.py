"""Closing a round: which contributions of (round, stage) every holder aggregates.

docs/PROTOCOL.md, "Closing a round". The holders of a stage, ranked by their
chain seats (join order, read alike by every member), name the round's
coordinator: the first present one, the others as fallbacks. It closes as soon as every
expected replica's contribution is here, or at the round deadline with at
least ``quorum`` replicas; everyone aggregates exactly the set of the first
valid close of the highest-ranked live coordinator, so all holders keep
bit-identical weights. Owns the accepted closes.

A close from a peer is checked before it is used (:meth:`RoundCoordinator.judge`):
at least ``quorum`` replicas, entries in canonical order, distinct replicas,
peers and envelopes, every entry placed on that stage and replica, and every
named contribution fetched, signed by the named peer and decodable. An invalid
close is ignored (its signed envelope stays in the round book as evidence) and
its coordinator is skipped for the round, so the next one takes over at once.
A close whose contributions are still on their way is waited for as long as
its fetches make progress, and refused only after :meth:`RoundCoordinator.stall_limit`
seconds without any (a slow or CPU-starved machine makes a round slower, not
its set different); the named contributions are fetched from their senders
and from the close's coordinator, which held every one of them when it closed.

A round a restarted node catches up (one before the first it contributes to:
:meth:`Station.catching_up <node.live.state.station.Station.catching_up>`) was
closed by the run while it was away: it takes the close the others took as soon
as that is here, whoever signed it, and closes the round itself only at its
deadline, if none came. Before, a restarted node that ranked first among the
stage's holders closed such rounds anew at once, with what it held then (its
own re-announced contribution too, which the run's close may have left out):
its weights then left the committed record (issue 75).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ledger.merkle import merkle_root
from node import protocol as msg
from node.errors import NodeError
from node.live.state.closesteps import close_steps
from node.live.exchange.pool import ContributionPool
from node.live.peers.membership import Membership
from node.live.state.roundbook import RoundBook
from node.live.exchange.takeover import TakingOver
from node.live.exchange.closejudge import CloseJudging, PENDING

logger = logging.getLogger(__name__)

#: Each next coordinator in the rotation waits this much longer before closing.
CLOSE_FALLBACK_S = 6.0
#: While waiting for a close, pull recent run messages from every peer this often (gossip is best effort).
RESYNC_EVERY_S = 5.0
#: Lower bound of how long a close whose contributions are not all here yet may go without
#: progress (one more entry placed and fetched) before it is refused; the limit itself scales
#: with the round timeout (:meth:`RoundCoordinator.stall_limit`). Refusing an honest close
#: because a starved machine fetched slowly would make nodes aggregate different sets, so the
#: clock restarts with every entry that arrives; a close naming something nobody can fetch
#: costs the round at most one such stall before the next coordinator takes over.
PENDING_LIMIT_S = 20.0
#: A round past its deadline and every fallback without a close is retried (waited for) and
#: reported this often.
QUORUM_WARN_EVERY_S = 30.0
#: Another coordinator's close is used only once it has been here this long without a second,
#: different close of the same coordinator arriving (gossip floods both versions of an
#: equivocating close to every node well within it; see docs/PROTOCOL.md).
CLOSE_SETTLE_S = 2.0


class RoundStopped(NodeError):
    """The node was asked to stop while a round waited for its close."""


class CloseInterrupted(NodeError):
    """The node's ``interrupt`` condition came true while a round waited for its close (nothing applied)."""


class RoundCoordinator(CloseJudging, TakingOver):
    """Closes of the rounds this node finishes (see module docstring).

    ``contributed(t)``: whether this node trained and encoded round ``t``;
    ``gossip(t, kind, message, stage)`` signs and publishes a message and returns
    its envelope bytes; ``resync()`` pulls recent messages from the peers.
    ``previous_life_finished``: the last round this node finished before a restart
    (it never signs a second, different close for those). ``station``: this node's
    :class:`~node.live.state.station.Station` (the round it entered at, :meth:`expects`).
    """

    def __init__(self, peer_id: str, quorum: int, round_timeout: float, book: RoundBook,
                 membership: Membership, contributions: ContributionPool,
                 contributed: Callable[[int], bool], gossip: Callable[..., bytes], resync: Callable[[], None],
                 previous_life_finished: int, transfer_timeout: float = 60.0,
                 stop: threading.Event | None = None, clock: Callable[[], float] = time.monotonic,
                 station=None, steps_range: tuple[int, int] | None = None) -> None:
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
        self.transfer_timeout = transfer_timeout
        self.stop = stop
        self.station = station  # node.live.state.station.Station: where this node entered (None: round 0)
        # A time-bounded run's range of declared steps (DilocoConfig.steps_range): its closes name each
        # contribution's count (node.live.state.closesteps); None with fixed H.
        self.steps_range = steps_range
        self._clock = clock  # judge's stall clock (a test drives it)
        self._accepted: dict[tuple[int, int], msg.Close] = {}
        #: Peers named in a close this node took in this life:
        #: members it has seen contribute (:meth:`expects`).
        self._seen_in_closes: set[str] = set()
        self._invalid: dict[tuple[int, int, str], str] = {}  # (round, stage, coordinator) -> reason
        # (round, stage, coordinator) -> (entries here, when that count was first reached)
        self._pending_since: dict[tuple[int, int, str], tuple[int, float]] = {}
        self._asked: dict[tuple[int, int], float] = {}  # (round, stage) -> when this node asked to take over
        self._lock = threading.Lock()
        #: While set and true, a wait for a close gives up with CloseInterrupted (a split cluster's
        #: pipeline came back while this node sat rounds out: it must re-enter with its partner).
        self.interrupt: Callable[[], bool] | None = None
        #: issue 80: true once the chain holds the run's last round (node.live.round.ending.RunOverWatch): a
        #: close still waited for then can never matter, so the node stops (RunOver, exit 6) instead of
        #: waiting for replicas forever; ``run_over_seen`` says it did.
        self.run_over: Callable[[], bool] | None = None
        self.run_over_seen = False

    # -- what the node tells it -------------------------------------------------------------
    @contextmanager
    def interruptible(self, interrupt: Callable[[], bool]) -> Iterator[None]:
        """Inside, a wait for a close gives up with CloseInterrupted once ``interrupt()`` is true."""
        self.interrupt = interrupt
        try:
            yield
        finally:
            self.interrupt = None

    def rotation(self, outer_round: int, stage: int) -> list[str]:
        """The coordinators of (round, stage), first to last: its holders in the order of their chain seats.

        Join order, which every member reads alike from the chain (Membership.seat_order), not an
        order of the holders each node has heard of: a fresh joiner that some holders know and
        others do not yet comes last in both views, so both take the same coordinator's close.
        Coordinating costs one small signed close per (round, stage); the commits (transactions)
        rotate among the members (topology.committer_order)."""
        return self.membership.seat_order(stage)

    # -- what was decided ---------------------------------------------------------------
    def adopt(self, outer_round: int, stage: int, close: msg.Close) -> None:
        """Take ``close`` as the decision of (round, stage) without waiting (a round sealed in an earlier
        life).

        The set is published again as this node's close: after a whole-run restart nobody holds
        the original close any more, and a peer that had not sealed the round would otherwise
        wait a full deadline for it, fall behind, and close later rounds without this replica.
        """
        with self._lock:
            self._accepted[(outer_round, stage)] = close
            self._seen_in_closes.update(entry[1] for entry in close.contributions)
        data = self.gossip(outer_round, msg.CLOSE, close, stage)
        self.book.add_close(outer_round, stage, self.peer_id, close, data)

    def accepted(self, outer_round: int, stage: int) -> msg.Close | None:
        """The close this node aggregated for (round, stage), if it did."""
        with self._lock:
            return self._accepted.get((outer_round, stage))

    def stage_root(self, outer_round: int, stage: int) -> bytes:
        """Merkle root of the envelope hashes of the accepted close of (round, stage)."""
        return merkle_root([entry[2] for entry in self._accepted[(outer_round, stage)].contributions])

    def forget_before(self, outer_round: int) -> None:
        with self._lock:
            for book in (self._accepted, self._invalid, self._pending_since, self._asked):
                for key in [k for k in book if k[0] < outer_round]:
                    del book[key]

    def withdraw(self, outer_round: int, stage: int, close: msg.Close, reason: str) -> list[str]:
        """Refuse every close of (round, stage) in the book that names ``close``'s set, whose apply found
        inputs that never came (:class:`node.live.exchange.protocol.InputsWithheld`), and forget it as this
        node's
        decision: the next coordinator's close counts (docs/PROTOCOL.md, "Sliced exchange", withholding).
        Returns the coordinators refused."""
        signers = [coordinator for coordinator, (other, _data) in self.book.snapshot_closes(outer_round,
                                                                                            stage).items()
                   if other.contributions == close.contributions]
        with self._lock:
            self._accepted.pop((outer_round, stage), None)
            for coordinator in signers:
                self._invalid[(outer_round, stage, coordinator)] = reason
        logger.warning("round %d stage %d: close of %s refused: %s", outer_round, stage,
                       ", ".join(c[-8:] for c in signers), reason)
        return signers

    def invalid_closes(self, outer_round: int, stage: int) -> dict[str, str]:
        """Coordinators whose close of (round, stage) was refused, with the reason."""
        with self._lock:
            return {c: why for (r, s, c), why in self._invalid.items() if (r, s) == (outer_round, stage)}

    def stall_limit(self) -> float:
        """Seconds a pending close may go without one more entry arriving before it is refused."""
        return max(PENDING_LIMIT_S, min(self.round_timeout, self.transfer_timeout))

    def _may_close(self, outer_round: int, stage: int, order: list[str], present: set[str],
                   deadline: float) -> bool:
        """Whether this node may have to close (round, stage) soon: the first live, unrefused
        coordinator in the rotation, or, once the deadline passed, the fallback whose turn
        (``deadline + rank x CLOSE_FALLBACK_S``, as :meth:`await_close` decides) is at most one
        turn away. A lazy pool (the sliced exchange) fetches the announced contributions and their
        bundles only then: a fallback has a whole turn to fetch them before it closes, and the
        holders whose turn is far off (every one of them in a large run) fetch nothing."""
        refused = set(self.invalid_closes(outer_round, stage)) | self.book.yielded(outer_round, stage)
        ranked = [c for c in order if (c == self.peer_id or c in present) and c not in refused]
        if self.peer_id not in ranked:
            return False
        rank = ranked.index(self.peer_id)
        return rank == 0 or time.monotonic() >= deadline + (rank - 1) * CLOSE_FALLBACK_S

    # -- waiting for the decision -------------------------------------------------------
    def await_close(self, outer_round: int, stage: int,
                    clock_from: Callable[[], float | None] | None = None) -> msg.Close:
        """Wait for the round's close decision; close it ourselves when we are the coordinator.

        The round deadline runs from now, or from ``clock_from()`` (monotonic seconds; None: not
        yet): the apply prefetch waits for a close while the next round trains, and what depends
        on the deadline (closing with a quorum, a lower-ranked coordinator's close) must not come
        a round sooner than where the apply runs inline, so its deadline runs from when the
        training thread reaches the apply. A close that needs no deadline is decided at once.
        """
        order = self.rotation(outer_round, stage)
        started = time.monotonic()
        if clock_from is None:
            clock_from = lambda: started  # noqa: E731
        alive = self.membership.alive()
        present = self.membership.present()

        def current_deadline() -> float:
            since = clock_from()
            return math.inf if since is None else since + self.round_timeout

        def decide() -> msg.Close | None:
            now = time.monotonic()
            deadline = current_deadline()
            closes = self.book.snapshot_closes(outer_round, stage)
            verdicts = {c: self.judge(outer_round, stage, c, closes[c][0]) for c in order if c in closes}
            # A coordinator that signed it will not close (a yield) is skipped, and a close of it not used.
            refused = {c for c, verdict in verdicts.items() if verdict not in (None, PENDING)} | \
                self.book.yielded(outer_round, stage)
            # Coordinators that are gone (Membership.present), closed invalidly or yielded are skipped at
            # once. Not the ejected ones: when a node learns of an ejection is its own timing, and the
            # set it aggregates must not depend on it (an ejected member's close is judged as any).
            ranked = [c for c in order if (c == self.peer_id or c in present) and c not in refused]
            catching_up = self.station is not None and self.station.catching_up(outer_round)
            at_once = order if catching_up else ranked[:1]  # catching up: the run's close, whoever signed it
            for rank, coordinator in enumerate(order):
                if coordinator in refused or coordinator not in closes:
                    continue
                # A lower-ranked coordinator's close counts from deadline + rank x fallback (when it
                # may close), or at once if every coordinator ranked above it is gone or refused.
                if rank == 0 or now >= deadline + rank * CLOSE_FALLBACK_S or coordinator in at_once:
                    if verdicts[coordinator] == PENDING:
                        return None  # its contributions are still on their way
                    if coordinator != self.peer_id and \
                            self.book.close_age(outer_round, stage, coordinator) < CLOSE_SETTLE_S:
                        return None  # not settled: a second, different version may still arrive
                    return closes[coordinator][0]
            if outer_round > self.previous_life_finished and self.peer_id in ranked:
                rank = ranked.index(self.peer_id)
                if rank == 0:
                    if catching_up and now < deadline:
                        return None  # the run's close comes with the peers' messages (resync)
                    close = self.try_close(outer_round, stage, final=now >= deadline, alive=alive)
                    if close is None and now >= deadline and self._asked_by_lower(outer_round, stage, order):
                        self._yield(outer_round, stage)  # the answer to a takeover: this node will not close
                    return close
                if now >= deadline + rank * CLOSE_FALLBACK_S:
                    return self._take_over(outer_round, stage, ranked[:rank], now, alive)
            return None

        last_resync = last_warning = started
        while True:
            if self.contributions.lazy and self._may_close(outer_round, stage, order, present,
                                                           current_deadline()):
                self.contributions.want(outer_round, stage)
            self.contributions.prefetch(outer_round, stage)
            alive, present = self.membership.alive(), self.membership.present()
            close = self.book.wait_for(decide, timeout=1.0, stop=None)
            if close is not None:
                self._accept(outer_round, stage, close)
                return close
            if time.monotonic() - last_resync > RESYNC_EVERY_S:
                last_resync = time.monotonic()
                self.resync()
            self._raise_if_no_longer_waited(outer_round, stage)
            # A round that misses its quorum stays open (docs/PROTOCOL.md, "A round without a quorum"):
            # the run pauses and the round closes as soon as enough replicas are back.
            if time.monotonic() - last_warning > QUORUM_WARN_EVERY_S and \
                    self._warn_overdue(outer_round, stage, current_deadline(), len(order)):
                last_warning = time.monotonic()

    def _accept(self, outer_round: int, stage: int, close: msg.Close) -> None:
        """``close`` is this node's decision of (round, stage)."""
        with self._lock:
            self._accepted[(outer_round, stage)] = close
            self._seen_in_closes.update(entry[1] for entry in close.contributions)

    def _raise_if_no_longer_waited(self, outer_round: int, stage: int) -> None:
        if self.stop is not None and self.stop.is_set():
            raise RoundStopped(f"round {outer_round} stage {stage}: stopped while waiting for its close")
        if self.interrupt is not None and self.interrupt():
            raise CloseInterrupted(f"round {outer_round} stage {stage}: no longer waited for here")
        if self.run_over is not None and self.run_over():
            self.run_over_seen = True
            if self.stop is not None:
                self.stop.set()
            raise RoundStopped(f"round {outer_round} stage {stage}: the run is over on chain (its last "
                               "round is committed) while this close was still waited for here: stopping")

    def _warn_overdue(self, outer_round: int, stage: int, deadline: float, coordinators: int) -> bool:
        """Say so if (round, stage) is past its deadline and every fallback without a close; whether it is."""
        overdue = time.monotonic() - (deadline + (coordinators + 2) * CLOSE_FALLBACK_S + self.stall_limit())
        if overdue <= 0:
            return False
        have = {a.replica for a in self.book.snapshot_announces(outer_round, stage).values()}
        logger.warning("round %d stage %d: no close %.0fs past the deadline; %d replica(s) announced, "
                       "quorum %d: waiting for replicas to come back", outer_round, stage,
                       time.monotonic() - deadline, len(have), self.quorum)
        return True

    def try_close(self, outer_round: int, stage: int, final: bool, alive: set[str]) -> msg.Close | None:
        """As coordinator: close (round, stage) if :meth:`ready_close` says so, and publish the close."""
        close = self.ready_close(outer_round, stage, final, alive)
        if close is not None:
            data = self.gossip(outer_round, msg.CLOSE, close, stage)
            self.book.add_close(outer_round, stage, self.peer_id, close, data)
        return close

    def expects(self, peer: str, outer_round: int, stage: int) -> bool:
        """Whether a close of (round, stage) waits for ``peer``'s contribution (docs/PROTOCOL.md, "Who a
        close waits for"), from its hellos and announces.

        A member this node has seen contribute (named in a close it took in this life) or that
        entered no later than this node (``first_round`` at most this node's: a fresh run's
        founders, every node after the whole run restarted) is waited for as it always was: from
        its ``first_round`` on, and while it has not decided where it enters (-1), too. A
        newcomer (a joiner, in every view; a member seen by no close of this life) is waited
        for only once it is ready: from its ``first_round`` on, once it trains (``training_round``
        at least ``first_round``: its restore and catch-up are done) or announced a contribution
        to the round; while undecided, only in round 0 or the round this node entered at. So a
        joiner that still restores a checkpoint or catches up costs the others nothing, and once
        in a close it is a member like any other. Which set a round aggregates is still the coordinator's
        close, judged alike by every node. A member is waited for in a round before its first one only where
        it announced a contribution to it (a restarted node's re-announced contribution).
        """
        info = self.book.live_peers(math.inf).get(peer)
        if info is None:
            return False
        first, training = info.hello.first_round, info.hello.training_round
        mine = self.station.first_round if self.station is not None else 0
        with self._lock:
            member = peer in self._seen_in_closes
        if member or 0 <= first <= mine:
            # -1 (deciding where it enters) included, as before; and a round before its first that it
            # announced a contribution to (a restarted node re-announces what its earlier life sent,
            # resume.py): that contribution is on its way, so the close holds it whatever the timing.
            return first <= outer_round or peer in self.book.snapshot_announces(outer_round, stage)
        if first < 0:
            return outer_round in (0, mine)
        if first > outer_round:
            return False
        return training >= first or peer in self.book.snapshot_announces(outer_round, stage)

    def ready_close(self, outer_round: int, stage: int, final: bool, alive: set[str],
                    log: bool = True) -> msg.Close | None:
        """The close this node would sign as coordinator: when every expected replica's contribution
        is here (:meth:`expects`), or at the deadline with a quorum; None otherwise (``log``: say so)."""
        announced = self.book.snapshot_announces(outer_round, stage)
        have = self.contributions.closable(outer_round, stage)  # the sliced exchange: bundles held too
        ready = {a.peer_id: a for a in announced.values() if a.envelope_hash in have}
        placements = self.membership.placements
        # A replica whose contribution was proven bad this round is not waited for.
        bad_senders = {sender for sender, _reason in self.contributions.rejected(outer_round, stage).values()}
        expected = set()
        for peer, placement in placements.items():
            if stage not in placement.stages:
                continue
            if peer == self.peer_id:
                if self.contributed(outer_round):
                    expected.add(peer)
                continue
            if peer in alive and peer not in bad_senders and self.expects(peer, outer_round, stage):
                expected.add(peer)
        # A replica's stage is closed only with its partner stages (a split cluster's): never a part of a
        # replica whose other stages will not come (no rerun could check it), and not before they came.
        waiting, orphaned = self.partial_replicas(outer_round, stage, ready, alive)
        expected -= orphaned
        ready = {p: a for p, a in ready.items() if p not in waiting and p not in orphaned}
        replicas = {a.replica for a in ready.values()}
        if not ready or not (expected <= set(ready) or (final and len(replicas) >= self.quorum)):
            return None  # never an empty close: a round without contributions waits for them
        entries = sorted([[a.replica, a.peer_id, a.envelope_hash, a.size] for a in ready.values()],
                         key=lambda e: (e[0], e[1], e[2]))
        close = msg.Close(entries, close_steps(entries, have, self.steps_range))
        late = {placements[p].replica for p in expected - set(ready)}
        if log:
            logger.info("round %d stage %d closed with replicas %s%s%s", outer_round, stage, sorted(replicas),
                        f" (missing {sorted(late)})" if late else "",
                        f" (replica(s) {sorted(placements[p].replica for p in orphaned)} left out: their "
                        "other stages' contributions will not come)" if orphaned else "")
        return close

    def partial_replicas(self, outer_round: int, stage: int, ready: dict, alive: set[str]) -> tuple[set, set]:
        """(waiting, orphaned): the peers of ``ready`` (peer -> its announce of (round, stage)) whose replica
        has not announced its contribution of every other stage of the round: ``waiting`` while a holder of
        such a stage is still waited for (:meth:`expects`; this node itself if it contributed), else
        ``orphaned`` (its holders gone or no longer waited for: a split cluster's partner died between the
        two stages' publishes).

        docs/PROTOCOL.md, "A split cluster that loses a node": a replica is rerun whole (every stage's start
        state and claim), so a stage aggregated without its partner's contribution could be checked by no
        spot check and no audit (issue 75: a partner killed after the pipeline's eval and before its
        publish left round 4 of replica 0 with stage 0 only). A replica's stage waits for its partners'
        announces like any expected contribution; at the deadline, or once the partner is gone, the
        replica is left out of the close (its signer keeps the envelope, ``left_out_own``)."""
        others = [s for s in range(self.membership.num_stages) if s != stage]
        if not others:
            return set(), set()
        announced = {s: {a.replica for a in self.book.snapshot_announces(outer_round, s).values()}
                     for s in others}
        placements = self.membership.placements
        waiting, orphaned = set(), set()
        for peer, announce in ready.items():
            missing = [s for s in others if announce.replica not in announced[s]]
            if not missing:
                continue
            holders = [(p, s) for p, pl in placements.items() for s in missing
                       if pl.replica == announce.replica and s in pl.stages]
            if any(self.contributed(outer_round) if p == self.peer_id else
                   p in alive and self.expects(p, outer_round, s) for p, s in holders):
                waiting.add(peer)
            else:
                orphaned.add(peer)
        return waiting, orphaned
