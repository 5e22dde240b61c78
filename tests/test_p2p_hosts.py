"""Real py-libp2p hosts on 127.0.0.1: discovery, gossip with envelope validation, sync pull, blobs."""

import hashlib
import os
import queue
import time

import pytest
from waiting import wait_until

from p2p.config import P2PConfig
from p2p.envelope import Envelope, EnvelopeValidator, decode_envelope
from p2p.errors import BlobHashMismatch, BlobNotFound, P2PError
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(90)
RUN = 42




@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Four hosts; hosts 1-3 know only host 0 (bootstrap) and must find each other through the DHT."""
    root = tmp_path_factory.mktemp("cluster")
    hosts = [P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=root / "h0")]
    for index in range(1, 4):
        config = P2PConfig(bootstrap=hosts[0].listen_addrs, gossip_resync_interval=0)
        hosts.append(P2PHost.start(config, Identity.generate(), data_dir=root / f"h{index}"))
    yield hosts
    for host in hosts:
        host.close()


def test_bootstrap_and_dht_discovery(cluster):
    ids = {h.peer_id for h in cluster}
    wait_until(
        lambda: all(set(h.peers()) == ids - {h.peer_id} for h in cluster), 60, "a full mesh of connections"
    )
    assert all(addr.endswith(f"/p2p/{h.peer_id}") for h in cluster for addr in h.listen_addrs)
    # Peer routing: host 3 learned host 2's address without being told.
    addrs = cluster[3].find_peer(cluster[2].peer_id, timeout=10)
    port = cluster[2].listen_addrs[0].split("/tcp/")[1].split("/")[0]
    assert any(f"/tcp/{port}" in a for a in addrs)


def subscribe_all(cluster, topic, validators):
    queues = [h.subscribe(topic, v.accepts) for h, v in zip(cluster, validators)]
    others = len(cluster) - 1
    wait_until(
        # Generous: on a loaded 2-core machine DHT discovery and subscription exchange take seconds.
        lambda: all(len(h.topic_peers(topic)) == others for h in cluster), 60, f"subscriptions on {topic}"
    )
    time.sleep(2.5)  # a couple of 1 s heartbeats to graft the mesh
    return queues


def drain(q, count, timeout=10):
    items = []
    deadline = time.monotonic() + timeout
    while len(items) < count and time.monotonic() < deadline:
        try:
            items.append(q.get(timeout=0.1))
        except queue.Empty:
            pass
    return items


def test_gossip_reaches_all_and_invalid_envelopes_are_not_relayed(cluster):
    validators = [EnvelopeValidator(RUN, max_size=1 << 20) for _ in cluster]
    queues = subscribe_all(cluster, "dlx/run42/control", validators)
    sender = cluster[2]
    good = Envelope.create(sender.identity, RUN, 0, "announce", b"round 0 begins")
    wrong_run = Envelope.create(sender.identity, RUN + 1, 0, "announce", b"other run")
    sender.publish("dlx/run42/control", wrong_run.to_bytes())
    sender.publish("dlx/run42/control", good.to_bytes())
    for index, q in enumerate(queues):
        items = drain(q, 2 if index == 2 else 1, timeout=10)
        received = [decode_envelope(data, 1 << 20) for data, _ in items]
        if index == 2:  # the publisher gets its own messages back, unvalidated
            assert {e.run_id for e in received} == {RUN, RUN + 1}
            continue
        assert [e.payload for e in received] == [b"round 0 begins"], f"host {index}"
        assert items[0][1] == sender.peer_id
        assert validators[index].rejections["wrong_run"] >= 1
        assert q.empty()


def test_many_messages_are_not_dropped_by_spam_protection(cluster):
    topic = "dlx/run42/burst"
    queues = subscribe_all(cluster, topic, [EnvelopeValidator(RUN, max_size=1 << 20) for _ in cluster])
    before = [host.transfer_stats().get("/meshsub", {}) for host in cluster]
    for index in range(60):  # py-libp2p's default would drop everything past 10/s
        envelope = Envelope.create(cluster[1].identity, RUN, 0, "attestation", b"%d" % index, stage=index)
        cluster[1].publish(topic, envelope.to_bytes())
    for index, q in enumerate(queues):
        assert len(drain(q, 60, timeout=15)) == 60, f"host {index}"
    # Messages are counted where they are published and where they are delivered, each once.
    after = [host.transfer_stats()["/meshsub"] for host in cluster]
    counted = lambda i, key: after[i][key] - before[i].get(key, 0)  # noqa: E731
    assert counted(1, "messages_sent") == 60 and counted(1, "messages_received") == 0
    for index in (0, 2, 3):
        assert counted(index, "messages_received") == 60, f"host {index}"
        assert counted(index, "messages_sent") == 0, f"host {index}"


def test_late_subscriber_gets_recent_messages(cluster):
    topic = "dlx/run42/late"
    for host in cluster[:3]:
        host.subscribe(topic)
    wait_until(lambda: len(cluster[0].topic_peers(topic)) == 2, 60, "early subscriptions")
    for index in range(3):
        cluster[0].publish(topic, b"message %d" % index)
    late_queue = cluster[3].subscribe(topic, lambda data, peer: data != b"message 1")
    cluster[3].resync(topic, timeout=10)  # gossip replay may race it; each message arrives once
    got = sorted(data for data, _ in drain(late_queue, 3, timeout=2))
    assert got == [b"message 0", b"message 2"]  # the validator screened pulled messages too


def test_sync_recovers_a_message_gossip_rejected_while_behind(cluster):
    """Host 3 is a round behind: it rejects round-1 gossip, then catches up and pulls it via /dlx/sync."""
    topic = "dlx/run42/rounds"
    validators = [
        EnvelopeValidator(RUN, max_size=1 << 20, max_rounds_ahead=0 if i == 3 else 2) for i in range(4)
    ]
    queues = subscribe_all(cluster, topic, validators)
    ahead = Envelope.create(cluster[0].identity, RUN, 1, "announce", b"round 1 begins")
    cluster[0].publish(topic, ahead.to_bytes())
    assert [d for d, _ in drain(queues[1], 1, timeout=10)] == [ahead.to_bytes()]
    wait_until(lambda: validators[3].rejections["future_round"] >= 1, 10, "host 3 to reject round 1")
    assert queues[3].empty()
    validators[3].advance(1)
    assert cluster[3].resync(topic, timeout=10) == 1
    assert queues[3].get(timeout=1)[0] == ahead.to_bytes()
    assert cluster[3].resync(topic, timeout=10) == 0  # incremental: nothing new the second time
    assert cluster[3].transfer_stats()["/dlx/sync/1.0.0"]["received"] >= len(ahead.to_bytes())


def test_republishing_identical_bytes_is_deduplicated(cluster):
    topic = "dlx/run42/control"
    data = Envelope.create(cluster[1].identity, RUN, 0, "hello", b"once").to_bytes()
    assert cluster[1].publish(topic, data) is True
    assert cluster[1].publish(topic, data) is False  # same content id: not sent twice


def test_oversized_gossip_is_refused_loudly(cluster):
    with pytest.raises(P2PError, match="blob"):
        cluster[0].publish("dlx/run42/control", b"x" * 1_100_000)


def test_blob_provide_find_fetch(cluster, tmp_path):
    data = os.urandom(20 << 20)
    source = tmp_path / "pseudo_gradient.bin"
    source.write_bytes(data)
    sha = cluster[0].provide_blob(source)
    assert sha == hashlib.sha256(data).hexdigest() and cluster[0].has_blob(sha)
    assert cluster[3].find_providers(sha) == [cluster[0].peer_id]
    out = cluster[3].fetch_blob(sha, tmp_path / "out" / "a.bin", timeout=60)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == sha
    assert cluster[3].has_blob(sha)
    assert cluster[3].blob_peer_stats()[cluster[0].peer_id]["received"] == len(data)
    # Host 3 now serves it too; host 2 downloads ranges from both in parallel.
    cluster[3].provide_blob(cluster[3].blob_path(sha))
    providers = set(cluster[2].find_providers(sha))
    assert providers == {cluster[0].peer_id, cluster[3].peer_id}
    out2 = cluster[2].fetch_blob(sha, tmp_path / "out" / "b.bin", providers=sorted(providers), timeout=60)
    assert out2.read_bytes() == data
    per_peer = cluster[2].blob_peer_stats()
    assert per_peer[cluster[0].peer_id]["received"] > 0 and per_peer[cluster[3].peer_id]["received"] > 0
    assert sum(per_peer[p]["received"] for p in providers) == len(data)


def test_corrupt_provider_is_detected(cluster, tmp_path):
    data = os.urandom(3 << 20)
    sha = cluster[1].provide_blob(data, announce=False)
    path = cluster[1].blob_path(sha)
    path.chmod(0o644)
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit off
    with pytest.raises(BlobHashMismatch):
        cluster[2].fetch_blob(sha, tmp_path / "bad.bin", providers=[cluster[1].peer_id], timeout=30)
    assert not cluster[2].has_blob(sha) and not (tmp_path / "bad.bin").exists()


def test_missing_and_removed_blobs(cluster, tmp_path):
    unknown = hashlib.sha256(b"nobody has this").hexdigest()
    assert cluster[1].find_providers(unknown, timeout=5) == []
    with pytest.raises(BlobNotFound):
        cluster[1].fetch_blob(unknown, tmp_path / "x", providers=[cluster[0].peer_id], timeout=20)
    sha = cluster[0].provide_blob(b"short-lived")
    assert cluster[0].remove_blob(sha) and not cluster[0].has_blob(sha)
    with pytest.raises(BlobNotFound):
        cluster[1].fetch_blob(sha, tmp_path / "y", providers=[cluster[0].peer_id], timeout=20)


def test_messages_a_subscriber_does_not_keep_are_delivered_but_not_served_by_sync(cluster):
    """``keep_for_sync``: host 0 delivers every message but keeps only some to re-serve; a late
    subscriber pulling from host 0 alone gets those. A raising predicate keeps nothing and costs
    only that message."""
    topic = "dlx/run42/kept"

    def keep(data: bytes) -> bool:
        if data == b"boom":
            raise ValueError("a buggy predicate")
        return not data.startswith(b"beacon")

    queue0 = cluster[0].subscribe(topic, keep_for_sync=keep)
    cluster[1].subscribe(topic)
    wait_until(lambda: len(cluster[1].topic_peers(topic)) >= 1, 60, "host 0's subscription")
    sent = [b"beacon 1", b"record 1", b"boom", b"beacon 2", b"record 2"]
    for data in sent:
        cluster[1].publish(topic, data)
    assert sorted(d for d, _ in drain(queue0, len(sent), timeout=15)) == sorted(sent)  # all delivered
    cluster[1].unsubscribe(topic)  # host 1 keeps what it published: pull from host 0 only

    from libp2p.peer.id import ID

    from p2p.gossip import pull_recent

    async def pull():  # the /dlx/sync client, aimed at host 0 alone
        messages, _cursor, _offered = await pull_recent(cluster[2]._libp2p,
                                                        ID.from_base58(cluster[0].peer_id), topic, b"", 0)
        return messages

    served = cluster[2]._call(pull, timeout=15, what="pull from host 0")
    assert sorted(served) == [b"record 1", b"record 2"]


def test_sync_offers_ids_and_sends_only_the_messages_the_puller_lacks(cluster):
    """``/dlx/sync/1.1.0``: host 0 offers the ids of what it holds; the puller, which already has
    some of the messages, gets only the others. A puller that speaks only 1.0.0 still gets all."""
    topic = "dlx/run42/offer"
    queue0 = cluster[0].subscribe(topic)
    cluster[1].subscribe(topic)
    wait_until(lambda: len(cluster[1].topic_peers(topic)) >= 1, 60, "host 0's subscription")
    sent = [b"offer %d " % i + bytes(200) for i in range(6)]
    for data in sent:
        cluster[1].publish(topic, data)
    assert sorted(d for d, _ in drain(queue0, len(sent), timeout=15)) == sorted(sent)
    cluster[1].unsubscribe(topic)

    from libp2p.peer.id import ID

    from p2p.gossip import SYNC_PROTOCOL, pull_recent, sync_id

    held = {sync_id(m) for m in sent[:4]}
    host0 = ID.from_base58(cluster[0].peer_id)

    async def pull_lacking():
        return await pull_recent(cluster[2]._libp2p, host0, topic, b"", 0, have=held.__contains__)

    messages, (_epoch, cursor), offered = cluster[2]._call(pull_lacking, timeout=15, what="pull from host 0")
    assert sorted(messages) == sorted(sent[4:])
    assert offered == 16 * len(sent) and cursor >= len(sent)

    async def pull_v1():  # an older peer: it negotiates 1.0.0 and gets every message
        stream = await cluster[2]._libp2p.new_stream(host0, [SYNC_PROTOCOL])
        from p2p.gossip import parse_sync_response, sync_request_frame
        from p2p.wire import read_frame, write_frame
        try:
            await write_frame(stream, sync_request_frame(topic, b"", 0))
            return parse_sync_response(await read_frame(stream, 1 << 20, max_containers=2))[0]
        finally:
            await stream.close()

    assert sorted(cluster[2]._call(pull_v1, timeout=15, what="1.0.0 pull from host 0")) == sorted(sent)


def test_a_hostile_sync_offer_or_want_is_refused():
    from p2p.gossip import parse_sync_offer, parse_sync_want, sync_offer_frame
    from p2p.wire import ProtocolViolation

    good = sync_offer_frame(b"e" * 8, 3, [b"i" * 16, b"j" * 16])
    assert parse_sync_offer(good) == ([b"i" * 16, b"j" * 16], (b"e" * 8, 3))
    for bad in (sync_offer_frame(b"e" * 8, 3, [b"short"]), sync_offer_frame(b"e" * 8, 3, [7]),
                {"epoch": b"e", "next": 1}, {"epoch": b"e", "next": 1, "ids": b"x"}):
        with pytest.raises(ProtocolViolation):
            parse_sync_offer(bad)
    assert parse_sync_want({"want": [0, 2, 5]}, 6) == [0, 2, 5]
    assert parse_sync_want({"want": []}, 0) == []
    for bad in ({"want": [1, 1]}, {"want": [2, 1]}, {"want": [0, 6]}, {"want": [-1]}, {"want": ["0"]},
                {"want": [True]}, {}):
        with pytest.raises(ProtocolViolation):
            parse_sync_want(bad, 6)
