"""Envelope encoding and every rejection reason (malformed, oversized, bad signature, replay, ...)."""

import hashlib

import msgpack
import pytest

from p2p.envelope import DOMAIN, Envelope, EnvelopeValidator, decode_envelope, verify_header
from p2p.errors import EnvelopeRejected
from p2p.identity import Identity

ALICE = Identity.from_seed(b"\x01" * 32)
MAX = 1 << 20


def make(**overrides):
    fields = dict(identity=ALICE, run_id=7, round=3, kind="announce", payload=b"payload", stage=1, replica=0)
    fields.update(overrides)
    return Envelope.create(**fields)


def raw_map(envelope):
    return msgpack.unpackb(envelope.to_bytes(), raw=False)


def repack(fields):
    return msgpack.packb(fields, use_bin_type=True)


def resign(fields, identity=ALICE):
    """Re-sign tampered fields so that only the intended check can fail."""
    signed = [
        fields[name]
        for name in (
            "domain",
            "version",
            "run_id",
            "round",
            "kind",
            "stage",
            "replica",
            "sender",
            "payload_sha256",
            "timestamp_ms",
        )
    ]
    fields["signature"] = identity.sign(msgpack.packb(signed, use_bin_type=True))
    return repack(fields)


def reason_of(data, max_size=MAX):
    with pytest.raises(EnvelopeRejected) as info:
        decode_envelope(data, max_size)
    return info.value.reason


def test_roundtrip_and_identity():
    envelope = make()
    decoded = decode_envelope(envelope.to_bytes(), MAX)
    assert decoded == envelope
    assert decoded.sender_peer_id == ALICE.peer_id
    assert decoded.envelope_hash == hashlib.sha256(envelope.to_bytes()).hexdigest()
    assert decoded.payload_sha256 == hashlib.sha256(b"payload").digest()
    assert (decoded.stage, decoded.replica, decoded.kind) == (1, 0, "announce")
    assert raw_map(envelope)["domain"] == DOMAIN
    assert make(stage=-1, replica=-1).stage == -1


def test_signed_header_without_payload_still_verifies():
    header = make(payload=b"x" * 1000).header()
    assert header.payload == b"" and verify_header(header)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"not msgpack at all",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"domain": DOMAIN}),
        msgpack.packb(b"bytes"),
    ],
)
def test_malformed(data):
    assert reason_of(data) == "malformed"


def test_unknown_field_is_malformed():
    fields = raw_map(make())
    fields["extra"] = 1
    assert reason_of(repack(fields)) == "malformed"


@pytest.mark.parametrize(
    "name,value",
    [
        ("round", True),
        ("round", -1),
        ("round", "3"),
        ("stage", -2),
        ("sender", b"\x00" * 31),
        ("payload_sha256", "ab" * 32),
        ("payload", "text"),
        ("run_id", 1.5),
        ("signature", b"\x00" * 10),
    ],
)
def test_wrong_types_and_lengths_are_malformed(name, value):
    fields = raw_map(make())
    fields[name] = value
    assert reason_of(repack(fields)) == "malformed"


def test_bad_kind():
    assert reason_of(resign({**raw_map(make()), "kind": "Not A Kind"})) == "bad_kind"


def test_oversized():
    envelope = make(payload=b"x" * 5000)
    assert reason_of(envelope.to_bytes(), max_size=4000) == "oversized"
    assert decode_envelope(envelope.to_bytes(), max_size=6000).payload == b"x" * 5000


def test_non_canonical_encoding():
    fields = raw_map(make())
    reordered = dict(reversed(list(fields.items())))
    assert reason_of(repack(reordered)) == "non_canonical"


def test_bad_domain_and_version():
    assert reason_of(resign({**raw_map(make()), "domain": b"dlx-envelope-v0"})) == "bad_domain"
    assert reason_of(resign({**raw_map(make()), "version": 2})) == "bad_version"


def test_bad_signature_on_any_tampered_field():
    for name, value in [
        ("round", 4),
        ("run_id", 8),
        ("kind", "contribution"),
        ("stage", 2),
        ("replica", 1),
        ("timestamp_ms", 1),
        ("payload_sha256", hashlib.sha256(b"other").digest()),
    ]:
        fields = raw_map(make())
        fields[name] = value
        if name == "payload_sha256":
            fields["payload"] = b"other"
        assert reason_of(repack(fields)) == "bad_signature", name
    mallory = Identity.from_seed(b"\x02" * 32)
    fields = raw_map(make())
    fields["sender"] = mallory.public_key_bytes  # claims to be Mallory, signed by Alice
    assert reason_of(repack(fields)) == "bad_signature"


