"""Write tests/vectors/wire.json: test vectors of the dlx wire formats (docs/P2P.md, docs/PROTOCOL.md).

Deterministic: a fixed ed25519 seed, fixed timestamps, fixed field values (ed25519 signatures are
deterministic, RFC 8032). Run from the repository root::

    python tests/vectors/make_vectors.py          # rewrite the file
    python tests/vectors/make_vectors.py --check  # exit 1 if the file differs from what this writes

JSON conventions (so any language can read the file): ``*_hex`` strings are lowercase hex bytes.
Inside ``fields`` and ``inputs`` objects, a msgpack ``bin`` value is written ``{"bin": "<hex>"}``, a float64
``{"f64": <number, or "nan", "inf", "-inf">}`` (a finite float64 as a JSON number, which round-trips exactly;
``"nan"`` is the quiet NaN 0x7ff8000000000000, ``"inf"``/``"-inf"`` 0x7ff0000000000000/0xfff0000000000000), a
msgpack bool a JSON ``true``/``false``, an integer outside JavaScript's exact range (|n| > 2^53 - 1) ``{"int":
"<decimal>"}``, and plain JSON strings and integers are msgpack ``str`` and ``int``.
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

from eth_account import Account

from ledger.attest import (
    DOMAIN_NAME,
    DOMAIN_TYPE,
    DOMAIN_VERSION,
    RECORD_TYPE,
    VERDICT_TYPE,
    domain_separator,
    record_digest,
    record_struct_hash,
    sign_record,
    sign_verdict,
    typed_data,
    verdict_digest,
    verdict_struct_hash,
)
from ledger.merkle import merkle_proof, merkle_root
from ledger.records import RoundRecord, Verdict
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
from p2p.gossip import (
    SYNC_OFFER_PROTOCOL,
    SYNC_PROTOCOL,
    gossip_message_id,
    sync_id,
    sync_messages_frame,
    sync_offer_frame,
    sync_request_frame,
    sync_response_frame,
    sync_want_frame,
)
from p2p.identity import Identity
from p2p.wire import encode_frame
from training.slicemessages import partial_payload

OUT = Path(__file__).with_name("wire.json")
SEED = bytes(range(32))  # the test key: never use it for anything else
TIMESTAMP_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
RUN_ID = 7
# EIP-712 known answers: a fixed secp256k1 test key (never use it for anything else), anvil's chain id
# and the address the first contract deployed by anvil's first dev account gets.
EIP712_KEY = hashlib.sha256(b"dlx-node test vectors: secp256k1 key").digest()
CHAIN_ID = 31337
LEDGER_ADDRESS = "0x5FbDB2315678afecb367f032d93F642f64180aa3"


def _h(n: int) -> bytes:
    """A recognisable 32-byte value: sha256 of one byte."""
    return hashlib.sha256(bytes([n])).digest()


MAX_SAFE_INTEGER = (1 << 53) - 1  # JavaScript's Number.MAX_SAFE_INTEGER


def tag(value: Any) -> Any:
    """A msgpack value as tagged JSON (see the module docstring)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SAFE_INTEGER:
        return {"int": str(value)}
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, float):
        if math.isnan(value):
            return {"f64": "nan"}
        if math.isinf(value):  # JSON has no infinity (json.dumps would write the non-standard Infinity)
            return {"f64": "inf" if value > 0 else "-inf"}
        return {"f64": value}
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
    if isinstance(value, dict) and set(value) == {"int"}:
        return int(value["int"])
    if isinstance(value, list):
        return [untag(v) for v in value]
    if isinstance(value, dict):
        return {k: untag(v) for k, v in value.items()}
    return value


def eip712_record() -> RoundRecord:
    """The record the ``record`` payload vector signs (run 7, round 3: the envelope's run and round)."""
    return RoundRecord(run_id=RUN_ID, round=3, prev_head=_h(7), weights_root=_h(8), contributions_root=_h(9),
                       train_loss_micro=3_250_000, eval_loss_micro=3_500_000, tokens=131_072,
                       num_contributors=2)


def eip712_verdict() -> Verdict:
    """The verdict the ``verdict`` payload vector signs."""
    return Verdict(run_id=RUN_ID, accused="0x" + "33" * 20, evidence_hash=_h(10), guilty=True)


