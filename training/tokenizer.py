"""Tokenizers: the built-in byte-level one, or a Hugging Face ``tokenizers`` BPE file named by its content.

``model.tokenizer`` is one of:

``"bytes"``
    :class:`ByteTokenizer`: token id = raw byte value (vocabulary 256), nothing
    to download. Text is encoded as UTF-8 and every byte is one token, so any
    string (and any file, UTF-8 or not) round-trips. Decoding a sequence that
    splits a multi-byte character replaces the broken bytes with U+FFFD.
a path
    A ``tokenizer.json`` written by the ``tokenizers`` library
    (:func:`train_bpe` makes one: ``dlx-node data prepare --train-tokenizer``),
    loaded as :class:`HFTokenizer`.
``"sha256:<hex>"``
    The same, named by the sha256 of the file's bytes: it is looked up as
    ``<hex>.json`` in the directories the caller searches (a node keeps its run's
    tokenizer in ``<data_dir>/tokenizers/``) and refused unless its bytes hash
    to ``<hex>``. The run document names a tokenizer this way, so every replica,
    joiner and auditor tokenizes with the very same file.

Every tokenizer exposes ``vocab_size``, ``encode``/``encode_batch``, ``decode``,
``eos_id`` (the id separating documents, or None), ``sha256`` (of the file;
"bytes" for the byte tokenizer) and ``hf_files(model_max_length)``, the
``tokenizer.json`` and ``tokenizer_config.json`` that make
``transformers.AutoTokenizer.from_pretrained`` give the same ids.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from training.errors import TokenizerError

logger = logging.getLogger(__name__)

VOCAB_SIZE = 256
BYTES = "bytes"
SHA256_PREFIX = "sha256:"
END_OF_TEXT = "<|endoftext|>"
_HEX64 = re.compile(r"[0-9a-f]{64}")
CHUNK_BYTES = 1 << 20  # text is encoded in pieces of about this size (see safe_chunks)


def _printable(byte: int) -> bool:
    return 0x21 <= byte <= 0x7E


def last_safe_cut(data: bytes) -> int:
    """The largest ``i`` such that ``data[:i]`` and ``data[i:]`` encode to the ids of ``data``; 0 if none.

    A cut right after ``"\n"`` that has printable ASCII on both sides is a
    boundary of GPT-2's pre-tokenizer regex whatever surrounds it (the newline is
    a pre-token of its own, and a lone one at the end of a piece is too), and BPE
    never merges across pre-tokens. The byte tokenizer has no merges at all.
    """
    i = data.rfind(b"\n", 1, len(data) - 1)
    while i > 0:
        if _printable(data[i - 1]) and _printable(data[i + 1]):
            return i + 1
        i = data.rfind(b"\n", 1, i)
    return 0


def safe_chunks(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of ``stream`` in pieces of about ``chunk_bytes`` cut only at :func:`last_safe_cut` points."""
    carry = b""
    while True:
        block = stream.read(chunk_bytes)
        if not block:
            break
        data = carry + block
        cut = last_safe_cut(data)
        if cut:
            yield data[:cut]
            carry = data[cut:]
        else:
            carry = data
    if carry:
        yield carry


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


class ByteTokenizer:
    """Encode text to its UTF-8 bytes and back."""

    vocab_size = VOCAB_SIZE
    sha256 = BYTES
    eos_id = None  # every id is a byte: none is free to separate documents
    # In a Hugging Face export byte 0 (NUL, which text never contains) stands in for bos/eos.
    hf_special_id = 0

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode_chunks(self, chunks: list[bytes]) -> list[np.ndarray]:
        """Ids of raw byte pieces (no decoding: any file round-trips)."""
        return [np.frombuffer(chunk, dtype=np.uint8) for chunk in chunks]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (each in [0, 256)); invalid UTF-8 becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def hf_files(self, model_max_length: int) -> dict[str, dict[str, Any] | bytes]:
        """A byte-level BPE with no merges over GPT-2's alphabet: id = raw byte value, no special tokens
        (any text, including the character that stands for byte 0, round-trips)."""
        mapping = bytes_to_unicode()
        byte_level = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": False,
        }
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": dict(byte_level),
            "post_processor": None,
            "decoder": dict(byte_level),
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {mapping[byte]: byte for byte in range(256)},
                "merges": [],
            },
        }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
        }
        return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


