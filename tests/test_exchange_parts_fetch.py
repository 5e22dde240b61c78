"""A contribution's parts fetched in parallel from the peers that hold it, each checked alone as it arrives
(node/live/exchange/partsfetch.py, node/live/exchange/parts.py), on real py-libp2p hosts on 127.0.0.1; and a
parts announcement checked before anything is fetched (a lying one is refused, the node goes on)."""

from __future__ import annotations

import hashlib
import threading

import pytest
from waiting import wait_until

from node import protocol as msg
from node.live.exchange.parts import ContributionParts
from node.live.exchange.partsfetch import PartsLayout, PartsUnavailable, fetch_parts
from node.live.state.roundbook import Announced
from p2p.config import P2PConfig
from p2p.envelope import Envelope, decode_envelope, payload_offset
from p2p.host import P2PHost
from p2p.identity import Identity
from p2p.parts import cut_at, pack_manifest, part_digests
from tests.test_exchange_parts import SEED, contribution, parts_envelope

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """The sender, a holder that fetched the contribution, and a fetcher, connected."""
    base = tmp_path_factory.mktemp("hosts")
    config = dict(gossip_resync_interval=0)
    sender = P2PHost.start(P2PConfig(**config), Identity.from_seed(SEED), data_dir=base / "sender")
    holder = P2PHost.start(P2PConfig(bootstrap=sender.listen_addrs, **config), Identity.generate(),
                           data_dir=base / "holder")
    fetcher = P2PHost.start(P2PConfig(bootstrap=sender.listen_addrs + holder.listen_addrs, **config),
                            Identity.generate(), data_dir=base / "fetcher")
    wait_until(lambda: {sender.peer_id, holder.peer_id} <= set(fetcher.peers()), 60, "fetcher connected")
    yield sender, holder, fetcher
    for host in (fetcher, holder, sender):
        host.close()


def served(hosts, parts: int = 5, outer_round: int = 0):
    """A version-2 contribution stored whole at the sender and the holder (as each serves its own and what
    it fetched); its layout."""
    sender, holder, _ = hosts
    envelope, pieces = parts_envelope(contribution(outer_round), parts=parts)
    whole = envelope.to_bytes()
    for host in (sender, holder):
        host.provide_blob(whole, announce=False)
    digest = hashlib.sha256(whole).hexdigest()
    layout = PartsLayout.of(digest, payload_offset(envelope, len(envelope.payload)), envelope.sizes,
                            part_digests(pieces))
    return envelope, pieces, layout


def test_the_parts_come_in_parallel_from_both_holders_and_assemble_to_the_envelope(hosts):
    sender, holder, fetcher = hosts
    envelope, pieces, layout = served(hosts)
    whole = envelope.to_bytes()
    assert all(whole[at:at + size] == piece for at, size, piece in zip(layout.offsets, layout.sizes, pieces))
    parts = fetch_parts(fetcher, layout, [sender.peer_id, holder.peer_id], streams=3)
    assert parts == pieces
    # as they arrive, to a consumer (a cluster's rank 0 forwards each), never kept here
    seen: dict[int, bytes] = {}
    lock = threading.Lock()

    def take(index: int, data: bytes) -> None:
        with lock:
            seen[index] = data

    assert fetch_parts(fetcher, layout, [holder.peer_id, sender.peer_id], streams=2, on_part=take) is None
    assert [seen[index] for index in range(len(pieces))] == pieces


def test_a_peer_serving_a_wrong_part_is_passed_over_and_one_with_none_fails_the_fetch(hosts, tmp_path):
    sender, holder, fetcher = hosts
    envelope, pieces, layout = served(hosts, parts=4, outer_round=1)
    # the holder's copy corrupted on its disk: it serves other bytes for part 2
    path = holder.store.path(layout.blob_hex)
    data = bytearray(path.read_bytes())
    data[layout.offsets[2] + 3] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    # part 2 asks the holder first (2 mod 2 = 0), is refused, then comes from the sender
    assert fetch_parts(fetcher, layout, [holder.peer_id, sender.peer_id], streams=4) == pieces
    with pytest.raises(PartsUnavailable, match=r"part 2: .*part_digest_mismatch"):
        fetch_parts(fetcher, layout, [holder.peer_id], streams=4)
    # a layout that names a part past the blob's end: every peer refuses the range
    bad = PartsLayout(layout.blob_hex, layout.offsets[:-1] + (layout.offsets[-1] + 10,), layout.sizes,
                      layout.digests)
    with pytest.raises(PartsUnavailable, match="part 3"):
        fetch_parts(fetcher, bad, [sender.peer_id], streams=2)


