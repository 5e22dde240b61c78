"""A replica's slices of one stage as one content-addressed *bundle*, and the constant-size *reference* its
contribution envelope signs (docs/PROTOCOL.md, "Sliced exchange"; :mod:`training.butterfly` makes the slices).

Aggregator ``j`` reads record ``j`` and slice ``j`` of each bundle by range and checks them against the
signed reference (a Merkle path to its slices root); an auditor reads whole bundles
(:func:`bundle_slices`, :func:`rerun_claim`). Pure functions of bytes: no torch here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from training.codec_wire import MAX_DECLARED_STEPS, header_steps
from training.slice_plan import MAX_SLICES, SliceError

_EMPTY = bytes(32)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# A replica's slices of one stage travel as one content-addressed *bundle* blob; its contribution
# envelope carries only a constant-size *reference* (the bundle's hash and the Merkle root of its
# slices), and aggregator j reads record j and slice j of each bundle by range (docs/PROTOCOL.md,
# "Sliced exchange"): nobody fetches the R x A slice hashes.
REFERENCE_PREFIX = b"dlx-slices/2"
# A time-bounded run's reference (diloco.round_budget_s, issue 44) declares the replica's inner steps too: the
# count its every slice blob declares (codec_wire version 2), so that an envelope alone says what its
# contribution weighs (the close, the record's tokens, the audit) without its bundle.
DECLARED_REFERENCE_PREFIX = b"dlx-slices/3"
BUNDLE_PREFIX = b"dlx-bundle/1"
_REFERENCE = struct.Struct(">I32sQ32s")  # A, bundle sha256, bundle size, slices root
_STEPS = struct.Struct(">I")  # the declared inner steps of a version-3 reference
_RECORD_HEAD = struct.Struct(">32sQQ")  # slice sha256, offset in the bundle, size


@dataclass(frozen=True)
class SliceReference:
    """A parsed contribution reference: the bundle to read slices from and the root they must prove to."""

    num_slices: int
    bundle_digest: bytes
    bundle_size: int
    slices_root: bytes
    steps: int | None = None  # the inner steps a time-bounded run's reference declares (None: version 2)


def tree_depth(num_slices: int) -> int:
    """Levels of a bundle's slice tree: ``ceil(log2 A)`` (0 for one slice)."""
    return max(0, (num_slices - 1).bit_length())


def record_size(num_slices: int) -> int:
    """Bytes of one bundle record: slice sha256, offset, size and ``tree_depth`` sibling hashes."""
    return _RECORD_HEAD.size + 32 * tree_depth(num_slices)


def record_range(num_slices: int, slice_index: int) -> tuple[int, int]:
    """``(offset, length)`` of record ``slice_index`` in a bundle of ``num_slices`` slices (fixed positions).
    """
    size = record_size(num_slices)
    return len(BUNDLE_PREFIX) + 4 + slice_index * size, size


def slice_leaf(slice_index: int, digest: bytes, offset: int, size: int) -> bytes:
    """Leaf ``j`` of a bundle's slice tree: ``sha256(b"slice" || u32 j || sha256(blob) || u64 offset || u64
    size)``."""
    return _sha(b"slice" + struct.pack(">I", slice_index) + digest + struct.pack(">QQ", offset, size))


