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

import json
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root holds the packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# The vectors' other modules sit beside this file (also when a test loads it by its path).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vectors_common import (  # noqa: E402
    CHAIN_ID,
    EIP712_KEY,
    LEDGER_ADDRESS,
    RUN_ID,
    SEED,
    TIMESTAMP_MS,
    fixed_hash,
    payload_messages,
    payload_vectors,
    tag,
    untag,  # noqa: F401 - tests/test_wire_vectors.py reads it from here
)
from vectors_frames import (  # noqa: E402
    blob_vectors,
    contribution_payload_vectors,
    eip712_vectors,
    merkle_vectors,
    sync_vectors,
)
from vectors_parts import envelope_v2_vectors  # noqa: E402
from vectors_rejected import (  # noqa: E402
    REFUSAL_STEPS,  # noqa: F401 - tests/test_wire_vectors.py reads it from here
    rejected_payload_vectors,
    rejected_vectors,
    reordered_payload_vectors,
)

from ledger.merkle import merkle_root  # noqa: E402
from node import protocol as msg  # noqa: E402
from p2p.blob_protocol import BLOB_PROTOCOL  # noqa: E402
from p2p.envelope import DOMAIN, Envelope  # noqa: E402
from p2p.gossip import SYNC_OFFER_PROTOCOL, SYNC_PROTOCOL, gossip_message_id  # noqa: E402
from p2p.identity import Identity  # noqa: E402
from training.slicemessages import partial_payload  # noqa: E402

OUT = Path(__file__).with_name("wire.json")
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


def binding_claim():
    """The ``Contribution`` message (EIP-712, ledger/contribution_binding.py) of the bound contribution
    vector: run RUN_ID, round 3, stage 0, the payload-piece root and sum-tree root of :func:`codec_blob` as
    a version-3 run's factors list them, 0 steps (a fixed-H run)."""
    from node.fraudproof import contribution_claim
    from training.config import DilocoConfig

    shapes = {k: tuple(v) for k, v in CODEC_SHAPES.items()}
    return contribution_claim(codec_blob(), shapes, DilocoConfig(commitments="normed"), run_id=RUN_ID,
                              outer_round=3, stage=0, decode_args={"stage_index": 0, "outer_round": 3})


def bound_contribution_body() -> msg.ContributionBody:
    """The default body of a version-3 run (``dlx-contribution/4``): the contribution vector's fields, the
    EIP-712 vectors' account as contributor and its signature of :func:`binding_claim`."""
    from eth_account import Account

    from ledger.contribution_binding import sign_contribution

    signer = Account.from_key(EIP712_KEY)
    binding = sign_contribution(signer, binding_claim(), CHAIN_ID, LEDGER_ADDRESS)
    return msg.ContributionBody(fixed_hash(11), fixed_hash(12), codec_blob(), fixed_hash(14),
                                bytes.fromhex(signer.address[2:]), binding)


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
                      payload=msg.encode_contribution_body(msg.ContributionBody(
                          fixed_hash(11), fixed_hash(12), codec_blob(), fixed_hash(14)))))
    # A version-3 run's contribution (the default of new runs: diloco.commitments "normed"), bound to its
    # member: docs/PROTOCOL.md's second ContributionBody form.
    cases.append(dict(name="bound_contribution", run_id=RUN_ID, round=3, kind=msg.CONTRIBUTION, stage=0,
                      replica=1, timestamp_ms=TIMESTAMP_MS,
                      payload=msg.encode_contribution_body(bound_contribution_body())))
    # The sliced exchange's partial: a blob (never gossiped), fixed layout like a contribution
    # (docs/PROTOCOL.md, "Sliced exchange"): b"dlx-partial/2"
    # || u32 j || u32 A || u32 n || inputs_root (32) || blob. Its inputs are the `close` payload vector's
    # entries: n = their count, inputs_root = merkle_root of their envelope hashes in the close's order.
    cases.append(dict(name="partial", run_id=RUN_ID, round=3, kind=msg.PARTIAL, stage=1, replica=0,
                      timestamp_ms=TIMESTAMP_MS,
                      payload=partial_payload(1, 2, merkle_root(_close_hashes()), len(_close_hashes()),
                                              bytes(range(64)))))
    # The same with a real partial blob: a slice blob is a contribution of the slice's sub-tensor shapes
    # (docs/SLICED.md, "Bit-exact replay"), here the contribution vector's codec blob (stage 0, round 3).
    cases.append(dict(name="partial_with_codec_blob", run_id=RUN_ID, round=3, kind=msg.PARTIAL, stage=0,
                      replica=0, timestamp_ms=TIMESTAMP_MS,
                      payload=partial_payload(1, 2, merkle_root(_close_hashes()), len(_close_hashes()),
                                              codec_blob())))
    cases.append(dict(name="integer_widths", run_id=(1 << 32), round=300, kind="widths", stage=128,
                      replica=65_536, timestamp_ms=TIMESTAMP_MS + 1, payload=b""))
    cases.append(dict(name="large_indices", run_id=(1 << 64) - 1, round=255, kind="x_1", stage=127,
                      replica=32, timestamp_ms=0, payload=b"\x00"))
    return cases


def msg_partial_blob(payload: bytes) -> bytes:
    """The partial blob a partial payload carries (training/slicemessages.py's strict parse)."""
    from training.slicemessages import parse_partial

    return parse_partial(payload).blob


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
                "magic": (msg.BOUND_CONTRIBUTION_MAGIC if body.binding else msg.CONTRIBUTION_MAGIC).decode(),
                "state_hash_hex": body.state_hash.hex(), "data_commitment_hex": body.data_commitment.hex(),
                "applied_hash_hex": body.applied_hash.hex(), "codec": codec_vector()}
            if body.binding:  # the member and its signature of the EIP-712 message named here
                out[-1]["contribution_body"].update(
                    contributor_hex=body.contributor.hex(), binding_hex=body.binding.hex(),
                    binding_message="eip712.messages['contribution']: its payloadRoot and normRoot are the "
                                    "codec blob's payload-piece root and sum-tree root (docs/PROTOCOL.md)")
        if case["kind"] == msg.PARTIAL:  # the fixed layout's parts, the root derived from the close vector
            out[-1]["partial_body"] = {
                "slice_index": 1, "num_slices": 2, "num_inputs": len(_close_hashes()),
                "inputs_from": "the payload vector 'close': its entries' envelope hashes, in its order",
                "input_hashes_hex": [h.hex() for h in _close_hashes()],
                "inputs_root_hex": merkle_root(_close_hashes()).hex(),
                "blob_hex": msg_partial_blob(case["payload"]).hex()}
            if case["name"] == "partial_with_codec_blob":  # the blob decoded for the slice's shapes
                out[-1]["partial_body"]["codec"] = codec_vector()
    return out


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
        "eip712": eip712_vectors(binding_claim()),
        "blob": {"protocol": str(BLOB_PROTOCOL), "frames": blob_vectors()},
        "sync": {"protocol": str(SYNC_PROTOCOL), "offer_protocol": str(SYNC_OFFER_PROTOCOL),
                 "frames": sync_vectors()},
        "contribution_payloads": contribution_payload_vectors(),
        "envelopes_v2": envelope_v2_vectors(codec_blob(), CODEC_SHAPES),
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
