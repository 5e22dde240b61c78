"""Who is in the run: placement of the declared peers, their liveness, and the entry round.

Owns what a node knows about its peers beyond single rounds: the placement of
every run member that declared its cluster in a ``hello`` (pure
:func:`node.live.state.topology.place_members` over the signed declarations and the
chain's seats: a replica index is the chain's seat index of its cluster's first
member, so no hello heard or missed shifts another's), the set
of peers that still count as present, and the round the live peers are
training. The hellos themselves are filed in the :class:`RoundBook`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from node import protocol as msg
from node.errors import NodeError
from node.live.state.roundbook import PEER_TTL_S, RoundBook
from node.live.state.topology import Declaration, Placement, Seat, place_members

logger = logging.getLogger(__name__)


class Membership:
    """Placement and liveness of the run's peers, as this node sees them (see module docstring).

    ``seat(account, public_key)`` returns the hello's account's :class:`Seat` in the run (held
    now or ended) if it is bound to the key that signed the hello, else None; only such peers
    are placed. ``own_seat`` is this node's own.
    """

    def __init__(self, peer_id: str, cluster: str, cluster_size: int, num_stages: int, book: RoundBook,
                 seat: Callable[[bytes, bytes], Seat | None], own_seat: Seat = Seat((0, 0), 0)) -> None:
        self.peer_id = peer_id
        self.cluster = cluster
        self.cluster_size = cluster_size
        self.num_stages = num_stages
        self.book = book
        self.seat = seat
        self.own_seat = own_seat
        self.placements: dict[str, Placement] = {}
        self._seats: dict[str, Seat] = {}  # peer id -> its account's seat in the run on chain
        self._connected: set[str] = set()
        self._ejected: set[str] = set()
        self._lock = threading.Lock()

    # -- placement --------------------------------------------------------------------
    def refresh(self) -> dict[str, Placement]:
        """Recompute every peer's placement from the hellos heard so far and their seats on chain."""
        # Every peer ever heard of, not only the live ones: a departed member's late closes still
        # check. Its hello can shift nobody's index (place_members): one view hearing it and another
        # not (a joiner, a restarted node) place every current member alike.
        decls = [Declaration(self.peer_id, self.cluster, self.cluster_size, self.own_seat)]
        for peer_id, info in self.book.live_peers(float("inf")).items():
            if peer_id == self.peer_id:
                continue
            seat = self.seat(info.hello.account, info.public_key)
            if seat is not None:
                decls.append(Declaration(peer_id, info.hello.cluster, info.hello.cluster_size, seat))
        placements = place_members(decls, self.num_stages)
        with self._lock:
            self.placements = placements
            self._seats = {d.peer_id: d.seat for d in decls}
        return placements

    def await_placement(self, want_replicas: int, join_timeout: float, stop: threading.Event) -> Placement:
        """Wait until this node's cluster is complete and ``want_replicas`` replicas declared themselves.

        After ``join_timeout`` a complete own cluster is enough; after twice that the
        node gives up with an error that says what to check.
        """
        deadline = time.monotonic() + join_timeout
        while not stop.is_set():
            placements = self.refresh()
            mine = placements.get(self.peer_id)
            replicas = {p.replica for p in placements.values()}
            if mine is not None and (len(replicas) >= want_replicas or time.monotonic() > deadline):
                return mine
            if time.monotonic() > deadline + join_timeout:
                raise NodeError(f"cluster {self.cluster!r} did not form within {2 * join_timeout:.0f}s: "
                                f"check that its {self.cluster_size} members run and can reach each other")
            time.sleep(0.5)
        raise NodeError("stopped while joining")

    def account_of(self, peer_id: str) -> bytes | None:
        """The 20-byte account ``peer_id``'s hello named (a placed peer's: bound on chain to the key that
        signed it, :meth:`refresh`), or None where none was heard."""
        info = self.book.live_peers(float("inf")).get(peer_id)
        return None if info is None else bytes(info.hello.account)

    def first_stage_peer(self, placement: Placement) -> str | None:
        """The peer that holds stage 0 of ``placement``'s replica in its cluster (a current seat's over a
        departed one's), or None where none is placed."""
        with self._lock:
            placements, seats = dict(self.placements), dict(self._seats)
        held = [p for p, pl in placements.items()
                if (pl.cluster, pl.replica) == (placement.cluster, placement.replica) and 0 in pl.stages]
        held.sort(key=lambda p: (not (p in seats and seats[p].current), p))
        return held[0] if held else None

    def holders(self, stage: int) -> list[str]:
        """Peer ids placed on ``stage``, sorted."""
        return sorted(p for p, pl in self.refresh().items() if stage in pl.stages)

    def seat_order(self, stage: int) -> list[str]:
        """Holders of ``stage`` in the order their accounts joined the run on chain (peer id breaks a tie).

        The chain's seats are the same for every member: a holder this node has not heard of yet
        (a fresh joiner whose hello is on its way) joined after every holder it has heard of, so
        it can only come last, and every view names the same first coordinator."""
        placements = self.refresh()
        with self._lock:
            seats = dict(self._seats)
        return sorted((p for p, pl in placements.items() if stage in pl.stages),
                      key=lambda p: (seats[p].index, p))

    def placed_peers(self) -> list[str]:
        with self._lock:
            return sorted(self.placements)

    def eject(self, peer_id: str) -> None:
        """A member found guilty on chain: its contributions no longer count and it is no longer expected.

        Its placement stays, so that no other replica's index shifts (it seeds their data). Which
        close a round aggregates does not change: when each node learns of an ejection differs
        (by seconds to a round), so its closes are still judged like anyone's and it stays in the
        rotation while it is present (:meth:`present`); the ejected node stops itself once it learns.
        """
        self._ejected.add(peer_id)

    def ejected(self, peer_id: str) -> bool:
        return peer_id in self._ejected

    def check_sender(self, env) -> None:
        """Refuse a round message whose sender is not placed where the envelope says it is."""
        # An ejected member's announces no longer count. Its closes do, judged like anyone's: whether
        # a node heard of the ejection before or after a close arrived must not change which close it
        # aggregates (docs/PROTOCOL.md, "Closing a round"); so do its attestations of rounds it took
        # part in (loss reports: every member must derive the same record either way).
        if env.sender_peer_id in self._ejected and env.kind == msg.ANNOUNCE:
            raise msg.ProtocolError(
                f"{env.kind} from {env.sender_peer_id[-8:]}, a member ejected from the run")
        def fits(placed: Placement | None) -> bool:
            return placed is not None and env.stage in placed.stages and (
                env.kind != msg.ANNOUNCE or env.replica == placed.replica)

        if fits(self.placements.get(env.sender_peer_id)):
            return
        if not fits(self.refresh().get(env.sender_peer_id)):
            raise msg.ProtocolError(
                f"{env.kind} from {env.sender_peer_id[-8:]} for stage {env.stage} replica "
                f"{env.replica} does not match its placement")

    # -- liveness ---------------------------------------------------------------------
    def set_connected(self, peer_ids: list[str]) -> None:
        """The peers the host has an open connection to (the heartbeat's last look)."""
        self._connected = set(peer_ids)

    def alive(self) -> set[str]:
        """Peers that count as present: heard from within PEER_TTL_S, or still connected.

        A peer is declared gone only on evidence that survives a slow peer: a process that
        is stopped or starved of CPU keeps its connections open (the kernel holds them), so
        it stays expected until the round deadline; a crashed one drops its connections
        and, once its last message is PEER_TTL_S old, is gone.
        """
        return self.present() - self._ejected

    def present(self) -> set[str]:
        """Peers heard from within PEER_TTL_S or still connected, ejected or not.

        The close rotation skips a coordinator only when it is gone (:meth:`alive`'s evidence),
        not when it was ejected: an ejection is learnt at different moments by different nodes,
        and a rule that depended on it would let them aggregate different closes of a round.
        """
        return set(self.book.live_peers(PEER_TTL_S)) | self._connected

    def first_round_of(self, peer_id: str) -> int | None:
        """The first round a peer announced it contributes to (-1: still joining), or None if unknown."""
        info = self.book.live_peers(float("inf")).get(peer_id)
        return None if info is None else info.hello.first_round

    def live_training_round(self, last_committed: int, window: int) -> int:
        """The highest round a live, placed peer (not this node) says it trains; -1 if none.

        A hello is only a claim: one past ``last_committed + window`` (no honest peer runs
        that far ahead of the chain) is ignored, so a member cannot push a joiner's entry
        round out of reach with an absurd number.
        """
        placements = self.refresh()
        claims = []
        for peer, info in self.book.live_peers(PEER_TTL_S).items():
            if peer == self.peer_id or peer not in placements:
                continue
            if info.hello.training_round > last_committed + window:
                logger.warning("ignoring %s's claim to train round %d (last committed %d)", peer[-8:],
                               info.hello.training_round, last_committed)
                continue
            claims.append(info.hello.training_round)
        return max(claims, default=-1)

    def claimed_rounds(self, last_committed: int, window: int) -> list[tuple[int, int]]:
        """(first_round, training_round) of every live, placed peer (not this node) that trains a round.

        A peer claims every round from the first it contributes to in this life through the one
        it trains now; claims past ``last_committed + window`` are ignored, as in
        :meth:`live_training_round`.
        """
        placements = self.refresh()
        claims = []
        for peer, info in self.book.live_peers(PEER_TTL_S).items():
            if peer == self.peer_id or peer not in placements:
                continue
            hello = info.hello
            if 0 <= hello.first_round <= hello.training_round <= last_committed + window:
                claims.append((hello.first_round, hello.training_round))
        return claims

    def live_providers(self) -> list[str]:
        """Live peers other than this node (checkpoint and blob providers)."""
        return [p for p in self.book.live_peers(PEER_TTL_S) if p != self.peer_id]
