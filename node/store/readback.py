"""A stage's global state read back from the checkpoint files that hold its bytes (issue 75: disk per node).

With the outer state on disk (``storage.outer_state = "disk"``, training/stage_engine_outer.py) the engine's
global weights and momentum after round ``t`` are a file without a name (2 x the stage's bytes), held by the
engine until its next outer step and by the node for the rounds after it (the state a re-entry or a fork of
round ``t + 1`` starts from: node/live/round/finisher.py, node/live/record/forkrepair.py). On a checkpoint
round the node writes the very same tensors to its stage shard, and its committer to the round's full
checkpoint: the same float32 bytes, twice on disk. :func:`read_back` points the engine's mappings
(:class:`training.spilled.SpilledTensors`) at the shard once it is written, so the unnamed file's blocks go;
:func:`moved` points every mapping that reads a shard at the round's full checkpoint once that is written
from this node's shard (in a one-stage run the newest committed round keeps only the full file:
node/store/retention.py ``redundant_shards``).

Bits: a mapping is moved only onto a file written from it (the shard: :func:`write_checkpoint` streams the
mapping's own tensors) or built from that file's verified bytes (the full checkpoint, when the builder took
this node's shard for the stage), each tensor at the offset its safetensors header gives, with the same
name, dtype and shape, or not at all. The checkpoint files are never written in place (written under a
temporary name, renamed, hard-linked read-only into the blob store); a pruned one stays readable through the
open descriptor (its blocks then count as before, no more). Nothing of this is read after a restart.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch

from training.spilled import SpilledTensors

logger = logging.getLogger(__name__)

#: The checkpoint's tensor names of each part (node/store/checkpoint.py, ``CheckpointTensors``).
PARTS = ("weights.", "momentum.")

_lock = threading.Lock()
# resolved path -> the mappings reading from it, each with its prefix in the file
_readers: dict[str, list[tuple[weakref.ref, str]]] = {}


def float32_offsets(fd: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (absolute offset of its data, shape) of every float32 tensor in the safetensors file ``fd``
    (its header only is read). ValueError if the header is not one of that file."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise ValueError(f"{size} bytes: not a safetensors file")
    length = struct.unpack("<Q", head)[0]
    if length > min(size - 8, 100 << 20):
        raise ValueError(f"a header of {length} bytes in a file of {size}")
    header = json.loads(os.pread(fd, length, 8))
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry.get("dtype") != "F32":
            continue
        start, end = entry["data_offsets"]
        shape = tuple(int(n) for n in entry["shape"])
        if not (0 <= start and end == start + 4 * math.prod(shape) and 8 + length + end <= size):
            raise ValueError(f"{name!r}: data offsets {start}, {end} do not fit the file")
        out[name] = (8 + length + start, shape)
    return out


def read_back(path: Path, parts: Mapping[str, Mapping[str, torch.Tensor]]) -> bool:
    """Read each mapping of ``parts`` (prefix in the file -> the mapping: ``{"weights.": .., "momentum.":
    ..}``) from the checkpoint file ``path`` from now on, where it is a spilled one whose every tensor the
    file holds under ``prefix + name`` as float32 of its shape (module docstring: the caller's word that the
    bytes are the same); the others are left as they are. True if every spilled one moved."""
    spilled = {prefix: part for prefix, part in parts.items() if isinstance(part, SpilledTensors)}
    if not spilled:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        logger.debug("%s not opened to read the state back from: %s", path, exc)
        return False
    moved = True
    try:
        where = float32_offsets(fd)
        for prefix, part in spilled.items():
            offsets = {}
            for name in part:
                found = where.get(prefix + name)
                if found is None or found[1] != tuple(part.shape_of(name)):
                    raise ValueError(f"{prefix}{name} is not in the file as float32 of its shape")
                offsets[name] = found[0]
            part.read_from(os.dup(fd), offsets)
            with _lock:
                _readers.setdefault(str(Path(path).resolve()), []).append((weakref.ref(part), prefix))
    except (OSError, ValueError) as exc:
        logger.warning("state not read back from %s (its own file kept): %s", path, exc)
        moved = False
    finally:
        os.close(fd)
    _purge()
    return moved


def moved(old: Path, new: Path) -> int:
    """Read every mapping that reads ``old`` (:func:`read_back`) from ``new`` from now on: a file holding the
    same bytes under the same names (a full checkpoint built from this node's shard ``old``). How many
    moved."""
    with _lock:
        readers = _readers.pop(str(Path(old).resolve()), [])
    count = 0
    for ref, prefix in readers:
        part = ref()
        if part is not None and read_back(new, {prefix: part}):
            count += 1
    return count


def _purge() -> None:
    """Forget the files whose every reader is gone."""
    with _lock:
        for key in list(_readers):
            _readers[key] = [(ref, prefix) for ref, prefix in _readers[key] if ref() is not None]
            if not _readers[key]:
                del _readers[key]
