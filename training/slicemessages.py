"""The signed bytes of the sliced exchange (:mod:`training.butterfly`): slice messages and partial payloads.

Payloads (byte layouts; the node signs with its :mod:`p2p.identity` key):

* slice message (replica i to aggregator j, over the authenticated stream):
  ``b"dlx-slice/1" || u32 j || u32 A || signature (64) || slice blob``, the
  signature over :func:`slice_signing_bytes` (run, round, stage, i, j, A,
  sha256(blob)). Not a full :mod:`p2p.envelope` envelope: that costs ~190 bytes
  more per input, R times per aggregator, and the envelope validator allows one
  envelope per (sender, round, kind, stage), not A of them;
* partial (one :mod:`p2p.envelope` envelope per aggregator and stage, kind
  ``partial``, which fits that rule): ``b"dlx-partial/2" || u32 j || u32 A ||
  u32 R || inputs_root (32) || partial blob``, ``inputs_root`` the Merkle root
  of :func:`input_leaf` over the R inputs in canonical order, so the partial's
  signature binds exactly what went in and the aggregator can show the signed
  slices it used. (The live node binds the close's contributions root instead,
  the Merkle root of the closed envelope hashes: each signed envelope fixes its
  reference, which fixes every slice of its bundle: :mod:`training.slicebundle`; docs/PROTOCOL.md.)

:func:`check_partial` audits a partial by replaying its slice (:func:`training.butterfly.replay_partial`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from training.butterfly import replay_partial
from training.config_compression import CompressionConfig
from training.slice_plan import MAX_SLICES, SliceError, SlicePlan

SLICE_SIGNATURE_DOMAIN = b"dlx-slice-sig/1"
SLICE_PREFIX = b"dlx-slice/1"
PARTIAL_PREFIX = b"dlx-partial/2"
_EMPTY = bytes(32)


def _sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def slice_signing_bytes(
    run_id: int,
    outer_round: int,
    stage_index: int,
    replica: int,
    slice_index: int,
    num_slices: int,
    blob: bytes,
) -> bytes:
    """What replica i signs for its slice j: domain, run, round, stage, replica, j, A, sha256(blob).

    The domain prefix keeps this signature from being valid over anything else
    (an envelope's signing bytes start with ``b"dlx-envelope-v1"``).
    """
    return SLICE_SIGNATURE_DOMAIN + struct.pack(
        ">QQIIII", run_id, outer_round, stage_index, replica, slice_index, num_slices
    ) + _sha(blob)


def slice_message(slice_index: int, num_slices: int, signature: bytes, blob: bytes) -> bytes:
    """What a replica sends aggregator j: ``b"dlx-slice/1" || u32 j || u32 A || signature (64) || slice
    blob``."""
    if len(signature) != 64:
        raise SliceError("slice signature must be 64 bytes")
    return SLICE_PREFIX + struct.pack(">II", slice_index, num_slices) + signature + blob


def parse_slice_message(message: bytes, slice_index: int, num_slices: int) -> tuple[bytes, bytes]:
    """``(signature, blob)`` of a slice message for slice ``slice_index`` of ``num_slices``; SliceError
    otherwise.

    The caller checks the signature over :func:`slice_signing_bytes` with the
    sender's key (``p2p.identity.verify_signature``), then decodes the blob.
    """
    head = len(SLICE_PREFIX) + 8
    if len(message) < head + 64 or not message.startswith(SLICE_PREFIX):
        raise SliceError("slice message: too short or wrong prefix")
    index, count = struct.unpack_from(">II", message, len(SLICE_PREFIX))
    if index != slice_index or count != num_slices:
        raise SliceError(
            f"slice message for slice {index} of {count}, expected {slice_index} of {num_slices}"
        )
    return message[head:head + 64], message[head + 64:]


def input_leaf(replica: int, blob: bytes | None) -> bytes:
    """Leaf of a partial's inputs root: ``sha256(b"input" || u32 i || sha256(blob))``, 32 zero bytes for a
    missing one."""
    return _sha(b"input" + struct.pack(">I", replica) + (_EMPTY if blob is None else _sha(blob)))


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """Binary sha256 Merkle root; an odd node is carried up unchanged; no leaves: 32 zero bytes."""
    level = list(leaves)
    if not level:
        return _EMPTY
    while len(level) > 1:
        level = [
            _sha(level[k] + level[k + 1]) if k + 1 < len(level) else level[k] for k in range(0, len(level), 2)
        ]
    return level[0]


def inputs_root(slice_blobs: Sequence[bytes | None]) -> bytes:
    """The Merkle root a partial binds: :func:`input_leaf` of every input in canonical order."""
    return merkle_root([input_leaf(replica, blob) for replica, blob in enumerate(slice_blobs)])


@dataclass(frozen=True)
class Partial:
    """A parsed partial payload."""

    slice_index: int
    num_slices: int
    num_inputs: int
    inputs_root: bytes
    blob: bytes


def partial_payload(slice_index: int, num_slices: int, root: bytes, num_inputs: int, blob: bytes) -> bytes:
    """Payload of aggregator j's ``partial`` envelope (module docstring); ``root`` is the 32-byte inputs
    root (:func:`inputs_root` in process; the close's contributions root in the live node)."""
    if len(root) != 32:
        raise SliceError("the inputs root must be 32 bytes")
    return PARTIAL_PREFIX + struct.pack(">III", slice_index, num_slices, num_inputs) + root + blob


def parse_partial(payload: bytes) -> Partial:
    """Strictly parse a partial payload; SliceError on anything else."""
    head = len(PARTIAL_PREFIX) + 12 + 32
    if len(payload) < head or not payload.startswith(PARTIAL_PREFIX):
        raise SliceError("partial: too short or wrong prefix")
    index, count, inputs = struct.unpack_from(">III", payload, len(PARTIAL_PREFIX))
    if not 0 <= index < count <= MAX_SLICES:
        raise SliceError(f"partial: slice {index} of {count}")
    return Partial(index, count, inputs, payload[head - 32:head], payload[head:])


def check_partial(
    partial: Partial, slice_blobs: Sequence[bytes | None], plan: SlicePlan,
    cfg: CompressionConfig, stage_budget: int, *, norm_clip: float, stage_index: int, outer_round: int,
    steps_range: tuple[int, int] | None = None,
) -> str:
    """Audit one partial by replay: ``""`` if it is exactly what these inputs give, else the reason.

    Costs the slice's inputs (``~C`` bytes whatever R for ``A = R``) and one
    aggregation of one slice.
    """
    if partial.num_slices != plan.num_slices:
        return f"partial names {partial.num_slices} slices, the plan has {plan.num_slices}"
    if partial.num_inputs != len(slice_blobs):
        return f"partial binds {partial.num_inputs} inputs, the round has {len(slice_blobs)}"
    if inputs_root(slice_blobs) != partial.inputs_root:
        return "inputs root differs from the round's inputs"
    expected = replay_partial(
        slice_blobs, plan, partial.slice_index, cfg, stage_budget, norm_clip=norm_clip,
        stage_index=stage_index, outer_round=outer_round, steps_range=steps_range,
    )
    if expected != partial.blob:
        return (f"partial bytes differ from the replay (sha256 {_sha(partial.blob).hex()[:16]} != "
                f"{_sha(expected).hex()[:16]})")
    return ""
