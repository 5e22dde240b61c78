"""Envelope version 2's vectors (docs/P2P.md, "Envelope version 2"): a contribution in parts, its header, its
parts, their manifest, root and proofs, and refused variants; part of tests/vectors/wire.json
(``envelopes_v2``), checked by tests/test_exchange_parts.py."""

from __future__ import annotations

from typing import Any

import msgpack
from vectors_common import RUN_ID, SEED, TIMESTAMP_MS, fixed_hash

from node import protocol as msg
from p2p.envelope import DOMAIN_PARTS, Envelope, payload_offset
from p2p.identity import Identity
from p2p.parts import cut_at, pack_manifest, part_digests, part_proof
from training.cluster_parts import blob_cuts, exchange_plan


def parts_announce_header() -> tuple[bytes, bytes]:
    """(header, manifest) of a small version-2 envelope: the ``parts_announce`` payload vector's."""
    payload = bytes(range(40))
    envelope = Envelope.create(Identity.from_seed(SEED), RUN_ID, 3, msg.CONTRIBUTION, payload, stage=1,
                               replica=0, timestamp_ms=TIMESTAMP_MS, part_sizes=[16, 24])
    return envelope.header().to_bytes(), pack_manifest(part_digests(cut_at(payload, envelope.sizes)))


def envelope_v2_vectors(blob: bytes, shapes: dict) -> dict[str, Any]:
    """The contribution vector's body (codec ``blob`` of ``shapes``) in 2 parts (``exchange_parts`` 2)."""
    body = msg.encode_contribution_body(msg.ContributionBody(fixed_hash(11), fixed_hash(12), blob,
                                                             fixed_hash(14)))
    plan = exchange_plan({k: tuple(v) for k, v in shapes.items()}, 2)
    sizes = blob_cuts(blob, plan)
    sizes[0] += len(body) - len(blob)
    envelope = Envelope.create(Identity.from_seed(SEED), RUN_ID, 3, msg.CONTRIBUTION, body, stage=0,
                               replica=1, timestamp_ms=TIMESTAMP_MS, part_sizes=sizes)
    parts = cut_at(body, sizes)
    digests = part_digests(parts)
    data = envelope.to_bytes()
    fields = msgpack.unpackb(data, raw=False)

    def packed(**changes) -> str:
        return msgpack.packb(dict(fields, **changes), use_bin_type=True).hex()

    flipped = body[:-1] + bytes([body[-1] ^ 1])
    return {
        "domain": DOMAIN_PARTS.decode("ascii"),
        "exchange_parts": 2,
        "parts_plan": [list(names) for names in plan.names],
        "part_sizes": sizes,
        "part_sizes_hex": envelope.part_sizes.hex(),
        "part_digests_hex": [d.hex() for d in digests],
        "parts_hex": [p.hex() for p in parts],
        "manifest_hex": pack_manifest(digests).hex(),
        "parts_root_hex": envelope.parts_root.hex(),
        "proofs_hex": [[s.hex() for s in part_proof(digests, i)] for i in range(len(parts))],
        "payload_offset": payload_offset(envelope, len(body)),
        "signing_bytes_hex": envelope.signing_bytes().hex(),
        "header_hex": envelope.header().to_bytes().hex(),
        "envelope_hex": data.hex(),
        "envelope_hash_hex": envelope.envelope_hash,
        "rejected": [
            {"name": "payload_cut_short", "envelope_hex": packed(payload=body[:-1]),
             "reason": "parts_size_mismatch"},
            {"name": "payload_byte_flipped", "envelope_hex": packed(payload=flipped),
             "reason": "parts_root_mismatch"},
            {"name": "part_of_zero_bytes",
             "envelope_hex": packed(part_sizes=bytes(8) + envelope.part_sizes[8:]), "reason": "malformed"},
            {"name": "payload_sha256_beside_parts", "envelope_hex": packed(payload_sha256=bytes(32)),
             "reason": "malformed"},
            {"name": "version_1_domain", "envelope_hex": packed(domain=b"dlx-envelope-v1"),
             "reason": "bad_domain"},
            {"name": "version_1_with_parts", "envelope_hex": packed(version=1), "reason": "bad_version"},
            {"name": "tampered_round", "envelope_hex": packed(round=4), "reason": "bad_signature"},
        ],
    }
