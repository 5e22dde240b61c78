"""The shared part of tests/vectors/make_vectors.py: the fixed keys and values, the tagged-JSON convention
(:func:`tag`, :func:`untag`: make_vectors.py's docstring) and every gossiped payload kind's message."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from eth_account import Account

from ledger.attest import sign_record, sign_verdict
from ledger.records import RoundRecord, Verdict
from node import protocol as msg
from p2p.identity import Identity


SEED = bytes(range(32))  # the test key: never use it for anything else
TIMESTAMP_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
RUN_ID = 7
# EIP-712 known answers: a fixed secp256k1 test key (never use it for anything else), anvil's chain id
# and the address the first contract deployed by anvil's first dev account gets.
EIP712_KEY = hashlib.sha256(b"dlx-node test vectors: secp256k1 key").digest()
CHAIN_ID = 31337
LEDGER_ADDRESS = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
MAX_SAFE_INTEGER = (1 << 53) - 1  # JavaScript's Number.MAX_SAFE_INTEGER


def fixed_hash(n: int) -> bytes:
    """A recognisable 32-byte value: sha256 of one byte."""
    return hashlib.sha256(bytes([n])).digest()


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
    return RoundRecord(run_id=RUN_ID, round=3, prev_head=fixed_hash(7), weights_root=fixed_hash(8),
                       contributions_root=fixed_hash(9), train_loss_micro=3_250_000,
                       eval_loss_micro=3_500_000, tokens=131_072, num_contributors=2)


def eip712_verdict() -> Verdict:
    """The verdict the ``verdict`` payload vector signs."""
    return Verdict(run_id=RUN_ID, accused="0x" + "33" * 20, evidence_hash=fixed_hash(10), guilty=True)


def payload_messages() -> list[tuple[str, str, Any]]:
    """(name, kind, message) of every gossiped payload kind, with representative values."""
    from vectors_parts import parts_announce_header  # it builds on this module's values

    identity = Identity.from_seed(SEED)
    signer = Account.from_key(EIP712_KEY)
    record = eip712_record()
    return [
        ("hello", msg.HELLO, msg.Hello(
            cluster="c0", cluster_size=2, account=bytes.fromhex("11" * 20),
            addrs=[f"/ip4/127.0.0.1/tcp/4001/p2p/{identity.peer_id}"],
            training_round=3, first_round=-1)),
        ("announce", msg.ANNOUNCE, msg.Announce(envelope_hash=fixed_hash(1), size=23_456_789)),
        ("close", msg.CLOSE, msg.Close(contributions=[
            [0, identity.peer_id, fixed_hash(2), 1000],
            [1, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", fixed_hash(3), 70_000],
        ])),
        ("attestation_last_stage", msg.ATTESTATION, msg.Attestation(
            weights_hash=fixed_hash(4), contributions_root=fixed_hash(5), num_contributions=2,
            train_loss=3.25, eval_loss=3.5, tokens=65_536, shard_hash=fixed_hash(6), checkpoint_hash=b"")),
        ("attestation_inner_stage", msg.ATTESTATION, msg.Attestation(
            weights_hash=fixed_hash(4), contributions_root=fixed_hash(5), num_contributions=2,
            train_loss=math.nan, eval_loss=math.nan, tokens=0, shard_hash=b"", checkpoint_hash=b"")),
        ("record", msg.RECORD, msg.RecordSignature(
            prev_head=fixed_hash(7), weights_root=fixed_hash(8), contributions_root=fixed_hash(9),
            train_loss_micro=3_250_000, eval_loss_micro=3_500_000, tokens=131_072, num_contributors=2,
            checkpoint_hash=record.checkpoint_hash, account=bytes.fromhex(signer.address[2:]),
            signature=sign_record(signer, record, CHAIN_ID, LEDGER_ADDRESS))),
        ("accusation", msg.ACCUSATION, msg.Accusation(
            outer_round=3, accused=bytes.fromhex("33" * 20), accused_peer=identity.peer_id, replica=1,
            evidence_hash=fixed_hash(10), evidence_size=4096)),
        ("verdict", msg.VERDICT, msg.VerdictSignature(
            accused=bytes.fromhex("33" * 20), evidence_hash=fixed_hash(10), guilty=True,
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
            slice_index=1, envelope_hash=fixed_hash(14), size=8_364)),
        # Taking over a close (docs/PROTOCOL.md, "Closing a round"): both are an empty map; the envelope's
        # round and stage say which close.
        ("takeover", msg.TAKEOVER, msg.Takeover()),
        ("yield", msg.YIELD, msg.Yield()),
        # A run whose rounds are bounded by time (issue 44):
        # the close names each contribution's declared steps
        # (0: none in the run's range). A fixed-H close leaves the key out ("close" above).
        ("close_time_bounded", msg.CLOSE, msg.Close(contributions=[
            [0, identity.peer_id, fixed_hash(2), 1000],
            [1, "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN", fixed_hash(3), 70_000],
        ], steps=[12, 0])),
        # A run whose contributions travel in parts (diloco.exchange_parts > 1): a version-2 header and its
        # parts' digests (docs/P2P.md, "Envelope version 2").
        ("parts_announce", msg.PARTS_ANNOUNCE, msg.PartsAnnounce(
            fixed_hash(15), 8_364, *parts_announce_header())),
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
