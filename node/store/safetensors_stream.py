"""float32 safetensors files written one tensor at a time: byte for byte what safetensors writes (issue 75).

``safetensors.torch.save_file`` needs every tensor in memory at once (it writes from their pointers). A node
assembling a round's full checkpoint held every stage's weights and momentum so (8 bytes per parameter of the
whole model, S times a stage of an S-stage run). :func:`write_safetensors` writes the same file from a
mapping whose tensors are read one at a time (a spilled stage stays in its file until its tensor is written).

The layout it reproduces (safetensors 0.4+, checked against ``save_file`` in tests/test_checkpoint_stream.py):
an 8-byte little-endian header length, the header (compact JSON: ``__metadata__`` first, then each tensor's
``{"dtype","shape","data_offsets"}`` in data order), padded with spaces to a multiple of 8 bytes, then the
tensors' little-endian data in ascending order of their names' bytes (every tensor here is float32, so the
dtype does not reorder them).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from typing import BinaryIO

import torch

from training.hashing import tensor_le_array

_ALIGN = 8


def shape_of(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """A tensor's shape without reading it where the mapping can say it (a spilled one: ``shape_of``)."""
    known = getattr(tensors, "shape_of", None)
    return tuple(known(name)) if known is not None else tuple(tensors[name].shape)


def safetensors_header(shapes: Mapping[str, tuple[int, ...]], metadata: Mapping[str, str] | None
                       ) -> tuple[bytes, list[str]]:
    """``(the file's bytes before its data, the tensors' names in data order)`` for float32 tensors of
    ``shapes``. ``metadata``: at most one key (safetensors writes several in hash-map order, so their order
    would not be the file's)."""
    if metadata is not None and len(metadata) > 1:
        raise ValueError("one metadata key at most: safetensors orders several at random")
    order = sorted(shapes, key=lambda name: name.encode("utf-8"))
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        size = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _ALIGN)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(out: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None,
                      shapes: Callable[[str], tuple[int, ...]] | None = None) -> None:
    """Write ``tensors`` (float32) to ``out`` as safetensors writes them, one tensor read at a time.
    ``shapes``: each tensor's shape without reading it (default :func:`shape_of`)."""
    shape = shapes or (lambda name: shape_of(tensors, name))
    layout = {name: shape(name) for name in tensors}
    header, order = safetensors_header(layout, metadata)
    out.write(header)
    for name in order:
        tensor = tensors[name]
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != layout[name]:
            raise ValueError(f"{name!r}: {tensor.dtype} {tuple(tensor.shape)}, not float32 {layout[name]}")
        if tensor.numel():
            out.write(memoryview(tensor_le_array(tensor.detach().contiguous())).cast("B"))


def data_ranges(path) -> list[tuple[int, int]]:
    """``(offset, length)`` of each tensor's data in the safetensors file ``path``, ascending: what a blob
    store keeps as pieces shared with other packed blobs (p2p/blobpack.py). ValueError if the header is not
    a safetensors header of that file; only the header is read."""
    with open(path, "rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(0)
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: {size} bytes, not a safetensors file")
        length = struct.unpack("<Q", head)[0]
        if length > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: a header of {length} bytes in a file of {size}")
        header = json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not an object")
    base, out = 8 + length, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= size - base):
            raise ValueError(f"{path}: {name!r} has data offsets {start}, {end} outside the file")
        out.append((base + start, end - start))
    out.sort()
    if any(a + n > b for (a, n), (b, _m) in zip(out, out[1:])):
        raise ValueError(f"{path}: tensors' data overlap")
    return out
