"""A restarted node never signs a round's slot again with other content (node/live/state/saidlog.py).

Real envelopes and a real peer validator; the host is a boundary stand-in that only records what
would be published. Life 1 attests (round 5, stage 0) and closes it; life 2 (a new log over the same
directory, a new messenger) re-derives the round: the same attestation is signed anew and published
(the peer drops it as "the same payload re-signed"), another one is not published at all, so the
peer never holds two versions of the slot (equivocation evidence against an honest node).
"""

from __future__ import annotations

import math

import pytest

from node import protocol as msg
from node.live.assembly import EQUIVOCATION_EXEMPT
from node.live.peers.messenger import Messenger
from node.live.state.saidlog import SaidLog
from node.live.state.station import Station
from p2p.envelope import EnvelopeValidator, decode_envelope
from p2p.errors import EnvelopeRejected
from p2p.identity import Identity

RUN = 9
MAX = msg.MAX_GOSSIP_PAYLOAD + 4096


class Host:
    """What the messenger publishes (the network boundary)."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    def publish(self, _topic: str, data: bytes) -> None:
        self.published.append(data)


def attestation(weights: bytes, tokens: int = 512) -> msg.Attestation:
    return msg.Attestation(weights * 32, b"\x02" * 32, 3, 2.5, math.nan, tokens, b"", b"")


def life(tmp_path, identity) -> tuple[Messenger, Host]:
    host = Host()
    said = SaidLog(root=tmp_path / "said", exempt_kinds=EQUIVOCATION_EXEMPT, max_bytes=MAX)
    return Messenger(identity=identity, run_id=RUN, host=host, station=Station(), said=said), host


def test_a_restarted_node_says_a_slot_again_only_identically(tmp_path):
    identity = Identity.generate()
    peer = EnvelopeValidator(RUN, max_size=MAX, max_rounds_ahead=64,
                             equivocation_exempt_kinds=EQUIVOCATION_EXEMPT)
    first, host1 = life(tmp_path, identity)
    first.gossip(5, msg.ATTESTATION, attestation(b"\x01"), 0)
    first.gossip(5, msg.CLOSE, msg.Close([[0, "p", b"\x03" * 32, 10]]), 0)
    for data in host1.published:
        peer.check(data)

    second, host2 = life(tmp_path, identity)  # the same data directory after a kill
    # The same attestation: signed anew and published; the peer drops it as a replay, not as equivocation.
    same = second.gossip(5, msg.ATTESTATION, attestation(b"\x01"), 0)
    assert host2.published == [same]
    with pytest.raises(EnvelopeRejected) as replay:
        peer.check(same)
    assert replay.value.reason == "replayed"
    # Another attestation of the slot (a round re-based after a fork, figures lost with the process):
    # not published; the earlier envelope is what stands.
    other = second.gossip(5, msg.ATTESTATION, attestation(b"\x07", tokens=0), 0)
    assert host2.published == [same]
    assert other == host1.published[0]
    assert decode_envelope(other, MAX).payload == msg.encode_payload(attestation(b"\x01"))
    second.gossip(5, msg.CLOSE, msg.Close([[1, "q", b"\x04" * 32, 10]]), 0)
    assert host2.published == [same]
    assert not peer.equivocations
    # Other slots go out as usual, in any life; and within one life nothing is held back.
    fresh = second.gossip(6, msg.ATTESTATION, attestation(b"\x08"), 0)
    assert host2.published[-1] == fresh
    peer.check(fresh)


def test_exempt_kinds_are_not_kept_and_an_unreadable_entry_is_dropped(tmp_path):
    identity = Identity.generate()
    first, _host = life(tmp_path, identity)
    first.gossip(2, msg.ACCUSATION, attestation(b"\x01"), -1)  # the log looks at the kind only
    assert not list((tmp_path / "said").glob(f"*/{msg.ACCUSATION}-*.env"))
    junk = tmp_path / "said" / f"{3:012d}" / f"{msg.CLOSE}-0.env"
    junk.parent.mkdir(parents=True, exist_ok=True)
    junk.write_bytes(b"not an envelope")
    second, host = life(tmp_path, identity)
    assert not junk.exists()
    second.gossip(3, msg.CLOSE, msg.Close([[0, "p", b"\x03" * 32, 10]]), 0)
    assert len(host.published) == 1