def payload_messages() -> list[tuple[str, str, Any]]:
    """(name, kind, message) of every gossiped payload kind, with representative values."""
    identity = Identity.from_seed(SEED)
    signer = Account.from_key(EIP712_KEY)
    record = eip712_record()
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
            checkpoint_hash=record.checkpoint_hash, account=bytes.fromhex(signer.address[2:]),
            signature=sign_record(signer, record, CHAIN_ID, LEDGER_ADDRESS))),
        ("accusation", msg.ACCUSATION, msg.Accusation(
            outer_round=3, accused=bytes.fromhex("33" * 20), accused_peer=identity.peer_id, replica=1,
            evidence_hash=_h(10), evidence_size=4096)),
        ("verdict", msg.VERDICT, msg.VerdictSignature(
            accused=bytes.fromhex("33" * 20), evidence_hash=_h(10), guilty=True,
            account=bytes.fromhex(signer.address[2:]),
            signature=sign_verdict(signer, eip712_verdict(), CHAIN_ID, LEDGER_ADDRESS))),
        ("evidence", msg.EVIDENCE, msg.Evidence(
            accused=bytes.fromhex("33" * 20), replica=1, contributions=[b"\x81" * 8, b"\x82" * 8],
            verdict="mismatch", reason="largest relative distance 0.28 (tolerance 0.01)",
            distances=[0.28, 0.1])),
        ("evidence_broken_chain", msg.EVIDENCE, msg.Evidence(
            accused=bytes.fromhex("33" * 20), replica=1, contributions=[b"\x81" * 8, b"\x83" * 8],
            verdict="state_mismatch", reason="round 4's start state is not round 3's result",
            distances=[0.0, math.inf])),
        ("partial_announce", msg.PARTIAL_ANNOUNCE, msg.PartialAnnounce(
            slice_index=1, envelope_hash=_h(14), size=8_364)),
        # Taking over a close (docs/PROTOCOL.md, "Closing a round"): both are an empty map; the envelope's
        # round and stage say which close.
        ("takeover", msg.TAKEOVER, msg.Takeover()),
        ("yield", msg.YIELD, msg.Yield()),
        # A run whose rounds are bounded by time (issue 44):
        # the close names each contribution's declared steps
        # (0: none in the run's range). A fixed-H close leaves the key out ("close" above).
        ("close_time_bounded", msg.CLOSE, msg.Close(contributions=[
            [0, identity.peer_id, _h(2), 1000],
            [1, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", _h(3), 70_000],
        ], steps=[12, 0])),
    ]


def payload_vectors() -> list[dict[str, Any]]:
    import msgpack

    out = []
    for name, kind, message in payload_messages():
        encoded = msg.encode_payload(message)
        out.append({
            "name": name,
            "kind": kind,
            # The keys on the wire: an optional key left out when empty (docs/PROTOCOL.md).
            "fields": tag({f: getattr(message, f) for f in message.__dataclass_fields__
                           if f in msgpack.unpackb(encoded, raw=False)}),
            "payload_hex": encoded.hex(),
        })
    return out


#: The stage's tensors the contribution vector's codec blob encodes (names ascending, as the blob lists them).
CODEC_SHAPES = {"a.lowrank": [4, 3], "b.quant": [2, 3], "c.raw": [2]}


def codec_blob() -> bytes:
    """A codec blob (training/codec_wire.py, docs/DILOCOX.md) with one entry of each coding, small integers
    chosen by hand so that every party decodes the same float32 bits: stage 0, round 3 (the envelope's)."""
    import numpy as np
    import torch

    from training.codec_wire import pack_contribution
    from training.codec_exact import pack_ints

    def f32(values: list[float]) -> bytes:
        return np.asarray(values, dtype="<f4").tobytes()

    entries = [
        {"n": "a.lowrank", "s": CODEC_SHAPES["a.lowrank"], "c": "lowrank", "b": 4, "r": 1,
         "p": pack_ints(torch.tensor([1, -2, 3, 0]), 4), "q": pack_ints(torch.tensor([2, -1, 7]), 4),
         "w": np.asarray([3], dtype="<u2").tobytes(), "x": f32([0.5])},
        {"n": "b.quant", "s": CODEC_SHAPES["b.quant"], "c": "quant", "b": 8,
         "q": pack_ints(torch.tensor([1, -1, 0, 127, -127, 5]), 8), "x": f32([0.25, 1.0, 0.125])},
        {"n": "c.raw", "s": CODEC_SHAPES["c.raw"], "c": "raw", "d": f32([1.5, -2.0])},
    ]
    return pack_contribution(0, 3, entries)