def test_payload_hash_mismatch():
    fields = raw_map(make())
    fields["payload"] = b"swapped payload"
    assert reason_of(repack(fields)) == "payload_hash_mismatch"


def validator(**kwargs):
    return EnvelopeValidator(run_id=7, max_size=MAX, min_round=3, max_rounds_ahead=2, **kwargs)


def check_reason(v, data):
    with pytest.raises(EnvelopeRejected) as info:
        v.check(data)
    return info.value.reason


def test_validator_run_and_round_window():
    v = validator()
    assert v.check(make().to_bytes()).round == 3
    assert check_reason(v, make(run_id=8).to_bytes()) == "wrong_run"
    assert check_reason(v, make(round=2).to_bytes()) == "stale_round"
    assert check_reason(v, make(round=6).to_bytes()) == "future_round"
    assert v.check(make(round=5).to_bytes()).round == 5
    assert v.rejections == {"wrong_run": 1, "stale_round": 1, "future_round": 1}


def test_validator_replay():
    v = validator()
    data = make().to_bytes()
    v.check(data)
    assert check_reason(v, data) == "replayed"
    assert not v.accepts(data)


def test_validator_keeps_equivocation_evidence():
    v = validator()
    first = make(payload=b"one")
    second = make(payload=b"two")
    v.check(first.to_bytes())
    assert check_reason(v, second.to_bytes()) == "equivocation"
    [evidence] = v.equivocations
    assert evidence.sender_peer_id == ALICE.peer_id
    assert (evidence.run_id, evidence.round, evidence.kind, evidence.stage) == (7, 3, "announce", 1)
    assert evidence.first.payload_sha256 != evidence.second.payload_sha256
    assert verify_header(evidence.first) and verify_header(evidence.second)
    # Another stage, another kind or another sender is not equivocation.
    v.check(make(payload=b"two", stage=2).to_bytes())
    v.check(make(payload=b"two", kind="attestation").to_bytes())
    v.check(make(identity=Identity.from_seed(b"\x03" * 32), payload=b"two").to_bytes())
    assert len(v.equivocations) == 1


def test_exempt_kinds_may_be_resigned():
    v = validator()
    v.check(make(kind="hello", payload=b"a").to_bytes())
    v.check(make(kind="hello", payload=b"b").to_bytes())
    assert v.equivocations == []


def test_advance_moves_floor_and_forgets_old_rounds():
    v = validator()
    v.check(make(round=3).to_bytes())
    v.advance(4)
    assert check_reason(v, make(round=3).to_bytes()) == "stale_round"
    assert v._seen.keys() == set() and v._slots == {}
    v.advance(2)  # never moves backwards
    assert v.min_round == 4


def test_allowed_kinds_and_clock_skew():
    v = validator(allowed_kinds={"announce"}, max_clock_skew_s=60)
    assert check_reason(v, make(kind="checkpoint").to_bytes()) == "bad_kind"
    assert check_reason(v, make(timestamp_ms=1000).to_bytes()) == "bad_timestamp"
    assert v.check(make().to_bytes()).kind == "announce"


def test_create_refuses_bad_fields():
    with pytest.raises(EnvelopeRejected):
        make(kind="Bad Kind")
    with pytest.raises(EnvelopeRejected):
        make(round=-1)


def test_the_same_payload_signed_again_is_a_replay_and_a_different_one_is_equivocation():
    """A restarted sender re-signs what it said before: dropped quietly, no evidence against it."""
    identity = Identity.generate()
    validator = EnvelopeValidator(7, max_size=1 << 16, max_rounds_ahead=8)
    first = Envelope.create(identity, 7, 3, "attestation", b"same result", stage=1)
    validator.check(first.to_bytes())
    again = Envelope.create(identity, 7, 3, "attestation", b"same result", stage=1,
                            timestamp_ms=first.timestamp_ms + 1)
    assert again.to_bytes() != first.to_bytes()
    with pytest.raises(EnvelopeRejected) as info:
        validator.check(again.to_bytes())
    assert info.value.reason == "replayed" and not validator.equivocations
    other = Envelope.create(identity, 7, 3, "attestation", b"another result", stage=1)
    with pytest.raises(EnvelopeRejected) as info:
        validator.check(other.to_bytes())
    assert info.value.reason == "equivocation" and len(validator.equivocations) == 1
