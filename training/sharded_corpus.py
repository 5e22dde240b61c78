"""Reading a prepared dataset (the format: :mod:`training.shards`): the memory-mapped token stream, the
corpus that serves windows of it as :class:`training.data.Corpus` does, and opening a dataset directory,
every shard checked against the manifest first."""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.errors import ShardError
from training.shards import (
    MANIFEST_NAME,
    ROOT_PREFIX,
    SHARD_HEADER,
    Manifest,
    parse_manifest,
    verify_shard,
)

logger = logging.getLogger(__name__)


class ShardedTokens:
    """The concatenated id stream of a dataset's shards, read by memory map."""

    def __init__(self, directory: Path, manifest: Manifest, release_pages: bool = True) -> None:
        self.directory = directory
        self.manifest = manifest
        self.release_pages = release_pages  # False only to measure what the release saves
        self._bounds = np.cumsum([0] + [shard.tokens for shard in manifest.shards])
        self._dtype = np.dtype(manifest.dtype).newbyteorder("<")
        self._maps: dict[int, tuple[mmap.mmap, np.ndarray]] = {}

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def _shard(self, index: int) -> np.ndarray:
        if index not in self._maps:
            path = self.directory / self.manifest.shards[index].file
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            ids = np.frombuffer(mapped, dtype=self._dtype, count=self.manifest.shards[index].tokens,
                                offset=SHARD_HEADER.size)
            self._maps[index] = (mapped, ids)
        return self._maps[index][1]

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``out[i] = ids[starts[i] : starts[i] + length]`` as int64 (windows may cross shard boundaries)."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise ShardError(f"{self.directory}: window outside the dataset's {len(self)} tokens")
        out = np.empty((starts.size, length), dtype=np.int64)
        shard_of = np.searchsorted(self._bounds, starts, side="right") - 1
        offsets = np.arange(length)
        for index in np.unique(shard_of):
            rows = np.nonzero(shard_of == index)[0]
            local = starts[rows] - self._bounds[index]
            ids = self._shard(int(index))
            inside = local + length <= ids.size
            if inside.any():
                out[rows[inside]] = ids[local[inside, None] + offsets]
            self._release(int(index))
            for row in rows[~inside]:  # the few windows that run into the next shard(s)
                out[row] = self._read_across(int(starts[row]), length)
        return out

    def _read_across(self, start: int, length: int) -> np.ndarray:
        pieces, position = [], start
        while position < start + length:
            index = int(np.searchsorted(self._bounds, position, side="right") - 1)
            ids = self._shard(index)
            local = position - int(self._bounds[index])
            take = min(ids.size - local, start + length - position)
            pieces.append(ids[local:local + take].astype(np.int64))
            self._release(index)
            position += take
        return np.concatenate(pieces)

    def _release(self, index: int) -> None:
        # The windows are copied out: drop the shard's mapped pages from this process (they stay in the
        # page cache). A fault can map a whole large folio (up to 2 MiB), so pages are released shard
        # by shard: resident memory holds at most one shard's worth, whatever the dataset's size.
        if self.release_pages and hasattr(mmap, "MADV_DONTNEED"):
            self._maps[index][0].madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self._maps.clear()  # the arrays hold the maps; both go with the last reference


@dataclass(frozen=True)
class TokenSpan:
    """Ids ``[start, end)`` of a :class:`ShardedTokens` stream: one split of a dataset."""

    tokens: ShardedTokens
    start: int
    end: int

    def numel(self) -> int:
        return self.end - self.start

    def windows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """LongTensor of shape ``starts.shape + (length,)`` with the ids at split offsets ``starts``."""
        flat = starts.reshape(-1).numpy().astype(np.int64) + self.start
        if flat.size and flat.max() + length > self.end:
            raise ShardError(f"window runs past the end of the split [{self.start}, {self.end})")
        return torch.from_numpy(self.tokens.gather(flat, length)).view(*starts.shape, length)