def codec_vector() -> dict[str, Any]:
    """The contribution vector's codec blob and what it decodes to (float32, little-endian, row-major)."""
    from training.codec_wire import decode_contribution

    blob = codec_blob()
    decoded = decode_contribution(blob, {k: tuple(v) for k, v in CODEC_SHAPES.items()}, stage_index=0,
                                  outer_round=3)
    return {"blob_hex": blob.hex(), "stage": 0, "round": 3, "shapes": CODEC_SHAPES,
            "decoded": {name: {"values": [float(v) for v in tensor.reshape(-1).tolist()],
                               "f32le_hex": tensor.numpy().astype("<f4").tobytes().hex()}
                        for name, tensor in decoded.items()}}


def envelope_cases() -> list[dict[str, Any]]:
    """Envelope inputs: one per payload kind, a contribution, and integer-width edge cases."""
    cases = []
    # Header values as the node sets them (docs/PROTOCOL.md, "Messages"): a hello always says
    # round 0, stage and replica -1; a record names no stage; the others name (round, stage)
    # and the sender's replica.
    header = {msg.HELLO: (0, -1, -1), msg.RECORD: (3, -1, 0), msg.ACCUSATION: (5, -1, 0),
              msg.VERDICT: (5, -1, 0), msg.EVIDENCE: (3, -1, 0)}
    for name, kind, message in payload_messages():
        outer_round, stage, replica = header.get(kind, (3, 1, 0))
        cases.append(dict(name=name, run_id=RUN_ID, round=outer_round, kind=kind, stage=stage,
                          replica=replica, timestamp_ms=TIMESTAMP_MS, payload=msg.encode_payload(message)))
    cases.append(dict(name="contribution", run_id=RUN_ID, round=3, kind=msg.CONTRIBUTION, stage=0,
                      replica=1, timestamp_ms=TIMESTAMP_MS,
                      payload=msg.encode_contribution_body(msg.ContributionBody(_h(11), _h(12), codec_blob(),
                                                                               _h(14)))))
    # The sliced exchange's partial: a blob (never gossiped), fixed layout like a contribution
    # (docs/PROTOCOL.md, "Sliced exchange"): b"dlx-partial/2"
    # || u32 j || u32 A || u32 n || inputs_root (32) || blob. Its inputs are the `close` payload vector's
    # entries: n = their count, inputs_root = merkle_root of their envelope hashes in the close's order.
    cases.append(dict(name="partial", run_id=RUN_ID, round=3, kind=msg.PARTIAL, stage=1, replica=0,
                      timestamp_ms=TIMESTAMP_MS,
                      payload=partial_payload(1, 2, merkle_root(_close_hashes()), len(_close_hashes()),
                                              bytes(range(64)))))
    cases.append(dict(name="integer_widths", run_id=(1 << 32), round=300, kind="widths", stage=128,
                      replica=65_536, timestamp_ms=TIMESTAMP_MS + 1, payload=b""))
    cases.append(dict(name="large_indices", run_id=(1 << 64) - 1, round=255, kind="x_1", stage=127,
                      replica=32, timestamp_ms=0, payload=b"\x00"))
    return cases


