"""A served blob is read into a buffer of its own size unless it fills the kept 4 MiB ones (issue 45's soak).

Every served range took a read buffer of FILE_IO_BYTES (4 MiB), zeroed, so all of it resident: each concurrent
serve of a few-kB contribution beyond the two kept made one more for the length of the serve, and the soak's
nodes' RSS stepped by 4 MiB up and down with them (the probe's mapping of 4,100 kB: glibc's mmapped 4 MiB),
and for good once a catch-up's concurrent fetches first filled the kept pair. Real py-libp2p hosts on
127.0.0.1.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from waiting import wait_until

from p2p.blob_protocol import FILE_IO_BYTES
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(180)


def test_small_blobs_are_served_from_buffers_of_their_size_and_large_ones_from_the_kept_pair(tmp_path):
    a = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "a")
    b = P2PHost.start(P2PConfig(bootstrap=a.listen_addrs, gossip_resync_interval=0), Identity.generate(),
                      data_dir=tmp_path / "b")
    server = a._blob_server
    try:
        wait_until(lambda: b.peer_id in a.peers() and a.peer_id in b.peers(), 60, "a and b connected")
        small = {a.provide_blob(os.urandom(3000 + i), announce=False): i for i in range(12)}
        with ThreadPoolExecutor(6) as pool:  # served side by side, as a round's contributions are
            fetched = list(
                pool.map(lambda d: b.fetch_blob(d, tmp_path / f"got-{d[:8]}", providers=[a.peer_id],
                                                timeout=60), small))
        assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in fetched] == list(small)
        assert server._read_buffers == []  # nothing of 4 MiB made, nothing kept
        large = a.provide_blob(os.urandom(FILE_IO_BYTES + 12345), announce=False)
        got = b.fetch_blob(large, tmp_path / "got-large", providers=[a.peer_id], timeout=60)
        assert hashlib.sha256(got.read_bytes()).hexdigest() == large
        assert [len(buffer) for buffer in server._read_buffers] == [FILE_IO_BYTES]  # reused by the next one
    finally:
        b.close()
        a.close()


def test_the_read_buffer_fits_the_range():
    from p2p.blob_server import _KEPT_READ_BUFFERS, BlobServer

    server = BlobServer.__new__(BlobServer)
    server._read_buffers = []
    assert len(server._take_read_buffer(1)) == 1 and len(server._take_read_buffer(FILE_IO_BYTES - 1)) \
        == FILE_IO_BYTES - 1
    for length in (FILE_IO_BYTES - 1, 10):  # buffers smaller than the kept size are never kept
        server._give_back_read_buffer(bytearray(length))
    assert server._read_buffers == []
    full = [server._take_read_buffer(FILE_IO_BYTES + n) for n in range(_KEPT_READ_BUFFERS + 1)]
    assert all(len(buffer) == FILE_IO_BYTES for buffer in full)
    for buffer in full:
        server._give_back_read_buffer(buffer)
    assert len(server._read_buffers) == _KEPT_READ_BUFFERS
    assert server._take_read_buffer(FILE_IO_BYTES) is full[_KEPT_READ_BUFFERS - 1]  # the last kept, reused
