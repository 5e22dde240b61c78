"""``dlx-node data prepare``: turn text, JSON lines or Parquet into a sharded, manifest-pinned dataset.

Inputs, by file name:

``*.jsonl``, ``*.ndjson``, ``*.json``
    One JSON object per line; the document is its ``text_field`` (default
    ``"text"``; a line without it is an error naming the file and line).
``*.parquet``
    The ``text_field`` column, read in row batches with ``pyarrow`` (an optional
    dependency: ``pip install pyarrow``).
anything else
    A text file; the whole file is one document. It is read in pieces cut where
    the tokenizer would split anyway (:func:`training.tokenizer.safe_chunks`), so
    memory does not grow with the file and the ids equal those of the whole text.

Documents are encoded in batches (a BPE encodes a batch on all cores) and
appended, in input order, to one stream of ids, separated by the tokenizer's
``<|endoftext|>`` (the byte tokenizer has no free id: there, by ``"\\n\\n"``).
The stream is cut into fixed-size shards (:class:`training.shards.ShardWriter`).
The held-out split is chosen in the manifest: the ids of ``eval_inputs`` if
given (written after the training inputs), else the tail
``ceil(N * eval_fraction)`` ids, as :func:`training.data.corpus_from_bytes`
holds out a text's tail. So a single text file prepared with the byte tokenizer
gives exactly the training batches the file itself gives.

:func:`train_tokenizer` trains a byte-level BPE on the training inputs first
(``--train-tokenizer --vocab-size N``); its ``tokenizer.json`` is written into
the dataset directory and named in the manifest by its sha256.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training.errors import DataError, ShardError
from training.shards import (
    DEFAULT_SHARD_TOKENS,
    MANIFEST_NAME,
    TOKENIZER_NAME,
    Manifest,
    ShardWriter,
    tail_eval_start,
)
from training.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    safe_chunks,
    tokenizer_from_bytes,
    tokenizer_reference,
    train_bpe,
)

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
BATCH_BYTES = 8 << 20  # text handed to the tokenizer at once
#: ``progress(bytes_read, bytes_total)`` after every batch.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Piece:
    """Raw bytes of part of a document; ``last`` marks a document's final piece."""

    data: bytes
    last: bool
    size: int  # input bytes this piece accounts for (progress)


def _text_pieces(path: Path) -> Iterator[Piece]:
    with open(path, "rb") as handle:
        previous = None
        for chunk in safe_chunks(handle):
            if previous is not None:
                yield Piece(previous, False, len(previous))
            previous = chunk
        if previous is not None:
            yield Piece(previous, True, len(previous))


def _json_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{number}: not a JSON object ({exc})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: no string field {text_field!r} (use --text-field NAME)")
            yield Piece(text.encode("utf-8"), True, len(line))


def _parquet_pieces(path: Path, text_field: str) -> Iterator[Piece]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    parquet = pq.ParquetFile(path)
    if text_field not in parquet.schema_arrow.names:
        raise DataError(
            f"{path}: no column {text_field!r} (columns: {parquet.schema_arrow.names}); use --text-field"
        )
    total_rows = max(1, parquet.metadata.num_rows)
    size = path.stat().st_size
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        column = batch.column(0).to_pylist()
        share = size * len(column) // total_rows
        for index, text in enumerate(column):
            if text is None:
                continue
            yield Piece(str(text).encode("utf-8"), True, share if index == 0 else 0)


def document_pieces(path: str | os.PathLike, text_field: str = "text") -> Iterator[Piece]:
    """The documents of one input file as pieces of raw bytes (see the module docstring)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"input {path}: not a file")
    suffix = path.suffix.lower()
    if suffix in JSON_SUFFIXES:
        return _json_pieces(path, text_field)
    if suffix == ".parquet":
        return _parquet_pieces(path, text_field)
    return _text_pieces(path)


def _batches(pieces: Iterable[Piece]) -> Iterator[list[Piece]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.data)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _separator(tokenizer: Tokenizer) -> np.ndarray:
    if tokenizer.eos_id is not None:
        return np.array([tokenizer.eos_id], dtype=np.int64)
    return np.frombuffer(b"\n\n", dtype=np.uint8).astype(np.int64)


def _write_inputs(
    inputs: list[Path], writer: ShardWriter, tokenizer: Tokenizer, text_field: str, separate_first: bool,
    progress: Progress | None, done: list[int], total: int,
) -> None:
    """Encode every document of ``inputs`` into ``writer``, a separator before each but the very first."""
    separator = _separator(tokenizer)
    need_separator = separate_first
    for path in inputs:
        for batch in _batches(document_pieces(path, text_field)):
            for piece, ids in zip(batch, tokenizer.encode_chunks([piece.data for piece in batch])):
                if need_separator:
                    writer.append(separator)
                    need_separator = False
                writer.append(ids)
                need_separator = piece.last
                done[0] += piece.size
            if progress is not None:
                progress(done[0], total)


def train_tokenizer(
    inputs: Iterable[str | os.PathLike], vocab_size: int, text_field: str = "text"
) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` tokens trained on the documents of ``inputs``."""

    def texts() -> Iterator[str]:
        for path in inputs:
            for piece in document_pieces(path, text_field):
                yield piece.data.decode("utf-8", errors="replace")

    return tokenizer_from_bytes(train_bpe(texts(), vocab_size), source="<trained>")


def prepare_dataset(
    inputs: Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    *,
    eval_inputs: Iterable[str | os.PathLike] = (),
    eval_fraction: float = 0.1,
    text_field: str = "text",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Progress | None = None,
) -> Manifest:
    """Encode ``inputs`` with ``tokenizer`` (default: bytes) into shards and a manifest in ``out_dir``.

    ``out_dir`` must not exist or be empty; it is written in a temporary sibling and renamed into place
    when complete, so a failed or interrupted run leaves nothing that looks like a dataset.
    """
    tokenizer = tokenizer or ByteTokenizer()
    train_paths = [Path(p).expanduser() for p in inputs]
    eval_paths = [Path(p).expanduser() for p in eval_inputs]
    if not train_paths:
        raise DataError("no input files: give at least one text, JSON lines or Parquet file")
    if not eval_paths and not 0.0 < eval_fraction < 0.5:
        raise DataError(f"--eval-fraction {eval_fraction}: must be in (0, 0.5)")
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out} exists and is not empty: choose a new output directory")
    for path in train_paths + eval_paths:
        if not path.is_file():
            raise DataError(f"input {path}: not a file")
    total = sum(path.stat().st_size for path in train_paths + eval_paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.preparing")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        writer = ShardWriter(staging, tokenizer.vocab_size, shard_tokens)
        done = [0]
        _write_inputs(train_paths, writer, tokenizer, text_field, False, progress, done, total)
        if eval_paths:
            eval_start = writer.tokens_written
            _write_inputs(eval_paths, writer, tokenizer, text_field, True, progress, done, total)
        else:
            eval_start = tail_eval_start(writer.tokens_written, eval_fraction)
        if isinstance(tokenizer, HFTokenizer):
            (staging / TOKENIZER_NAME).write_bytes(tokenizer.data)
        try:
            manifest = writer.finish(tokenizer_reference(tokenizer), eval_start)
        except ShardError as exc:
            raise DataError(str(exc).replace(str(staging), str(out))) from None
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("prepared %s: %d shards, %d tokens (%d held out), root %s", out, len(manifest.shards),
                manifest.num_tokens, manifest.num_tokens - manifest.eval_start, manifest.root)
    return manifest


__all__ = ["MANIFEST_NAME", "document_pieces", "prepare_dataset", "train_tokenizer"]
