"""tests/vectors/make_vectors.py's refusals: envelopes and payloads a conforming receiver must refuse (with
the reason or the check that refuses them), and payloads with their keys reordered, which it accepts."""

from __future__ import annotations

from typing import Any

from eth_account import Account
from vectors_common import (
    EIP712_KEY,
    RUN_ID,
    SEED,
    TIMESTAMP_MS,
    fixed_hash,
    payload_messages,
    payload_vectors,
)

from node import protocol as msg
from p2p.envelope import Envelope
from p2p.identity import Identity


#: The receiver's size limit a rejected envelope is decoded with (each case names it: ``max_size``).
REJECTED_MAX_SIZE = 1 << 20
_DROP = object()  # a key left out of a rejected payload


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
        ("announce_hash_31_bytes", msg.ANNOUNCE,
         encoded(messages["announce"], envelope_hash=fixed_hash(1)[:31]),
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
         dict(encoded(messages["announce"], envelope_hash=fixed_hash(1)[:31]), extra=1),
         "two faults: the extra key (step 4) names the refusal, not the short hash (step 7)"),
        ("close_steps_empty_and_replica_negative", msg.CLOSE, encoded(
            messages["close"], steps=[], contributions=[[-1, *messages["close"].contributions[0][1:]]]),
         "two faults: the empty optional key (step 5), not the replica -1 (step 7)"),
    ]
    cases.append(("hello_addr_513_characters", msg.HELLO, encoded(
        messages["hello"], addrs=["/ip4/127.0.0.1/tcp/4001/p2p/" + "x" * (513 - 28)]),
        "a str inside a list is at most 512 characters too (checked with the list's entries, step 7)"))
    vectors = [{"name": name, "kind": kind, "payload_hex": msgpack.packb(fields, use_bin_type=True).hex(),
                "step": refusal_step(kind, msgpack.packb(fields, use_bin_type=True)), "why": why}
               for name, kind, fields, why in cases]
    # A map holding a key twice cannot be written as a dict: the announce's map with its first key repeated.
    body = msgpack.packb(encoded(messages["announce"]), use_bin_type=True)
    assert 0x80 <= body[0] < 0x8f, "a fixmap"
    first_key, first_value = next(iter(encoded(messages["announce"]).items()))
    repeated = bytes([body[0] + 1]) + body[1:] + msgpack.packb(first_key) + msgpack.packb(first_value,
                                                                                          use_bin_type=True)
    vectors.append({"name": "announce_repeated_key", "kind": msg.ANNOUNCE, "payload_hex": repeated.hex(),
                    "step": refusal_step(msg.ANNOUNCE, repeated),
                    "why": "a key twice (with the same value): refused while decoding, never the first or "
                           "last value kept"})
    return vectors


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