def _close_hashes() -> list[bytes]:
    """The envelope hashes the `close` payload vector closes, in its (canonical) order."""
    close = next(message for name, _kind, message in payload_messages() if name == "close")
    return [entry[2] for entry in close.contributions]


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
            "inputs": tag({
                "run_id": case["run_id"], "round": case["round"], "kind": case["kind"],
                "stage": case["stage"], "replica": case["replica"],
                "timestamp_ms": case["timestamp_ms"], "payload_hex": case["payload"].hex(),
            }),
            "payload_sha256_hex": envelope.payload_sha256.hex(),
            "signing_bytes_hex": envelope.signing_bytes().hex(),
            "signature_hex": envelope.signature.hex(),
            "envelope_hex": data.hex(),
            "envelope_hash_hex": envelope.envelope_hash,
            "gossip_message_id": gossip_message_id(data).decode("ascii"),
        })
        if case["kind"] == msg.CONTRIBUTION:  # the fixed layout's parts, and the codec blob decoded
            body = msg.decode_contribution_body(case["payload"])
            out[-1]["contribution_body"] = {
                "state_hash_hex": body.state_hash.hex(), "data_commitment_hex": body.data_commitment.hex(),
                "applied_hash_hex": body.applied_hash.hex(), "codec": codec_vector()}
        if case["kind"] == msg.PARTIAL:  # the fixed layout's parts, the root derived from the close vector
            out[-1]["partial_body"] = {
                "slice_index": 1, "num_slices": 2, "num_inputs": len(_close_hashes()),
                "inputs_from": "the payload vector 'close': its entries' envelope hashes, in its order",
                "input_hashes_hex": [h.hex() for h in _close_hashes()],
                "inputs_root_hex": merkle_root(_close_hashes()).hex(), "blob_hex": bytes(range(64)).hex()}
    return out


#: The receiver's size limit a rejected envelope is decoded with (each case names it: ``max_size``).
REJECTED_MAX_SIZE = 1 << 20