def _tree_levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Levels of the complete binary tree over ``leaves`` padded with zero hashes to a power of two."""
    level = list(leaves) + [_EMPTY] * ((1 << tree_depth(len(leaves))) - len(leaves))
    levels = [level]
    while len(level) > 1:
        level = [_sha(level[k] + level[k + 1]) for k in range(0, len(level), 2)]
        levels.append(level)
    return levels


def _fold_path(leaf: bytes, index: int, siblings: Sequence[bytes]) -> bytes:
    node = leaf
    for sibling in siblings:
        node = _sha(sibling + node) if index & 1 else _sha(node + sibling)
        index >>= 1
    return node


def slice_bundle(blobs: Sequence[bytes], steps: int | None = None) -> tuple[bytes, bytes]:
    """``(bundle, reference)`` of a replica's slice blobs of one stage.

    bundle    = ``b"dlx-bundle/1" || u32 A || A records || slice blobs in order``, record j =
                ``sha256(b_j) || u64 offset || u64 size || tree_depth(A) siblings`` (its Merkle path);
    reference = ``b"dlx-slices/2" || u32 A || sha256(bundle) || u64 len(bundle) || slices root``
                (88 bytes whatever A), what the contribution envelope signs; with ``steps`` (a
                time-bounded run) ``b"dlx-slices/3" || the same || u32 steps``, and every slice blob
                must declare that count (:func:`read_slice`).
    """
    count = len(blobs)
    if not 1 <= count <= MAX_SLICES or any(len(blob) < 1 for blob in blobs):
        raise SliceError(f"a bundle holds 1..{MAX_SLICES} non-empty slice blobs, got {count}")
    offset = len(BUNDLE_PREFIX) + 4 + count * record_size(count)
    heads = []
    for blob in blobs:
        heads.append((_sha(blob), offset, len(blob)))
        offset += len(blob)
    levels = _tree_levels([slice_leaf(j, *head) for j, head in enumerate(heads)])
    records = []
    for j, head in enumerate(heads):
        siblings = [levels[level][(j >> level) ^ 1] for level in range(len(levels) - 1)]
        records.append(_RECORD_HEAD.pack(*head) + b"".join(siblings))
    bundle = BUNDLE_PREFIX + struct.pack(">I", count) + b"".join(records) + b"".join(blobs)
    fields = _REFERENCE.pack(count, _sha(bundle), len(bundle), levels[-1][0])
    if steps is None:
        return bundle, REFERENCE_PREFIX + fields
    if type(steps) is not int or not 1 <= steps <= MAX_DECLARED_STEPS:
        raise SliceError(
            f"declared inner steps {steps!r}: must be a whole number in [1, {MAX_DECLARED_STEPS}]"
        )
    return bundle, DECLARED_REFERENCE_PREFIX + fields + _STEPS.pack(steps)


def parse_slice_reference(data: bytes, num_slices: int, max_bundle_bytes: int) -> SliceReference:
    """A contribution's reference for a plan of ``num_slices`` slices; SliceError on anything else.

    Both versions parse (the run's range of declared steps is the aggregation's to check)."""
    steps = None
    if len(data) == len(REFERENCE_PREFIX) + _REFERENCE.size and data.startswith(REFERENCE_PREFIX):
        pass
    elif (len(data) == len(DECLARED_REFERENCE_PREFIX) + _REFERENCE.size + _STEPS.size
          and data.startswith(DECLARED_REFERENCE_PREFIX)):
        (steps,) = _STEPS.unpack_from(data, len(DECLARED_REFERENCE_PREFIX) + _REFERENCE.size)
        if not 1 <= steps <= MAX_DECLARED_STEPS:
            raise SliceError(f"slice reference declares {steps} inner steps (1..{MAX_DECLARED_STEPS})")
    else:
        raise SliceError("slice reference: wrong size or prefix")
    count, digest, size, root = _REFERENCE.unpack_from(data, len(REFERENCE_PREFIX))
    if count != num_slices:
        raise SliceError(f"slice reference names {count} slices, the plan has {num_slices}")
    smallest = len(BUNDLE_PREFIX) + 4 + count * (record_size(count) + 1)  # every slice at least one byte
    if not smallest <= size <= max_bundle_bytes:
        raise SliceError(f"slice reference: a bundle of {size} bytes ({smallest}..{max_bundle_bytes})")
    return SliceReference(count, digest, size, root, steps)


def reference_steps(blob: bytes) -> int | None:
    """The inner steps a contribution envelope's blob declares, whatever the exchange: a version-3 slice
    reference's count, or a codec blob's (codec_wire version 2); None for neither (never raises)."""
    if blob.startswith(DECLARED_REFERENCE_PREFIX):
        if len(blob) != len(DECLARED_REFERENCE_PREFIX) + _REFERENCE.size + _STEPS.size:
            return None
        (steps,) = _STEPS.unpack_from(blob, len(DECLARED_REFERENCE_PREFIX) + _REFERENCE.size)
        return steps if 1 <= steps <= MAX_DECLARED_STEPS else None
    if blob.startswith(REFERENCE_PREFIX):
        return None
    return header_steps(blob)


def counted_steps(blob: bytes, steps_range: tuple[int, int]) -> int:
    """What a closed contribution counts in a time-bounded run's record (its ``tokens``, the close's
    ``steps``): the inner steps its envelope's ``blob`` declares (:func:`reference_steps`) inside the run's
    ``(min_inner_steps, inner_steps)``, else 0 (the aggregation excludes it: ``bad_steps``)."""
    steps = reference_steps(blob)
    return steps if steps is not None and steps_range[0] <= steps <= steps_range[1] else 0


def slice_declares(blob: bytes, reference: SliceReference) -> bool:
    """Whether a slice blob declares what its reference does: the same inner steps (codec_wire version 2)
    under a version-3 reference, none under a version-2 one. A slice that does not is not the one its
    signer's reference vouches for (an absent input, as a slice its record does not prove)."""
    return header_steps(blob) == reference.steps


