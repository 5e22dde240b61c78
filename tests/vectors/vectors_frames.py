"""tests/vectors/make_vectors.py's chain and stream vectors: Merkle roots and proofs, EIP-712 known answers,
the blob and sync protocols' frames, and the codec payloads' declared inner steps."""

from __future__ import annotations

import hashlib
from typing import Any

from eth_account import Account
from vectors_common import (
    CHAIN_ID,
    EIP712_KEY,
    LEDGER_ADDRESS,
    RUN_ID,
    eip712_record,
    eip712_verdict,
    fixed_hash,
    tag,
)

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
from node import protocol as msg
from p2p.blob_protocol import (
    bad_request_reply,
    busy_reply,
    not_found_reply,
    ok_reply,
    out_of_range_reply,
    request_frame,
)
from p2p.gossip import (
    sync_id,
    sync_messages_frame,
    sync_offer_frame,
    sync_request_frame,
    sync_response_frame,
    sync_want_frame,
)
from p2p.wire import encode_frame


def merkle_vectors() -> dict[str, Any]:
    """Roots and proofs of ledger.merkle (docs/PROTOCOL.md, "The contributions root")."""
    roots = []
    for count in range(8):
        leaves = [fixed_hash(100 + i) for i in range(count)]
        roots.append({"leaves_hex": [leaf.hex() for leaf in leaves], "root_hex": merkle_root(leaves).hex()})
    leaves = [fixed_hash(100 + i) for i in range(5)]
    proofs = [{"index": i, "leaf_hex": leaves[i].hex(), "root_hex": merkle_root(leaves).hex(),
               "proof": [{"sibling_hex": sibling.hex(), "sibling_is_left": left}
                         for sibling, left in merkle_proof(leaves, i)]}
              for i in range(len(leaves))]
    return {"leaf": "sha256(0x00 || leaf)", "inner": "sha256(0x01 || left || right)",
            "odd": "the last node of a level with an odd count is promoted unchanged",
            "empty": "sha256(b'')", "roots": roots, "proofs": proofs}


def eip712_vectors(claim) -> dict[str, Any]:
    """EIP-712 known answers for the three types members sign (docs/LEDGER.md): the ``record`` and ``verdict``
    payload vectors carry these signatures, the ``bound_contribution`` envelope the ``contribution``'s
    (``claim``: a ledger.contribution_binding.ContributionClaim)."""
    from ledger.contribution_binding import CONTRIBUTION_TYPE, sign_contribution

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
    out["messages"].append({
        "name": "contribution",
        "type": CONTRIBUTION_TYPE,
        "type_hash_hex": keccak(text=CONTRIBUTION_TYPE).hex(),
        "typed_data": claim.typed_data(CHAIN_ID, LEDGER_ADDRESS),
        "struct_hash_hex": claim.struct_hash().hex(),
        "digest_hex": claim.digest(CHAIN_ID, LEDGER_ADDRESS).hex(),
        "signature_hex": sign_contribution(signer, claim, CHAIN_ID, LEDGER_ADDRESS).hex(),
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
