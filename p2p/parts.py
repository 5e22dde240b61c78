"""A message in parts, each part verifiable alone: envelope version 2's parts root (docs/P2P.md, "Parts").

A version-2 envelope (:mod:`p2p.envelope`) signs, instead of the sha256 of its whole payload, the Merkle root
over the sha256 digests of its payload's P *parts* (consecutive byte ranges: their concatenation is the
payload) and the parts' sizes. Each part travels as a blob of its own (content-addressed by its sha256), so a
receiver checks a part the moment it is here, never waiting for the others.

Definition (SHA-256; the tree is the record's, ledger/merkle.py, over these leaves)::

    leaf         = sha256(part)                                   (32 bytes: the part's blob id)
    leaf hash    = sha256(0x00 || leaf)
    inner hash   = sha256(0x01 || left || right)
    an odd node at the end of a level is promoted unchanged; the root of one leaf is its leaf hash
    part_sizes   = the parts' sizes, each uint64 big-endian, concatenated (signed beside the root)

A *manifest* lists the P digests (a holder's announcement of its parts carries it): checked once against the
signed root, each part is then checked by its size and digest alone. A part can instead come with its
*proof*, the sibling hashes from its leaf up; the path follows from the index and P, so a proof for another
index or another tree does not verify. Every failure raises :class:`PartRejected` with a specific ``reason``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from p2p.errors import P2PError

#: The most parts one envelope may have (the wire's bound; a run's diloco.exchange_parts is at most this).
MAX_PARTS = 1024
DIGEST_BYTES = 32
_LEAF = b"\x00"
_INNER = b"\x01"
_SIZE = struct.Struct(">Q")


class PartRejected(P2PError):
    """A part, a manifest or a proof failed its check; ``reason`` is a short code.

    Reasons: ``part_index_out_of_range``, ``part_truncated``, ``part_oversized``, ``part_digest_mismatch``,
    ``part_proof_invalid``, ``manifest_malformed``, ``manifest_root_mismatch`` (a lying announcement),
    ``announcement_mismatch`` (node/: an announcement whose header is not the announcer's contribution).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"part rejected ({reason})" + (f": {detail}" if detail else ""))


def _inner_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_INNER + left + right).digest()


def _levels(digests: Sequence[bytes]) -> list[list[bytes]]:
    level = [hashlib.sha256(_LEAF + bytes(d)).digest() for d in digests]
    levels = [level]
    while len(level) > 1:
        paired = [_inner_hash(a, b) for a, b in zip(level[0::2], level[1::2])]
        level = paired + level[len(paired) * 2:]
        levels.append(level)
    return levels


def parts_root(digests: Sequence[bytes]) -> bytes:
    """The root over the parts' sha256 ``digests`` (module docstring)."""
    if not 1 <= len(digests) <= MAX_PARTS:
        raise PartRejected("manifest_malformed", f"{len(digests)} parts: must be 1 to {MAX_PARTS}")
    return _levels(digests)[-1][0]


def part_digests(parts: Sequence[bytes]) -> list[bytes]:
    return [hashlib.sha256(part).digest() for part in parts]


def part_proof(digests: Sequence[bytes], index: int) -> list[bytes]:
    """Part ``index``'s proof: its siblings from the leaf up (none at a level where its node is promoted)."""
    check_index(index, len(digests))
    proof, position = [], index
    for level in _levels(digests)[:-1]:
        if position ^ 1 < len(level):
            proof.append(level[position ^ 1])
        position //= 2
    return proof


def pack_sizes(sizes: Sequence[int]) -> bytes:
    """``part_sizes`` on the wire: each size a uint64 big-endian."""
    return b"".join(_SIZE.pack(size) for size in sizes)


def unpack_sizes(data: bytes) -> list[int]:
    """The sizes ``part_sizes`` holds (raises ``manifest_malformed`` unless 1 to MAX_PARTS positive sizes)."""
    if not isinstance(data, bytes) or len(data) % _SIZE.size or not 1 <= len(data) // _SIZE.size <= MAX_PARTS:
        raise PartRejected("manifest_malformed", f"part_sizes: must be 1 to {MAX_PARTS} uint64s")
    sizes = [size for (size,) in _SIZE.iter_unpack(data)]
    if not all(sizes):
        raise PartRejected("manifest_malformed", "part_sizes: a part of 0 bytes")
    return sizes


def cut_at(payload: bytes, sizes: Sequence[int]) -> list[bytes]:
    """``payload`` cut into consecutive parts of ``sizes`` (their sum must be its length)."""
    if sum(sizes) != len(payload):
        raise PartRejected("part_truncated" if sum(sizes) > len(payload) else "part_oversized",
                           f"{len(payload)} bytes for parts of {sum(sizes)}")
    parts, at = [], 0
    for size in sizes:
        parts.append(payload[at:at + size])
        at += size
    return parts


def pack_manifest(digests: Sequence[bytes]) -> bytes:
    """A manifest on the wire: the digests concatenated (32 bytes each)."""
    return b"".join(digests)


def check_manifest(manifest: bytes, root: bytes, count: int) -> list[bytes]:
    """The digests of a manifest that an envelope of ``root`` and ``count`` parts signed; raises
    ``manifest_malformed`` or ``manifest_root_mismatch`` (a lying announcement)."""
    if not isinstance(manifest, bytes) or len(manifest) % DIGEST_BYTES:
        raise PartRejected("manifest_malformed", "a manifest is 32-byte digests")
    digests = [manifest[at:at + DIGEST_BYTES] for at in range(0, len(manifest), DIGEST_BYTES)]
    if len(digests) != count:
        raise PartRejected("manifest_root_mismatch", f"{len(digests)} parts listed, the envelope has {count}")
    if parts_root(digests) != root:
        raise PartRejected("manifest_root_mismatch", "the listed parts do not hash to the signed root")
    return digests


def check_index(index: int, count: int) -> None:
    if type(index) is not int or not 0 <= index < count:
        raise PartRejected("part_index_out_of_range", f"part {index!r} of {count}")


def check_part(index: int, data: bytes, digest: bytes, size: int) -> None:
    """Raise unless ``data`` has ``size`` bytes and sha256 ``digest`` (part ``index``, for the message)."""
    _check_size(index, data, size)
    if hashlib.sha256(data).digest() != digest:
        raise PartRejected("part_digest_mismatch", f"part {index}: not the signed part")


def _check_size(index: int, data: bytes, size: int) -> None:
    if len(data) < size:
        raise PartRejected("part_truncated", f"part {index}: {len(data)} of {size} bytes")
    if len(data) > size:
        raise PartRejected("part_oversized", f"part {index}: {len(data)} bytes, {size} signed")


def verify_part(root: bytes, sizes: Sequence[int], index: int, data: bytes, proof: Sequence[bytes]) -> None:
    """Check part ``index`` alone against a signed ``root`` and ``sizes`` with its ``proof`` (raises
    :class:`PartRejected`; returns None when it holds)."""
    check_index(index, len(sizes))
    _check_size(index, data, sizes[index])
    node = hashlib.sha256(_LEAF + hashlib.sha256(data).digest()).digest()
    position, width, siblings = index, len(sizes), list(proof)
    while width > 1:
        if position ^ 1 < width:
            if not siblings:
                raise PartRejected("part_proof_invalid", f"part {index}: proof too short")
            sibling = siblings.pop(0)
            node = _inner_hash(sibling, node) if position & 1 else _inner_hash(node, sibling)
        position, width = position // 2, (width + 1) // 2
    if siblings or node != root:
        raise PartRejected("part_proof_invalid", f"part {index}: does not hash up to the signed root")
