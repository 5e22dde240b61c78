"""The engine's spilled global state read back from the checkpoint files that hold its bytes (issue 75).

node/store/readback.py: a stage's global weights and momentum, each an unnamed file
(training/spilled.py ``SpilledTensors``), are read from the stage shard once it is written from them, and
from the round's full checkpoint once that is built from the shard; their own files' blocks go. Real files,
the real checkpoint writer; the same bits before and after, a file that does not hold them refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from node.store.checkpoint import Checkpoint, write_checkpoint
from node.store.readback import moved, read_back
from training.spilled import SpilledTensors, spill_float32


def _state(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    weights = {"b.weight": torch.randn(5, 3, generator=generator),
               "a.bias": torch.randn(7, generator=generator)}
    weights["c.empty"] = torch.zeros(0)
    momentum = {name: torch.randn(value.shape, generator=generator) for name, value in weights.items()}
    return weights, momentum


def _checkpoint(weights, momentum, stage_hashes=None) -> Checkpoint:
    return Checkpoint(1, 3, {"preset": "test"}, b"\x01" * 32, stage_hashes or {0: b"\x02" * 32}, weights,
                      momentum)


def _unnamed_files(directory: Path) -> int:
    """Files without a name under ``directory`` this process holds open (each once)."""
    root = str(directory.resolve())
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(root + os.sep) and target.endswith(" (deleted)"):
                inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            continue
    return len(inodes)


def _bits(tensors) -> dict[str, bytes]:
    return {name: tensors[name].numpy().tobytes() for name in tensors}


def test_the_spilled_state_is_read_from_the_shard_and_then_the_full_checkpoint_with_the_same_bits(tmp_path):
    weights, momentum = _state(0)
    spill = tmp_path / "outer-state"
    held = (spill_float32(weights, spill), spill_float32(momentum, spill))
    before = [_bits(part) for part in held]
    assert _unnamed_files(spill) == 2
    shard = tmp_path / "checkpoints" / "shard-00000003-stage0.safetensors"
    write_checkpoint(shard, _checkpoint(*held))
    assert read_back(shard, {"weights.": held[0], "momentum.": held[1]})
    assert _unnamed_files(spill) == 0  # the spilled files' blocks went
    assert [_bits(part) for part in held] == before
    # the full checkpoint (other metadata, so other offsets) built from the shard's bytes
    full = tmp_path / "checkpoints" / "round-00000003.safetensors"
    write_checkpoint(full, _checkpoint(*held, {0: b"\x02" * 32, 1: b"\x03" * 32}))
    assert moved(shard, full) == 2
    shard.unlink()  # the retention drops the shard the full file repeats
    assert _unnamed_files(tmp_path / "checkpoints") == 0  # nothing reads the shard any more
    assert [_bits(part) for part in held] == before
    full.unlink()  # pruned while still held: read through the open file, counted as a file without a name
    assert [_bits(part) for part in held] == before
    assert _unnamed_files(tmp_path / "checkpoints") == 1


@pytest.mark.parametrize("other", ["other shape", "missing tensor", "renamed part"])
def test_a_file_that_does_not_hold_the_tensors_leaves_the_state_in_its_own_file(tmp_path, other):
    weights, momentum = _state(1)
    spill = tmp_path / "outer-state"
    held = spill_float32(weights, spill)
    before = _bits(held)
    written = dict(weights)
    if other == "other shape":
        written["b.weight"] = torch.zeros(3, 5)
    elif other == "missing tensor":
        del written["a.bias"]
    path = tmp_path / "shard.safetensors"
    write_checkpoint(path, _checkpoint(written, {n: v for n, v in momentum.items() if n in written}))
    prefix = "momentum_not." if other == "renamed part" else "weights."
    assert not read_back(path, {prefix: held})
    assert _unnamed_files(spill) == 1  # still its own file
    assert _bits(held) == before


def test_a_file_cut_short_after_the_move_is_refused_not_read(tmp_path):
    weights, momentum = _state(2)
    held = spill_float32(weights, tmp_path / "outer-state")
    path = tmp_path / "shard.safetensors"
    write_checkpoint(path, _checkpoint(weights, momentum))
    assert read_back(path, {"weights.": held})
    os.chmod(path, 0o644)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 4)
    with pytest.raises(OSError, match="refused"):
        held["b.weight"]


def test_a_mapping_held_in_ram_is_left_as_it_is(tmp_path):
    weights, momentum = _state(3)
    path = tmp_path / "shard.safetensors"
    write_checkpoint(path, _checkpoint(weights, momentum))
    assert not read_back(path, {"weights.": weights, "momentum.": momentum})
    assert not isinstance(weights, SpilledTensors)
