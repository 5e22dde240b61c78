"""Canonical hashes of stage weights.

A replica, the aggregator and a later auditor must agree on "the global weights
of stage s after round t" without shipping the weights around, so the weights
are named by a sha256 over a byte layout that depends only on the tensors'
names, dtypes, shapes and values, never on the platform, the memory layout
(strides) or the insertion order of the dict.

Layout of :func:`stage_weights_hash` (all integers little-endian)::

    b"dlx-weights-v1"                      14 bytes, domain separation
    u32  number of tensors
    for each tensor, names in ascending order of their UTF-8 bytes:
        u32  len(name_utf8)      then name_utf8
        u8   len(dtype_tag)      then dtype_tag (ASCII, e.g. b"float32")
        u32  ndim                then each dim as u64
        u64  len(data)           then data: the row-major (C-contiguous)
                                 elements, each as its little-endian bytes

Layout of :func:`weights_root`::

    b"dlx-weights-root-v1" || u32 number of stages || hash_0 || hash_1 || ...

with the 32-byte stage hashes in stage-index order. Both digests are sha256.
The bytes of a float are hashed as they are, so ``-0.0`` and ``0.0`` (or two NaN
payloads) hash differently: the hash certifies bit-exact weights.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
from collections.abc import Mapping

import numpy as np
import torch

from training.errors import WeightsHashError

logger = logging.getLogger(__name__)

WEIGHTS_MAGIC = b"dlx-weights-v1"
ROOT_MAGIC = b"dlx-weights-root-v1"
HASH_SIZE = 32

# dtype -> (tag written into the hash, integer dtype of the same width used to
# reinterpret the bits; little-endian conversion is done on those integers).
_DTYPE_TAGS: dict[torch.dtype, tuple[bytes, torch.dtype]] = {
    torch.float32: (b"float32", torch.int32),
    torch.float64: (b"float64", torch.int64),
    torch.float16: (b"float16", torch.int16),
    torch.bfloat16: (b"bfloat16", torch.int16),
    torch.int64: (b"int64", torch.int64),
    torch.int32: (b"int32", torch.int32),
    torch.int16: (b"int16", torch.int16),
    torch.int8: (b"int8", torch.int8),
    torch.uint8: (b"uint8", torch.uint8),
    torch.bool: (b"bool", torch.uint8),
}


def tensor_le_bytes(tensor: torch.Tensor) -> bytes:
    """Row-major little-endian bytes of ``tensor``'s elements (any strides, any host)."""
    return tensor_le_array(tensor).tobytes()


def tensor_le_array(tensor: torch.Tensor) -> np.ndarray:
    """:func:`tensor_le_bytes` as a C-contiguous array (hashed or joined through the buffer protocol, without
    a copy)."""
    if tensor.dtype not in _DTYPE_TAGS:
        raise WeightsHashError(f"dtype {tensor.dtype} has no canonical hash layout")
    _, int_dtype = _DTYPE_TAGS[tensor.dtype]
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if tensor.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.dtype != int_dtype:
        flat = flat.view(int_dtype)
    array = flat.numpy()
    if sys.byteorder != "little" and array.dtype.itemsize > 1:
        array = array.byteswap()
    return array


def stage_weights_hash(named_tensors: Mapping[str, torch.Tensor]) -> bytes:
    """sha256 (32 bytes) of ``named_tensors`` in the layout of this module's docstring."""
    digest = weights_digest(len(named_tensors))
    for name in sorted(named_tensors, key=lambda n: n.encode("utf-8")):
        hash_tensor_into(digest, name, named_tensors[name])
    return digest.digest()


def weights_digest(count: int):
    """A sha256 fed :func:`stage_weights_hash`'s header for ``count`` tensors: feed each tensor in name
    order with :func:`hash_tensor_into` (a stage hashed a tensor at a time, training/cluster_engine.py)."""
    digest = hashlib.sha256()
    digest.update(WEIGHTS_MAGIC)
    digest.update(struct.pack("<I", count))
    return digest


def hash_tensor_into(digest, name: str, tensor: torch.Tensor) -> None:
    """Feed one named tensor to a :func:`stage_weights_hash` digest (module docstring's layout)."""
    if not isinstance(tensor, torch.Tensor):
        raise WeightsHashError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.dtype not in _DTYPE_TAGS:
        raise WeightsHashError(f"{name!r}: dtype {tensor.dtype} has no canonical hash layout")
    name_bytes = name.encode("utf-8")
    tag, _ = _DTYPE_TAGS[tensor.dtype]
    data = tensor_le_array(tensor)
    digest.update(struct.pack("<I", len(name_bytes)))
    digest.update(name_bytes)
    digest.update(struct.pack("<B", len(tag)))
    digest.update(tag)
    digest.update(struct.pack("<I", tensor.dim()))
    for dim in tensor.shape:
        digest.update(struct.pack("<Q", dim))
    digest.update(struct.pack("<Q", data.nbytes))
    digest.update(data)


def weights_root(stage_hashes: list[bytes]) -> bytes:
    """sha256 over the per-stage hashes in stage-index order (the whole model's weights)."""
    digest = hashlib.sha256()
    digest.update(ROOT_MAGIC)
    digest.update(struct.pack("<I", len(stage_hashes)))
    for index, stage_hash in enumerate(stage_hashes):
        if not isinstance(stage_hash, (bytes, bytearray)) or len(stage_hash) != HASH_SIZE:
            raise WeightsHashError(f"stage hash {index} is not {HASH_SIZE} bytes")
        digest.update(bytes(stage_hash))
    return digest.digest()
