"""Prepared datasets: fixed-size shards of token ids, a manifest that names them, and a memory-mapped reader.

A dataset directory (``dlx-node data prepare``, :mod:`training.prepare`) holds

``shard-00000.bin``, ``shard-00001.bin``, ...
    A 32-byte header, then the token ids as little-endian ``uint16`` (vocabulary
    up to 65536) or ``uint32``::

        magic b"DLXTOKS\\0" | u16 version (1) | u16 bytes per id | u32 vocab_size | u64 tokens | 8 zero bytes

    Every shard holds ``shard_tokens`` ids except the last, which holds the rest.
``manifest.json``
    ``format`` ("dlx-dataset-v1"), ``tokenizer`` ("bytes" or "sha256:<hex>" of
    the tokenizer file, see :mod:`training.tokenizer`), ``vocab_size``,
    ``dtype``, ``shard_tokens``, ``num_tokens``, the held-out split
    ``eval_start`` (ids ``[0, eval_start)`` are the training split,
    ``[eval_start, num_tokens)`` the held-out one), every shard's ``file``,
    ``sha256`` and ``tokens``, and ``root``:
``tokenizer.json``
    The tokenizer file itself when it is not "bytes" (a copy, for convenience).

The root is a Merkle root (pairs hashed with sha256, an odd node carried up)
over one leaf for the dataset's parameters and one per shard::

    leaf_params  = sha256(b"dlx-dataset-v1/params" || canonical JSON of
                          {dtype, eval_start, num_tokens, shard_tokens, tokenizer, vocab_size})
    leaf_shard_i = sha256(b"dlx-dataset-v1/shard" || sha256 of shard file i (32 bytes) || u64be(tokens_i))

so it pins every id, their order, the split and the tokenizer: a run names its
dataset by ``manifest:<root>`` in the run document, and a peer can send a
single shard that is checked against its manifest entry.

The token stream is the concatenation of the shards. :class:`ShardedCorpus`
serves windows of it exactly as :class:`training.data.Corpus` serves windows of
an in-memory text (same offsets from (run seed, replica, round, step, row)), by
memory map: resident memory holds the windows read, not the dataset (the pages
a read maps are released shard by shard as it goes, ``ShardedTokens._release``).
Opening a dataset checks every shard against the manifest (size, header,
sha256, ids below the vocabulary) with ordinary reads, and refuses a bad one
with a :class:`ShardError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training.errors import ShardError

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = "dlx-dataset-v1"
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
SHARD_MAGIC = b"DLXTOKS\x00"
SHARD_VERSION = 1
SHARD_HEADER = struct.Struct("<8sHHIQ8x")  # 32 bytes
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 ids per shard
ROOT_PREFIX = "manifest:"  # how a run document names a prepared dataset: manifest:<root>
_DTYPES = {"uint16": 2, "uint32": 4}
_READ_CHUNK = 1 << 22  # ids per read while verifying


def token_dtype(vocab_size: int) -> str:
    """The narrowest id type for a vocabulary: uint16 up to 65536 ids, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest names it."""

    file: str
    sha256: str
    tokens: int


@dataclass(frozen=True)
class Manifest:
    """A prepared dataset's manifest (see the module docstring)."""

    tokenizer: str
    vocab_size: int
    dtype: str
    shard_tokens: int
    eval_start: int
    shards: tuple[ShardEntry, ...]

    @property
    def num_tokens(self) -> int:
        return sum(shard.tokens for shard in self.shards)

    def params(self) -> dict:
        return {
            "dtype": self.dtype,
            "eval_start": self.eval_start,
            "num_tokens": self.num_tokens,
            "shard_tokens": self.shard_tokens,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
        }

    @property
    def root(self) -> str:
        """The Merkle root (hex) over the parameters and the shards."""
        params = json.dumps(self.params(), sort_keys=True, separators=(",", ":")).encode()
        leaves = [hashlib.sha256(b"dlx-dataset-v1/params" + params).digest()]
        for shard in self.shards:
            leaves.append(hashlib.sha256(
                b"dlx-dataset-v1/shard" + bytes.fromhex(shard.sha256) + struct.pack(">Q", shard.tokens)
            ).digest())
        return merkle_root(leaves).hex()

    def to_json(self) -> bytes:
        document = {
            "format": MANIFEST_FORMAT,
            **self.params(),
            "shards": [{"file": s.file, "sha256": s.sha256, "tokens": s.tokens} for s in self.shards],
            "root": self.root,
        }
        return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()


