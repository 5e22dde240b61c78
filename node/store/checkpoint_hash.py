"""What a round record's ``checkpointHash`` commits: the whole file, or a chunked run's header (issue 75).

The run document fixes the rule (``diloco.checkpoint_hash``, :attr:`RunLayout.header_hashed`):

* ``"file"`` (every run made before the rule existed, every hashed run, and by default every run whose
  checkpoint is under 512 MiB: the demo's): ``H = sha256(file)``, the whole safetensors file.
* ``"header"`` (a chunked run's; by default where the checkpoint is 512 MiB or more):
  ``H = sha256(HEADER_HASH_TAG || header)``, where ``header`` is the file's first ``8 + n`` bytes: its
  little-endian length field ``n`` and the ``n`` bytes of safetensors header JSON (every tensor's dtype,
  shape and data offsets, and the ``dlx`` metadata: run id, round, model config, tokenizer, config hash,
  every stage's weights hash and every stage's leaf). Each stage leaf commits the chunk roots of its
  stage's weights and outer momentum, and the record's weights root commits the leaves, so ``H`` and the
  record together commit every byte of the file, checked stage by stage against the leaves rather than
  by one sha256 of the whole.

The header is a function of the run document and the round's agreed stage hashes and leaves
(:func:`checkpoint_header`: the bytes ``write_checkpoint`` writes first), so a committer computes ``H``
having checked only the stages it holds, never downloading another stage's state. The tag keeps ``H``
apart from any blob's sha256: no served file's content hash is a header-hashed record's ``H``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from node.store.checkpoint import Checkpoint, RunLayout
from node.store.safetensors_stream import safetensors_header

HEADER_HASH_TAG = b"dlx-checkpoint-header-hash/v1"


def header_hash(header: bytes) -> bytes:
    """A header-hashed record's ``checkpointHash`` of the checkpoint whose first bytes are ``header``."""
    return hashlib.sha256(HEADER_HASH_TAG + header).digest()


def header_of(data: bytes) -> bytes | None:
    """The first ``8 + n`` bytes of a safetensors file's ``data`` (its length field and header), None if the
    length field does not fit in ``data``."""
    if len(data) < 8:
        return None
    length = int.from_bytes(data[:8], "little")
    return data[:8 + length] if 8 + length <= len(data) else None


def record_hash(data: bytes, header_hashed: bool) -> bytes:
    """The ``checkpointHash`` a record names for the checkpoint file ``data`` under the run's rule (a
    header-hashed rule over a file without a whole header: the hash of no header, never a record's)."""
    if not header_hashed:
        return hashlib.sha256(data).digest()
    header = header_of(data)
    return header_hash(header) if header is not None else hashlib.sha256(b"no header").digest()


def file_record_hash(path: str | Path, header_hashed: bool) -> bytes:
    """:func:`record_hash` of the file at ``path``: its header alone read where the rule is the header's, else
    the file hashed in reads."""
    from p2p.blobstore import hash_file

    if not header_hashed:
        return bytes.fromhex(hash_file(Path(path)))
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        size = handle.seek(0, 2)
        if length < 0 or 8 + length > size:
            return record_hash(head, True)
        handle.seek(8)
        return header_hash(head + handle.read(length))


def names_record(data: bytes, content_hash: bytes) -> bool:
    """Whether the file ``data`` is the one a record naming ``content_hash`` publishes under either rule (for
    a reader without the run document: the header-hashed rule vouches only for the header, so such a reader
    still checks every tensor against the leaves before trusting it)."""
    return record_hash(data, False) == content_hash or record_hash(data, True) == content_hash


def metadata_only(layout: RunLayout, round_index: int, stage_hashes: dict[int, bytes],
                  stage_leaves: dict[int, bytes]) -> Checkpoint:
    """The checkpoint of ``round_index`` with the run's metadata and no tensors (what its header says)."""
    return Checkpoint(layout.run_id, round_index, dict(layout.model_config), layout.config_hash,
                      dict(stage_hashes), {}, {}, dict(stage_leaves))


def checkpoint_header(layout: RunLayout, ckpt: Checkpoint) -> bytes:
    """The first bytes ``write_checkpoint`` writes for a checkpoint of the run with ``ckpt``'s metadata (its
    tensors are not read): every stage's ``weights.<name>`` and ``momentum.<name>`` as float32 of the run's
    shapes (the momentum of an outer-Adam run: both moments stacked) at the offsets safetensors gives them,
    and the metadata as ``Checkpoint`` writes it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for stage_shapes in layout.stage_shapes:
        for name, shape in stage_shapes.items():
            shapes[f"weights.{name}"] = tuple(shape)
            shapes[f"momentum.{name}"] = tuple(shape) if layout.outer_moments == 1 else (
                layout.outer_moments, *shape)
    header, _order = safetensors_header(shapes, ckpt._metadata())
    return header
