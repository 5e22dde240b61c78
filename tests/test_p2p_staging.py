"""Downloads written with and without O_DIRECT (p2p.staging), from honest, odd and lying providers."""

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time

import msgpack
import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from p2p.blob_protocol import PIECE_BYTES
from p2p.config import P2PConfig
from p2p.errors import BlobHashMismatch, BlobNotFound
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(90)
BLOB = TProtocol("/dlx/blob/1.0.0")


def staging_is_empty(host_dir):
    return list((host_dir / "blobs" / ".staging").iterdir()) == []


@pytest.mark.parametrize("direct_io", [True, False])
def test_an_unaligned_blob_of_several_pieces_arrives_whole(tmp_path, direct_io):
    data = os.urandom(2 * PIECE_BYTES + 12_345)  # three pieces, the last ending mid-block
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "a") as provider:
        with P2PHost.start(
            P2PConfig(blob_direct_io=direct_io), Identity.generate(), data_dir=tmp_path / "b"
        ) as fetcher:
            sha = provider.provide_blob(data, announce=False)
            fetcher.connect(provider.listen_addrs[0])
            out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
            assert out.stat().st_size == len(data) and out.read_bytes() == data
            assert fetcher.blob_path(sha).read_bytes() == data
            assert staging_is_empty(tmp_path / "b")


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_corrupt_blob_is_refused_and_leaves_nothing(tmp_path, direct_io):
    data = os.urandom(PIECE_BYTES + 5000)
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "a") as provider:
        with P2PHost.start(
            P2PConfig(blob_direct_io=direct_io), Identity.generate(), data_dir=tmp_path / "b"
        ) as fetcher:
            sha = provider.provide_blob(data, announce=False)
            stored = provider.blob_path(sha)
            stored.chmod(0o644)
            with open(stored, "r+b") as handle:  # one bit off, inside an aligned direct-written block
                handle.seek(3 * 4096 + 7)
                byte = handle.read(1)
                handle.seek(3 * 4096 + 7)
                handle.write(bytes([byte[0] ^ 1]))
            fetcher.connect(provider.listen_addrs[0])
            with pytest.raises(BlobHashMismatch):
                fetcher.fetch_blob(sha, tmp_path / "bad.bin", providers=[provider.peer_id], timeout=60)
            assert not fetcher.has_blob(sha) and not (tmp_path / "bad.bin").exists()
            assert staging_is_empty(tmp_path / "b")


def frame(obj):
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class RawProvider:
    """A bare py-libp2p host serving ``data`` over /dlx/blob/1.0.0 its own way, on a thread.

    ``tamper(offset, payload) -> payload`` may change the bytes of a range before they go out.
    Every reply (header and range bytes) is sent in a single stream write, so the header and
    the first bytes share yamux frames and Noise messages: legal, if not what this project sends.
    """

    def __init__(self, data, tamper=None):
        self.data = data
        self.tamper = tamper or (lambda offset, payload: payload)
        self._ready = queue.Queue()
        self._stop = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def __enter__(self):
        self._thread.start()
        self.addr = self._ready.get(timeout=30)
        return self

    def __exit__(self, *exc):
        self._token.run_sync_soon(self._stop.set)
        self._thread.join(30)

    async def _serve(self, stream):
        length = int.from_bytes(await stream.read(4), "big")
        request = msgpack.unpackb(await stream.read(length))
        digest, offset, size = request["sha256"], request["offset"], request["length"]
        header = {"status": "ok", "total": len(self.data), "sha256": digest, "offset": offset, "length": size}
        await stream.write(frame(header) + self.tamper(offset, self.data[offset : offset + size]))
        await stream.close()

    async def _main(self):
        key_pair = create_new_key_pair()
        noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
        host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
            transports=[TCP()],
        )
        host.set_stream_handler(BLOB, self._serve)
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            self.peer_id = host.get_id().to_base58()
            self._ready.put(f"{host.get_addrs()[0]}")
            await self._stop.wait()
            await host.close()


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_provider_that_sends_header_and_bytes_in_one_write_is_understood(tmp_path, direct_io):
    data = os.urandom(PIECE_BYTES + 3 * 4096 + 99)
    sha = hashlib.sha256(data).hexdigest()
    with RawProvider(data) as provider, P2PHost.start(
        P2PConfig(blob_direct_io=direct_io), Identity.generate(), data_dir=tmp_path / "b"
    ) as fetcher:
        fetcher.connect(provider.addr)
        out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[provider.peer_id], timeout=60)
        assert out.read_bytes() == data
        assert staging_is_empty(tmp_path / "b")


