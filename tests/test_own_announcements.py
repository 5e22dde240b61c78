"""A node announces its own contributions on the DHT only while the round is live (issue 45, the soak).

Under the default ``storage.keep_rounds = 0`` a node keeps every contribution it made, for the audit;
announced for ever, each one added a provider record, a ``providing_keys`` entry and a republish time to the
DHT's store, round after round, and py-libp2p would re-announce all of them 22 hours on. The pool stops
announcing a round's contributions when it forgets the round; the blob store keeps serving them to a peer that
names this node.
"""

from __future__ import annotations

import hashlib

import pytest
from waiting import wait_until

from node.live.exchange.pool import ContributionPool
from node.live.state.roundbook import RoundBook
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(180)


def _providing(host: P2PHost) -> set[str]:
    async def keys() -> set[str]:
        return {key[2:].hex() for key in host._dht.provider_store.providing_keys}

    return host._call(keys, timeout=5, what="providing keys")


def test_contributions_of_forgotten_rounds_are_served_but_no_longer_announced(tmp_path):
    host = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "h")
    pool = ContributionPool(host, RoundBook(), 1, tmp_path / "incoming", 1 << 20, 5.0, 2)
    try:
        digests = {r: pool.serve_own(r, f"round {r} contribution".encode()).hex() for r in range(10)}
        wait_until(lambda: _providing(host) == set(digests.values()), 60, "ten contributions announced")
        pool.forget_before(6)
        assert _providing(host) == {digests[r] for r in range(6, 10)}
        assert all(host.has_blob(digest) for digest in digests.values())  # still served, from the store
        # A contribution to a round already forgotten (a restart's re-announcement of an old one) is served
        # and never announced; a live round's is.
        late = pool.serve_own(3, b"round 3 contribution, again").hex()
        live = pool.serve_own(11, b"round 11 contribution").hex()
        wait_until(lambda: live in _providing(host), 60, "round 11 announced")
        assert late not in _providing(host) and host.has_blob(late)
        assert hashlib.sha256(host.blob_path(late).read_bytes()).hexdigest() == late
    finally:
        pool.close()
        host.close()


class _HeldAnnouncing:
    """A real host whose announcements wait for ``release`` (the DHT's put under load), the rest passed
    through."""

    def __init__(self, host: P2PHost) -> None:
        import threading

        self.host, self.started, self.release = host, threading.Event(), threading.Event()

    def provide_blob(self, source, announce: bool = True, timeout: float = 30.0, link: bool = False) -> str:
        if announce:
            self.started.set()
            assert self.release.wait(60)
        return self.host.provide_blob(source, announce=announce, timeout=timeout)

    def __getattr__(self, name):
        return getattr(self.host, name)


def test_a_round_forgotten_while_its_contribution_was_being_announced_is_not_left_announced(tmp_path):
    """forget_before runs while the announcer is inside the DHT put of that round's contribution: once the put
    ends the contribution is retired (before, it was registered ahead of the put and forget_before's stop
    came first, so the put re-announced it for good)."""
    host = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "h")
    held = _HeldAnnouncing(host)
    pool = ContributionPool(held, RoundBook(), 1, tmp_path / "incoming", 1 << 20, 5.0, 2)
    try:
        digest = pool.serve_own(0, b"round 0 contribution").hex()
        assert held.started.wait(60)
        pool.forget_before(1)
        held.release.set()
        kept = pool.serve_own(1, b"round 1 contribution").hex()  # queued behind round 0's announcement
        wait_until(lambda: kept in _providing(host), 60, "round 1 announced")
        assert digest not in _providing(host) and host.has_blob(digest)
    finally:
        pool.close()
        host.close()
