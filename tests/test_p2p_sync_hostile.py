"""``/dlx/sync/1.1.0`` against a hostile server: real py-libp2p hosts on 127.0.0.1.

The server offers ids, the puller names what it wants, the server sends messages. A server that
then sends messages it did not offer, or offered ones the puller did not want, or a tampered copy
of an offered one, must not get them delivered: only what was offered and wanted is, once.
"""

import queue

import pytest
from test_p2p_hosts import wait_until as _wait_until

from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(120)
TOPIC = "dlx/run42/hostile-sync"


def _drain(q: queue.Queue) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(q.get_nowait()[0])
        except queue.Empty:
            return out


def test_a_sync_server_cannot_push_what_it_did_not_offer_or_the_puller_did_not_want(tmp_path):
    from p2p.gossip import (
        SYNC_OFFER_PROTOCOL,
        parse_sync_request,
        parse_sync_want,
        sync_id,
        sync_messages_frame,
        sync_offer_frame,
        want_frame_limit,
    )
    from p2p.wire import read_frame, write_frame

    offered = [b"offered %d " % i + bytes(64) for i in range(3)]
    held_already, lacking = offered[0], offered[1:]
    unoffered = b"never offered " + bytes(64)
    tampered = offered[1] + b"!"  # not the bytes whose id was offered
    seen_want: list[list[int]] = []

    async def hostile_server(stream) -> None:
        topic, _epoch, _after = parse_sync_request(await read_frame(stream, 4096))
        assert topic == TOPIC
        await write_frame(stream, sync_offer_frame(b"e" * 8, len(offered), [sync_id(m) for m in offered]))
        want = parse_sync_want(await read_frame(stream, want_frame_limit(len(offered))), len(offered))
        seen_want.append(want)
        # Everything offered (wanted or not), plus a message never offered and a tampered copy.
        await write_frame(stream, sync_messages_frame([*offered, unoffered, tampered]))
        await stream.close()

    hostile = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "h")
    honest = None
    try:
        honest = P2PHost.start(P2PConfig(bootstrap=hostile.listen_addrs, gossip_resync_interval=0),
                               Identity.generate(), data_dir=tmp_path / "p")

        async def replace_handler() -> None:
            hostile._libp2p.set_stream_handler(SYNC_OFFER_PROTOCOL, hostile_server)

        hostile._call(replace_handler, timeout=10, what="install the hostile sync handler")
        delivered = honest.subscribe(TOPIC)
        _wait_until(lambda: hostile.peer_id in honest.peers(), 60, "a connection to the hostile host")
        honest.publish(TOPIC, held_already)  # our own message: delivered and remembered, so not wanted
        _wait_until(lambda: not delivered.empty(), 30, "our own message")
        assert _drain(delivered) == [held_already]

        new = honest.resync(TOPIC, timeout=30)
        got = _drain(delivered)
        assert seen_want == [[1, 2]]  # the one it held was not asked for
        assert sorted(got) == sorted(lacking) and new == len(lacking), got
        assert unoffered not in got and tampered not in got
        # A second pull delivers nothing again (duplicates are dropped, the cursor moved on).
        honest.resync(TOPIC, timeout=30)
        assert _drain(delivered) == []
    finally:
        if honest is not None:
            honest.close()
        hostile.close()
