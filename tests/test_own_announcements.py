"""A node announces its own contributions on the DHT only while the round is live (issue 45, the soak).

Under the default ``storage.keep_rounds = 0`` a node keeps every contribution it made, for the audit; announced
for ever, each one added a provider record, a ``providing_keys`` entry and a republish time to the DHT's store,
round after round, and py-libp2p would re-announce all of them 22 hours on. The pool stops announcing a round's
contributions when it forgets the round; the blob store keeps serving them to a peer that names this node.
"""

from __future__ import annotations

import hashlib

import pytest

from node.live.exchange import ContributionPool
from node.live.roundbook import RoundBook
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from waiting import wait_until

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
        # A contribution to a round already forgotten (a restart's re-announcement of an old one) is served and
        # never announced; a live round's is.
        late = pool.serve_own(3, b"round 3 contribution, again").hex()
        live = pool.serve_own(11, b"round 11 contribution").hex()
        wait_until(lambda: live in _providing(host), 60, "round 11 announced")
        assert late not in _providing(host) and host.has_blob(late)
        assert hashlib.sha256(host.blob_path(late).read_bytes()).hexdigest() == late
    finally:
        pool.close()
        host.close()