def rejected_vectors() -> list[dict[str, Any]]:
    """Envelopes a conforming decoder must refuse, with the reason this implementation gives."""
    import msgpack

    identity = Identity.from_seed(SEED)
    good = Envelope.create(identity, RUN_ID, 3, "announce", b"p", stage=1, replica=0,
                           timestamp_ms=TIMESTAMP_MS)
    fields = msgpack.unpackb(good.to_bytes(), raw=False)
    cases = []

    def add(name: str, data: bytes, reason: str, why: str, max_size: int = REJECTED_MAX_SIZE) -> None:
        cases.append({"name": name, "envelope_hex": data.hex(), "max_size": max_size, "reason": reason,
                      "why": why})

    def packed(**changes: Any) -> bytes:
        return msgpack.packb(dict(fields, **changes), use_bin_type=True)

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
    add("domain_short", msgpack.packb(dict(fields, domain=b"dlx"), use_bin_type=True), "bad_domain",
        "a domain of another length: the domain is compared before any field's type or length")
    add("domain_as_str", msgpack.packb(dict(fields, domain="dlx-envelope-v1"), use_bin_type=True),
        "bad_domain", "the domain as str, not bin")
    add("bad_version", msgpack.packb(dict(fields, version=2), use_bin_type=True), "bad_version", "version 2")
    add("bad_kind", msgpack.packb(dict(fields, kind="Announce"), use_bin_type=True), "bad_kind",
        "kind outside [a-z0-9_]{1,32}")
    add("signature_63_bytes", msgpack.packb(dict(fields, signature=good.signature[:63]), use_bin_type=True),
        "malformed", "signature of 63 bytes")
    add("payload_as_map", msgpack.packb(dict(fields, payload={"a": 1}), use_bin_type=True), "malformed",
        "a nested map: refused while decoding, before anything is built")
    add("oversized", good.to_bytes(), "oversized",
        "a valid envelope one byte over the receiver's limit: refused before anything is decoded",
        max_size=len(good.to_bytes()) - 1)
    # A repeated key: the map has at most 12 entries, so a repeat leaves a field missing (check 2).
    items = list(fields.items())
    repeated = b"\x8c" + b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
                                  for k, v in items[:-1] + [items[2]])
    add("repeated_key", repeated, "malformed",
        "12 entries, run_id twice and signature missing: the key set is not the twelve fields")
    thirteen = b"\x8d" + b"".join(msgpack.packb(k, use_bin_type=True) + msgpack.packb(v, use_bin_type=True)
                                   for k, v in items + [items[2]])
    add("thirteen_entries", thirteen, "malformed",
        "a map of 13 entries (run_id twice): over the 12 a map may hold")
    add("version_true", packed(version=True), "malformed",
        "version as true: equal to 1 for check 4, not an int for check 5")
    add("version_float", packed(version=1.0), "malformed",
        "version as float64 1.0: equal to 1 for check 4, not an int for check 5")
    add("version_false", packed(version=False), "bad_version", "version as false: not equal to 1 (check 4)")
    add("version_str", packed(version="1"), "bad_version",
        "version as the str \"1\": not equal to 1 (check 4)")
    add("empty_array", packed(payload=[]), "malformed", "an empty array as the payload: no array anywhere")
    add("empty_array_domain", packed(domain=[]), "malformed",
        "an empty array as the domain: refused while decoding (check 2), before the domain is compared")
    add("str_65_bytes", packed(kind="\u00e9" * 33), "malformed",
        "a str of 33 characters but 66 UTF-8 bytes: str lengths are counted in bytes (max 64)")
    add("kind_64_bytes", packed(kind="a" * 64), "bad_kind",
        "a str of 64 bytes decodes; as a kind it is too long")
    add("nested_empty_map", packed(payload={}), "malformed", "an empty map inside the envelope: a second map")
    add("negative_round", packed(round=-1), "malformed", "round -1: only stage and replica may be -1")
    add("stage_minus_2", packed(stage=-2), "malformed", "stage -2: below -1")
    add("sender_31_bytes", packed(sender=fields["sender"][:31]), "malformed", "a sender key of 31 bytes")
    # Order of the checks (docs/P2P.md): the first failing check names the reason.
    missing = {k: v for k, v in fields.items() if k != "timestamp_ms"}
    add("order_missing_field_before_domain", msgpack.packb(dict(missing, domain=b"x"), use_bin_type=True),
        "malformed", "a missing field and a bad domain: the key set is checked first")
    add("order_domain_before_version", msgpack.packb(dict(fields, domain=b"x", version=2), use_bin_type=True),
        "bad_domain", "a bad domain and a bad version: the domain is checked first")
    add("order_version_before_types", msgpack.packb(dict(fields, version=2, stage=True), use_bin_type=True),
        "bad_version", "a bad version and a bool for an int: the version is checked before field types")
    add("order_non_canonical_before_signature",
        msgpack.packb(dict(reversed(list(dict(fields, round=4).items()))), use_bin_type=True),
        "non_canonical",
        "keys out of order and a tampered round: canonical form is checked before the signature")
    add("order_payload_hash_before_signature",
        msgpack.packb(dict(fields, payload=b"q", round=4), use_bin_type=True), "payload_hash_mismatch",
        "another payload and a tampered round: the payload hash is checked before the signature")
    # Within check 5: int fields (version, run_id, round, timestamp_ms, stage, replica), then kind, then
    # sender, payload_sha256, payload, signature; the first that fails names the reason.
    add("order_int_before_kind", packed(timestamp_ms=-5, kind="Announce"), "malformed",
        "a negative timestamp and a bad kind: the int fields are checked before the kind")
    add("order_kind_before_bytes", packed(kind="Announce", sender=b"short"), "bad_kind",
        "a bad kind and a short sender: the kind is checked before the bytes fields")
    add("order_types_before_canonical", msgpack.packb(dict(reversed(list(dict(fields, kind="A").items()))),
                                                      use_bin_type=True), "bad_kind",
        "keys out of order and a bad kind: field types (check 5) come before the canonical form (check 6)")
    add("order_oversized_before_malformed", b"\xc1" * 64, "oversized",
        "not msgpack and over the limit: the size is checked before anything is decoded", max_size=63)
    return cases