def parse_slice_record(record: bytes, reference: SliceReference, slice_index: int) -> tuple[bytes, int, int]:
    """``(sha256, offset, size)`` of slice ``slice_index`` from its bundle record, checked against the
    reference (its Merkle path to the signed root, a range inside the bundle's slice area)."""
    count = reference.num_slices
    if not 0 <= slice_index < count or len(record) != record_size(count):
        raise SliceError(f"slice record {slice_index}: {len(record)} bytes, expected {record_size(count)}")
    digest, offset, size = _RECORD_HEAD.unpack_from(record)
    head = _RECORD_HEAD.size
    siblings = [record[head + 32 * k:head + 32 * (k + 1)] for k in range(tree_depth(count))]
    if (
        _fold_path(slice_leaf(slice_index, digest, offset, size), slice_index, siblings)
        != reference.slices_root
    ):
        raise SliceError(
            f"slice record {slice_index}: its Merkle path does not lead to the signed slices root"
        )
    first = len(BUNDLE_PREFIX) + 4 + count * record_size(count)
    if size < 1 or offset < first or offset + size > reference.bundle_size:
        raise SliceError(f"slice record {slice_index}: bytes {offset}+{size} outside the bundle's slices")
    return digest, offset, size


def read_slice(bundle: bytes, reference: SliceReference, slice_index: int) -> bytes | None:
    """Slice ``slice_index`` of a whole bundle as a range reader gets it: its record must prove to the
    reference's root, its bytes match the record and declare the reference's steps (:func:`slice_declares`);
    None otherwise (that input is absent)."""
    offset, length = record_range(reference.num_slices, slice_index)
    try:
        digest, start, size = parse_slice_record(bundle[offset:offset + length], reference, slice_index)
    except SliceError:
        return None
    blob = bundle[start:start + size]
    return blob if _sha(blob) == digest and slice_declares(blob, reference) else None


def bundle_slices(bundle: bytes, reference: SliceReference) -> list[bytes | None]:
    """Every slice of a whole bundle, each as :func:`read_slice` decides (the auditor's read, and an
    aggregator's when a provider's ranges do not check). SliceError if it is not the referenced bundle."""
    if _sha(bundle) != reference.bundle_digest or len(bundle) != reference.bundle_size:
        raise SliceError("bundle does not match its reference")
    return [read_slice(bundle, reference, j) for j in range(reference.num_slices)]


def rerun_claim(bundle: bytes, reference: SliceReference) -> bytes:
    """What a rerun compares a sliced contribution with: the msgpack array of the slice blobs its bundle
    proves, which is what the sliced encoder returns
    (:class:`training.butterfly.SlicedErrorFeedbackCompressor`), so a bit-exact rerun gives the same bytes.
    SliceError if it is not the referenced bundle or a slice does not check (the node's spot checker and the
    audit's ``--reexecute`` both read claims so)."""
    import msgpack

    slices = bundle_slices(bundle, reference)
    bad = [j for j, blob in enumerate(slices) if blob is None]
    if bad:
        raise SliceError(f"bundle does not prove slices {bad}")
    return msgpack.packb(slices, use_bin_type=True)