def test_a_lying_provider_costs_only_its_transfer(tmp_path):
    """Right header, wrong bytes in the second piece: refused by the hash, the host goes on."""
    data = os.urandom(2 * PIECE_BYTES)
    sha = hashlib.sha256(data).hexdigest()

    def flip_second_piece(offset, payload):
        if offset <= PIECE_BYTES < offset + len(payload):
            at = PIECE_BYTES - offset + 4096
            payload = payload[:at] + bytes([payload[at] ^ 0x80]) + payload[at + 1 :]
        return payload

    config = P2PConfig(blob_direct_io=True)
    with P2PHost.start(config, Identity.generate(), data_dir=tmp_path / "b") as fetcher:
        with RawProvider(data, tamper=flip_second_piece) as liar:
            fetcher.connect(liar.addr)
            with pytest.raises(BlobHashMismatch):
                fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[liar.peer_id], timeout=60)
            assert not fetcher.has_blob(sha) and staging_is_empty(tmp_path / "b")
        with RawProvider(data) as honest:
            fetcher.connect(honest.addr)
            out = fetcher.fetch_blob(sha, tmp_path / "out.bin", providers=[honest.peer_id], timeout=60)
            assert out.read_bytes() == data


FETCHER_SCRIPT = """
import sys
from pathlib import Path
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

addr, peer, sha, data_dir = sys.argv[1:5]
with P2PHost.start(P2PConfig(blob_direct_io=True), Identity.generate(), data_dir=Path(data_dir)) as host:
    host.connect(addr)
    host.fetch_blob(sha, Path(data_dir) / "out.bin", providers=[peer], timeout=120)
"""


def test_a_fetcher_killed_mid_download_leaves_no_blob_and_serves_none(tmp_path):
    """SIGKILL during a direct-written download: on restart the staging file is gone, the blob absent."""
    source = tmp_path / "blob.bin"
    data = os.urandom(3 * PIECE_BYTES)
    source.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    provider = subprocess.Popen(
        [sys.executable, "-m", "p2p.serve", str(source), "--data-dir", str(tmp_path / "provider"),
         "--rate-limit-bps", "4e6"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    fetcher = None
    try:
        info = json.loads(provider.stdout.readline())
        fetcher_dir = tmp_path / "fetcher"
        fetcher = subprocess.Popen(
            [sys.executable, "-c", FETCHER_SCRIPT, info["listen_addrs"][0], info["peer_id"], sha,
             str(fetcher_dir)]
        )
        staging = fetcher_dir / "blobs" / ".staging"
        deadline = time.monotonic() + 60
        # Killed once part of the blob is on disk (blocks written, not just the file's size set).
        while not any(part.stat().st_blocks > 0 for part in (staging.glob("*") if staging.exists() else [])):
            assert fetcher.poll() is None, "the fetcher ended before it was killed"
            assert time.monotonic() < deadline, "no staged bytes within 60 s"
            time.sleep(0.05)
        fetcher.kill()
        fetcher.wait()
        assert list(staging.iterdir()) and not (fetcher_dir / "blobs" / sha).exists()
        with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=fetcher_dir) as restarted:
            assert list(staging.iterdir()) == []  # the interrupted write is dropped at start
            assert not restarted.has_blob(sha)
            with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "asker") as asker:
                asker.connect(restarted.listen_addrs[0])
                with pytest.raises(BlobNotFound):
                    asker.fetch_blob(sha, tmp_path / "x.bin", providers=[restarted.peer_id], timeout=30)
    finally:
        if fetcher is not None and fetcher.poll() is None:
            fetcher.kill()
            fetcher.wait()
        provider.stdin.close()
        provider.wait(timeout=30)
