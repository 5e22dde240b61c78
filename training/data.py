"""Text corpora and the deterministic batches every replica trains on.

Corpus
    A file is read as raw bytes (the tokenizer is byte-level, so any file works,
    UTF-8 or not). The last ``ceil(len * eval_fraction)`` bytes are held out for
    evaluation, the rest is the training split; the two are disjoint byte
    ranges. ``Corpus.sha256`` is the digest of the whole file so an auditor can
    check that it holds the same data. Without a file, :func:`generated_corpus`
    makes a small synthetic English-like text from a seed.

Round batches (what an auditor re-executes)
    The batches replica ``r`` trains on in outer round ``t`` depend only on
    ``(run_seed, r, t)`` and the corpus, never on process state, RNG state or
    the number of replicas. For inner step ``k`` (0-based) and batch row ``b``:

    .. code-block:: text

        digest  = sha256(b"dlx-node/round-batches/v1"
                         || u64be(run_seed) || u64be(r) || u64be(t)
                         || u64be(k) || u64be(b))
        n_start = len(train) - block_size           # valid window starts
        offset  = int.from_bytes(digest[:8], "big") % n_start
        x[k][b] = train[offset     : offset + block_size]
        y[k][b] = train[offset + 1 : offset + block_size + 1]

    All five integers must be in [0, 2**64). Replicas therefore draw
    independently seeded windows (not disjoint ones: with a few hundred kB of
    text and thousands of windows per round, forcing disjointness would not
    change the statistics). The batch of step ``k`` does not depend on
    ``inner_steps``, so a longer round extends a shorter one.

Eval batches
    Fixed and RNG-free: ``n * batch_size`` windows of the held-out split whose
    starts are evenly spaced, ``start_j = (j * n_start_eval) // (n * batch_size)``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import struct
from dataclasses import dataclass

import torch

from training.config import ModelConfig, TrainingConfig
from training.errors import DataError

logger = logging.getLogger(__name__)

ROUND_BATCHES_DOMAIN = b"dlx-node/round-batches/v1"
_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into a training part and a held-out tail."""

    train: torch.Tensor  # uint8, 1-D
    eval: torch.Tensor  # uint8, 1-D, the bytes after ``train``
    source: str  # file path or a description of the generated text
    sha256: str  # hex digest of the whole corpus (train + eval)

    @property
    def num_bytes(self) -> int:
        return int(self.train.numel() + self.eval.numel())


def corpus_from_bytes(data: bytes, eval_fraction: float = 0.1, source: str = "<bytes>") -> Corpus:
    """Split ``data`` into train and a held-out tail of ``ceil(len * eval_fraction)`` bytes."""
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction}: must be in (0, 1)")
    if len(data) == 0:
        raise DataError(f"{source}: corpus is empty")
    n_eval = math.ceil(len(data) * eval_fraction)
    if n_eval >= len(data):
        raise DataError(f"{source}: {len(data)} bytes is too short to hold out an eval split")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = len(data) - n_eval
    return Corpus(
        train=tokens[:split],
        eval=tokens[split:],
        source=source,
        sha256=hashlib.sha256(data).hexdigest(),
    )