def rejected_payload_vectors() -> list[dict[str, Any]]:
    """Payloads a conforming receiver must refuse (the envelope around them is valid)."""
    import msgpack

    def encoded(message: Any, **changes: Any) -> dict[str, Any]:
        fields = dict(msgpack.unpackb(msg.encode_payload(message), raw=False), **changes)  # the wire's keys
        return {k: v for k, v in fields.items() if v is not _DROP}

    signer = Account.from_key(EIP712_KEY)
    messages = {name: message for name, _kind, message in payload_messages()}
    cases = [
        ("verdict_guilty_as_int", msg.VERDICT, encoded(messages["verdict"], guilty=1),
         "guilty is a bool (0xc3/0xc2); the int 1 is refused"),
        ("hello_cluster_size_as_bool", msg.HELLO, encoded(messages["hello"], cluster_size=True),
         "a bool is not an int"),
        ("announce_extra_key", msg.ANNOUNCE, dict(encoded(messages["announce"]), extra=1), "an unknown key"),
        ("announce_missing_key", msg.ANNOUNCE, encoded(messages["announce"], size=_DROP), "a missing key"),
        ("announce_hash_31_bytes", msg.ANNOUNCE, encoded(messages["announce"], envelope_hash=_h(1)[:31]),
         "a hash of 31 bytes"),
        ("record_signature_64_bytes", msg.RECORD, encoded(messages["record"], signature=bytes(64)),
         "an EIP-712 signature is 65 bytes (r || s || v)"),
        ("record_tokens_negative", msg.RECORD, encoded(messages["record"], tokens=-1), "tokens < 0"),
        ("yield_extra_key", msg.YIELD, {"to": "12D3KooW"}, "a yield is an empty map"),
        ("partial_announce_slice_2_16", msg.PARTIAL_ANNOUNCE,
         encoded(messages["partial_announce"], slice_index=1 << 16), "slice_index >= 2^16"),
        ("verdict_account_as_str", msg.VERDICT, encoded(messages["verdict"], account=signer.address),
         "an account is 20 bytes of bin, not a hex str"),
        ("close_replica_as_bool", msg.CLOSE, encoded(messages["close"], contributions=[
            [True, *messages["close"].contributions[0][1:]]]), "a replica of true: a bool is not an int"),
        ("close_replica_negative", msg.CLOSE, encoded(messages["close"], contributions=[
            [-1, *messages["close"].contributions[0][1:]]]),
         "replica -1: a closed contribution has a replica"),
        ("close_size_0", msg.CLOSE, encoded(messages["close"], contributions=[
            [*messages["close"].contributions[0][:3], 0]]), "size 0: an envelope has at least one byte"),
        ("close_entry_of_3", msg.CLOSE, encoded(messages["close"], contributions=[
            messages["close"].contributions[0][:3]]), "an entry of 3 items, not 4"),
        ("attestation_tokens_negative", msg.ATTESTATION,
         encoded(messages["attestation_last_stage"], tokens=-1),
         "tokens < 0 (the record's range, [0, 2^64))"),
        ("attestation_count_negative", msg.ATTESTATION,
         encoded(messages["attestation_last_stage"], num_contributions=-1), "num_contributions < 0"),
        ("hello_nested_list", msg.HELLO, encoded(messages["hello"], addrs=[[]]),
         "a list inside addrs: 3 maps and arrays where a hello holds 2 (refused while decoding)"),
        ("close_steps_empty", msg.CLOSE, encoded(messages["close"], steps=[]),
         "an optional key sent empty: a fixed-H close leaves steps out"),
        ("close_steps_one_short", msg.CLOSE, encoded(messages["close_time_bounded"], steps=[12]),
         "one declared step count for two contributions"),
        ("close_steps_negative", msg.CLOSE, encoded(messages["close_time_bounded"], steps=[12, -1]),
         "a declared step count < 0"),
        ("close_steps_as_bool", msg.CLOSE, encoded(messages["close_time_bounded"], steps=[12, True]),
         "a bool is not a step count"),
        ("attestation_stage_leaf_empty", msg.ATTESTATION,
         encoded(messages["attestation_last_stage"], stage_leaf=b""),
         "an optional key sent empty (step 5), refused before its length (160 bytes) is looked at"),
        ("announce_extra_key_and_hash_31_bytes", msg.ANNOUNCE,
         dict(encoded(messages["announce"], envelope_hash=_h(1)[:31]), extra=1),
         "two faults: the extra key (step 4) names the refusal, not the short hash (step 7)"),
        ("close_steps_empty_and_replica_negative", msg.CLOSE, encoded(
            messages["close"], steps=[], contributions=[[-1, *messages["close"].contributions[0][1:]]]),
         "two faults: the empty optional key (step 5), not the replica -1 (step 7)"),
    ]
    return [{"name": name, "kind": kind, "payload_hex": msgpack.packb(fields, use_bin_type=True).hex(),
             "step": refusal_step(kind, msgpack.packb(fields, use_bin_type=True)), "why": why}
            for name, kind, fields, why in cases]