class Station:
    def __init__(self, shapes) -> None:
        self.shapes = shapes

    def worker(self):
        return self

    def stage_shapes(self, stage):
        return self.shapes

    def replica(self):
        return 1


class Messenger:
    def __init__(self) -> None:
        self.identity = Identity.from_seed(SEED)
        self.gossiped: list = []

    def gossip(self, outer_round, kind, message, stage=-1):
        self.gossiped.append((outer_round, kind, message, stage))


def gossip_envelope(message: msg.PartsAnnounce, outer_round: int = 3, stage: int = 0, replica: int = 1,
                    seed: bytes = SEED) -> Envelope:
    return Envelope.create(Identity.from_seed(seed), 7, outer_round, msg.PARTS_ANNOUNCE,
                           msg.encode_payload(message), stage=stage, replica=replica)


def test_a_node_signs_announces_checks_and_fetches_its_run_s_contributions_in_parts(hosts):
    from tests.test_exchange_parts import stage_shapes

    sender, holder, fetcher = hosts
    body = msg.encode_contribution_body(msg.ContributionBody(bytes(32), bytes(32), contribution(2)))
    own = ContributionParts(3, messenger=Messenger(), host=sender, station=Station(stage_shapes()), run_id=7,
                            max_bytes=1 << 24, transfer_timeout=30.0)
    whole = own.sign(3, 0, body, contribution(2))
    env = decode_envelope(whole, 1 << 24)
    assert env.in_parts and env.payload == body and len(env.sizes) == 3
    digest = hashlib.sha256(whole).digest()
    sender.provide_blob(whole, announce=False)
    own.announce(3, 0, digest, whole)
    (_, kind, announce, _), = own.messenger.gossiped
    assert kind == msg.PARTS_ANNOUNCE and announce.envelope_hash == digest
    assert msg.decode_payload(msg.PARTS_ANNOUNCE, msg.encode_payload(announce)) == announce

    other = ContributionParts(3, messenger=Messenger(), host=fetcher, station=Station(stage_shapes()),
                              run_id=7, max_bytes=1 << 24, transfer_timeout=30.0)
    a = Announced(sender.peer_id, 1, digest, len(whole))
    # lying announcements are refused, each with its reason, and nothing is kept
    wrong = pack_manifest(list(reversed(part_digests(cut_at(env.payload, env.sizes)))))
    lies = {
        "manifest_root_mismatch": (msg.PartsAnnounce(digest, len(whole), announce.header, wrong), {}),
        "announcement_mismatch": (announce, {"stage": 1}),
        # the header's last byte flipped (set to a constant, it was a no-op whenever the byte already was one)
        "bad_signature": (msg.PartsAnnounce(digest, len(whole),
                                            announce.header[:-1] + bytes([announce.header[-1] ^ 1]),
                                            announce.manifest), {}),
    }
    for reason, (message, where) in lies.items():
        other.on_announce(gossip_envelope(message, **where), message, b"")
        assert other.refused[reason] == 1, (reason, other.refused)
    assert other.known(digest) is None
    assert other.fetch(3, 0, a, [sender.peer_id], []) is None  # no checked announcement: the whole blob
    other.on_announce(gossip_envelope(announce), announce, b"")
    assert other.known(digest) is not None
    assert other.fetch(3, 0, a, [sender.peer_id], [holder.peer_id]) == whole
    # a part no peer has: the fetch gives up, the caller fetches the whole blob
    gone = Announced(sender.peer_id, 1, hashlib.sha256(b"gone").digest(), len(whole))
    other._known[gone.envelope_hash] = other.known(digest)
    assert other.fetch(3, 0, gone, [sender.peer_id], []) is None
    assert other.refused["parts_unavailable"] == 1
    other.forget_before(4)
    assert other.known(digest) is None
