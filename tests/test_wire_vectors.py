"""tests/vectors/wire.json against the project's own encoders and decoders.

Every vector is decoded from its bytes, re-encoded and compared byte for byte; signatures are
verified with the vector's public key; and the file must be exactly what
tests/vectors/make_vectors.py writes today (so a change of format shows up as a diff of the JSON).
"""

import base64
import hashlib
import importlib.util
import json
import math
from pathlib import Path

import msgpack
import pytest
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import ContentAddressedMessageIDGenerator

from node import protocol as msg
from p2p.blob_protocol import MAX_FRAME_BYTES, parse_request
from p2p.envelope import Envelope, decode_envelope, verify_header
from p2p.errors import EnvelopeRejected
from p2p.gossip import (gossip_message_id, sync_messages_frame, sync_offer_frame, sync_request_frame,
                        sync_response_frame, sync_want_frame)
from p2p.identity import Identity, peer_id_from_public_key, verify_signature
from p2p.wire import decode_frame, encode_frame

VECTORS_PATH = Path(__file__).parent / "vectors" / "wire.json"
_spec = importlib.util.spec_from_file_location("make_vectors", VECTORS_PATH.with_name("make_vectors.py"))
make_vectors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_vectors)
render, untag = make_vectors.render, make_vectors.untag
VECTORS = json.loads(VECTORS_PATH.read_text())
KEY = VECTORS["key"]


def by_name(items):
    return {item["name"]: item for item in items}


def test_file_is_what_the_generator_writes():
    assert VECTORS_PATH.read_text() == render(), "run: python tests/vectors/make_vectors.py"


def test_key():
    identity = Identity.from_seed(bytes.fromhex(KEY["ed25519_seed_hex"]))
    assert identity.public_key_bytes.hex() == KEY["public_key_hex"]
    assert identity.peer_id == KEY["peer_id"] == peer_id_from_public_key(identity.public_key_bytes)


def test_run_topic():
    assert VECTORS["run_topic"] == msg.run_topic(7) == "/dlx/run/7/v1"


@pytest.mark.parametrize("vector", VECTORS["envelopes"], ids=lambda v: v["name"])
def test_envelope(vector):
    data = bytes.fromhex(vector["envelope_hex"])
    public_key = bytes.fromhex(KEY["public_key_hex"])
    signing_bytes = bytes.fromhex(vector["signing_bytes_hex"])
    signature = bytes.fromhex(vector["signature_hex"])
    assert verify_signature(public_key, signing_bytes, signature)

    envelope = decode_envelope(data, max_size=1 << 20)
    inputs = vector["inputs"]
    payload = bytes.fromhex(inputs["payload_hex"])
    for name in ("run_id", "round", "kind", "stage", "replica", "timestamp_ms"):
        assert getattr(envelope, name) == inputs[name], name
    assert envelope.payload == payload
    assert envelope.sender.hex() == KEY["public_key_hex"]
    assert envelope.payload_sha256.hex() == vector["payload_sha256_hex"] == hashlib.sha256(payload).hexdigest()
    assert envelope.signing_bytes() == signing_bytes
    assert envelope.signature == signature
    assert envelope.to_bytes() == data
    assert envelope.envelope_hash == vector["envelope_hash_hex"] == hashlib.sha256(data).hexdigest()
    assert verify_header(envelope.header())

    # The signing bytes are the msgpack array of the ten signed fields, in order.
    signed = msgpack.unpackb(signing_bytes, raw=False)
    assert signed == [b"dlx-envelope-v1", 1, inputs["run_id"], inputs["round"], inputs["kind"],
                      inputs["stage"], inputs["replica"], public_key, envelope.payload_sha256,
                      inputs["timestamp_ms"]]

    # Signing the inputs again gives the same bytes (ed25519 is deterministic).
    identity = Identity.from_seed(bytes.fromhex(KEY["ed25519_seed_hex"]))
    again = Envelope.create(identity, inputs["run_id"], inputs["round"], inputs["kind"], payload,
                            stage=inputs["stage"], replica=inputs["replica"], timestamp_ms=inputs["timestamp_ms"])
    assert again.to_bytes() == data

    message_id = vector["gossip_message_id"].encode("ascii")
    assert gossip_message_id(data) == message_id
    assert base64.b64decode(message_id) == hashlib.sha256(data).digest()
    assert ContentAddressedMessageIDGenerator().generate_id(rpc_pb2.Message(data=data)) == message_id


