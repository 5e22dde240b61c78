"""The run's data as the chain binds it (issue 78; docs/FRAUD_PROOF.md "The data's binding").

A run claim (StepProver.claimRun) commits the batches its inner steps read, and anyone may dispute one
token of one of them against the run's data (StepProver.challengeData): the defender opens the token under
the claim's batch tree and the corpus's token it must be under the run's data root, and the contract
recomputes where the token comes from. This module makes both sides' leaves (bytes; the trees and roots are
``ledger``'s, made by the caller: this package knows no chain).

**The data root.** The training split's token ids (``split_tokens("train")`` of them: the ids before the
held-out tail, :mod:`training.data`) as one tensor of ids cut into the chunk leaves of training/chunks.py (64
ids a leaf; header ``u32 tensor 0, u64 offset, u64 cols 1, u32 count``, then each id a big-endian u32). Its
root is the run's ``DataTerms.root``, fixed by the run's creator with the program (``StepProver.setData``),
with the seed, the training split's length, the batch rows and the block size.

**The windows, keyed by the contributor's account.** Row ``b`` of step ``k``'s batch of the contribution made
by member account ``key`` (20 bytes) in round ``t`` starts at::

    offset = u64be(sha256(b"dlx-node/round-batches/v2" || u64be(run_seed) || key || u64be(t)
                          || u64be(k) || u64be(b))[:8]) % (len(train) - block_size)

and is the ``block_size + 1`` ids ``train[offset .. offset + block_size]`` (the inputs ``x`` and the
next-token targets ``y`` of :func:`training.data.round_batches`, overlapping by all but one id). The
formula is :func:`training.data.window_offsets`' with the replica index replaced by the account: the chain
knows a contribution's account (its round's factors list the member that signed it, and the aggregation
proof holds the signature to it) but not the replica index (a seat count of join events, in no contract's
state, and in no signed message), so an account is what it can recompute the windows from.

**The node's key.** A node draws its batches by these windows in a run with ``training.data_windows =
"account"`` (:func:`training.data.round_batches` given the 20 bytes; otherwise by the replica index). The key
is the replica's, one for all its stages (a split replica's stages read the same batch): the account of the
member that holds its stage 0, so a stage-0 contribution's key is its own signer's, the account the contract
checks a claim's ``dataKey`` against; a later stage's claim names it with its member's signature of it and the
stage-0 opening (docs/FRAUD_PROOF.md "The node's draw", "The replica's key").

**A step's batch** is one tensor of ids, ``(rows, block_size + 1)`` row-major (:func:`batch_leaves`): the
token tensor a program op reads as the step's data (StepProver ``DATA_INPUT``); the claim's ``batchRoot`` is
the tree of ``2**ceil(log2 steps)`` 32-byte leaves, leaf ``k`` step ``k``'s tensor root, zero past the steps
(``rulebook.data_windows.batch_words``).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from rulebook.data_windows import window_offset
from training.errors import DataError

CHUNK = 64
_HEADER = np.dtype([("tensor", ">u4"), ("offset", ">u8"), ("cols", ">u8"), ("count", ">u4")])


def id_leaves(ids, cols: int = 1, first: int = 0) -> list[bytes]:
    """The chunk leaves of a tensor of token ids (any shape, row-major; ``cols`` its matrix view's columns):
    tensor 0, 64 ids a leaf, each a big-endian u32; ``first``: the ids' offset in a longer tensor (a multiple
    of 64: its leaves continue that tensor's)."""
    if first % CHUNK:
        raise DataError(f"first={first}: a span of a longer tensor starts at a multiple of {CHUNK} ids")
    flat = np.ascontiguousarray(torch.as_tensor(ids).reshape(-1).numpy())
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) > 0xFFFFFFFF):
        raise DataError("token ids must be in [0, 2**32)")
    words = flat.astype(">u4")
    full, rest = divmod(words.size, CHUNK)
    leaves: list[bytes] = []
    if full:
        headers = np.zeros(full, dtype=_HEADER)
        headers["cols"], headers["count"] = cols, CHUNK
        headers["offset"] = first + np.arange(full, dtype=np.uint64) * CHUNK
        table = np.hstack([headers.view(np.uint8).reshape(full, -1),
                           words[:full * CHUNK].view(np.uint8).reshape(full, -1)])
        data = table.tobytes()
        width = table.shape[1]
        leaves = [data[i:i + width] for i in range(0, len(data), width)]
    if rest:
        offset = full * CHUNK
        leaves.append(struct.pack(">IQQI", 0, first + offset, cols, rest) + words[offset:].tobytes())
    return leaves


def train_ids(corpus) -> torch.Tensor:
    """The training split's token ids, whole (an in-memory corpus's tensor, a prepared dataset's read)."""
    train = getattr(corpus, "train", None)
    if isinstance(train, torch.Tensor):
        return train
    n = corpus.split_tokens("train")
    return corpus.split("train").windows(torch.tensor([0]), n)[0]


def data_leaves(corpus) -> list[bytes]:
    """The chunk leaves of the training split's ids: the run's data root is their tree's."""
    return id_leaves(train_ids(corpus))


#: Ids read at a time by :func:`iter_data_leaves` (8 MiB of int64).
SPAN = CHUNK * 16384


def iter_data_leaves(corpus, span: int = SPAN):
    """:func:`data_leaves`, one span of ``span`` ids (a multiple of 64) read at a time: a prepared dataset's
    training split is never held whole."""
    if span < CHUNK or span % CHUNK:
        raise DataError(f"span={span}: must be a positive multiple of {CHUNK}")
    train = getattr(corpus, "train", None)
    n = corpus.split_tokens("train")
    for start in range(0, n, span):
        length = min(span, n - start)
        ids = train[start:start + length] if isinstance(train, torch.Tensor) \
            else corpus.split("train").windows(torch.tensor([start]), length)[0]
        yield from id_leaves(ids, first=start)


def key_window_offsets(run_seed: int, key: bytes, round: int, steps: int, rows: int,
                       n_start: int) -> list[list[int]]:
    """Start offsets ``[step][row]`` of the windows of steps ``0 <= step < steps`` of the contribution made by
    account ``key`` (20 bytes) in ``round`` (``rulebook.data_windows.window_offset``; DataError for bad
    arguments)."""
    if steps < 1 or rows < 1:
        raise DataError(f"steps={steps}, rows={rows}: both must be >= 1")
    try:
        return [[window_offset(run_seed, key, round, step, row, n_start) for row in range(rows)]
                for step in range(steps)]
    except ValueError as exc:
        raise DataError(str(exc)) from None


def claim_batches(corpus, run_seed: int, key: bytes, round: int, steps: int, rows: int,
                  block_size: int) -> list[torch.Tensor]:
    """Each step's batch (LongTensor ``(rows, block_size + 1)``: row ``b`` the window at its offset) of the
    contribution made by ``key`` in ``round``; ``batch[:, :-1]`` and ``batch[:, 1:]`` are the step's ``x``
    and ``y``."""
    n_start = corpus.split_tokens("train") - block_size
    offsets = torch.tensor(key_window_offsets(run_seed, key, round, steps, rows, n_start))
    xs, ys = corpus.windows("train", offsets, block_size)
    return [torch.cat([xs[k], ys[k][:, -1:]], dim=1) for k in range(steps)]


def batch_leaves(batch: torch.Tensor) -> list[bytes]:
    """The chunk leaves of one step's batch, ``(rows, block_size + 1)`` ids."""
    return id_leaves(batch, cols=int(batch.shape[-1]))
