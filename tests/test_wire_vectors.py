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
from p2p.gossip import (
    gossip_message_id,
    sync_messages_frame,
    sync_offer_frame,
    sync_request_frame,
    sync_response_frame,
    sync_want_frame,
)
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
    inputs = untag(vector["inputs"])
    payload = bytes.fromhex(inputs["payload_hex"])
    for name in ("run_id", "round", "kind", "stage", "replica", "timestamp_ms"):
        assert getattr(envelope, name) == inputs[name], name
    assert envelope.payload == payload
    assert envelope.sender.hex() == KEY["public_key_hex"]
    assert envelope.payload_sha256.hex() == vector["payload_sha256_hex"] \
        == hashlib.sha256(payload).hexdigest()
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
                            stage=inputs["stage"], replica=inputs["replica"],
                            timestamp_ms=inputs["timestamp_ms"])
    assert again.to_bytes() == data

    message_id = vector["gossip_message_id"].encode("ascii")
    assert gossip_message_id(data) == message_id
    assert base64.b64decode(message_id) == hashlib.sha256(data).digest()
    assert ContentAddressedMessageIDGenerator().generate_id(rpc_pb2.Message(data=data)) == message_id


def test_big_integers_are_strings_for_javascript():
    # JSON numbers beyond 2^53 - 1 lose precision in JavaScript: the file writes them as {"int": "..."}.
    def walk(value):
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            assert abs(value) <= (1 << 53) - 1, value
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(VECTORS)
    large = by_name(VECTORS["envelopes"])["large_indices"]
    assert large["inputs"]["run_id"] == {"int": str((1 << 64) - 1)}


@pytest.mark.parametrize("name", ["partial", "partial_with_codec_blob"])
def test_partial_envelope_payload_is_the_sliced_layout(name):
    from ledger.merkle import merkle_root
    from training.codec_wire import decode_contribution
    from training.slicemessages import PARTIAL_PREFIX, parse_partial

    vector = by_name(VECTORS["envelopes"])[name]
    payload = bytes.fromhex(vector["inputs"]["payload_hex"])
    assert payload.startswith(PARTIAL_PREFIX) and PARTIAL_PREFIX == b"dlx-partial/2"
    partial = parse_partial(payload)
    body = vector["partial_body"]
    assert (partial.slice_index, partial.num_slices, partial.num_inputs) == (
        body["slice_index"], body["num_slices"], body["num_inputs"]) == (1, 2, 2)
    assert partial.blob == bytes.fromhex(body["blob_hex"])
    # The root is derived from the close it aggregates: the close vector's envelope hashes, in its order.
    close = msg.decode_payload(msg.CLOSE, bytes.fromhex(by_name(VECTORS["payloads"])["close"]["payload_hex"]))
    hashes = [entry[2] for entry in close.contributions]
    assert [bytes.fromhex(h) for h in body["input_hashes_hex"]] == hashes
    assert len(hashes) == partial.num_inputs
    assert partial.inputs_root == merkle_root(hashes) == bytes.fromhex(body["inputs_root_hex"])
    if "codec" in body:  # issue 80 point 11: the partial blob's own format is a codec blob of the slice
        codec = body["codec"]
        shapes = {key: tuple(shape) for key, shape in codec["shapes"].items()}
        decoded = decode_contribution(partial.blob, shapes, stage_index=codec["stage"],
                                      outer_round=codec["round"], refuse_raw=False)
        for key, tensor in decoded.items():
            assert tensor.numpy().astype("<f4").tobytes().hex() == codec["decoded"][key]["f32le_hex"], key


def test_envelope_payloads_are_the_payload_vectors():
    payloads = {v["payload_hex"] for v in VECTORS["payloads"]}
    for vector in VECTORS["envelopes"]:
        if vector["inputs"]["kind"] in msg._TYPES:
            assert vector["inputs"]["payload_hex"] in payloads, vector["name"]


@pytest.mark.parametrize("vector", VECTORS["rejected_envelopes"], ids=lambda v: v["name"])
def test_rejected_envelope(vector):
    with pytest.raises(EnvelopeRejected) as caught:
        decode_envelope(bytes.fromhex(vector["envelope_hex"]), max_size=vector["max_size"])
    assert caught.value.reason == vector["reason"]


def test_rejected_envelopes_name_every_reason():
    reasons = {v["reason"] for v in VECTORS["rejected_envelopes"]}
    assert reasons == {"oversized", "malformed", "bad_domain", "bad_version", "bad_kind", "non_canonical",
                       "payload_hash_mismatch", "bad_signature"}


def test_contribution_vector_carries_a_real_codec_blob():
    from training.codec_wire import decode_contribution

    vector = by_name(VECTORS["envelopes"])["contribution"]
    body = msg.decode_contribution_body(bytes.fromhex(vector["inputs"]["payload_hex"]))
    described = vector["contribution_body"]
    assert body.state_hash.hex() == described["state_hash_hex"]
    assert body.applied_hash.hex() == described["applied_hash_hex"]
    codec = described["codec"]
    assert body.blob.hex() == codec["blob_hex"]
    shapes = {name: tuple(shape) for name, shape in codec["shapes"].items()}
    decoded = decode_contribution(body.blob, shapes, stage_index=codec["stage"], outer_round=codec["round"],
                                  refuse_raw=False)
    assert set(decoded) == set(codec["decoded"]) and {e["c"] for e in msgpack.unpackb(body.blob)["t"]} == {
        "lowrank", "quant", "raw"}
    for name, tensor in decoded.items():
        assert tensor.numpy().astype("<f4").tobytes().hex() == codec["decoded"][name]["f32le_hex"], name