def merkle_root(leaves: list[bytes]) -> bytes:
    """sha256 Merkle root: pairs hashed left || right, an odd last node carried up unchanged."""
    if not leaves:
        raise ShardError("a Merkle root needs at least one leaf")
    level = list(leaves)
    while len(level) > 1:
        nxt = [hashlib.sha256(level[i] + level[i + 1]).digest() for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def parse_manifest(data: bytes, source: str = MANIFEST_NAME) -> Manifest:
    """Decode and check a manifest: every field typed and in range, shards consistent, root recomputed."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ShardError(f"{source}: not valid JSON ({type(exc).__name__})") from None
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise ShardError(f"{source}: not a {MANIFEST_FORMAT} manifest")

    def field(name: str, kind: type, ok: Callable[[object], bool] = lambda v: True):
        value = document.get(name)
        if type(value) is not kind or not ok(value):
            raise ShardError(f"{source}: field {name!r} is missing or invalid ({str(value)[:60]!r})")
        return value

    vocab = field("vocab_size", int, lambda v: 1 <= v < 1 << 32)
    dtype = field("dtype", str, lambda v: v in _DTYPES)
    if dtype != token_dtype(vocab):
        raise ShardError(f"{source}: dtype {dtype} does not fit vocab_size {vocab} (expected {token_dtype(vocab)})")
    shard_tokens = field("shard_tokens", int, lambda v: v >= 1)
    tokenizer = field("tokenizer", str, lambda v: v == "bytes" or v.startswith("sha256:"))
    shards_raw = field("shards", list, lambda v: len(v) >= 1)
    shards = []
    for index, raw in enumerate(shards_raw):
        if not isinstance(raw, dict):
            raise ShardError(f"{source}: shard {index} is not an object")
        name, digest, tokens = raw.get("file"), raw.get("sha256"), raw.get("tokens")
        if name != shard_name(index):
            raise ShardError(f"{source}: shard {index} is named {str(name)[:40]!r}, expected {shard_name(index)!r}")
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
            raise ShardError(f"{source}: shard {name} has no valid sha256")
        last = index == len(shards_raw) - 1
        if type(tokens) is not int or not (1 <= tokens <= shard_tokens) or (not last and tokens != shard_tokens):
            raise ShardError(f"{source}: shard {name} holds {tokens!r} tokens; every shard but the last holds "
                             f"shard_tokens={shard_tokens}")
        shards.append(ShardEntry(name, digest, tokens))
    manifest = Manifest(tokenizer, vocab, dtype, shard_tokens, 0, tuple(shards))
    eval_start = field("eval_start", int, lambda v: 1 <= v < manifest.num_tokens)
    if field("num_tokens", int) != manifest.num_tokens:
        raise ShardError(f"{source}: num_tokens {document['num_tokens']} is not the shards' sum {manifest.num_tokens}")
    manifest = Manifest(tokenizer, vocab, dtype, shard_tokens, eval_start, tuple(shards))
    if document.get("root") != manifest.root:
        raise ShardError(f"{source}: root {str(document.get('root'))[:64]} is not the root of its contents "
                         f"({manifest.root})")
    return manifest


# ---------------------------------------------------------------------- writing
def write_shard(path: Path, tokens: np.ndarray, vocab_size: int) -> ShardEntry:
    """Write one shard (header + little-endian ids) and return its manifest entry."""
    dtype = np.dtype(token_dtype(vocab_size)).newbyteorder("<")
    ids = np.ascontiguousarray(tokens, dtype=dtype)
    header = SHARD_HEADER.pack(SHARD_MAGIC, SHARD_VERSION, dtype.itemsize, vocab_size, ids.size)
    digest = hashlib.sha256(header)
    payload = memoryview(ids).cast("B")
    digest.update(payload)
    with open(path, "wb") as handle:
        handle.write(header)
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    return ShardEntry(path.name, digest.hexdigest(), int(ids.size))


class ShardWriter:
    """Accumulates a stream of token ids into fixed-size shards in ``out_dir`` (constant memory)."""

    def __init__(self, out_dir: Path, vocab_size: int, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> None:
        if shard_tokens < 1:
            raise ShardError(f"shard_tokens={shard_tokens}: must be >= 1")
        self.out_dir = Path(out_dir)
        self.vocab_size = vocab_size
        self.shard_tokens = shard_tokens
        self.dtype = token_dtype(vocab_size)
        self._buffer = np.empty(shard_tokens, dtype=self.dtype)
        self._filled = 0
        self.shards: list[ShardEntry] = []
        self.tokens_written = 0

    def append(self, ids: np.ndarray | list[int]) -> None:
        ids = np.asarray(ids)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ShardError(f"token id out of [0, {self.vocab_size}) while writing {self.out_dir}")
        position = 0
        while position < ids.size:
            take = min(ids.size - position, self.shard_tokens - self._filled)
            self._buffer[self._filled:self._filled + take] = ids[position:position + take]
            self._filled += take
            position += take
            if self._filled == self.shard_tokens:
                self._flush()
        self.tokens_written += int(ids.size)

    def _flush(self) -> None:
        if self._filled:
            path = self.out_dir / shard_name(len(self.shards))
            self.shards.append(write_shard(path, self._buffer[:self._filled], self.vocab_size))
            self._filled = 0

    def finish(self, tokenizer: str, eval_start: int) -> Manifest:
        """Write the last shard and ``manifest.json``; the held-out split starts at id ``eval_start``."""
        self._flush()
        total = sum(shard.tokens for shard in self.shards)
        if not 1 <= eval_start < total:
            raise ShardError(f"{self.out_dir}: {total} tokens cannot hold a training split and a held-out split "
                             f"starting at {eval_start}; give more text")
        manifest = Manifest(tokenizer, self.vocab_size, self.dtype, self.shard_tokens, eval_start,
                            tuple(self.shards))
        tmp = self.out_dir / (MANIFEST_NAME + ".tmp")
        tmp.write_bytes(manifest.to_json())
        os.replace(tmp, self.out_dir / MANIFEST_NAME)
        return manifest


def tail_eval_start(num_tokens: int, eval_fraction: float) -> int:
    """Where the held-out tail of ``ceil(num_tokens * eval_fraction)`` ids starts (as training.data splits a text)."""
    return num_tokens - math.ceil(num_tokens * eval_fraction)


# ---------------------------------------------------------------------- reading
def shard_size(entry: ShardEntry, manifest: Manifest) -> int:
    """Bytes of a shard file: the header and ``tokens`` ids."""
    return SHARD_HEADER.size + entry.tokens * _DTYPES[manifest.dtype]


def verify_shard(path: Path, entry: ShardEntry, manifest: Manifest) -> None:
    """Check one shard file against its manifest entry; a :class:`ShardError` names the file and the fault."""
    itemsize = _DTYPES[manifest.dtype]
    expected_size = shard_size(entry, manifest)
    try:
        size = path.stat().st_size
        handle = open(path, "rb")  # noqa: SIM115 - closed by the with below; opening may fail on its own
    except OSError as exc:
        raise ShardError(f"{path}: cannot read shard ({exc.strerror})") from None
    with handle:
        if size < expected_size:
            raise ShardError(f"{path}: truncated: {size} bytes, the manifest's {entry.tokens} tokens need "
                             f"{expected_size}")
        if size > expected_size:
            raise ShardError(f"{path}: {size} bytes, more than the manifest's {entry.tokens} tokens ({expected_size})")
        header = handle.read(SHARD_HEADER.size)
        magic, version, width, vocab, tokens = SHARD_HEADER.unpack(header)
        if magic != SHARD_MAGIC or version != SHARD_VERSION:
            raise ShardError(f"{path}: wrong header: not a version-{SHARD_VERSION} dlx token shard")
        if (width, vocab, tokens) != (itemsize, manifest.vocab_size, entry.tokens):
            raise ShardError(f"{path}: wrong header: {width}-byte ids, vocab {vocab}, {tokens} tokens; the manifest "
                             f"says {itemsize}-byte ids, vocab {manifest.vocab_size}, {entry.tokens} tokens")
        digest = hashlib.sha256(header)
        dtype = np.dtype(manifest.dtype).newbyteorder("<")
        largest = 0
        buffer = bytearray(_READ_CHUNK * itemsize)
        view = memoryview(buffer)
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
            largest = max(largest, int(np.frombuffer(buffer, dtype=dtype, count=count // itemsize).max()))
    if digest.hexdigest() != entry.sha256:
        raise ShardError(f"{path}: wrong hash: sha256 {digest.hexdigest()}, the manifest says {entry.sha256}")
    if largest >= manifest.vocab_size:
        raise ShardError(f"{path}: token id {largest} is beyond the vocabulary ({manifest.vocab_size} ids)")


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
        raise ShardError(f"{directory / MANIFEST_NAME}: dataset root {manifest.root}, the run's is {expected_root}")
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


def open_run_dataset(path: str | os.PathLike, reference: str, tokenizer: str, vocab_size: int) -> ShardedCorpus:
    """The prepared dataset a run document names: ``reference`` is its ``training.data_sha256``
    (``manifest:<root>``), ``tokenizer`` its ``model.tokenizer`` ("bytes" or "sha256:<hex>"), ``vocab_size``
    the model's. Every shard is checked (once per process), as a node does before it trains.

    Raises:
        ShardError: ``path`` is not a prepared dataset, or another one (its root, its tokenizer or its
            vocabulary differ from the run's: the message names which), or a shard fails its check.
    """
    if not reference.startswith(ROOT_PREFIX):
        raise ShardError(f"the run did not train on a prepared dataset (training.data_sha256={reference[:80]!r})")
    if not is_dataset(path):
        raise ShardError(f"{path}: not a prepared dataset (no {MANIFEST_NAME}); the run trained on {reference}")
    corpus = open_dataset(path, expected_root=reference[len(ROOT_PREFIX):])
    if corpus.manifest.tokenizer != tokenizer:
        raise ShardError(f"{corpus.source}: prepared with tokenizer {corpus.manifest.tokenizer}, the run's "
                         f"model.tokenizer is {tokenizer}")
    if corpus.manifest.vocab_size > vocab_size:
        raise ShardError(f"{corpus.source}: ids up to {corpus.manifest.vocab_size - 1}, the run's model.vocab_size "
                         f"is {vocab_size}")
    return corpus
