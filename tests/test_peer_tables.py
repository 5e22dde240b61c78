"""Tables keyed by peer id stay bounded as peers come and go (docs/P2P.md, "What a surviving node keeps per
churn event"): each is fed more distinct peer ids than its cap, as joiners, ``dlx-node join`` fetch hosts or a
flood of made-up keys would over a long run, and must hold at most its cap while keeping the peers still
active.
"""

import trio

from node import protocol as msg
from node.live.state import roundbook
from node.live.state.roundbook import RoundBook
from p2p import ratelimit, transfer_stats
from p2p.ratelimit import PeerRateLimiter
from p2p.transfer_stats import TransferStats


def test_blob_stats_keep_the_peers_updated_last():
    stats = TransferStats()
    stats.add_peer("member", received=1)
    for index in range(3 * transfer_stats.MAX_PEER_STATS):
        stats.add_peer(f"fetch-host-{index}", sent=10)
        if index % 100 == 0:
            stats.add_peer("member", received=1)  # a peer still exchanging blobs is kept, its totals whole
    snapshot = stats.peers_snapshot()
    assert len(snapshot) == transfer_stats.MAX_PEER_STATS
    assert snapshot["member"]["received"] == 1 + len(range(0, 3 * transfer_stats.MAX_PEER_STATS, 100))
    assert "fetch-host-0" not in snapshot and f"fetch-host-{3 * transfer_stats.MAX_PEER_STATS - 1}" \
        in snapshot


def test_rate_limit_buckets_stay_bounded():
    limiter = PeerRateLimiter(rate=1e9)

    async def traffic() -> None:
        for index in range(3 * ratelimit.MAX_BUCKETS):
            await limiter.consume(f"peer-{index}", "out", 100)
            limiter.expect(f"peer-{index}")
            await limiter.consume("member", "out", 100)

    trio.run(traffic)
    assert len(limiter._buckets) == ratelimit.MAX_BUCKETS
    assert ("member", "out") in limiter._buckets


def test_the_round_book_keeps_the_peers_heard_from_last():
    book = RoundBook()

    def hello(peer: str) -> None:
        book.add_hello(peer, peer.encode(), msg.Hello(f"c-{peer}", 1, b"\x01" * 20, [], 0, 0))

    for index in range(3 * roundbook.MAX_PEERS):
        hello(f"gone-{index}")
        if index % 100 == 0:
            hello("member")  # a member says hello every second
    assert len(book.peers) <= roundbook.MAX_PEERS
    assert "member" in book.live_peers(float("inf"))
    assert f"gone-{3 * roundbook.MAX_PEERS - 1}" in book.peers
