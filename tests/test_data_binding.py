"""The run's data as the chain binds it, on the training side (issue 78; training/data_binding.py): the
token-id chunk leaves, the keyed windows, and a prepared dataset's leaves and batches, which are those of the
same ids in memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ledger.chunkproof import tree_root
from rulebook.data_windows import batch_depth, batch_words, window_offset
from training.chunks import leaf_values
from training.data import corpus_from_ids
from training.data_binding import batch_leaves, claim_batches, data_leaves, id_leaves, key_window_offsets
from training.errors import DataError
from training.sharded_corpus import open_dataset
from training.shards import ShardWriter

KEY = bytes.fromhex("ab" * 20)


def test_id_leaves_are_chunk_leaves_of_the_ids():
    ids = torch.arange(130, dtype=torch.int64) * 33_000  # past 16 bits
    leaves = id_leaves(ids)
    assert len(leaves) == 3
    values = []
    for chunk, leaf in enumerate(leaves):
        (tensor, offset, cols, count), words = leaf_values(leaf)
        assert (tensor, offset, cols, count) == (0, 64 * chunk, 1, min(64, 130 - 64 * chunk))
        values += words
    assert values == ids.tolist()
    batch = ids[:12].view(3, 4)
    assert leaf_values(batch_leaves(batch)[0])[0] == (0, 0, 4, 12)
    with pytest.raises(DataError, match="token ids"):
        id_leaves(torch.tensor([-1]))
    with pytest.raises(DataError, match="token ids"):
        id_leaves(np.array([2**32]))


def test_keyed_windows_are_the_rulebooks_and_refuse_bad_arguments():
    offsets = key_window_offsets(5, KEY, 3, 4, 2, 1000)
    assert offsets == [[window_offset(5, KEY, 3, k, b, 1000) for b in range(2)] for k in range(4)]
    assert all(0 <= o < 1000 for row in offsets for o in row)
    assert key_window_offsets(5, KEY, 3, 2, 2, 1000) == offsets[:2]  # a step's windows: not the step count's
    for args, match in (((5, KEY[:19], 3, 4, 2, 1000), "20-byte"), ((-1, KEY, 3, 4, 2, 1000), "seed"),
                        ((5, KEY, 2**64, 4, 2, 1000), "round"), ((5, KEY, 3, 0, 2, 1000), "steps"),
                        ((5, KEY, 3, 4, 2, 0), "window start")):
        with pytest.raises(DataError, match=match):
            key_window_offsets(*args)
    assert [batch_depth(s) for s in (1, 2, 3, 4, 5, 100)] == [0, 1, 2, 2, 3, 7]
    assert batch_words([b"\x01" * 32] * 3) == [b"\x01" * 32] * 3 + [bytes(32)]


def test_a_prepared_dataset_gives_the_same_leaves_and_batches_as_its_ids_in_memory(tmp_path):
    ids = np.arange(5_000, dtype=np.int64) * 7 % 3_000
    writer = ShardWriter(tmp_path, vocab_size=3_000, shard_tokens=700)  # the windows cross shards
    writer.append(ids)
    writer.finish("bytes", eval_start=4_500)
    dataset = open_dataset(tmp_path)
    memory = corpus_from_ids(torch.from_numpy(ids), "00" * 32, eval_fraction=0.1)
    assert memory.split_tokens("train") == dataset.split_tokens("train") == 4_500
    assert tree_root(data_leaves(dataset)) == tree_root(data_leaves(memory))
    for a, b in zip(claim_batches(dataset, 9, KEY, 2, 3, 4, 16), claim_batches(memory, 9, KEY, 2, 3, 4, 16),
                    strict=True):
        assert a.shape == (4, 17) and torch.equal(a, b)