class HFTokenizer:
    """A ``tokenizers`` JSON file (its exact bytes are kept: they are what ``sha256`` names)."""

    def __init__(self, data: bytes, source: str = "<bytes>") -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - a dependency of the package
            raise TokenizerError("model.tokenizer is a file: install the 'tokenizers' package") from None
        try:
            self._tokenizer = Tokenizer.from_str(data.decode("utf-8"))
        # Not a broad catch: tokenizers (Rust, via PyO3) raises Exception itself for any parse error, its only
        # error type; UnicodeDecodeError is one too.
        except Exception as exc:  # noqa: BLE001
            raise TokenizerError(f"{source}: not a tokenizers JSON file ({type(exc).__name__}: "
                                 f"{str(exc)[:200]})") from None
        self.data = data
        self.source = source
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._tokenizer.token_to_id(END_OF_TEXT)
        self.hf_special_id = self.eos_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of every text (the library encodes them on all cores)."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def encode_chunks(self, chunks: list[bytes]) -> list[np.ndarray]:
        """Ids of UTF-8 pieces (from :func:`safe_chunks`; invalid UTF-8 becomes U+FFFD), on all cores."""
        texts = [chunk.decode("utf-8", errors="replace") for chunk in chunks]
        return [np.asarray(ids, dtype=np.int64) for ids in self.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def hf_files(self, model_max_length: int) -> dict[str, dict[str, Any] | bytes]:
        """The file itself (its exact bytes, so it still hashes to ``sha256``), and a config for
        ``PreTrainedTokenizerFast`` with its end-of-text token."""
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
        }
        if self.eos_id is not None:
            config.update(bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)
        return {"tokenizer.json": self.data, "tokenizer_config.json": config}


Tokenizer = ByteTokenizer | HFTokenizer


def parse_reference(spec: str) -> str | None:
    """The hex digest of a ``"sha256:<hex>"`` reference, None for anything else (bytes, a path)."""
    if not spec.startswith(SHA256_PREFIX):
        return None
    digest = spec[len(SHA256_PREFIX):]
    if not _HEX64.fullmatch(digest):
        raise TokenizerError(f"model.tokenizer={spec!r}: after 'sha256:' give 64 lowercase hex digits")
    return digest


def tokenizer_from_bytes(
    data: bytes, expected_sha256: str | None = None, source: str = "<bytes>"
) -> HFTokenizer:
    """Parse a tokenizer file's bytes; with ``expected_sha256``, refuse any other content."""
    if expected_sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != expected_sha256:
            raise TokenizerError(f"{source}: sha256 {got}, the run's tokenizer is {expected_sha256}")
    return HFTokenizer(data, source)


def load_tokenizer(spec: str, search_dirs: Iterable[str | os.PathLike] = ()) -> Tokenizer:
    """The tokenizer ``model.tokenizer`` names (see the module docstring)."""
    if spec == BYTES:
        return ByteTokenizer()
    digest = parse_reference(spec)
    if digest is None:
        path = Path(spec).expanduser()
        try:
            return tokenizer_from_bytes(path.read_bytes(), source=str(path))
        except OSError as exc:
            raise TokenizerError(f"model.tokenizer={spec!r}: cannot read it ({exc.strerror})") from None
    searched = []
    for directory in search_dirs:
        path = Path(directory).expanduser() / f"{digest}.json"
        searched.append(str(path))
        if path.is_file():
            return tokenizer_from_bytes(path.read_bytes(), digest, source=str(path))
    raise TokenizerError(
        f"tokenizer {spec[:23]}... not found (looked for {searched or 'no directory'}): put the run's "
        "tokenizer.json there under that name, or fetch it from a peer of the run"
    )


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """The model's vocabulary must hold every id the tokenizer emits."""
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size} "
            f"tokens): set model.vocab_size = {tokenizer.vocab_size}"
        )


def encode_bytes(tokenizer: Tokenizer, data: bytes) -> np.ndarray:
    """Ids of a whole text given as bytes, encoded in :func:`safe_chunks` pieces (int64)."""
    import io

    pieces = tokenizer.encode_chunks(list(safe_chunks(io.BytesIO(data))))
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def tokenizer_reference(tokenizer: Tokenizer) -> str:
    """How a run document and a dataset manifest name ``tokenizer``: "bytes" or "sha256:<hex>"."""
    return BYTES if tokenizer.sha256 == BYTES else SHA256_PREFIX + tokenizer.sha256


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int = 2) -> bytes:
    """Train a byte-level BPE (GPT-2's scheme) with the ``tokenizers`` library; the JSON file's bytes.

    The 256 byte symbols are always in the vocabulary (any text encodes, none is
    unknown), ``<|endoftext|>`` is id 0 and separates documents, and the
    ByteLevel pre-tokenizer and decoder make ``decode(encode(text)) == text``.
    The vocabulary is ``vocab_size`` or smaller if the text has fewer merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(
            f"--vocab-size {vocab_size}: a byte-level BPE needs at least {len(alphabet) + 1} "
            "(256 bytes and <|endoftext|>)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    logger.info("trained a byte-level BPE of %d tokens", tokenizer.get_vocab_size())
    return tokenizer.to_str(pretty=False).encode("utf-8")
