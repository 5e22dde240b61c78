"""Write tests/vectors/wire.json: test vectors of the dlx wire formats (docs/P2P.md, docs/PROTOCOL.md).

Deterministic: a fixed ed25519 seed, fixed timestamps, fixed field values (ed25519 signatures are
deterministic, RFC 8032). Run from the repository root::

    python tests/vectors/make_vectors.py          # rewrite the file
    python tests/vectors/make_vectors.py --check  # exit 1 if the file differs from what this writes

JSON conventions (so any language can read the file): ``*_hex`` strings are lowercase hex bytes.
Inside ``fields`` objects, a msgpack ``bin`` value is written ``{"bin": "<hex>"}``, a float64
``{"f64": <number or "nan">}``, and plain JSON strings and integers are msgpack ``str`` and ``int``.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node import protocol as msg
from p2p.blob_protocol import (
    BLOB_PROTOCOL,
    bad_request_reply,
    busy_reply,
    not_found_reply,
    ok_reply,
    out_of_range_reply,
    request_frame,
)
from p2p.envelope import DOMAIN, Envelope
from p2p.gossip import (SYNC_OFFER_PROTOCOL, SYNC_PROTOCOL, gossip_message_id, sync_id, sync_messages_frame,
                        sync_offer_frame, sync_request_frame, sync_response_frame, sync_want_frame)
from p2p.identity import Identity
from p2p.wire import encode_frame

OUT = Path(__file__).with_name("wire.json")
SEED = bytes(range(32))  # the test key: never use it for anything else
TIMESTAMP_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
RUN_ID = 7


def _h(n: int) -> bytes:
    """A recognisable 32-byte value: sha256 of one byte."""
    return hashlib.sha256(bytes([n])).digest()


def tag(value: Any) -> Any:
    """A msgpack value as tagged JSON (see the module docstring)."""
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, float):
        return {"f64": "nan" if math.isnan(value) else value}
    if isinstance(value, list):
        return [tag(v) for v in value]
    if isinstance(value, dict):
        return {k: tag(v) for k, v in value.items()}
    return value


def untag(value: Any) -> Any:
    """The inverse of :func:`tag`."""
    if isinstance(value, dict) and set(value) == {"bin"}:
        return bytes.fromhex(value["bin"])
    if isinstance(value, dict) and set(value) == {"f64"}:
        return float(value["f64"])
    if isinstance(value, list):
        return [untag(v) for v in value]
    if isinstance(value, dict):
        return {k: untag(v) for k, v in value.items()}
    return value


def payload_messages() -> list[tuple[str, str, Any]]:
    """(name, kind, message) of every gossiped payload kind, with representative values."""
    identity = Identity.from_seed(SEED)
    return [
        ("hello", msg.HELLO, msg.Hello(
            cluster="c0", cluster_size=2, account=bytes.fromhex("11" * 20),
            addrs=[f"/ip4/127.0.0.1/tcp/4001/p2p/{identity.peer_id}"],
            training_round=3, first_round=-1)),
        ("announce", msg.ANNOUNCE, msg.Announce(envelope_hash=_h(1), size=23_456_789)),
        ("close", msg.CLOSE, msg.Close(contributions=[
            [0, identity.peer_id, _h(2), 1000],
            [1, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", _h(3), 70_000],
        ])),
        ("attestation_last_stage", msg.ATTESTATION, msg.Attestation(
            weights_hash=_h(4), contributions_root=_h(5), num_contributions=2,
            train_loss=3.25, eval_loss=3.5, tokens=65_536, shard_hash=_h(6), checkpoint_hash=b"")),
        ("attestation_inner_stage", msg.ATTESTATION, msg.Attestation(
            weights_hash=_h(4), contributions_root=_h(5), num_contributions=2,
            train_loss=math.nan, eval_loss=math.nan, tokens=0, shard_hash=b"", checkpoint_hash=b"")),
        ("record", msg.RECORD, msg.RecordSignature(
            prev_head=_h(7), weights_root=_h(8), contributions_root=_h(9),
            train_loss_micro=3_250_000, eval_loss_micro=3_500_000, tokens=131_072, num_contributors=2,
            checkpoint_hash=bytes(32), account=bytes.fromhex("22" * 20),
            signature=bytes(range(64)) + b"\x1b")),
        ("accusation", msg.ACCUSATION, msg.Accusation(
            outer_round=3, accused=bytes.fromhex("33" * 20), accused_peer=identity.peer_id, replica=1,
            evidence_hash=_h(10), evidence_size=4096)),
        ("verdict", msg.VERDICT, msg.VerdictSignature(
            accused=bytes.fromhex("33" * 20), evidence_hash=_h(10), guilty=True, account=bytes.fromhex("22" * 20),
            signature=bytes(range(64)) + b"\x1c")),
        ("evidence", msg.EVIDENCE, msg.Evidence(
            accused=bytes.fromhex("33" * 20), replica=1, contributions=[b"\x81" * 8, b"\x82" * 8],
            verdict="mismatch", reason="largest relative distance 0.28 (tolerance 0.01)", distances=[0.28, 0.1])),
    ]


def payload_vectors() -> list[dict[str, Any]]:
    out = []
    for name, kind, message in payload_messages():
        encoded = msg.encode_payload(message)
        out.append({
            "name": name,
            "kind": kind,
            "fields": tag({f: getattr(message, f) for f in message.__dataclass_fields__}),
            "payload_hex": encoded.hex(),
        })
    return out


def envelope_cases() -> list[dict[str, Any]]:
    """Envelope inputs: one per payload kind, a contribution, and integer-width edge cases."""
    cases = []
    # Header values as the node sets them (docs/PROTOCOL.md, "Messages"): a hello always says
    # round 0, stage and replica -1; a record names no stage; the others name (round, stage)
    # and the sender's replica.
    header = {msg.HELLO: (0, -1, -1), msg.RECORD: (3, -1, 0), msg.ACCUSATION: (5, -1, 0), msg.VERDICT: (5, -1, 0),
              msg.EVIDENCE: (3, -1, 0)}
    for name, kind, message in payload_messages():
        outer_round, stage, replica = header.get(kind, (3, 1, 0))
        cases.append(dict(name=name, run_id=RUN_ID, round=outer_round, kind=kind, stage=stage, replica=replica,
                          timestamp_ms=TIMESTAMP_MS, payload=msg.encode_payload(message)))
    cases.append(dict(name="contribution", run_id=RUN_ID, round=3, kind=msg.CONTRIBUTION, stage=0,
                      replica=1, timestamp_ms=TIMESTAMP_MS,
                      payload=msg.encode_contribution_body(msg.ContributionBody(_h(11), _h(12), bytes(range(256)) * 2))))
    cases.append(dict(name="integer_widths", run_id=(1 << 32), round=300, kind="widths", stage=128,
                      replica=65_536, timestamp_ms=TIMESTAMP_MS + 1, payload=b""))
    cases.append(dict(name="large_indices", run_id=(1 << 64) - 1, round=255, kind="x_1", stage=127,
                      replica=32, timestamp_ms=0, payload=b"\x00"))
    return cases


def envelope_vectors() -> list[dict[str, Any]]:
    identity = Identity.from_seed(SEED)
    out = []
    for case in envelope_cases():
        envelope = Envelope.create(
            identity, case["run_id"], case["round"], case["kind"], case["payload"],
            stage=case["stage"], replica=case["replica"], timestamp_ms=case["timestamp_ms"],
        )
        data = envelope.to_bytes()
        out.append({
            "name": case["name"],
            "inputs": {
                "run_id": case["run_id"], "round": case["round"], "kind": case["kind"],
                "stage": case["stage"], "replica": case["replica"],
                "timestamp_ms": case["timestamp_ms"], "payload_hex": case["payload"].hex(),
            },
            "payload_sha256_hex": envelope.payload_sha256.hex(),
            "signing_bytes_hex": envelope.signing_bytes().hex(),
            "signature_hex": envelope.signature.hex(),
            "envelope_hex": data.hex(),
            "envelope_hash_hex": envelope.envelope_hash,
            "gossip_message_id": gossip_message_id(data).decode("ascii"),
        })
    return out


def rejected_vectors() -> list[dict[str, Any]]:
    """Envelopes a conforming decoder must refuse, with the reason this implementation gives."""
    import msgpack

    identity = Identity.from_seed(SEED)
    good = Envelope.create(identity, RUN_ID, 3, "announce", b"p", stage=1, replica=0,
                           timestamp_ms=TIMESTAMP_MS)
    fields = msgpack.unpackb(good.to_bytes(), raw=False)
    cases = []

    def add(name: str, data: bytes, reason: str, why: str) -> None:
        cases.append({"name": name, "envelope_hex": data.hex(), "reason": reason, "why": why})

    reordered = dict(reversed(list(fields.items())))
    add("keys_out_of_order", msgpack.packb(reordered, use_bin_type=True), "non_canonical",
        "same fields, keys not in the specified order")
    wide = bytearray(good.to_bytes())
    # version 1 as uint16 (0xcd 0x00 0x01) instead of positive fixint 0x01
    key = msgpack.packb("version", use_bin_type=True)
    at = bytes(wide).index(key) + len(key)
    assert wide[at] == 0x01
    wide[at:at + 1] = b"\xcd\x00\x01"
    add("wide_integer", bytes(wide), "non_canonical", "version 1 encoded as uint16, not fixint")
    as_str = dict(fields, payload="p")
    add("payload_as_str", msgpack.packb(as_str, use_bin_type=True), "malformed",
        "payload encoded as str, not bin")
    tampered = dict(fields, round=4)
    add("tampered_round", msgpack.packb(tampered, use_bin_type=True), "bad_signature",
        "round changed after signing")
    other_payload = dict(fields, payload=b"q")
    add("payload_hash_mismatch", msgpack.packb(other_payload, use_bin_type=True), "payload_hash_mismatch",
        "payload does not hash to payload_sha256")
    bad_domain = dict(fields, domain=b"dlx-envelope-v2")
    add("bad_domain", msgpack.packb(bad_domain, use_bin_type=True), "bad_domain", "unknown domain")
    boolean = dict(fields, stage=True)
    add("bool_for_int", msgpack.packb(boolean, use_bin_type=True), "malformed", "stage encoded as true")
    return cases


def blob_vectors() -> list[dict[str, Any]]:
    digest = hashlib.sha256(b"hello blob").digest()
    frames = [
        ("request_header_only", "request", request_frame(digest, 0, 0)),
        ("request_range", "request", request_frame(digest, 8 << 20, 8 << 20)),
        ("reply_ok_header_only", "reply", ok_reply(10, digest, 0, 0)),
        ("reply_ok_range", "reply", ok_reply(20_000_000, digest, 8 << 20, 8 << 20)),
        ("reply_not_found", "reply", not_found_reply()),
        ("reply_out_of_range", "reply", out_of_range_reply(10)),
        ("reply_busy", "reply", busy_reply()),
        ("reply_bad_request", "reply", bad_request_reply("sha256 must be 32 bytes")),
    ]
    return [{"name": name, "direction": direction, "fields": tag(frame), "frame_hex": encode_frame(frame).hex()}
            for name, direction, frame in frames]


def sync_vectors() -> list[dict[str, Any]]:
    topic = msg.run_topic(RUN_ID)
    epoch = bytes.fromhex("0102030405060708")
    frames = [
        ("request_first", "request", sync_request_frame(topic, b"", 0)),
        ("request_next", "request", sync_request_frame(topic, epoch, 41)),
        ("response", "response", sync_response_frame(epoch, 43, [b"\x81\xa1a\x01", b"second"])),
        ("response_empty", "response", sync_response_frame(epoch, 41, [])),
        # /dlx/sync/1.1.0: the request as above, then offer, want, messages.
        ("offer", "offer", sync_offer_frame(epoch, 43, [sync_id(b"\x81\xa1a\x01"), sync_id(b"second")])),
        ("want", "want", sync_want_frame([1])),
        ("messages", "messages", sync_messages_frame([b"second"])),
    ]
    return [{"name": name, "direction": direction, "fields": tag(frame), "frame_hex": encode_frame(frame).hex()}
            for name, direction, frame in frames]


def build() -> dict[str, Any]:
    identity = Identity.from_seed(SEED)
    return {
        "description": "dlx wire-format test vectors; see docs/P2P.md and docs/PROTOCOL.md. "
                       "Generated by tests/vectors/make_vectors.py; checked by tests/test_wire_vectors.py.",
        "conventions": "*_hex: lowercase hex bytes. In 'fields': {\"bin\": hex} is msgpack bin, "
                       "{\"f64\": x} is msgpack float64 (\"nan\" = the quiet NaN 0x7ff8000000000000), "
                       "JSON strings are msgpack str, JSON integers msgpack int in the smallest encoding.",
        "key": {
            "ed25519_seed_hex": SEED.hex(),
            "public_key_hex": identity.public_key_bytes.hex(),
            "peer_id": identity.peer_id,
        },
        "envelope_domain": DOMAIN.decode("ascii"),
        "run_topic": msg.run_topic(RUN_ID),
        "envelopes": envelope_vectors(),
        "rejected_envelopes": rejected_vectors(),
        "payloads": payload_vectors(),
        "blob": {"protocol": str(BLOB_PROTOCOL), "frames": blob_vectors()},
        "sync": {"protocol": str(SYNC_PROTOCOL), "offer_protocol": str(SYNC_OFFER_PROTOCOL), "frames": sync_vectors()},
    }


def render() -> str:
    return json.dumps(build(), indent=1) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tests/vectors/make_vectors.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
