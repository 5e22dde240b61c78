"""Text corpora and the deterministic batches every replica trains on.

Corpus
    With the byte tokenizer a file is read as raw bytes (token id = byte, so any
    file works, UTF-8 or not); with a BPE tokenizer (``model.tokenizer``) it is
    encoded in memory. The last ``ceil(len * eval_fraction)`` ids are held out
    for evaluation, the rest is the training split; the two are disjoint ranges.
    ``Corpus.sha256`` is the digest of the whole file so an auditor can check
    that it holds the same data. Without a file, :func:`generated_corpus` makes a
    small synthetic English-like text from a seed. A prepared dataset
    (``training.data_path`` = its directory, :mod:`training.shards`) is read by
    memory map instead, its held-out split chosen by its manifest, and its
    ``sha256`` is the manifest's root; the windows below are drawn from it by the
    same formulas (``train`` is its ids before ``eval_start``).

Round batches (what an auditor re-executes)
    The batches replica ``r`` trains on in outer round ``t`` depend only on
    ``(run_seed, r, t)`` and the corpus, never on process state, RNG state or
    the number of replicas. For inner step ``k`` (0-based) and batch row ``b``:

    .. code-block:: text

        digest  = sha256(b"dlx-node/round-batches/v1"
                         || u64be(run_seed) || u64be(r) || u64be(t)
                         || u64be(k) || u64be(b))
        n_start = len(train) - block_size           # valid window starts (train in ids)
        offset  = int.from_bytes(digest[:8], "big") % n_start
        x[k][b] = train[offset     : offset + block_size]
        y[k][b] = train[offset + 1 : offset + block_size + 1]

    All five integers must be in [0, 2**64). Replicas therefore draw
    independently seeded windows (not disjoint ones: with a few hundred kB of
    text and thousands of windows per round, forcing disjointness would not
    change the statistics). The batch of step ``k`` does not depend on
    ``inner_steps``, so a longer round extends a shorter one.

    The chain cannot recompute ``r`` (a seat count, in no contract's state):
    in a run with ``training.data_windows = "account"`` the windows are keyed by
    a 20-byte member account instead (the caller's: this package knows no
    chain), by the same formula with the domain ``b"dlx-node/round-batches/v2"``
    and the 20 bytes in place of ``u64be(r)`` (:mod:`training.data_binding`,
    ``rulebook.data_windows``): what StepProver's data dispute recomputes. Every
    function below that takes ``replica`` takes such a key in its place
    (:func:`windows_key` picks it by the run's setting).

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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from rulebook.data_windows import WINDOWS_DOMAIN
from training.config import ModelConfig, TrainingConfig
from training.errors import DataError
from training.sharded_corpus import ShardedCorpus, is_dataset, open_dataset
from training.shards import MANIFEST_NAME
from training.tokenizer import Tokenizer, check_vocab, encode_bytes, load_tokenizer, tokenizer_reference

logger = logging.getLogger(__name__)

ROUND_BATCHES_DOMAIN = b"dlx-node/round-batches/v1"
_U64_MAX = 2**64 - 1
#: A round's windows are drawn by a replica index (``training.data_windows = "replica"``) or by a 20-byte
#: member account (``"account"``): module docstring, "Round batches".
WindowsKey = int | bytes


@dataclass(frozen=True)
class Corpus:
    """A corpus in memory split into a training part and a held-out tail.

    Every corpus kind (this one, :class:`training.sharded_corpus.ShardedCorpus`) answers
    ``split_tokens(name)`` and ``windows(name, starts, block_size)`` for the
    splits "train" and "eval", and has ``source`` and ``sha256``; the batch
    functions below use nothing else.
    """

    train: torch.Tensor  # token ids, 1-D (uint8 for the byte tokenizer)
    eval: torch.Tensor  # token ids, 1-D, the ones after ``train``
    source: str  # file path or a description of the generated text
    sha256: str  # hex digest of the whole text (train + eval)

    @property
    def num_bytes(self) -> int:
        return int(self.train.numel() + self.eval.numel())

    def split_tokens(self, name: str) -> int:
        return int(self._split(name).numel())

    def windows(self, name: str, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets (LongTensors ``starts.shape + (block_size,)``) of split ``name``."""
        return _windows(self._split(name), starts, block_size)

    def _split(self, name: str) -> torch.Tensor:
        return {"train": self.train, "eval": self.eval}[name]


