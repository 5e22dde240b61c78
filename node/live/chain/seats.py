"""Seats on chain: which account holds which seat of the run, cached and refreshed from the
membership events (NodeChain's)."""

from __future__ import annotations

import bisect
import logging
import time

from ledger.chain import OUTAGE
from ledger.errors import LedgerError
from ledger.records import Membership
from node.live.state.topology import Seat
from p2p.errors import IdentityError
from p2p.identity import public_key_from_peer_id

logger = logging.getLogger(__name__)


#: An account without a seat makes the node re-read the run's membership events at most this often.
SEATS_REFRESH_S = 2.0

SEATS_READS_PER_S = 4.0

#: How long whether a member counts toward the quorum is cached (it changes at most once per tenure).
COUNTED_TTL_S = 5.0

#: How long a membership refresh waits for the chain connection another thread holds.
SEATS_LOCK_WAIT_S = 1.0


class ChainSeats:
    """The run's seats as the chain holds them (see the module docstring)."""

    def seat(self, run_id: int, account: bytes, public_key: bytes, current: bool = True) -> Membership | None:
        """The account's membership of the run if its seat is bound to ``public_key``.

        ``current``: only a seat held now (a signing seat); False: also one that ended (the
        member left or was slashed), which placement keeps so that no other replica's index
        shifts when a member goes. Read from the chain's membership events; re-read at most
        every few seconds when an unknown account asks, so a flood of hellos from outsiders
        cannot flood the RPC.
        """
        address = "0x" + account.hex()
        table = self._seats if current else self._placed
        seat = table.get(address.lower())
        if seat is None and self._may_refresh(address):
            self._refresh_seats(run_id)
            table = self._seats if current else self._placed
            seat = table.get(address.lower())
        if seat is None or seat.node_key != public_key:
            return None
        return seat

    def declared_platforms(self, run_id: int, peer_ids, fresh: bool = False) -> dict[str, bytes]:
        """peer id -> the platform its seat declared when it joined (the latest period of the account its key
        is bound to), for each of ``peer_ids`` that has held a seat of the run. Read from the chain's
        membership events, waiting for the connection (not from the gossip thread): a peer not in the cache,
        or ``fresh`` (before a claim is refused: its member may have left, withdrawn and joined again from
        other hardware), makes it re-read them. Raises LedgerError if they cannot be read, so that no caller
        acts on a partial view.
        """
        keys = {}
        for peer in peer_ids:
            try:
                keys[peer] = public_key_from_peer_id(peer)
            except IdentityError:
                continue  # not an ed25519 peer id: it cannot hold a seat
        if fresh or any(key not in self._declared for key in keys.values()):
            with self._lock:
                periods = self.client.memberships(run_id)
            # Events in chain order: a key's latest period wins (its account left, withdrew and joined again).
            self._declared = {m.node_key: m.platform for m in periods}
        return {peer: self._declared[key] for peer, key in keys.items() if key in self._declared}

    def seat_of(self, period: Membership) -> Seat:
        """A period from :meth:`seat` as placement reads it (node.live.state.topology.Seat): its index is the
        number of the run's periods that began before it, which later joins never change."""
        return Seat(period.joined, bisect.bisect_left(self._joins, period.joined), period.ended is None)

    def held_seat(self, run_id: int, address: str) -> bool:
        """Whether ``address`` holds or held a seat of the run (a member that left may still decide an
        accusation opened before it left; membership events, cached like :meth:`seat`)."""
        if self._placed.get(address.lower()) is None and self._may_refresh(address):
            self._refresh_seats(run_id)
        return self._placed.get(address.lower()) is not None

    def is_member(self, run_id: int, address: str) -> bool:
        """Whether ``address`` holds a signing seat of the run (membership events; cached like
        :meth:`seat`)."""
        if self._lookup(address) is None and self._may_refresh(address):
            self._refresh_seats(run_id)
        return self._lookup(address) is not None

    def _may_refresh(self, address: str) -> bool:
        """Re-read the seats for an account not seen yet at once, then at most every SEATS_REFRESH_S per
        account, and never more than SEATS_READS_PER_S times a second overall (hellos of outsiders)."""
        now = time.monotonic()
        last = self._unknown_checked.get(address.lower())
        if last is not None and now - last < SEATS_REFRESH_S:
            return False
        if now - self._seats_read < 1.0 / SEATS_READS_PER_S:
            return False
        if len(self._unknown_checked) > 4096:
            self._unknown_checked.clear()
        self._unknown_checked[address.lower()] = now
        return True

    def _lookup(self, address: str) -> Membership | None:
        return self._seats.get(address.lower())

    def _refresh_seats(self, run_id: int) -> None:
        # Called from the gossip thread, which must never stall on an RPC outage: not while the
        # endpoint is known down, nor behind the committer's call while that one retries (up to
        # ledger.retry_seconds). A skipped refresh is tried again on the account's next message.
        if OUTAGE.down_since is not None:
            logger.debug("membership read skipped: the chain RPC is unreachable")
            return
        if not self._lock.acquire(timeout=SEATS_LOCK_WAIT_S):
            logger.debug("membership read skipped: the chain connection is busy (an RPC outage?)")
            return
        try:
            periods = self.client.memberships(run_id)
        except LedgerError as exc:
            logger.debug("membership read failed: %s", exc)
            return
        finally:
            self._lock.release()
        self._seats = {m.account.lower(): m for m in periods if m.ended is None}
        # events in chain order: the latest period wins
        self._placed = {m.account.lower(): m for m in periods}
        self._joins = sorted(m.joined for m in periods)
        self._seats_read = time.monotonic()

    def is_counted(self, run_id: int, address: str) -> bool:
        """Whether ``address``'s signature counts toward the run's quorum now (cached COUNTED_TTL_S)."""
        key = address.lower()
        now = time.monotonic()
        cached = self._counted.get(key)
        if cached is not None and now - cached[1] < COUNTED_TTL_S:
            return cached[0]
        with self._lock:
            seat = self.client.member(run_id, address)
        counted = seat is not None and seat.counted
        if len(self._counted) > 4096:
            self._counted.clear()
        self._counted[key] = (counted, now)
        return counted

    def forget_seats(self, run_id: int) -> None:
        """Re-read the run's seats now (a member was slashed: it must stop counting at once)."""
        self._refresh_seats(run_id)