def test_envelope_payloads_are_the_payload_vectors():
    payloads = {v["payload_hex"] for v in VECTORS["payloads"]}
    for vector in VECTORS["envelopes"]:
        if vector["inputs"]["kind"] in msg._TYPES:
            assert vector["inputs"]["payload_hex"] in payloads, vector["name"]


@pytest.mark.parametrize("vector", VECTORS["rejected_envelopes"], ids=lambda v: v["name"])
def test_rejected_envelope(vector):
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(bytes.fromhex(vector["envelope_hex"]), max_size=1 << 20)
    assert caught.value.reason == vector["reason"]


def _same(decoded, expected):
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(decoded, float) and math.isnan(decoded)
    return type(decoded) is type(expected) and decoded == expected


@pytest.mark.parametrize("vector", VECTORS["payloads"], ids=lambda v: v["name"])
def test_payload(vector):
    data = bytes.fromhex(vector["payload_hex"])
    message = msg.decode_payload(vector["kind"], data)
    fields = untag(vector["fields"])
    assert list(fields) == list(message.__dataclass_fields__)  # the documented key order
    for name, expected in fields.items():
        assert _same(getattr(message, name), expected), name
    assert msg.encode_payload(message) == data
    # Keys in the order of the field list, floats as float64 (0xcb), never float32.
    raw = msgpack.unpackb(data, raw=False)
    assert list(raw) == list(fields)
    for name, value in fields.items():
        if isinstance(value, float):
            packed = msgpack.packb(value)
            assert packed[0] == 0xCB and packed in data


@pytest.mark.parametrize("vector", VECTORS["blob"]["frames"], ids=lambda v: v["name"])
def test_blob_frame(vector):
    data = bytes.fromhex(vector["frame_hex"])
    frame = decode_frame(data, MAX_FRAME_BYTES)
    assert frame == untag(vector["fields"])
    assert encode_frame(frame) == data
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    if vector["direction"] == "request":
        digest, offset, length = parse_request(frame)
        assert list(frame) == ["sha256", "offset", "length"]
        assert len(digest) == 32 and offset >= 0 and length >= 0
    else:
        expected_keys = {
            "ok": ["status", "total", "sha256", "offset", "length"],
            "not_found": ["status"],
            "out_of_range": ["status", "total"],
            "busy": ["status"],
            "bad_request": ["status", "detail"],
        }
        assert list(frame) == expected_keys[frame["status"]]


def test_blob_replies_cover_every_status():
    statuses = {untag(v["fields"]).get("status") for v in VECTORS["blob"]["frames"]}
    assert statuses == {None, "ok", "not_found", "out_of_range", "busy", "bad_request"}


@pytest.mark.parametrize("vector", VECTORS["sync"]["frames"], ids=lambda v: v["name"])
def test_sync_frame(vector):
    data = bytes.fromhex(vector["frame_hex"])
    frame = decode_frame(data, 16 << 20)
    assert frame == untag(vector["fields"])
    rebuilt = {
        "request": lambda: sync_request_frame(frame["topic"], frame["epoch"], frame["after"]),
        "response": lambda: sync_response_frame(frame["epoch"], frame["next"], frame["messages"]),
        "offer": lambda: sync_offer_frame(frame["epoch"], frame["next"], frame["ids"]),
        "want": lambda: sync_want_frame(frame["want"]),
        "messages": lambda: sync_messages_frame(frame["messages"]),
    }[vector["direction"]]()
    assert encode_frame(rebuilt) == data