#: Either corpus kind: in memory, or a prepared dataset read by memory map.
AnyCorpus = Corpus | ShardedCorpus


def corpus_from_ids(
    ids: np.ndarray | torch.Tensor, sha256: str, eval_fraction: float = 0.1, source: str = "<ids>"
) -> Corpus:
    """Split token ids into train and a held-out tail of ``ceil(len * eval_fraction)`` ids."""
    if not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction}: must be in (0, 1)")
    tokens = torch.as_tensor(ids)
    if tokens.numel() == 0:
        raise DataError(f"{source}: corpus is empty")
    n_eval = math.ceil(tokens.numel() * eval_fraction)
    if n_eval >= tokens.numel():
        raise DataError(f"{source}: {tokens.numel()} tokens is too short to hold out an eval split")
    split = tokens.numel() - n_eval
    return Corpus(train=tokens[:split], eval=tokens[split:], source=source, sha256=sha256)


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


def _read_file(path: str | os.PathLike) -> bytes:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}")
    if os.path.isdir(path):
        raise DataError(
            f"data path is a directory without a {MANIFEST_NAME} (not a prepared dataset): {path}"
        )
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise DataError(f"cannot read data file {path}: {exc}") from exc


def load_corpus(path: str | os.PathLike, eval_fraction: float = 0.1, block_size: int | None = None) -> Corpus:
    """Read a text file as bytes and split it; with ``block_size``, check both splits are long enough."""
    path = os.fspath(path)
    data = _read_file(path)
    corpus = corpus_from_bytes(data, eval_fraction, source=path)
    if block_size is not None:
        check_corpus(corpus, block_size)
    logger.info("corpus %s: %d train + %d eval bytes", path, corpus.train.numel(), corpus.eval.numel())
    return corpus


