"""p2p.pubsub_fastpath: a peer's unchanged signed record is checked once, anything else in full."""

from __future__ import annotations

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerstore import create_signed_peer_record
from libp2p.pubsub.pb import rpc_pb2
from multiaddr import Multiaddr

from p2p import pubsub_fastpath
from p2p.identity import Identity
from p2p.transport import build_libp2p_host


def _rpc(record: bytes) -> rpc_pb2.RPC:
    rpc = rpc_pb2.RPC()
    rpc.senderRecord = record
    return rpc


def _record(key_pair, port: int) -> tuple[ID, bytes]:
    peer = ID.from_pubkey(key_pair.public_key)
    env = create_signed_peer_record(peer, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")], key_pair.private_key)
    return peer, env.marshal_envelope()


def test_same_record_is_checked_once_a_changed_or_forged_one_in_full(monkeypatch):
    full_checks = []
    original = pubsub_fastpath._original_consume

    def counting(msg, host, peer_id):
        full_checks.append(bytes(msg.senderRecord))
        return original(msg, host, peer_id)

    monkeypatch.setattr(pubsub_fastpath, "_original_consume", counting)
    monkeypatch.setattr(pubsub_fastpath, "_checked", {})
    host = build_libp2p_host(Identity.generate())
    sender = create_new_key_pair()
    peer, record = _record(sender, 4001)

    assert pubsub_fastpath.maybe_consume_signed_record(_rpc(record), host, peer)
    assert pubsub_fastpath.maybe_consume_signed_record(_rpc(record), host, peer)
    assert full_checks == [record]  # the second copy of the same bytes was not verified again

    _peer, moved = _record(sender, 4002)  # new addresses: new bytes, checked
    assert pubsub_fastpath.maybe_consume_signed_record(_rpc(moved), host, peer)
    assert full_checks == [record, moved]

    forged = bytearray(record)
    forged[-1] ^= 1  # the signature no longer holds
    for _ in range(2):  # refused every time: a failure is never remembered
        assert not pubsub_fastpath.maybe_consume_signed_record(_rpc(bytes(forged)), host, peer)
    other = ID.from_pubkey(create_new_key_pair().public_key)
    assert not pubsub_fastpath.maybe_consume_signed_record(_rpc(record), host, other)  # not the sender's
    assert len(full_checks) == 5

    # no record: nothing to check
    assert pubsub_fastpath.maybe_consume_signed_record(rpc_pb2.RPC(), host, peer)


def test_the_patch_is_what_pubsub_and_gossipsub_call():
    from libp2p.pubsub import gossipsub, pubsub

    for module in (pubsub, gossipsub):
        assert module.maybe_consume_signed_record is pubsub_fastpath.maybe_consume_signed_record
        assert module.env_to_send_in_RPC is pubsub_fastpath.env_to_send_in_RPC
