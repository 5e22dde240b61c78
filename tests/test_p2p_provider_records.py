"""A long run's DHT provider records stay bounded (p2p.provider_records; issue 45's soak).

py-libp2p keeps every provider record it is sent for 48 h: every round's contributions, shards and
checkpoints, from every peer, so a node's memory grew round after round. Other peers' records now
age out after ``p2p.provider_record_ttl``; a host's own records stay while it serves the blob, and a
fetcher still finds a holder it is connected to (the holder answers for itself).

Real py-libp2p hosts on 127.0.0.1; the rounds of the second test are records with the timestamps
rounds 30 s apart would give them, in a real host's store.
"""

from __future__ import annotations

import hashlib
import time

import pytest
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr
from waiting import wait_until

from p2p.config import P2PConfig
from p2p.errors import P2PConfigError, P2PError
from p2p.host import P2PHost
from p2p.host_blobs import _dht_key
from p2p.identity import Identity
from p2p.provider_records import record_count

pytestmark = pytest.mark.timeout(180)

TTL = 600.0




def records_of(host: P2PHost, peer_id: str) -> int:
    async def count() -> int:
        return sum(peer_id in records for records in host._dht.provider_store.providers.values())

    return host._call(count, timeout=5, what="records of a peer")


@pytest.fixture
def two_hosts(tmp_path):
    config = dict(gossip_resync_interval=0, provider_record_ttl=TTL)
    a = P2PHost.start(P2PConfig(**config), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, **config), Identity.generate(),
                      data_dir=tmp_path / "b")
    wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
    yield a, b
    b.close()
    a.close()


def test_other_peers_records_age_out_own_ones_stay_and_the_holder_is_still_found(two_hosts, tmp_path):
    a, b = two_hosts
    blobs = [a.provide_blob(f"round {r} contribution of a".encode()) for r in range(6)]
    own = b.provide_blob(b"round 0 contribution of b")
    wait_until(lambda: records_of(b, a.peer_id) == len(blobs), 60, "b holding a's provider records")
    assert records_of(a, a.peer_id) == len(blobs)

    # Past the TTL: b drops what it held for a, keeps its own record (it still serves that blob); a keeps
    # its own six likewise.
    later = time.time() + TTL + 1
    assert b._call(b._trim_provider_records, later, timeout=5, what="trim") == len(blobs)
    a._call(a._trim_provider_records, later, timeout=5, what="trim")
    assert records_of(b, a.peer_id) == 0 and records_of(b, b.peer_id) == 1
    assert records_of(a, a.peer_id) == len(blobs) and records_of(a, b.peer_id) == 0

    # b still finds a as a provider of a's blob (a answers for itself) and fetches it.
    assert a.peer_id in b.find_providers(blobs[3])
    fetched = b.fetch_blob(blobs[3], tmp_path / "fetched")
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == blobs[3]
    assert b.peer_id in b.find_providers(own)

    # A blob a no longer serves loses a's own record too.
    a.remove_blob(blobs[0])
    a._call(a._trim_provider_records, timeout=5, what="trim")
    assert records_of(a, a.peer_id) == len(blobs) - 1


def test_records_retained_per_round_stay_bounded_over_a_long_run(tmp_path):
    """100 rounds 30 s apart, 8 peers announcing 3 blobs a round each: what the host holds after each
    round's trim is bounded by the rounds inside the TTL, not by the rounds run."""
    host = P2PHost.start(P2PConfig(gossip_resync_interval=0, provider_record_ttl=TTL), Identity.generate(),
                         data_dir=tmp_path / "h")
    peers = [Identity.generate().peer_id for _ in range(8)]
    start = time.time() - 100 * 30
    per_round = len(peers) * 3
    rounds_kept = int(TTL // 30) + 1

    async def run_rounds() -> list[int]:
        store = host._dht.provider_store
        held = []
        for round_index in range(100):
            at = start + 30 * round_index
            for peer in peers:
                info = PeerInfo(ID.from_base58(peer),
                                [Multiaddr(f"/ip4/10.0.0.{len(held) % 250 + 1}/tcp/4001")])
                for blob in range(3):
                    key = hashlib.sha256(f"{round_index}/{peer}/{blob}".encode()).digest()
                    store.add_provider(key, info)
                    store.providers[key][peer].timestamp = at
            await host._trim_provider_records(at)
            held.append(record_count(store))
        return held

    try:
        held = host._call(run_rounds, timeout=60, what="rounds")
    finally:
        host.close()
    assert max(held) <= per_round * rounds_kept, max(held)
    assert held[-1] == held[rounds_kept + 5] == per_round * rounds_kept  # flat once the TTL is full


def test_the_ttl_is_checked():
    with pytest.raises(P2PConfigError, match="provider_record_ttl"):
        P2PConfig(provider_record_ttl=0)


def test_a_blob_no_longer_announced_is_still_served_to_a_fetcher_that_names_its_holder(two_hosts, tmp_path):
    a, b = two_hosts
    kept, retired = a.provide_blob(b"round 9 contribution of a"), a.provide_blob(b"round 1 contribution of a")
    wait_until(lambda: records_of(b, a.peer_id) == 2, 60, "b holding a's provider records")

    async def providing() -> set[str]:
        # sha2-256 multihash: 1220 + digest
        return {key.hex()[4:] for key in a._dht.provider_store.providing_keys}

    assert a._call(providing, timeout=5, what="keys") == {kept, retired}
    a.stop_announcing(retired)
    a._call(a._trim_provider_records, timeout=5, what="trim")
    assert a._call(providing, timeout=5, what="keys") == {kept}  # nor re-announced 22 h on
    assert records_of(a, a.peer_id) == 1 and a.has_blob(retired)
    # b's copy of a's old record ages out (the TTL); then a
    # lookup finds no provider, a named fetch still works.
    b._call(b._trim_provider_records, time.time() + TTL + 1, timeout=5, what="trim")
    assert a.peer_id not in b.find_providers(retired) and a.peer_id in b.find_providers(kept)
    fetched = b.fetch_blob(retired, tmp_path / "fetched", providers=[a.peer_id])
    assert hashlib.sha256(fetched.read_bytes()).hexdigest() == retired
    with pytest.raises(P2PError):
        a.stop_announcing("not a digest")


def test_the_dhts_maintenance_pass_does_not_announce_a_fresh_blob_again(two_hosts):
    """py-libp2p's provide() left a key's republish time unset, so the DHT's maintenance loop (every 600 s)
    announced every blob provided since its last pass again (a lookup and k ADD_PROVIDERs each); the 22
    hours of the republish rule now count from the announcement. A key past them is still republished."""
    a, b = two_hosts
    fresh = a.provide_blob(b"a fresh checkpoint of a")
    old = a.provide_blob(b"a checkpoint of a announced 23 hours ago")
    store = a._dht.provider_store
    provided: list[bytes] = []
    original = store.provide

    async def counting(key: bytes) -> bool:
        provided.append(key)
        return await original(key)

    async def maintenance_pass() -> None:
        store._last_republish[_dht_key(old)] = time.time() - 23 * 3600
        store.provide = counting
        try:
            await store._republish_provider_records()  # what the DHT's main loop runs every 600 s
        finally:
            del store.provide

    a._call(maintenance_pass, timeout=60, what="the DHT's maintenance pass")
    assert provided == [_dht_key(old)], [key.hex() for key in provided]  # before: the fresh key too
    assert _dht_key(fresh) not in provided
