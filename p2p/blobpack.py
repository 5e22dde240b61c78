"""Blobs kept as pieces: one served blob stored as runs of bytes, its large runs shared by content (issue 75).

A node serves a start state every round (weights, both AdamW moments and the outer state: about 10 x its
stage's parameter bytes), and keeps a few rounds' worth while the chain's windows are open. Many of their
runs are the same bytes: the round-start snapshot is the live weights, the last encode's snapshot too, the
decoded update a state holds for round ``r - 1`` is the one the state before held for it, a zero residual is
zeros. Stored as files, each copy costs its bytes again.

A *packed* blob is the same blob (same sha256, same bytes served) stored as a *manifest*: the blob's bytes
as a list of parts, each either literal bytes (the small runs between) or a *piece*, a file
``<store>/.pieces/<sha256 of its bytes>`` that every packed blob holding those bytes shares. The caller
says where the large runs are (``cuts``: what a start state's tensors' data are); everything else is kept
literally. A manifest is ``<store>/.packed/<blob sha256>.pack``, binary (integers little-endian)::

    b"dlx-packed-v1"  u64 size  u32 number of parts
    per part:  b"b" u32 length, the literal bytes  |  b"p" the piece's 32-byte sha256, u64 length

A blob packed with ``compress`` (issue 75: a version-3 stage's sum trees, 91-96% zero bytes, kept for every
round inside the proof window) keeps each literal run of :data:`MIN_PIECE_BYTES` or more, in blocks of at
most :data:`COMPRESS_BLOCK_BYTES`, as a *compressed piece* where zlib saves a quarter or more: the piece
file holds the block's zlib stream (named by the sha256 of those bytes, shared like any piece), and the
manifest, then ``b"dlx-packed-v2"`` (v1 readers refuse it by its magic), says so::

    b"z" the piece's 32-byte sha256, u64 length of the block, u64 length of the piece

A reader inflates at most the block's length from the piece and refuses one that inflates to any other
length; the blob's sha256 is checked as for any blob (the bytes served are the same).

Writing goes pieces first, then the manifest (staged, fsynced, renamed): a crash leaves at worst pieces no
manifest names, which the next sweep deletes. A manifest is read as if an adversary wrote it (a damaged
disk, a hand edit): any structural problem, or a piece it names that is missing or of another length, and
the blob is not served (a warning names the file). Its bytes are never trusted either: a fetcher checks the
blob's sha256 as for any blob, and :func:`read_packed` (an auditor reading a node's directory) checks it.

Nothing here knows what a start state is: ``p2p/`` knows nothing of torch.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from p2p.errors import BlobError

logger = logging.getLogger(__name__)

PIECES_DIR = ".pieces"
PACKED_DIR = ".packed"
MANIFEST_SUFFIX = ".pack"
MANIFEST_MAGIC = b"dlx-packed-v1"
#: A manifest with compressed pieces (same length as MANIFEST_MAGIC).
MANIFEST_MAGIC_V2 = b"dlx-packed-v2"
#: The most bytes of a blob one compressed piece holds (what a read of any byte of it inflates).
COMPRESS_BLOCK_BYTES = 1 << 20
#: Runs shorter than this are kept literally in the manifest (a piece file per small tensor would cost more
#: in inodes and opens than it saves).
MIN_PIECE_BYTES = 4096
#: A manifest larger than this is refused unread (a start state of 65,536 tensors, the most its format
#: allows, needs about 12 MB).
MAX_MANIFEST_BYTES = 64 << 20
_COPY_BYTES = 4 << 20


@dataclass(frozen=True)
class PackedBlob:
    """One packed blob: its size and parts (``(kind, start, length, literal bytes or piece sha256)``; a
    compressed piece's ``"z"`` part holds ``(piece sha256, the piece's length)``)."""

    sha256_hex: str
    size: int
    parts: tuple[tuple[str, int, int, bytes | str], ...]
    pieces_dir: Path

    @property
    def starts(self) -> list[int]:
        return [part[1] for part in self.parts]

    def pieces(self) -> set[str]:
        """The sha256 hex of every piece it names."""
        return {value if kind == "p" else value[0]
                for kind, _start, _length, value in self.parts if kind != "b"}

    def pread(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of the blob (fewer at its end). BlobError if a piece is gone or
        shorter than its manifest says (the blob then cannot be served)."""
        end = min(self.size, offset + length)
        out = bytearray()
        index = bisect.bisect_right(self.starts, offset) - 1
        position = offset
        while position < end and 0 <= index < len(self.parts):
            kind, start, part_length, value = self.parts[index]
            inner = position - start
            take = min(part_length - inner, end - position)
            if kind == "b":
                out += value[inner:inner + take]
            elif kind == "z":
                out += self._inflate(value, part_length)[inner:inner + take]
            else:
                out += self._read_piece(value, inner, take)
            position += take
            index += 1
        return bytes(out)

    def _read_piece(self, piece_hex: str, offset: int, length: int) -> bytes:
        try:
            with open(self.pieces_dir / piece_hex, "rb") as handle:
                data = os.pread(handle.fileno(), length, offset)
        except OSError as exc:
            raise BlobError(f"packed blob {self.sha256_hex[:16]}: piece {piece_hex[:16]} unreadable: {exc}"
                            ) from None
        if len(data) != length:
            raise BlobError(f"packed blob {self.sha256_hex[:16]}: piece {piece_hex[:16]} is short")
        return data

    def _inflate(self, value: tuple[str, int], length: int) -> bytes:
        """The ``length`` bytes a compressed piece holds (BlobError if it is gone or inflates otherwise)."""
        piece_hex, stored = value
        deflated = self._read_piece(piece_hex, 0, stored)
        inflater = zlib.decompressobj()
        try:
            data = inflater.decompress(deflated, length)
        except zlib.error as exc:
            raise BlobError(f"packed blob {self.sha256_hex[:16]}: piece {piece_hex[:16]} does not inflate: "
                            f"{exc}") from None
        if len(data) != length or inflater.unconsumed_tail or not inflater.eof:
            raise BlobError(f"packed blob {self.sha256_hex[:16]}: piece {piece_hex[:16]} does not inflate to "
                            f"its {length} bytes")
        return data

    def write_to(self, out: BinaryIO) -> None:
        """Write the whole blob to ``out``, one part (or 4 MiB of one) at a time."""
        position = 0
        while position < self.size:
            block = self.pread(position, _COPY_BYTES)
            out.write(block)
            position += len(block)