def load_corpus(path: str | os.PathLike, eval_fraction: float = 0.1, block_size: int | None = None) -> Corpus:
    """Read a text file as bytes and split it; with ``block_size``, check both splits are long enough."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}")
    if os.path.isdir(path):
        raise DataError(f"data path is a directory, not a file: {path}")
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc}") from exc
    corpus = corpus_from_bytes(data, eval_fraction, source=path)
    if block_size is not None:
        check_corpus(corpus, block_size)
    logger.info("corpus %s: %d train + %d eval bytes", path, corpus.train.numel(), corpus.eval.numel())
    return corpus


def check_corpus(corpus: Corpus, block_size: int) -> None:
    """Both splits must hold at least one window of ``block_size + 1`` bytes."""
    for name, split in (("train", corpus.train), ("eval", corpus.eval)):
        if split.numel() < block_size + 1:
            raise DataError(
                f"{corpus.source}: {name} split has {split.numel()} bytes, fewer than "
                f"block_size + 1 = {block_size + 1}; use a longer file or a smaller block_size"
            )


# A tiny grammar: enough structure (agreement, recurring phrases, punctuation)
# for a small model's loss to fall well below the unigram entropy.
_NAMES = ["Anna", "Tom", "the miller", "the old king", "a young sailor", "my sister", "the teacher", "Clara"]
_ADJECTIVES = ["quiet", "red", "little", "bright", "cold", "heavy", "gentle", "strange", "green", "old"]
_NOUNS = ["lantern", "river", "garden", "letter", "horse", "window", "bridge", "song", "boat", "market"]
_VERBS = ["carries", "finds", "paints", "watches", "remembers", "follows", "opens", "sells"]
_PLACES = ["near the river", "in the garden", "by the old bridge", "at the market", "under the window"]
_TIMES = ["In the morning", "At night", "Every winter", "On Sunday", "After the rain"]
_FEELINGS = ["happy", "tired", "afraid", "calm", "proud"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    name = rng.choice(_NAMES)
    noun_phrase = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    if kind == 0:
        text = f"{name} {rng.choice(_VERBS)} {noun_phrase} {rng.choice(_PLACES)}."
    elif kind == 1:
        text = f"{rng.choice(_TIMES)}, {name} {rng.choice(_VERBS)} {noun_phrase}."
    elif kind == 2:
        text = f"{name} is {rng.choice(_FEELINGS)} because {noun_phrase} is {rng.choice(_ADJECTIVES)}."
    elif kind == 3:
        text = f'"Where is {noun_phrase}?" asks {name}.'
    else:
        count = rng.randrange(2, 10)
        text = f"{name} has {count} {rng.choice(_NOUNS)}s and {count + 1} {rng.choice(_NOUNS)}s."
    return text[0].upper() + text[1:]


def generated_text(seed: int = 0, n_bytes: int = 200_000) -> str:
    """Synthetic English-like text of about ``n_bytes`` ASCII bytes, a pure function of ``seed``."""
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < n_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 7))) + "\n"
        lines.append(paragraph)
        size += len(paragraph)
    return "".join(lines)[:n_bytes]


def generated_corpus(seed: int = 0, n_bytes: int = 200_000, eval_fraction: float = 0.1) -> Corpus:
    """A corpus of :func:`generated_text` for demos and tests when no file is given."""
    text = generated_text(seed, n_bytes)
    source = f"<generated seed={seed} bytes={n_bytes}>"
    return corpus_from_bytes(text.encode("ascii"), eval_fraction, source=source)


def corpus_from_config(training_cfg: TrainingConfig, model_cfg: ModelConfig) -> Corpus:
    """The corpus of ``training.data_path``, or the generated one (seeded by ``training.seed``) if empty."""
    if training_cfg.data_path:
        return load_corpus(training_cfg.data_path, training_cfg.eval_fraction, model_cfg.block_size)
    corpus = generated_corpus(training_cfg.seed, eval_fraction=training_cfg.eval_fraction)
    check_corpus(corpus, model_cfg.block_size)
    return corpus


def window_offsets(
    run_seed: int, replica: int, round: int, inner_steps: int, batch_size: int, n_start: int
) -> list[list[int]]:
    """Start offsets ``[step][row]`` of the windows, as derived in the module docstring."""
    for name, value in (("run_seed", run_seed), ("replica", replica), ("round", round)):
        if not 0 <= value <= _U64_MAX:
            raise DataError(f"{name}={value}: must be in [0, 2**64)")
    if inner_steps < 1 or batch_size < 1:
        raise DataError(f"inner_steps={inner_steps}, batch_size={batch_size}: both must be >= 1")
    if n_start < 1:
        raise DataError(f"no valid window start (n_start={n_start})")
    prefix = ROUND_BATCHES_DOMAIN + struct.pack(">QQQ", run_seed, replica, round)
    offsets = []
    for step in range(inner_steps):
        row_offsets = []
        for row in range(batch_size):
            digest = hashlib.sha256(prefix + struct.pack(">QQ", step, row)).digest()
            row_offsets.append(int.from_bytes(digest[:8], "big") % n_start)
        offsets.append(row_offsets)
    return offsets


def _windows(split: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts.unsqueeze(-1) + torch.arange(block_size + 1)
    windows = split[index].long()
    return windows[..., :-1].contiguous(), windows[..., 1:].contiguous()


def round_batches(
    corpus: Corpus,
    run_seed: int,
    replica: int,
    round: int,
    inner_steps: int,
    batch_size: int,
    block_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``inner_steps`` training batches ``(x, y)`` (LongTensors (B, T)) of ``replica`` in ``round``."""
    check_corpus(corpus, block_size)
    n_start = int(corpus.train.numel()) - block_size
    offsets = torch.tensor(window_offsets(run_seed, replica, round, inner_steps, batch_size, n_start))
    xs, ys = _windows(corpus.train, offsets, block_size)
    return [(xs[step], ys[step]) for step in range(inner_steps)]


def eval_batches(
    corpus: Corpus, n: int, batch_size: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed held-out batches ``(x, y)``: evenly spaced windows of the eval split."""
    check_corpus(corpus, block_size)
    if n < 1 or batch_size < 1:
        raise DataError(f"n={n}, batch_size={batch_size}: both must be >= 1")
    n_start = int(corpus.eval.numel()) - block_size
    total = n * batch_size
    starts = torch.tensor([(j * n_start) // total for j in range(total)]).view(n, batch_size)
    xs, ys = _windows(corpus.eval, starts, block_size)
    return [(xs[i], ys[i]) for i in range(n)]
