"""Content-addressed blob storage on disk (no networking here).

Layout: ``<root>/<sha256 hex>`` for complete, verified blobs and
``<root>/.staging/`` for writes in progress. Every blob enters the store through
a staging file that is hashed, fsynced and then ``os.replace``d into place, so
a crash never leaves a file under a name that does not match its content.
Besides the stored blobs, a store answers for files served from where they are
(:meth:`BlobStore.serve_file`, a dataset's shards) and for aliases (another hash
that names a stored blob, :meth:`BlobStore.alias`), both held in memory only, and for
*packed* blobs (:meth:`BlobStore.put_packed`, p2p/blobpack.py): a blob kept as
pieces shared by content with other packed blobs, served like any other.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

from p2p.blobpack import (MANIFEST_SUFFIX, PACKED_DIR, PIECES_DIR, PackedBlob, PackWriter, check_pieces,
                          pack_file, parse_manifest)
from p2p.errors import BlobError, BlobHashMismatch, BlobNotFound, BlobTooLarge

logger = logging.getLogger(__name__)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_READ_SIZE = 4 << 20


def check_sha256_hex(sha256_hex: str) -> str:
    """Normalise and validate a content address; raise BlobError if it is not 64 hex digits."""
    if not isinstance(sha256_hex, str) or not _HEX64.match(sha256_hex.lower()):
        raise BlobError(f"blob id {sha256_hex!r}: must be a sha256 as 64 hex digits")
    return sha256_hex.lower()


def hash_file(path: Path, length: int | None = None) -> str:
    """Hex sha256 of a file (hashlib releases the GIL on large buffers; call from a worker thread)."""
    digest = hashlib.sha256()
    remaining = length
    with open(path, "rb") as handle:
        while remaining is None or remaining > 0:
            chunk = handle.read(_READ_SIZE if remaining is None else min(_READ_SIZE, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def _load_sync_file_range() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux/glibc
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load_sync_file_range() if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``[offset, offset+length)`` of ``fd`` to disk without waiting for it.

    So the ``fsync`` that ends a download finds little left to write. Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` neither waits nor flushes the
    device cache: measured here, 100 MiB written in 4 MiB steps cost 0.04 s of
    system CPU with it (as with no sync at all) against 0.04-0.28 s with an
    ``fdatasync`` every 8 MiB, each of which also blocked the writer. It makes
    nothing durable: the final ``fsync`` still does. Elsewhere: ``fdatasync``.
    """
    if _SYNC_FILE_RANGE is None:
        os.fdatasync(fd)
        return
    if _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        os.fdatasync(fd)  # e.g. a filesystem that refuses it: the old way


