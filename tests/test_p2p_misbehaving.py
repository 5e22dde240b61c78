"""A misbehaving peer (raw libp2p streams with garbage, lies and oversized frames) never breaks a host."""

import hashlib

import msgpack
import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(60)
BLOB = TProtocol("/dlx/blob/1.0.0")
SYNC = TProtocol("/dlx/sync/1.0.0")


def frame(obj):
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


async def exchange(raw_host, peer_id, protocol, payload):
    """Send ``payload`` on a new stream and return whatever comes back (b"" if reset)."""
    stream = await raw_host.new_stream(peer_id, [protocol])
    received = b""
    try:
        await stream.write(payload)
        with trio.move_on_after(5):
            while True:
                chunk = await stream.read(1 << 16)
                if not chunk:
                    break
                received += chunk
    except Exception:  # reset by the host: what we want for garbage
        pass
    return received


def test_garbage_and_lies_are_answered_or_reset_and_the_host_keeps_serving(tmp_path):
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path) as host:
        data = b"real content" * 1000
        sha = host.provide_blob(data, announce=False)
        key_pair = create_new_key_pair()
        noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
        raw = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: noise},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
            transports=[TCP()],
        )
        answers = {}

        async def attack():
            async with raw.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                info = info_from_p2p_addr(multiaddr.Multiaddr(host.listen_addrs[0]))
                await raw.connect(info)
                peer = info.peer_id
                answers["junk"] = await exchange(raw, peer, BLOB, b"\x00\x00\x00\x05hello")
                answers["huge_frame"] = await exchange(raw, peer, BLOB, (1 << 31).to_bytes(4, "big"))
                answers["bool_offset"] = await exchange(
                    raw, peer, BLOB, frame({"sha256": bytes.fromhex(sha), "offset": True, "length": 1})
                )
                answers["short_hash"] = await exchange(
                    raw, peer, BLOB, frame({"sha256": b"\x01", "offset": 0, "length": 1})
                )
                answers["beyond_end"] = await exchange(
                    raw,
                    peer,
                    BLOB,
                    frame({"sha256": bytes.fromhex(sha), "offset": 0, "length": len(data) + 1}),
                )
                answers["unknown"] = await exchange(
                    raw,
                    peer,
                    BLOB,
                    frame({"sha256": hashlib.sha256(b"x").digest(), "offset": 0, "length": 1}),
                )
                answers["sync_junk"] = await exchange(raw, peer, SYNC, b"\xff" * 64)
                answers["range"] = await exchange(
                    raw, peer, BLOB, frame({"sha256": bytes.fromhex(sha), "offset": 4, "length": 8})
                )
                await raw.close()

        trio.run(attack)
        assert answers["sync_junk"] == b""

        def status(raw_answer):
            length = int.from_bytes(raw_answer[:4], "big")
            return msgpack.unpackb(raw_answer[4 : 4 + length])["status"], raw_answer[4 + length :]

        # An unreadable blob request frame is answered bad_request (saying why), nothing after it.
        assert status(answers["junk"]) == status(answers["huge_frame"]) == ("bad_request", b"")

        assert status(answers["bool_offset"])[0] == "bad_request"
        assert status(answers["short_hash"])[0] == "bad_request"
        assert status(answers["beyond_end"])[0] == "out_of_range"
        assert status(answers["unknown"])[0] == "not_found"
        assert status(answers["range"]) == ("ok", data[4:12])  # range requests serve exact slices
        # Still healthy: another host fetches the blob normally.
        with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "other") as other:
            other.connect(host.listen_addrs[0])
            out = other.fetch_blob(sha, tmp_path / "out.bin", providers=[host.peer_id], timeout=30)
            assert out.read_bytes() == data


def test_empty_blob_round_trip(tmp_path):
    with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "a") as a:
        with P2PHost.start(P2PConfig(), Identity.generate(), data_dir=tmp_path / "b") as b:
            sha = a.provide_blob(b"", announce=False)
            b.connect(a.listen_addrs[0])
            assert (
                b.fetch_blob(sha, tmp_path / "empty", providers=[a.peer_id], timeout=30).read_bytes() == b""
            )