def test_the_bound_contribution_vector_is_the_default_body_of_a_version_3_run():
    """Issue 80 point 11: ``dlx-contribution/4`` (docs/PROTOCOL.md's second form), its member and the EIP-712
    ``Contribution`` it signs; the message's roots are derived from the codec blob again here, and the
    signature recovers to the vectors' account."""
    from eth_account import Account
    from eth_account.messages import encode_typed_data

    from node.fraudproof import contribution_claim
    from training.config import DilocoConfig

    vector = by_name(VECTORS["envelopes"])["bound_contribution"]
    payload = bytes.fromhex(vector["inputs"]["payload_hex"])
    assert payload.startswith(b"dlx-contribution/4")
    body = msg.decode_contribution_body(payload)
    described = vector["contribution_body"]
    assert described["magic"] == "dlx-contribution/4"
    assert payload[18 + 96:18 + 96 + 20].hex() == body.contributor.hex() == described["contributor_hex"]
    assert payload[18 + 116:18 + 181].hex() == body.binding.hex() == described["binding_hex"]
    assert payload[18 + 181:] == body.blob and body.blob.hex() == described["codec"]["blob_hex"]
    assert "0x" + body.contributor.hex() == VECTORS["eip712"]["key"]["address"].lower()
    message = by_name(VECTORS["eip712"]["messages"])["contribution"]
    assert message["signature_hex"] == described["binding_hex"]
    shapes = {name: tuple(shape) for name, shape in described["codec"]["shapes"].items()}
    claim = contribution_claim(body.blob, shapes, DilocoConfig(commitments="normed"),
                               run_id=vector["inputs"]["run_id"], outer_round=3, stage=0,
                               decode_args={"stage_index": 0, "outer_round": 3})
    typed = message["typed_data"]["message"]
    assert (typed["runId"], typed["round"], typed["stage"], typed["steps"]) == (7, 3, 0, 0)
    assert typed["payloadRoot"] == "0x" + claim.payload_root.hex()
    assert typed["normRoot"] == "0x" + claim.norm_root.hex()
    signable = encode_typed_data(full_message=message["typed_data"])
    assert Account.recover_message(signable, signature=body.binding) == VECTORS["eip712"]["key"]["address"]


