"""A round's full checkpoint written one tensor at a time: the same bytes, one stage held (issue 75).

A node assembles every checkpoint round's full checkpoint from the stages' verified shards. It held every
stage's weights and momentum in RAM to write it (safetensors' ``save_file`` writes from every tensor's memory
at once): 8 bytes per parameter of the whole model, S times a stage of an S-stage run. Now each verified
stage waits in an unnamed file (training/spilled.py) and the file is written a tensor at a time
(node/store/safetensors_stream.py). These tests check that the bytes are safetensors' own, for random
tensors and for a checkpoint built from spilled stages, and that writing holds about one tensor.
"""

from __future__ import annotations

import io
import random
import tracemalloc

import pytest
import torch
from safetensors.torch import save

from node.store.checkpoint import Checkpoint, build_checkpoint, read_checkpoint, write_checkpoint
from node.store.safetensors_stream import safetensors_header, write_safetensors
from training.spilled import ChainedTensors, spill_float32


def test_the_streamed_file_is_safetensors_own_bytes():
    rng = random.Random(3)
    names = ["weights.", "momentum.", "a", "Z", "layers.1.", "layers.10.", "é", "_"]
    for _ in range(40):
        tensors = {}
        for _ in range(rng.randrange(1, 10)):
            shape = [rng.randrange(0, 6) for _ in range(rng.randrange(0, 4))]  # scalars and empty ones too
            tensors[rng.choice(names) + str(rng.randrange(50))] = torch.randn(shape)
        metadata = {"dlx": '{"q":"a\\"b","x":[1,2]}' + "y" * rng.randrange(9)} if rng.random() < 0.8 else None
        out = io.BytesIO()
        write_safetensors(out, tensors, metadata)
        assert out.getvalue() == save(tensors, metadata=metadata), (list(tensors), metadata)


def test_what_the_stream_cannot_write_as_safetensors_does_is_refused():
    with pytest.raises(ValueError, match="one metadata key at most"):
        safetensors_header({"a": (1,)}, {"a": "1", "b": "2"})
    with pytest.raises(ValueError, match="not float32"):
        write_safetensors(io.BytesIO(), {"a": torch.zeros(2, dtype=torch.float64)}, None)
    with pytest.raises(ValueError, match="not float32"):  # a spilled shape that is not the tensor's
        write_safetensors(io.BytesIO(), {"a": torch.zeros(2)}, None, shapes=lambda name: (3,))


def _stages(count: int, seed: int = 0, rows: int = 64) -> dict[int, tuple[dict, dict]]:
    generator = torch.Generator().manual_seed(seed)
    states = {}
    for stage in range(count):
        weights = {f"layers.{stage}.{kind}": torch.randn(rows, 48, generator=generator) for kind in "abcd"}
        weights[f"layers.{stage}.norm"] = torch.randn(48, generator=generator)
        states[stage] = (weights, {n: t * 0.5 for n, t in weights.items()})
    return states


class _Layout:
    run_id, config_hash, num_stages = 3, b"\x07" * 32, 4
    model_config = {"preset": "test", "n_layer": 4}


def test_a_checkpoint_built_from_spilled_stages_is_the_same_file_and_reads_back(tmp_path):
    states = _stages(4)
    in_ram = build_checkpoint(_Layout, 9, states, {s: bytes([s]) * 160 for s in range(4)})
    spilled = {s: (spill_float32(w, tmp_path), spill_float32(m, tmp_path)) for s, (w, m) in states.items()}
    streamed = build_checkpoint(_Layout, 9, spilled, {s: bytes([s]) * 160 for s in range(4)})
    assert isinstance(streamed.weights, ChainedTensors)
    assert streamed.stage_hashes == in_ram.stage_hashes
    want = Checkpoint(3, 9, _Layout.model_config, _Layout.config_hash, in_ram.stage_hashes,
                      dict(in_ram.weights), dict(in_ram.momentum), in_ram.stage_leaves).to_bytes()
    digest = write_checkpoint(tmp_path / "spilled.safetensors", streamed)
    assert (tmp_path / "spilled.safetensors").read_bytes() == want
    assert write_checkpoint(tmp_path / "ram.safetensors", in_ram) == digest
    back = read_checkpoint(tmp_path / "spilled.safetensors", digest)
    assert back.stage_hashes == in_ram.stage_hashes and back.stage_leaves == in_ram.stage_leaves
    for name, tensor in in_ram.weights.items():
        assert torch.equal(back.weights[name], tensor)
        assert torch.equal(back.momentum[name], in_ram.momentum[name])


def test_writing_a_spilled_checkpoint_holds_about_one_tensor(tmp_path):
    states = _stages(4, seed=1, rows=10000)  # 1.8 MiB tensors, 59 MiB in all
    total = sum(4 * t.numel() for w, m in states.values() for t in (*w.values(), *m.values()))
    largest = 4 * 10000 * 48
    spilled = {s: (spill_float32(w, tmp_path), spill_float32(m, tmp_path)) for s, (w, m) in states.items()}
    del states
    full = build_checkpoint(_Layout, 2, spilled)
    tracemalloc.start()
    try:
        write_checkpoint(tmp_path / "c.safetensors", full)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # each spilled tensor is read into a fresh buffer when written and let go before the next; the file is
    # then hashed in 4 MiB reads (p2p.blobstore.hash_file: two such reads alive at a time)
    assert peak < (8 << 20) + 3 * largest < total // 3, (peak, largest, total)
