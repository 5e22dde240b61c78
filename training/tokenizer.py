"""Byte-level tokenizer: token id = raw byte value (vocab 256), nothing to download.

Text is encoded as UTF-8 and every byte is one token, so any string (and any
file, UTF-8 or not) round-trips. Decoding a sequence that splits a multi-byte
character replaces the broken bytes with U+FFFD instead of failing.
"""

from __future__ import annotations

VOCAB_SIZE = 256


class ByteTokenizer:
    """Encode text to its UTF-8 bytes and back."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``: its UTF-8 bytes."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (each in [0, 256)); invalid UTF-8 becomes U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")