def check_corpus(corpus: AnyCorpus, block_size: int) -> None:
    """Both splits must hold at least one window of ``block_size + 1`` tokens."""
    for name in ("train", "eval"):
        size = corpus.split_tokens(name)
        if size < block_size + 1:
            raise DataError(
                f"{corpus.source}: {name} split has {size} tokens, fewer than "
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


def corpus_from_config(
    training_cfg: TrainingConfig, model_cfg: ModelConfig, tokenizer_dirs: Iterable[str | os.PathLike] = ()
) -> AnyCorpus:
    """The corpus of ``training.data_path`` in the ids of ``model.tokenizer``.

    ``data_path`` is a prepared dataset (a directory with a ``manifest.json``,
    :mod:`training.shards`; its tokenizer must be the model's), a text file
    (tokenized in memory; with the byte tokenizer, its bytes), or empty: the
    generated text seeded by ``training.seed``. ``tokenizer_dirs``: where a
    ``sha256:`` tokenizer reference is looked up.
    """
    tokenizer = load_tokenizer(model_cfg.tokenizer, tokenizer_dirs)
    check_vocab(tokenizer, model_cfg.vocab_size)
    path = training_cfg.data_path
    if path and is_dataset(path):
        corpus: AnyCorpus = open_dataset(path)
        _check_dataset_fits(corpus, tokenizer, model_cfg)
    elif path and model_cfg.byte_level:
        corpus = load_corpus(path, training_cfg.eval_fraction)
    elif path:
        data = _read_file(path)
        corpus = corpus_from_ids(encode_bytes(tokenizer, data), hashlib.sha256(data).hexdigest(),
                                 training_cfg.eval_fraction, source=path)
    elif model_cfg.byte_level:
        corpus = generated_corpus(training_cfg.seed, eval_fraction=training_cfg.eval_fraction)
    else:
        data = generated_text(training_cfg.seed).encode("ascii")
        corpus = corpus_from_ids(encode_bytes(tokenizer, data), hashlib.sha256(data).hexdigest(),
                                 training_cfg.eval_fraction, source=f"<generated seed={training_cfg.seed}>")
    check_corpus(corpus, model_cfg.block_size)
    return corpus


def _check_dataset_fits(corpus: ShardedCorpus, tokenizer: Tokenizer, model_cfg: ModelConfig) -> None:
    manifest = corpus.manifest
    if manifest.tokenizer != tokenizer_reference(tokenizer):
        raise DataError(
            f"{corpus.source}: prepared with tokenizer {manifest.tokenizer}, but model.tokenizer is "
            f"{tokenizer_reference(tokenizer)}: set model.tokenizer to the dataset's tokenizer.json"
        )
    if manifest.vocab_size > model_cfg.vocab_size:
        raise DataError(
            f"{corpus.source}: ids up to {manifest.vocab_size - 1}, model.vocab_size={model_cfg.vocab_size}:"
            f" set model.vocab_size = {manifest.vocab_size}"
        )


def windows_key(training_cfg: TrainingConfig, replica: int, account: bytes | None) -> WindowsKey:
    """The key the windows of ``replica``'s rounds are drawn by under the run's ``training.data_windows``:
    the replica index, or ``account`` (20 bytes; DataError where the run draws by account and there is none).
    """
    if training_cfg.data_windows != "account":
        return replica
    if account is None or len(bytes(account)) != 20:
        got = "none" if account is None else f"{len(bytes(account))} bytes"
        raise DataError(f'training.data_windows = "account": the windows of replica {replica} need its '
                        f"20-byte member account as their key, got {got}")
    return bytes(account)


def window_offsets(
    run_seed: int,
    replica: WindowsKey,
    round: int,
    inner_steps: int,
    batch_size: int,
    n_start: int,
    first_step: int = 0,
) -> list[list[int]]:
    """Start offsets ``[step][row]`` of the windows of steps ``first_step <= step < inner_steps``, as derived
    in the module docstring (each step's alone: a pure function of the run seed, replica, round and step).
    ``replica``: a replica index, or a 20-byte account (the windows keyed by account)."""
    keyed = isinstance(replica, (bytes, bytearray))
    if keyed and len(replica) != 20:
        raise DataError(f"a windows key is a replica index or a 20-byte account, not {len(replica)} bytes")
    for name, value in (("run_seed", run_seed), ("replica", 0 if keyed else replica), ("round", round)):
        if not 0 <= value <= _U64_MAX:
            raise DataError(f"{name}={value}: must be in [0, 2**64)")
    if inner_steps < 1 or batch_size < 1:
        raise DataError(f"inner_steps={inner_steps}, batch_size={batch_size}: both must be >= 1")
    if not 0 <= first_step < inner_steps:
        raise DataError(f"first_step={first_step}: must be in [0, inner_steps={inner_steps})")
    if n_start < 1:
        raise DataError(f"no valid window start (n_start={n_start})")
    if keyed:  # rulebook.data_windows.window_offset's layout: the account in place of u64be(replica)
        prefix = WINDOWS_DOMAIN + struct.pack(">Q", run_seed) + bytes(replica) + struct.pack(">Q", round)
    else:
        prefix = ROUND_BATCHES_DOMAIN + struct.pack(">QQQ", run_seed, replica, round)
    offsets = []
    for step in range(first_step, inner_steps):
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
    corpus: AnyCorpus,
    run_seed: int,
    replica: WindowsKey,
    round: int,
    inner_steps: int,
    batch_size: int,
    block_size: int,
    first_step: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The training batches ``(x, y)`` (LongTensors (B, T)) of ``replica`` in ``round``, of its inner steps
    ``first_step <= step < inner_steps`` (the same batch of a step whatever the others asked for).
    ``replica``: a replica index, or a 20-byte account (:func:`windows_key`)."""
    check_corpus(corpus, block_size)
    n_start = corpus.split_tokens("train") - block_size
    offsets = torch.tensor(
        window_offsets(run_seed, replica, round, inner_steps, batch_size, n_start, first_step)
    )
    xs, ys = corpus.windows("train", offsets, block_size)
    return [(xs[step], ys[step]) for step in range(inner_steps - first_step)]


def eval_batches(
    corpus: AnyCorpus, n: int, batch_size: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed held-out batches ``(x, y)``: evenly spaced windows of the eval split."""
    check_corpus(corpus, block_size)
    if n < 1 or batch_size < 1:
        raise DataError(f"n={n}, batch_size={batch_size}: both must be >= 1")
    n_start = corpus.split_tokens("eval") - block_size
    total = n * batch_size
    starts = torch.tensor([(j * n_start) // total for j in range(total)]).view(n, batch_size)
    xs, ys = corpus.windows("eval", starts, block_size)
    return [(xs[i], ys[i]) for i in range(n)]