#: The checks of node.protocol.decode_payload, in their order (docs/PROTOCOL.md, "The order of the checks"):
#: the words of each step's refusal. Step 7 (the values) is every other refusal.
REFUSAL_STEPS = {1: "carries no gossip payload", 2: "exceeds", 3: "is not msgpack",
                 4: "must have exactly the keys", 5: "an empty optional field", 6: ": unexpected "}


def refusal_step(kind: str, data: bytes) -> int:
    """The step of decode_payload that refuses ``data`` (an error if it is accepted)."""
    try:
        msg.decode_payload(kind, data)
    except msg.ProtocolError as exc:
        return next((step for step, words in REFUSAL_STEPS.items() if words in str(exc)), 7)
    raise AssertionError(f"{kind} payload {data.hex()} is accepted")


def reordered_payload_vectors() -> list[dict[str, Any]]:
    """Every payload vector of two keys or more with its keys reversed: accepted as the same message (a
    receiver does not check key order; the canonical encoding is the sender's duty)."""
    import msgpack

    out = []
    for vector in payload_vectors():
        raw = msgpack.unpackb(bytes.fromhex(vector["payload_hex"]), raw=False)
        if len(raw) < 2:
            continue
        reordered = dict(reversed(list(raw.items())))
        out.append({"name": vector["name"], "kind": vector["kind"],
                    "payload_hex": msgpack.packb(reordered, use_bin_type=True).hex(),
                    "canonical_hex": vector["payload_hex"]})
    return out


_DROP = object()  # a key left out of a rejected payload


def merkle_vectors() -> dict[str, Any]:
    """Roots and proofs of ledger.merkle (docs/PROTOCOL.md, "The contributions root")."""
    roots = []
    for count in range(8):
        leaves = [_h(100 + i) for i in range(count)]
        roots.append({"leaves_hex": [leaf.hex() for leaf in leaves], "root_hex": merkle_root(leaves).hex()})
    leaves = [_h(100 + i) for i in range(5)]
    proofs = [{"index": i, "leaf_hex": leaves[i].hex(), "root_hex": merkle_root(leaves).hex(),
               "proof": [{"sibling_hex": sibling.hex(), "sibling_is_left": left}
                         for sibling, left in merkle_proof(leaves, i)]}
              for i in range(len(leaves))]
    return {"leaf": "sha256(0x00 || leaf)", "inner": "sha256(0x01 || left || right)",
            "odd": "the last node of a level with an odd count is promoted unchanged",
            "empty": "sha256(b'')", "roots": roots, "proofs": proofs}