@dataclass(frozen=True)
class ShardedCorpus:
    """A prepared dataset as the training code sees a corpus: a training split and a held-out split.

    ``sha256`` is the manifest's root (what the run document commits to after ``manifest:``).
    """

    train: TokenSpan
    eval: TokenSpan
    source: str
    sha256: str
    manifest: Manifest

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def split(self, name: str) -> TokenSpan:
        return {"train": self.train, "eval": self.eval}[name]

    def split_tokens(self, name: str) -> int:
        return self.split(name).numel()

    def windows(self, name: str, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of the windows of split ``name`` starting at ``starts``."""
        ids = self.split(name).windows(starts, block_size + 1)
        return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


_VERIFIED: dict[tuple, str] = {}  # (path, size, mtime_ns) of a shard -> the sha256 it was verified to have


def read_manifest(path: str | os.PathLike) -> tuple[Path, Manifest]:
    """The dataset directory and its parsed manifest (``path``: the directory or its manifest.json)."""
    path = Path(path).expanduser()
    directory = path if path.is_dir() else path.parent
    manifest_path = directory / MANIFEST_NAME
    try:
        data = manifest_path.read_bytes()
    except OSError as exc:
        raise ShardError(f"{manifest_path}: cannot read the dataset manifest ({exc.strerror})") from None
    return directory, parse_manifest(data, str(manifest_path))


def open_dataset(
    path: str | os.PathLike, verify: bool = True, expected_root: str | None = None, release_pages: bool = True
) -> ShardedCorpus:
    """Open a prepared dataset; with ``verify`` every shard is checked (once per process) first.

    ``release_pages=False`` keeps the pages reads map resident (only to measure what releasing saves).

    Raises:
        ShardError: The manifest is malformed or not ``expected_root``, or a shard is missing,
            truncated, has a wrong header or hash, or holds an id beyond the vocabulary.
    """
    directory, manifest = read_manifest(path)
    if expected_root is not None and manifest.root != expected_root:
        raise ShardError(
            f"{directory / MANIFEST_NAME}: dataset root {manifest.root}, the run's is {expected_root}"
        )
    if verify:
        for entry in manifest.shards:
            shard_path = directory / entry.file
            try:
                stat = shard_path.stat()
            except OSError as exc:
                raise ShardError(f"{shard_path}: cannot read shard ({exc.strerror})") from None
            key = (str(shard_path.resolve()), stat.st_size, stat.st_mtime_ns)
            if _VERIFIED.get(key) != entry.sha256:
                verify_shard(shard_path, entry, manifest)
                _VERIFIED[key] = entry.sha256
    tokens = ShardedTokens(directory, manifest, release_pages)
    logger.info("dataset %s: %d shards, %d train + %d held-out tokens", directory, len(manifest.shards),
                manifest.eval_start, manifest.num_tokens - manifest.eval_start)
    return ShardedCorpus(
        train=TokenSpan(tokens, 0, manifest.eval_start),
        eval=TokenSpan(tokens, manifest.eval_start, manifest.num_tokens),
        source=str(directory),
        sha256=manifest.root,
        manifest=manifest,
    )


def is_dataset(path: str | os.PathLike) -> bool:
    """True when ``path`` is a prepared dataset directory or its manifest.json."""
    path = Path(path).expanduser()
    return (path / MANIFEST_NAME).is_file() if path.is_dir() else path.name == MANIFEST_NAME


def open_run_dataset(
    path: str | os.PathLike, reference: str, tokenizer: str, vocab_size: int
) -> ShardedCorpus:
    """The prepared dataset a run document names: ``reference`` is its ``training.data_sha256``
    (``manifest:<root>``), ``tokenizer`` its ``model.tokenizer`` ("bytes" or "sha256:<hex>"), ``vocab_size``
    the model's. Every shard is checked (once per process), as a node does before it trains.

    Raises:
        ShardError: ``path`` is not a prepared dataset, or another one (its root, its tokenizer or its
            vocabulary differ from the run's: the message names which), or a shard fails its check.
    """
    if not reference.startswith(ROOT_PREFIX):
        raise ShardError(
            f"the run did not train on a prepared dataset (training.data_sha256={reference[:80]!r})"
        )
    if not is_dataset(path):
        raise ShardError(
            f"{path}: not a prepared dataset (no {MANIFEST_NAME}); the run trained on {reference}"
        )
    corpus = open_dataset(path, expected_root=reference[len(ROOT_PREFIX):])
    if corpus.manifest.tokenizer != tokenizer:
        raise ShardError(f"{corpus.source}: prepared with tokenizer {corpus.manifest.tokenizer}, the run's "
                         f"model.tokenizer is {tokenizer}")
    if corpus.manifest.vocab_size > vocab_size:
        raise ShardError(
            f"{corpus.source}: ids up to {corpus.manifest.vocab_size - 1}, the run's model.vocab_size "
            f"is {vocab_size}"
        )
    return corpus
