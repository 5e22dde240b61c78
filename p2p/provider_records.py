"""Keep the DHT's provider records of a long run bounded: other peers' age out, ours share one PeerInfo.

py-libp2p's Kademlia provider store keeps every provider record it is sent for 48 hours (the
libp2p default), each with its own PeerInfo and address list. A run announces every round's
contributions, shards and checkpoints, so a node's store grew by every blob of every peer, round
after round: in issue 45's 60-minute soak, ~150 records a round on 8 nodes and most of the
nodes' RSS growth after warm-up (docs/P2P.md, "What the soak found").

What a record is for here: a fetcher asks every connected peer for a blob's providers
(``GET_PROVIDERS``, :meth:`p2p.host_blobs.HostBlobs.find_providers`), and a peer that holds the
blob answers for itself from its own record, which is kept as long as it serves the blob. Another
peer's record only helps a fetcher that is not connected to the holder, while the blob is being
fetched: the round it belongs to, or a checkpoint's pull. Those records are kept ``max_age``
seconds (``p2p.provider_record_ttl``) and dropped after; a holder's own record never is.
"""

from __future__ import annotations

from typing import Any

from libp2p.peer.peerinfo import PeerInfo


def trim_provider_records(store: Any, me: str, own: PeerInfo, max_age: float, now: float) -> int:
    """Drop other peers' records older than ``max_age`` from py-libp2p's ``ProviderStore`` ``store``
    (``providers``: key -> {peer id: ProviderRecord}, ``providing_keys``, ``_last_republish``); point
    every record of ours (``me``) at ``own``, one PeerInfo of this host; drop our record of a key we no
    longer provide, keys left without records, and republish times of keys we no longer provide.
    Returns how many records were dropped."""
    dropped = 0
    for key in list(store.providers):
        records = store.providers[key]
        for peer in list(records):
            record = records[peer]
            if peer == me:
                if key in store.providing_keys:
                    record.provider_info = own
                    continue
            elif now - record.timestamp <= max_age:
                continue
            del records[peer]
            dropped += 1
        if not records:
            del store.providers[key]
    for key in [k for k in store._last_republish if k not in store.providing_keys]:
        del store._last_republish[key]
    return dropped


def record_count(store: Any) -> int:
    """Provider records held in ``store`` (all keys, all peers)."""
    return sum(len(records) for records in store.providers.values())
