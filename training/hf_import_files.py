"""The safetensors files of an import (training/hf_import.py) and of an export (training/export.py), one
tensor at a time: :class:`SafetensorsReader` reads each tensor's bytes with ``readinto`` into memory of its
own (no memory map whose pages would stay resident, no second full copy of the model);
:func:`stream_safetensors` writes a float32 file tensor by tensor and returns its sha256.
:class:`HFImportError` is the import's error."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

from training.errors import TrainingError


def all_finite(tensor: Any) -> bool:
    """``torch.isfinite(tensor).all()`` in pieces of 4M elements: the whole-tensor form holds temporaries of
    about twice the tensor's size (measured on a (32000, 2048) float32 embedding: +430 MB)."""
    return all(bool(piece.isfinite().all()) for piece in tensor.reshape(-1).split(1 << 22))


class HFImportError(TrainingError, ValueError):
    """The directory is not a model this project can start from (the message says why and what is)."""


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsReader:
    """A safetensors file read one tensor at a time into memory of its own (``readinto``; no memory map)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "rb")  # noqa: SIM115 (closed by close())
        try:
            size = self.handle.seek(0, os.SEEK_END)
            self.handle.seek(0)
            head = self.handle.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("no safetensors header")
            header = json.loads(self.handle.read(length))
            self.base = 8 + length
            self.entries = {k: v for k, v in header.items() if k != "__metadata__"}
            for name, entry in self.entries.items():
                begin, end = entry["data_offsets"]
                if entry["dtype"] not in _DTYPES or not 0 <= begin <= end <= size - self.base:
                    raise ValueError(f"{name}: dtype {entry['dtype']} or offsets {entry['data_offsets']}")
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            self.handle.close()
            raise HFImportError(f"{path}: not a safetensors file of float tensors ({exc})") from None

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_tensor(self, name: str) -> Any:
        import torch

        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        dtype = getattr(torch, _DTYPES[entry["dtype"]])
        shape = tuple(int(n) for n in entry["shape"])
        count = 1
        for n in shape:
            count *= n
        if count * torch.empty((), dtype=dtype).element_size() != end - begin:
            raise HFImportError(f"{self.path}: {name}: {end - begin} bytes for shape {shape}")
        tensor = torch.empty(shape, dtype=dtype)
        if count:
            self.handle.seek(self.base + begin)
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
            if self.handle.readinto(view) != end - begin:
                raise HFImportError(f"{self.path}: {name} is cut short")
        return tensor

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()



def stream_safetensors(out: Any, shapes: dict[str, tuple[int, ...]], tensor_of: Any,
                       metadata: dict[str, str] | None = None) -> str:
    """Write a float32 safetensors file to the binary handle ``out``, tensor by tensor in ``shapes``' order
    (``tensor_of(name)`` gives each; only one is held at a time); return the file's sha256."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    digest = hashlib.sha256()
    for piece in (struct.pack("<Q", len(encoded)), encoded):
        out.write(piece)
        digest.update(piece)
    for name, shape in shapes.items():
        tensor = tensor_of(name)
        if tuple(tensor.shape) != tuple(shape):
            raise HFImportError(f"{name} has shape {tuple(tensor.shape)}, the model needs {tuple(shape)}")
        tensor = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if not all_finite(tensor):
            raise HFImportError(f"{name} holds NaN or infinite values")
        data = memoryview(tensor.numpy()).cast("B") if tensor.numel() else b""
        out.write(data)
        digest.update(data)
        del tensor, data
    return digest.hexdigest()

