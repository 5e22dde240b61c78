"""Prepared datasets: fixed-size shards of token ids and a manifest that names them (the memory-mapped reader:
:mod:`training.sharded_corpus`).

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

The token stream is the concatenation of the shards. :class:`training.sharded_corpus.ShardedCorpus`
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
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.errors import ShardError
from training.jsonbound import loads_bounded

MANIFEST_FORMAT = "dlx-dataset-v1"
MANIFEST_NAME = "manifest.json"
#: A manifest nests 3 deep ({"shards": [{...}]}); deeper is refused before decoding (training/jsonbound.py).
MAX_MANIFEST_DEPTH = 8
TOKENIZER_NAME = "tokenizer.json"
SHARD_MAGIC = b"DLXTOKS\x00"
SHARD_VERSION = 1
SHARD_HEADER = struct.Struct("<8sHHIQ8x")  # 32 bytes
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 ids per shard
ROOT_PREFIX = "manifest:"  # how a run document names a prepared dataset: manifest:<root>
ID_BYTES = {"uint16": 2, "uint32": 4}  # bytes per token id, by the manifest's dtype
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
        document = loads_bounded(data, MAX_MANIFEST_DEPTH)
    except (ValueError, RecursionError) as exc:
        raise ShardError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
        raise ShardError(f"{source}: not a {MANIFEST_FORMAT} manifest")

    def field(name: str, kind: type, ok: Callable[[object], bool] = lambda v: True):
        value = document.get(name)
        if type(value) is not kind or not ok(value):
            raise ShardError(f"{source}: field {name!r} is missing or invalid ({str(value)[:60]!r})")
        return value

    vocab = field("vocab_size", int, lambda v: 1 <= v < 1 << 32)
    dtype = field("dtype", str, lambda v: v in ID_BYTES)
    if dtype != token_dtype(vocab):
        raise ShardError(
            f"{source}: dtype {dtype} does not fit vocab_size {vocab} (expected {token_dtype(vocab)})"
        )
    shard_tokens = field("shard_tokens", int, lambda v: v >= 1)
    tokenizer = field("tokenizer", str, lambda v: v == "bytes" or v.startswith("sha256:"))
    shards_raw = field("shards", list, lambda v: len(v) >= 1)
    shards = []
    for index, raw in enumerate(shards_raw):
        if not isinstance(raw, dict):
            raise ShardError(f"{source}: shard {index} is not an object")
        name, digest, tokens = raw.get("file"), raw.get("sha256"), raw.get("tokens")
        if name != shard_name(index):
            raise ShardError(
                f"{source}: shard {index} is named {str(name)[:40]!r}, expected {shard_name(index)!r}"
            )
        if not (
            isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
        ):
            raise ShardError(f"{source}: shard {name} has no valid sha256")
        last = index == len(shards_raw) - 1
        if (
            type(tokens) is not int
            or not (1 <= tokens <= shard_tokens)
            or (not last and tokens != shard_tokens)
        ):
            raise ShardError(
                f"{source}: shard {name} holds {tokens!r} tokens; every shard but the last holds "
                f"shard_tokens={shard_tokens}"
            )
        shards.append(ShardEntry(name, digest, tokens))
    manifest = Manifest(tokenizer, vocab, dtype, shard_tokens, 0, tuple(shards))
    eval_start = field("eval_start", int, lambda v: 1 <= v < manifest.num_tokens)
    if field("num_tokens", int) != manifest.num_tokens:
        raise ShardError(
            f"{source}: num_tokens {document['num_tokens']} is not the shards' sum {manifest.num_tokens}"
        )
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
            raise ShardError(
                f"{self.out_dir}: {total} tokens cannot hold a training split and a held-out split "
                f"starting at {eval_start}; give more text"
            )
        manifest = Manifest(tokenizer, self.vocab_size, self.dtype, self.shard_tokens, eval_start,
                            tuple(self.shards))
        tmp = self.out_dir / (MANIFEST_NAME + ".tmp")
        tmp.write_bytes(manifest.to_json())
        os.replace(tmp, self.out_dir / MANIFEST_NAME)
        return manifest


def tail_eval_start(num_tokens: int, eval_fraction: float) -> int:
    """Where the held-out tail of ``ceil(num_tokens * eval_fraction)`` ids starts (as training.data splits a
    text)."""
    return num_tokens - math.ceil(num_tokens * eval_fraction)


# ---------------------------------------------------------------------- reading
def shard_size(entry: ShardEntry, manifest: Manifest) -> int:
    """Bytes of a shard file: the header and ``tokens`` ids."""
    return SHARD_HEADER.size + entry.tokens * ID_BYTES[manifest.dtype]


def verify_shard(path: Path, entry: ShardEntry, manifest: Manifest) -> None:
    """Check one shard file against its manifest entry; a :class:`ShardError` names the file and the fault."""
    itemsize = ID_BYTES[manifest.dtype]
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
            raise ShardError(
                f"{path}: {size} bytes, more than the manifest's {entry.tokens} tokens ({expected_size})"
            )
        header = handle.read(SHARD_HEADER.size)
        magic, version, width, vocab, tokens = SHARD_HEADER.unpack(header)
        if magic != SHARD_MAGIC or version != SHARD_VERSION:
            raise ShardError(f"{path}: wrong header: not a version-{SHARD_VERSION} dlx token shard")
        if (width, vocab, tokens) != (itemsize, manifest.vocab_size, entry.tokens):
            raise ShardError(
                f"{path}: wrong header: {width}-byte ids, vocab {vocab}, {tokens} tokens; the manifest "
                f"says {itemsize}-byte ids, vocab {manifest.vocab_size}, {entry.tokens} tokens"
            )
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


