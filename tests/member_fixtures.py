"""A member's view of a three-seat run for unit tests of node.live parts (the committer, the checkpoint
builder)."""

from __future__ import annotations

from node import protocol as msg
from node.live.peers.membership import Membership
from node.live.state.roundbook import RoundBook
from node.live.state.topology import Seat

PEERS = ["peer-a", "peer-b", "peer-c"]


def three_seat_membership() -> tuple[Membership, RoundBook]:
    """peer-a's membership and book: seats 0-2 held by ``PEERS`` (replicas 10-12), each other peer's hello
    heard."""
    book = RoundBook()
    seats = {peer.encode(): Seat((10 + i, 0), i) for i, peer in enumerate(PEERS)}
    membership = Membership("peer-a", "c-peer-a", 1, 1, book, seat=lambda _account, key: seats.get(key),
                            own_seat=seats[b"peer-a"])
    for peer in PEERS[1:]:
        book.add_hello(peer, peer.encode(), msg.Hello(f"c-{peer}", 1, b"\x01" * 20, [], 0, 0))
    membership.refresh()
    return membership, book