def link_or_copy(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """Put the file ``source`` at ``dest`` atomically: a hard link when the filesystem allows, else a copy.

    Goes through a temporary name beside ``dest`` and ``os.replace``, so ``dest`` is never seen half
    written; an existing ``dest`` is replaced. A hard link shares its inode with ``source``: do not edit
    either in place.
    """
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        try:
            shutil.copyfile(source, tmp)
        except BaseException:  # a full disk: no partial copy left
            tmp.unlink(missing_ok=True)
            raise
    os.replace(tmp, dest)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobRebuilder(Protocol):
    """What makes blobs a store does not hold, when a peer asks (:meth:`BlobStore.set_rebuilder`)."""

    def knows(self, sha256_hex: str) -> bool: ...

    def rebuild(self, sha256_hex: str) -> bool: ...


class BlobStore:
    """Verified blobs under one directory; safe to use from several threads."""

    def __init__(self, root: str | os.PathLike[str], max_blob_bytes: int) -> None:
        self.root = Path(root)
        self.staging = self.root / ".staging"
        self.staging.mkdir(parents=True, exist_ok=True)
        self.max_blob_bytes = max_blob_bytes
        #: key -> sha256 of a stored blob served under that key too (:meth:`alias`)
        self._aliases: dict[str, str] = {}
        #: sha256 -> a file outside the store served under it (:meth:`serve_file`)
        self._files: dict[str, Path] = {}
        for leftover in self.staging.iterdir():  # interrupted writes of a previous run
            leftover.unlink(missing_ok=True)
        self.pieces_dir, self.packed_dir = self.root / PIECES_DIR, self.root / PACKED_DIR
        #: sha256 -> a blob kept as pieces (:meth:`put_packed`), on disk under ``.packed/``
        self._packed: dict[str, PackedBlob] = {}
        self._pack_lock = threading.Lock()  # a sweep never takes a piece a manifest being written names
        if self.packed_dir.is_dir():
            self._load_packed()
        #: What makes a blob this store does not hold on request (:meth:`set_rebuilder`), asked in turn
        self._rebuilders: tuple[BlobRebuilder, ...] = ()

    def set_rebuilder(self, rebuilder: BlobRebuilder | None) -> None:
        """Let ``rebuilder`` make a blob a peer asks for that this store does not hold (a node's own start
        state it rebuilds rather than keeps: node/live/checks/staterebuild.py; a chunked run's published
        stage state written when asked: node/live/fraud/stateserve.py), beside those set before (None:
        none any more). The server asks ``rebuilder.knows(key)`` (quick, on the event loop), then
        ``rebuilder.rebuild(key)`` of the first that knows it on a thread (True once the blob is stored,
        under its sha256 or as an alias of it), and serves it as any other."""
        self._rebuilders = () if rebuilder is None else (*self._rebuilders, rebuilder)

    def _rebuilder_of(self, key_hex: str) -> BlobRebuilder | None:
        for rebuilder in self._rebuilders:  # a tuple replaced whole: read without a lock
            if rebuilder.knows(key_hex):
                return rebuilder
        return None

    def rebuildable(self, key_hex: str) -> bool:
        """Whether a rebuilder can make ``key_hex`` (:meth:`set_rebuilder`)."""
        return self._rebuilder_of(key_hex) is not None

    def rebuild(self, key_hex: str) -> bool:
        """Make ``key_hex`` with the rebuilder that knows it (blocking); True if it is stored now."""
        rebuilder = self._rebuilder_of(key_hex)
        return rebuilder is not None and rebuilder.rebuild(key_hex)

    def path(self, sha256_hex: str) -> Path:
        return self.root / check_sha256_hex(sha256_hex)

    def has(self, sha256_hex: str) -> bool:
        return self.path(sha256_hex).is_file()

    def size(self, sha256_hex: str) -> int:
        try:
            return self.path(sha256_hex).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(f"blob {sha256_hex} is not stored locally") from None

    def new_staging_file(self, suffix: str = ".part") -> Path:
        fd, name = tempfile.mkstemp(prefix="blob-", suffix=suffix, dir=self.staging)
        os.close(fd)
        return Path(name)

    def put_bytes(self, data: bytes) -> str:
        """Store ``data``; return its sha256 hex."""
        if len(data) > self.max_blob_bytes:
            raise BlobTooLarge(f"blob of {len(data)} bytes exceeds max_blob_bytes={self.max_blob_bytes}")
        sha256_hex = hashlib.sha256(data).hexdigest()
        if self.has(sha256_hex):
            return sha256_hex
        staged = self.new_staging_file()
        try:
            with open(staged, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException as exc:  # a full disk: no partial staging file left to eat the space freed later
            staged.unlink(missing_ok=True)
            # A failed write names no file: name the blob.
            if isinstance(exc, OSError) and exc.filename is None:
                raise OSError(exc.errno, exc.strerror, str(self.path(sha256_hex))) from None
            raise
        self.commit(staged, sha256_hex, verified=True)
        return sha256_hex

    def put_file(self, source: str | os.PathLike[str], link: bool = False) -> str:
        """Copy the file at ``source`` into the store (hashing while copying); return its sha256 hex.

        ``link``: hard-link it instead where the filesystem allows (no second copy on disk), hashing the
        link in 4 MiB reads. The file becomes read-only (the store's blobs are): the caller never edits it in
        place (a checkpoint is replaced whole, never edited). A filesystem without hard links gets a copy.
        """
        source = self._checked_source(source)
        if link:
            staged = self.staging / f"link-{os.getpid()}-{threading.get_ident()}-{source.name}"
            staged.unlink(missing_ok=True)
            try:
                os.link(source, staged)
            except OSError:
                pass  # another filesystem, or none allows it: copied below
            else:
                try:
                    sha256_hex = hash_file(staged)  # what the link holds, whatever the source became since
                except BaseException:
                    staged.unlink(missing_ok=True)
                    raise
                if self.has(sha256_hex):
                    staged.unlink(missing_ok=True)
                    return sha256_hex
                self.commit(staged, sha256_hex, verified=True)
                return sha256_hex
        staged = self.new_staging_file()
        digest = hashlib.sha256()
        try:
            with open(source, "rb") as src, open(staged, "wb") as dst:
                while chunk := src.read(_READ_SIZE):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except BaseException as exc:
            staged.unlink(missing_ok=True)
            # A failed write names no file: name the copy.
            if isinstance(exc, OSError) and exc.filename is None:
                raise OSError(exc.errno, exc.strerror, str(staged)) from None
            raise
        sha256_hex = digest.hexdigest()
        if self.has(sha256_hex):
            staged.unlink(missing_ok=True)
            return sha256_hex
        self.commit(staged, sha256_hex, verified=True)
        return sha256_hex

    def serve_file(self, sha256_hex: str, path: str | os.PathLike[str]) -> None:
        """Serve the file at ``path``, which the caller has verified to hash to ``sha256_hex``, from where it
        is: nothing is copied or linked, so a large file (a dataset's shard) costs no disk here. It is not a
        stored blob (:meth:`has` stays False): it is served until this process ends. Edited in place, it
        would be served with a wrong hash, which fetchers refuse.
        """
        path = Path(path)
        if not path.is_file():
            raise BlobNotFound(f"{path}: no such file to serve")
        if path.stat().st_size > self.max_blob_bytes:
            raise BlobTooLarge(
                f"{path}: {path.stat().st_size} bytes exceeds max_blob_bytes={self.max_blob_bytes}"
            )
        self._files[check_sha256_hex(sha256_hex)] = path

    def _checked_source(self, source: str | os.PathLike[str]) -> Path:
        """``source`` as a path, refused (BlobError, BlobTooLarge) when it cannot be read or is over
        ``max_blob_bytes``."""
        source = Path(source)
        try:
            size = source.stat().st_size
        except OSError as exc:
            raise BlobError(f"cannot read blob source {source}: {exc}") from None
        if size > self.max_blob_bytes:
            raise BlobTooLarge(f"{source}: {size} bytes exceeds max_blob_bytes={self.max_blob_bytes}")
        return source

    def put_packed(self, source: str | os.PathLike[str], cuts: list[tuple[int, int]],
                   compress: bool = False) -> str:
        """Keep the file at ``source`` as a packed blob (p2p/blobpack.py): its ``cuts`` (``(offset, length)``
        runs, ascending) as pieces shared with every packed blob holding the same bytes, the rest literally.
        Served under its sha256 (returned) like a stored blob, though :meth:`has` stays False (no file holds
        it: :meth:`packed` gives it). The source is left where it is. A failed write (a full disk) leaves
        nothing behind: pieces no manifest names are swept. ``compress``: the literal runs are kept as
        compressed pieces where zlib saves a quarter (p2p/blobpack.py)."""
        source = self._checked_source(source)
        return self._put_packed(lambda: pack_file(source, cuts, self.pieces_dir, self.staging, compress))

    def put_packed_parts(self, parts: Iterable[tuple[bytes | memoryview, bool]]) -> str:
        """Keep the blob whose bytes ``parts`` gives in order as a packed blob, never whole in memory nor in
        a file of its own: ``(bytes, True)`` a run kept as a piece shared by content (a start state's tensor
        data), ``(bytes, False)`` literal bytes (p2p/blobpack.py, :class:`PackWriter`). Otherwise as
        :meth:`put_packed`; its sha256 hex."""
        def build() -> tuple[str, bytes, set[str]]:
            writer = PackWriter(self.pieces_dir, self.staging)
            for data, shared in parts:
                if shared:
                    writer.piece((data,), memoryview(data).nbytes)
                else:
                    writer.literal(data)
            return writer.finish()

        return self._put_packed(build)

    def _put_packed(self, build: Callable[[], tuple[str, bytes, set[str]]]) -> str:
        """Run ``build`` (pieces written, the manifest returned) under the pack lock and keep its manifest."""
        with self._pack_lock:
            self.pieces_dir.mkdir(exist_ok=True)
            self.packed_dir.mkdir(exist_ok=True)
            try:
                sha256_hex, manifest, _named = build()
                if sha256_hex in self._packed or self.has(sha256_hex):
                    self._sweep()  # pieces only this copy wrote
                    return sha256_hex
                staged = self.new_staging_file(MANIFEST_SUFFIX)
                with open(staged, "wb") as handle:
                    handle.write(manifest)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(staged, self.packed_dir / f"{sha256_hex}{MANIFEST_SUFFIX}")
                _fsync_dir(self.packed_dir)
            except BaseException:
                for leftover in self.staging.glob(f"*{MANIFEST_SUFFIX}"):
                    leftover.unlink(missing_ok=True)
                self._sweep()
                raise
            self._packed[sha256_hex] = parse_manifest(manifest, sha256_hex, self.pieces_dir)
        return sha256_hex

    def packed(self, sha256_hex: str) -> PackedBlob | None:
        """The packed blob of that sha256, or None."""
        return self._packed.get(sha256_hex)

    def served_packed(self, key_hex: str) -> PackedBlob | None:
        """The packed blob served under ``key_hex``: its sha256 or an alias of it (:meth:`alias`); None."""
        return self._packed.get(key_hex) or self._packed.get(self._aliases.get(key_hex, key_hex))

    def read(self, sha256_hex: str) -> bytes:
        """The whole blob ``sha256_hex``, a file or packed; BlobNotFound if neither is held."""
        try:
            return self.path(sha256_hex).read_bytes()
        except FileNotFoundError:
            packed = self._packed.get(sha256_hex)
            if packed is None:
                raise BlobNotFound(f"blob {sha256_hex} is not stored locally") from None
            return packed.pread(0, packed.size)

    def _load_packed(self) -> None:
        """Read the manifests a previous run left (a damaged one, or one naming a missing piece, is not
        served: the warning names it), then sweep the pieces none names (a write a crash cut short)."""
        with self._pack_lock:
            for manifest in sorted(self.packed_dir.iterdir()):
                name = manifest.name.removesuffix(MANIFEST_SUFFIX)
                if not _HEX64.match(name) or manifest.suffix != MANIFEST_SUFFIX:
                    continue
                try:
                    blob = parse_manifest(manifest.read_bytes(), name, self.pieces_dir)
                    check_pieces(blob)
                except (OSError, BlobError) as exc:
                    logger.warning("packed blob %s not served: %s", manifest, exc)
                    continue
                self._packed[name] = blob
            self._sweep()

    def _sweep(self) -> None:
        """Delete the pieces no packed blob names (under ``_pack_lock``)."""
        if not self.pieces_dir.is_dir():
            return
        named = set().union(*(blob.pieces() for blob in self._packed.values()))
        for piece in self.pieces_dir.iterdir():
            if piece.name not in named:
                piece.unlink(missing_ok=True)

    def alias(self, key_hex: str, sha256_hex: str) -> None:
        """Serve the stored blob ``sha256_hex`` also under ``key_hex`` (another 32-byte hash that names it,
        e.g. a Merkle root). A fetcher cannot check such a blob by its sha256: it reads it by range
        (``fetch_alias``) and checks it against the key itself."""
        self._aliases[check_sha256_hex(key_hex)] = check_sha256_hex(sha256_hex)

    def served_path(self, key_hex: str) -> Path:
        """The file served under ``key_hex``: the stored blob of that sha256, else a file served from where it
        is (:meth:`serve_file`), else what the key aliases (the path need not exist: the caller stats it)."""
        path = self.path(key_hex)
        if path.is_file():
            return path
        target = self._aliases.get(key_hex, key_hex)
        return self._files.get(target) or self.path(target)

    def commit(self, staged: Path, sha256_hex: str, verified: bool = False) -> Path:
        """Move a complete staging file into place, hashing it first unless ``verified``."""
        sha256_hex = check_sha256_hex(sha256_hex)
        if not verified:
            actual = hash_file(staged)
            if actual != sha256_hex:
                staged.unlink(missing_ok=True)
                raise BlobHashMismatch(f"staged blob hashes to {actual}, expected {sha256_hex}")
        target = self.path(sha256_hex)
        # Read-only: exported copies are hard links, so this keeps callers from editing a
        # stored blob in place (which would make this host serve bytes that fail their hash).
        os.chmod(staged, 0o444)
        os.replace(staged, target)
        _fsync_dir(self.root)
        return target

    def export(self, sha256_hex: str, dest: str | os.PathLike[str]) -> Path:
        """Make the blob available at ``dest``: a read-only hard link when possible, else an atomic copy.

        Do not modify the result in place: copy it first (or remove it when done).
        """
        source = self.path(sha256_hex)
        if not source.is_file():
            raise BlobNotFound(f"blob {sha256_hex} is not stored locally")
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists() and os.path.samefile(dest, source):
            return dest
        link_or_copy(source, dest)
        return dest

    def remove(self, sha256_hex: str) -> bool:
        """Delete a stored blob and the aliases that served it (:meth:`alias`); True if it existed."""
        path = self.path(sha256_hex)
        existed = path.is_file()
        path.unlink(missing_ok=True)
        if sha256_hex in self._packed:  # no wait on a pack being written for any other blob
            with self._pack_lock:
                existed = self._packed.pop(sha256_hex, None) is not None or existed
                (self.packed_dir / f"{sha256_hex}{MANIFEST_SUFFIX}").unlink(missing_ok=True)
                self._sweep()
        # An alias of a removed blob serves nothing; kept, one stayed in memory for every chunked state a run
        # published and dropped (two a round and stage, issue 45). list(): alias() may run on another thread.
        for key, target in list(self._aliases.items()):
            if target == sha256_hex:
                self._aliases.pop(key, None)
        return existed

    def list(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_file() and _HEX64.match(p.name))