def test_the_file_is_strict_json_infinities_included():
    text = VECTORS_PATH.read_text()
    json.loads(text, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    evidence = untag(by_name(VECTORS["payloads"])["evidence_broken_chain"]["fields"])
    assert evidence["distances"][1] == math.inf


def _same(decoded, expected):
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(decoded, float) and math.isnan(decoded)
    return type(decoded) is type(expected) and decoded == expected


@pytest.mark.parametrize("vector", VECTORS["payloads"], ids=lambda v: v["name"])
def test_payload(vector):
    data = bytes.fromhex(vector["payload_hex"])
    message = msg.decode_payload(vector["kind"], data)
    fields = untag(vector["fields"])
    # The documented key order; an optional key (Close.steps) is left out when empty.
    assert list(fields) == [name for name in message.__dataclass_fields__ if name in fields]
    assert all(not getattr(message, name) for name in message.__dataclass_fields__ if name not in fields)
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


def test_payload_vectors_cover_every_gossip_kind():
    assert {v["kind"] for v in VECTORS["payloads"]} == set(msg._TYPES)


@pytest.mark.parametrize("vector", VECTORS["rejected_payloads"], ids=lambda v: v["name"])
def test_rejected_payload(vector):
    with pytest.raises(msg.ProtocolError) as refused:
        msg.decode_payload(vector["kind"], bytes.fromhex(vector["payload_hex"]))
    # The step of docs/PROTOCOL.md's "The order of the checks" that refuses it: the first fault wins.
    words = make_vectors.REFUSAL_STEPS.get(vector["step"])
    assert (words in str(refused.value)) if words else not any(
        w in str(refused.value) for w in make_vectors.REFUSAL_STEPS.values()), (vector["step"], refused.value)


def test_two_faults_are_refused_for_the_earlier_check():
    steps = {v["name"]: v["step"] for v in VECTORS["rejected_payloads"]}
    assert steps["announce_extra_key_and_hash_31_bytes"] == 4 and steps["announce_hash_31_bytes"] == 7
    assert steps["close_steps_empty_and_replica_negative"] == 5 and steps["close_replica_negative"] == 7
    assert steps["attestation_stage_leaf_empty"] == 5 and steps["hello_nested_list"] == 3


@pytest.mark.parametrize("vector", VECTORS["reordered_payloads"], ids=lambda v: v["name"])
def test_a_payload_in_another_key_order_is_the_same_message(vector):
    data, canonical = bytes.fromhex(vector["payload_hex"]), bytes.fromhex(vector["canonical_hex"])
    assert data != canonical
    assert msg.encode_payload(msg.decode_payload(vector["kind"], data)) == canonical


def test_merkle_roots_and_proofs():
    from ledger.merkle import EMPTY_ROOT, merkle_proof, merkle_root, verify_proof

    merkle = VECTORS["merkle"]
    assert bytes.fromhex(merkle["roots"][0]["root_hex"]) == EMPTY_ROOT == hashlib.sha256(b"").digest()
    for case in merkle["roots"]:
        leaves = [bytes.fromhex(h) for h in case["leaves_hex"]]
        assert merkle_root(leaves).hex() == case["root_hex"]
        if leaves:  # independently of ledger.merkle: the rules as docs/PROTOCOL.md states them
            level = [hashlib.sha256(b"\x00" + leaf).digest() for leaf in leaves]
            while len(level) > 1:
                paired = [hashlib.sha256(b"\x01" + level[i] + level[i + 1]).digest()
                          for i in range(0, len(level) - 1, 2)]
                level = paired + ([level[-1]] if len(level) % 2 else [])
            assert level[0].hex() == case["root_hex"]
    five = [bytes.fromhex(h) for h in merkle["roots"][5]["leaves_hex"]]
    for case in merkle["proofs"]:
        proof = [(bytes.fromhex(p["sibling_hex"]), p["sibling_is_left"]) for p in case["proof"]]
        assert merkle_proof(five, case["index"]) == proof
        assert verify_proof(bytes.fromhex(case["leaf_hex"]), proof, bytes.fromhex(case["root_hex"]))
    # Promoting (not duplicating) the odd node: a list and the list with its last leaf repeated differ.
    three = [bytes.fromhex(h) for h in merkle["roots"][3]["leaves_hex"]]
    assert merkle_root(three) != merkle_root(three + three[-1:])


@pytest.mark.parametrize("vector", VECTORS["eip712"]["messages"], ids=lambda v: v["name"])
def test_eip712_known_answer(vector):
    from eth_account import Account
    from eth_account.messages import encode_typed_data
    from eth_utils import keccak

    eip712 = VECTORS["eip712"]
    typed = vector["typed_data"]
    assert typed["domain"] == eip712["domain"]
    assert keccak(text=vector["type"]).hex() == vector["type_hash_hex"]
    assert keccak(text=eip712["domain_type"]).hex() == eip712["domain_type_hash_hex"]
    # An independent EIP-712 implementation (eth_account's eth_signTypedData_v4 encoder) gives the digest.
    signable = encode_typed_data(full_message=typed)
    assert signable.header.hex() == eip712["domain_separator_hex"]
    assert signable.body.hex() == vector["struct_hash_hex"]
    assert keccak(b"\x19\x01" + signable.header + signable.body).hex() == vector["digest_hex"]
    signature = bytes.fromhex(vector["signature_hex"])
    assert Account.recover_message(signable, signature=signature) == eip712["key"]["address"]
    assert Account.from_key(bytes.fromhex(eip712["key"]["private_key_hex"])).address \
        == eip712["key"]["address"]
    assert int.from_bytes(signature[32:64],
                          "big") <= 0x7FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF5D576E7357A4501DDFE92F46681B20A0
    if vector["name"] == "contribution":  # carried by the bound contribution envelope's body
        body = by_name(VECTORS["envelopes"])["bound_contribution"]["contribution_body"]
        assert body["binding_hex"] == vector["signature_hex"]
        assert "0x" + body["contributor_hex"] == eip712["key"]["address"].lower()
        return
    # The gossip payload of the same kind carries exactly this signature and signer.
    payload = untag(by_name(VECTORS["payloads"])[vector["name"]]["fields"])
    assert payload["signature"] == signature
    assert "0x" + payload["account"].hex() == eip712["key"]["address"].lower()


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


def test_a_frame_or_payload_holding_a_key_twice_is_refused_whatever_the_values():
    """docs/PROTOCOL.md step 3: a repeated key is refused, never resolved (msgpack libraries keep the first
    value, the last, or fail), in a p2p frame as in a gossip payload, with the same value or another."""
    import msgpack

    from node.protocol import ANNOUNCE, ProtocolError, decode_payload
    from p2p.wire import ProtocolViolation, decode_body

    for second in (1, 2):
        body = (bytes([0x82]) + msgpack.packb("a") + msgpack.packb(1) + msgpack.packb("a")
                + msgpack.packb(second))
        with pytest.raises(ProtocolViolation, match="holds the key 'a' twice"):
            decode_body(body)
        nested = msgpack.packb({"outer": 0})[:-1] + body  # {"outer": <the map above>}
        with pytest.raises(ProtocolViolation, match="twice"):
            decode_body(nested, max_containers=8)
    vector = by_name(VECTORS["rejected_payloads"])["announce_repeated_key"]
    with pytest.raises(ProtocolError, match="is not msgpack: a map holds the key"):
        decode_payload(ANNOUNCE, bytes.fromhex(vector["payload_hex"]))
    assert vector["step"] == 3