def parse_manifest(data: bytes, sha256_hex: str, pieces_dir: Path) -> PackedBlob:
    """A manifest's :class:`PackedBlob`, every field checked; BlobError saying what is wrong otherwise. The
    pieces are not opened here (:func:`check_pieces`)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise BlobError(f"packed blob manifest of {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    view, position = memoryview(data), 0

    def take(count: int) -> bytes:
        nonlocal position
        if position + count > len(view):
            raise BlobError(f"packed blob manifest truncated at byte {position} of {len(view)}")
        position += count
        return bytes(view[position - count:position])

    magic = take(len(MANIFEST_MAGIC))
    if magic not in (MANIFEST_MAGIC, MANIFEST_MAGIC_V2):
        raise BlobError("not a packed blob manifest (bad magic or version)")
    size, count = struct.unpack("<QI", take(12))
    parts, start = [], 0
    for _ in range(count):
        kind = take(1)
        if kind == b"b":
            literal = take(struct.unpack("<I", take(4))[0])
            if not literal:
                raise BlobError("packed blob manifest: an empty literal part")
            parts.append(("b", start, len(literal), literal))
        elif kind == b"p":
            piece_hex, length = take(32).hex(), struct.unpack("<Q", take(8))[0]
            if length == 0:
                raise BlobError("packed blob manifest: an empty piece")
            parts.append(("p", start, length, piece_hex))
        elif kind == b"z" and magic == MANIFEST_MAGIC_V2:
            piece_hex, length, stored = take(32).hex(), *struct.unpack("<QQ", take(16))
            if not 0 < length <= COMPRESS_BLOCK_BYTES or stored == 0:
                raise BlobError(f"packed blob manifest: a compressed piece of {length} bytes ({stored} "
                                "stored)")
            parts.append(("z", start, length, (piece_hex, stored)))
        else:
            raise BlobError(f"packed blob manifest: part kind {kind!r} unknown")
        start += parts[-1][2]
    if position != len(view):
        raise BlobError(f"packed blob manifest has {len(view) - position} trailing bytes")
    if start != size:
        raise BlobError(f"packed blob manifest: parts of {start} bytes for a blob of {size}")
    if magic == MANIFEST_MAGIC_V2 and not any(part[0] == "z" for part in parts):
        raise BlobError("packed blob manifest: version 2 without a compressed piece")
    return PackedBlob(sha256_hex, size, tuple(parts), pieces_dir)


def _encode_manifest(size: int, parts: list[tuple[str, bytes | str | tuple[str, int], int]]) -> bytes:
    magic = MANIFEST_MAGIC_V2 if any(kind == "z" for kind, _value, _length in parts) else MANIFEST_MAGIC
    out = [magic, struct.pack("<QI", size, len(parts))]
    for kind, value, length in parts:
        if kind == "b":
            out += [b"b", struct.pack("<I", length), value]
        elif kind == "z":
            out += [b"z", bytes.fromhex(value[0]), struct.pack("<QQ", length, value[1])]
        else:
            out += [b"p", bytes.fromhex(value), struct.pack("<Q", length)]
    return b"".join(out)


def check_pieces(blob: PackedBlob) -> None:
    """BlobError if a piece ``blob`` names is missing or of another length than its parts say."""
    for kind, _start, length, value in blob.parts:
        if kind == "b":
            continue
        if kind == "z":
            value, length = value
        try:
            actual = (blob.pieces_dir / value).stat().st_size
        except OSError:
            raise BlobError(f"packed blob {blob.sha256_hex[:16]}: piece {value[:16]} is missing") from None
        if actual != length:
            raise BlobError(f"packed blob {blob.sha256_hex[:16]}: piece {value[:16]} holds {actual} bytes, "
                            f"its manifest says {length}")


def pack_file(source: Path, cuts: list[tuple[int, int]], pieces_dir: Path, staging: Path,
              compress: bool = False) -> tuple[str, bytes, set[str]]:
    """Store the file ``source`` as pieces: ``(its sha256 hex, its manifest's bytes, the pieces it names)``.

    ``cuts``: ``(offset, length)`` of the runs to keep as pieces (ascending, not overlapping, inside the
    file); those under :data:`MIN_PIECE_BYTES` and every byte between them are kept literally. Each piece
    is written (staged, then renamed to its content's sha256) unless one of its bytes is there already. The
    caller holds the store's lock (a sweep must not take a piece before its manifest names it).
    ``compress``: the literal runs of MIN_PIECE_BYTES or more become compressed pieces where zlib saves a
    quarter (module docstring)."""
    size = source.stat().st_size
    runs, position = [], 0
    for offset, length in cuts:
        if offset < position or length < 0 or offset + length > size:
            raise BlobError(f"{source}: cut {offset}+{length} out of order or past the file's end ({size})")
        if length >= MIN_PIECE_BYTES:
            if offset > position:
                runs.append(("b", position, offset - position))
            runs.append(("p", offset, length))
            position = offset + length
    if position < size:
        runs.append(("b", position, size - position))
    writer = PackWriter(pieces_dir, staging, compress)
    with open(source, "rb") as handle:
        for kind, offset, length in runs:
            if kind == "p":
                writer.piece(_file_blocks(handle, offset, length, _COPY_BYTES), length)
                continue
            step = COMPRESS_BLOCK_BYTES if compress else length
            for block_at in range(offset, offset + length, step):
                writer.literal(b"".join(_file_blocks(handle, block_at, min(offset + length - block_at, step),
                                                     step)))
    return writer.finish()


def _file_blocks(handle: BinaryIO, offset: int, length: int, block: int) -> Iterator[bytes]:
    """``length`` bytes of ``handle`` from ``offset`` in reads of at most ``block`` bytes."""
    position, end = offset, offset + length
    while position < end:
        data = os.pread(handle.fileno(), min(block, end - position), position)
        if not data:
            raise BlobError(f"{handle.name} shrank while being packed")
        position += len(data)
        yield data


class PackWriter:
    """A packed blob built from its bytes in order, never whole in memory (issue 75: a node's own start state
    goes from its tensors straight into the store's pieces, no file of the whole state written first, which
    held 10 x the stage's weights beside the pieces being packed from it). :meth:`literal` adds bytes kept
    in the manifest (compressed pieces where ``compress`` and it pays, as :func:`pack_file`), :meth:`piece`
    a run kept as a shared piece (literally if under :data:`MIN_PIECE_BYTES`); :meth:`finish` gives what
    :func:`pack_file` gives. The caller holds the store's lock, as for :func:`pack_file`."""

    def __init__(self, pieces_dir: Path, staging: Path, compress: bool = False) -> None:
        self.pieces_dir, self.staging, self.compress = pieces_dir, staging, compress
        self._digest = hashlib.sha256()
        self._parts: list = []
        self._named: set[str] = set()
        self._size = 0

    def literal(self, data) -> None:
        """Add ``data`` (bytes-like) as literal bytes."""
        data = bytes(data)
        self._digest.update(data)
        self._size += len(data)
        _add_literal(self._parts, self._named, data, self.pieces_dir, self.staging, self.compress)

    def piece(self, blocks: Iterable, length: int) -> None:
        """Add the ``length`` bytes that ``blocks`` (bytes-like, in order) make as one piece: staged while
        hashed, renamed to its sha256 (or dropped: the same piece is there)."""
        if length < MIN_PIECE_BYTES:
            self.literal(b"".join(bytes(block) for block in blocks))
            return
        piece_hex = _write_piece(blocks, length, self._digest, self.pieces_dir, self.staging)
        self._size += length
        self._parts.append(("p", piece_hex, length))
        self._named.add(piece_hex)

    def finish(self) -> tuple[str, bytes, set[str]]:
        """``(the blob's sha256 hex, its manifest's bytes, the pieces it names)``."""
        if any(kind == "b" and length >= 1 << 32 for kind, _value, length in self._parts):
            raise BlobError("a literal run of 4 GiB or more (cut it)")
        return self._digest.hexdigest(), _encode_manifest(self._size, self._parts), set(self._named)


def _add_literal(parts: list, named: set[str], literal: bytes, pieces_dir: Path, staging: Path,
                 compress: bool) -> None:
    """Append the literal bytes to ``parts``: a compressed piece where asked and it saves a quarter, else a
    literal part (two literal runs in a row, a short cut between, are one part)."""
    if compress and len(literal) >= MIN_PIECE_BYTES:
        deflated = zlib.compress(literal, 6)
        if len(deflated) <= len(literal) * 3 // 4:
            piece_hex = _store_piece(deflated, pieces_dir, staging)
            parts.append(("z", (piece_hex, len(deflated)), len(literal)))
            named.add(piece_hex)
            return
    if parts and parts[-1][0] == "b":
        joined = parts[-1][1] + literal
        parts[-1] = ("b", joined, len(joined))
    else:
        parts.append(("b", literal, len(literal)))


def _store_piece(data: bytes, pieces_dir: Path, staging: Path) -> str:
    """Write ``data`` as a piece (staged, fsynced, renamed to its sha256; dropped if that piece is there)."""
    piece_hex = hashlib.sha256(data).hexdigest()
    target = pieces_dir / piece_hex
    if target.is_file() and target.stat().st_size == len(data):
        return piece_hex
    fd, name = tempfile.mkstemp(prefix="piece-", dir=staging)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(name, 0o444)
        os.replace(name, target)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return piece_hex


def _write_piece(blocks: Iterable, length: int, blob_digest, pieces_dir: Path, staging: Path) -> str:
    """Copy the ``length`` bytes of ``blocks`` into a staged piece (hashing them into the blob's digest and
    the piece's), then rename it to its sha256 (or drop it: the same piece is there)."""
    piece_digest = hashlib.sha256()
    fd, name = tempfile.mkstemp(prefix="piece-", dir=staging)
    staged = Path(name)
    try:
        written = 0
        with os.fdopen(fd, "wb") as out:
            for block in blocks:
                blob_digest.update(block)
                piece_digest.update(block)
                out.write(block)
                written += memoryview(block).nbytes
            if written != length:
                raise BlobError(f"a piece of {written} bytes where {length} were said")
            out.flush()
            os.fsync(out.fileno())
        piece_hex = piece_digest.hexdigest()
        target = pieces_dir / piece_hex
        if target.is_file() and target.stat().st_size == length:
            staged.unlink()
        else:
            os.chmod(staged, 0o444)
            os.replace(staged, target)
        return piece_hex
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def read_packed(blobs_dir: Path, sha256_hex: str) -> bytes | None:
    """The bytes of the packed blob ``sha256_hex`` of the blob store at ``blobs_dir`` (an auditor reading a
    node's directory), checked against the hash; None if it is not packed there, is damaged or does not
    hash to its name."""
    if len(sha256_hex) != 64 or any(c not in "0123456789abcdef" for c in sha256_hex):
        return None  # not a name a manifest can have (never a path of its own)
    manifest = blobs_dir / PACKED_DIR / f"{sha256_hex}{MANIFEST_SUFFIX}"
    try:
        if manifest.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        blob = parse_manifest(manifest.read_bytes(), sha256_hex, blobs_dir / PIECES_DIR)
        data = blob.pread(0, blob.size)
    except (OSError, BlobError):
        return None
    return data if hashlib.sha256(data).hexdigest() == sha256_hex else None
