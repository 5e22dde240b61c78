"""A download's first piece is asked for beside the size queries, and only used if its provider's size won."""

import os

import pytest
from libp2p.peer.id import ID

from p2p.blob_protocol import PIECE_BYTES, ok_reply, parse_reply
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity
from p2p.wire import ProtocolViolation

pytestmark = pytest.mark.timeout(120)


def requests(timeline):
    """The (offset, length) of every request a download made, in order ("request 0+0" is a size query)."""
    found = []
    for _, event in timeline:
        if event.startswith("request "):
            offset, length = event.split()[1].split("+")
            found.append((int(offset), int(length)))
    return found


def download(fetcher, sha, providers):
    """``BlobFetcher.download`` with the providers in this order (fetch_blob shuffles them)."""
    fetcher._blobs.timeline = []
    ids = [ID.from_base58(p) for p in providers]
    path = fetcher._call(fetcher._blobs.download, sha, ids, 1 << 30, timeout=60, what="download")
    timeline, fetcher._blobs.timeline = fetcher._blobs.timeline, None
    return path, timeline


def test_first_piece_is_asked_for_with_the_size_and_each_piece_once(tmp_path):
    blob = os.urandom(3 * PIECE_BYTES - 1000)
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "p") as provider, \
            P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "f") as fetcher:
        sha = provider.provide_blob(blob, announce=False)
        fetcher.connect(provider.listen_addrs[0])
        path, timeline = download(fetcher, sha, [provider.peer_id])
        assert path.read_bytes() == blob
        received = fetcher.transfer_stats()["/dlx/blob/1.0.0"]["received"]
    asked = requests(timeline)
    # one size query, then each piece once: the first one asked for before the size was known
    assert sorted(asked) == [(0, 0), (0, PIECE_BYTES), (PIECE_BYTES, PIECE_BYTES),
                             (2 * PIECE_BYTES, PIECE_BYTES - 1000)]
    events = [event for _, event in timeline]
    assert events.index(f"request 0+{PIECE_BYTES}") < events.index("size known")
    assert received == len(blob)  # nothing fetched twice


def test_first_piece_from_a_provider_outvoted_on_the_size_is_dropped(tmp_path):
    blob = os.urandom(PIECE_BYTES + 5000)
    hosts = [P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / f"h{i}") for i in range(4)]
    try:
        liar, honest, other, fetcher = hosts
        sha = honest.provide_blob(blob, announce=False)
        assert other.provide_blob(blob, announce=False) == sha
        # The liar stores something longer under the blob's name: it reports another size.
        assert liar.provide_blob(blob, announce=False) == sha
        stored = liar.store.path(sha)
        os.chmod(stored, 0o644)
        with open(stored, "ab") as handle:
            handle.write(b"extra")
        for host in (liar, honest, other):
            fetcher.connect(host.listen_addrs[0])
        path, timeline = download(fetcher, sha, [liar.peer_id, honest.peer_id, other.peer_id])
        assert path.read_bytes() == blob
        per_peer = fetcher.blob_peer_stats()
    finally:
        for host in hosts:
            host.close()
    asked = requests(timeline)
    # the early first piece (to the liar) was not used: the piece was asked for again
    assert asked.count((0, PIECE_BYTES)) == 2
    assert asked.count((0, 0)) == 3
    # not a byte of the liar's was taken in; the others gave the blob exactly once
    assert per_peer.get(liar.peer_id, {}).get("received", 0) == 0
    assert sum(per_peer.get(peer, {}).get("received", 0) for peer in (honest.peer_id, other.peer_id)) \
        == len(blob)


@pytest.mark.parametrize("total", [0, 99, 110])
def test_an_ok_reply_must_hold_its_range(total):
    digest = bytes(range(32))
    reply = ok_reply(total, digest, 10, 100)
    if total >= 110:
        assert parse_reply(reply, digest, 10, 100) == ("ok", total)
    else:
        with pytest.raises(ProtocolViolation):
            parse_reply(reply, digest, 10, 100)


def test_a_download_from_a_peer_not_yet_connected_dials_it_once(tmp_path):
    """The size query and the early first piece open their streams at once: one connection serves both."""
    import multiaddr

    blob = os.urandom(PIECE_BYTES + 1)
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "p") as provider, \
            P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "f") as fetcher:
        sha = provider.provide_blob(blob, announce=False)
        peer = ID.from_base58(provider.peer_id)
        address = multiaddr.Multiaddr(provider.listen_addrs[0].split("/p2p/")[0])

        async def learn_address():  # known (as from the DHT), not dialled
            fetcher._libp2p.get_peerstore().add_addrs(peer, [address], 3600)

        fetcher._call(learn_address, timeout=10, what="learn address")
        out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
        assert out.read_bytes() == blob

        async def connections():
            return len(fetcher._libp2p.get_network().get_connections(peer))

        assert fetcher._call(connections, timeout=10, what="connections") == 1
