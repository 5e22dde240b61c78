"""Canonical weight hash: the documented byte layout, recomputed independently here."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from training.errors import WeightsHashError
from training.hashing import stage_weights_hash, weights_root


def _expected(named: dict[str, list[float] | list[list[float]]]) -> bytes:
    """The layout of training/hashing.py's docstring, written out by hand for float32 tensors."""
    out = b"dlx-weights-v1" + struct.pack("<I", len(named))
    for name in sorted(named, key=lambda n: n.encode()):
        rows = named[name]
        if rows and isinstance(rows[0], list):
            shape = (len(rows), len(rows[0]))
            flat = [v for row in rows for v in row]
        else:
            shape = (len(rows),)
            flat = list(rows)
        data = b"".join(struct.pack("<f", v) for v in flat)
        out += struct.pack("<I", len(name.encode())) + name.encode()
        out += struct.pack("<B", 7) + b"float32"
        out += struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<Q", len(data)) + data
    return hashlib.sha256(out).digest()


def test_hash_matches_the_documented_layout():
    values = {"b.weight": [[1.0, -2.5], [0.125, 3.0]], "a.bias": [0.5, -0.0, 7.0], "ü": [1.0]}
    tensors = {name: torch.tensor(v, dtype=torch.float32) for name, v in values.items()}
    digest = stage_weights_hash(tensors)
    assert len(digest) == 32
    assert digest == _expected(values)
    # Pinned so that an accidental change of the layout is caught even if both sides change.
    assert digest.hex() == "9abf78cdf7ae2c9c888755e20c58f4fe451e98348bd6877c1d15ecb10a09833c"


def test_hash_ignores_dict_order_and_strides_but_not_values():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = {"x": base, "y": torch.ones(2)}
    second = {"y": torch.ones(2), "x": base.t().contiguous().t()}  # same values, other strides
    assert stage_weights_hash(first) == stage_weights_hash(second)
    assert stage_weights_hash(first) != stage_weights_hash({"x": base.reshape(4, 3), "y": torch.ones(2)})
    assert stage_weights_hash({"z": torch.tensor([0.0])}) != stage_weights_hash({"z": torch.tensor([-0.0])})
    assert stage_weights_hash(first) != stage_weights_hash({"x": base.double(), "y": torch.ones(2)})


def test_weights_root_layout_and_errors():
    hashes = [bytes([i]) * 32 for i in range(3)]
    expected = hashlib.sha256(b"dlx-weights-root-v1" + struct.pack("<I", 3) + b"".join(hashes)).digest()
    assert weights_root(hashes) == expected
    assert weights_root(hashes[::-1]) != expected
    with pytest.raises(WeightsHashError):
        weights_root([b"short"])
    with pytest.raises(WeightsHashError):
        stage_weights_hash({"x": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(WeightsHashError):
        stage_weights_hash({"x": [1.0]})