def eip712_vectors() -> dict[str, Any]:
    """EIP-712 known answers for the two types members sign (docs/LEDGER.md): the ``record`` and ``verdict``
    payload vectors carry these signatures."""
    from eth_utils import keccak

    signer = Account.from_key(EIP712_KEY)
    record, verdict = eip712_record(), eip712_verdict()
    out = {
        "key": {"private_key_hex": EIP712_KEY.hex(), "address": signer.address},
        "domain": {"name": DOMAIN_NAME, "version": DOMAIN_VERSION, "chainId": CHAIN_ID,
                   "verifyingContract": LEDGER_ADDRESS},
        "domain_type": DOMAIN_TYPE,
        "domain_type_hash_hex": keccak(text=DOMAIN_TYPE).hex(),
        "domain_separator_hex": domain_separator(CHAIN_ID, LEDGER_ADDRESS).hex(),
        "messages": [],
    }
    for name, message, type_string, struct_hash, digest, sign in (
        ("record", record, RECORD_TYPE, record_struct_hash(record),
         record_digest(record, CHAIN_ID, LEDGER_ADDRESS), sign_record),
        ("verdict", verdict, VERDICT_TYPE, verdict_struct_hash(verdict),
         verdict_digest(verdict, CHAIN_ID, LEDGER_ADDRESS), sign_verdict),
    ):
        out["messages"].append({
            "name": name,
            "type": type_string,
            "type_hash_hex": keccak(text=type_string).hex(),
            "typed_data": typed_data(message, CHAIN_ID, LEDGER_ADDRESS),
            "struct_hash_hex": struct_hash.hex(),
            "digest_hex": digest.hex(),
            "signature_hex": sign(signer, message, CHAIN_ID, LEDGER_ADDRESS).hex(),
        })
    return out


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
    return [{"name": name, "direction": direction, "fields": tag(frame),
             "frame_hex": encode_frame(frame).hex()}
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
    return [{"name": name, "direction": direction, "fields": tag(frame),
             "frame_hex": encode_frame(frame).hex()}
            for name, direction, frame in frames]


def contribution_payload_vectors() -> dict[str, Any]:
    """Codec payloads (training/codec_wire.py) of one stage of two raw tensors: version 1 (a fixed-H run's)
    and version 2, which declares the inner steps trained (``"ns"``, a time-bounded run's: docs/PROTOCOL.md,
    "Declared inner steps"); then version-2 payloads every decoder must refuse."""
    import torch

    from training.codec_wire import declare_steps, pack_contribution

    shapes = {"a.weight": [2, 3], "b.bias": [3]}
    values = {"a.weight": torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.125]]),
              "b.bias": torch.tensor([1.5, -2.5, 3.0])}
    entries = [{"n": name, "s": shapes[name], "c": "raw", "d": values[name].numpy().astype("<f4").tobytes()}
               for name in sorted(shapes)]
    v1 = pack_contribution(2, 5, entries)
    accepted = [
        {"name": "version 1 (no declared steps: H)", "payload_hex": v1.hex(), "declared_steps": None},
        {"name": "version 2, 7 inner steps declared", "payload_hex": declare_steps(v1, 7).hex(),
         "declared_steps": 7},
    ]
    import msgpack

    # The keys in the encoder's order (v, st, rd, ns, t), so that each refused payload has one fault: its ns.
    reordered = {"t": entries, "ns": 7, "rd": 5, "st": 2, "v": 2}
    accepted.append({"name": "version 2, 7 steps, keys in another order (key order is not checked)",
                     "payload_hex": msgpack.packb(reordered, use_bin_type=True).hex(), "declared_steps": 7})

    def bad(name: str, ns: Any) -> dict[str, Any]:
        message = {"v": 2, "st": 2, "rd": 5, **({} if ns is None else {"ns": ns}), "t": entries}
        return {"name": name, "payload_hex": msgpack.packb(message, use_bin_type=True).hex()}

    rejected = [bad("declares 0 steps", ns=0), bad("declares -1 steps", ns=-1),
                bad("declares 2**20 + 1 steps", ns=(1 << 20) + 1), bad("declares 2**63 steps", ns=1 << 63),
                bad("declares 7.0 (a float)", ns=7.0), bad("declares true", ns=True),
                bad("declares '7'", ns="7"), bad("version 2 without ns", ns=None)]
    return {"stage": 2, "round": 5, "shapes": shapes, "accepted": accepted, "rejected": rejected}


def build() -> dict[str, Any]:
    identity = Identity.from_seed(SEED)
    return {
        "description": "dlx wire-format test vectors; see docs/P2P.md and docs/PROTOCOL.md. "
                       "Generated by tests/vectors/make_vectors.py; checked by tests/test_wire_vectors.py.",
        "conventions": "*_hex: lowercase hex bytes. In 'fields': {\"bin\": hex} is msgpack bin, "
                       "{\"f64\": x} is msgpack float64 (\"nan\" = the quiet NaN 0x7ff8000000000000, "
                       "\"inf\" / \"-inf\" = 0x7ff0000000000000 / 0xfff0000000000000, never JSON Infinity), "
                       "JSON true/false msgpack bool (only where a field's type is bool), "
                       "{\"int\": \"<decimal>\"} an integer beyond JavaScript's exact range (|n| > 2^53 - "
                       "1), JSON strings are msgpack str, JSON integers msgpack int in "
                       "the smallest encoding.",
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
        "rejected_payloads": rejected_payload_vectors(),
        "reordered_payloads": reordered_payload_vectors(),
        "merkle": merkle_vectors(),
        "eip712": eip712_vectors(),
        "blob": {"protocol": str(BLOB_PROTOCOL), "frames": blob_vectors()},
        "sync": {"protocol": str(SYNC_PROTOCOL), "offer_protocol": str(SYNC_OFFER_PROTOCOL),
                 "frames": sync_vectors()},
        "contribution_payloads": contribution_payload_vectors(),
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
