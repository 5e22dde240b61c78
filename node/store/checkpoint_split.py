"""A chunked run's checkpoint kept as its header and each node's own stages, not whole (issue 75: disk).

Every node builds a checkpoint round's full checkpoint (node/live/record/checkpointbuild.py) and kept the
file: S times its stage's state on every node of an S-stage run (at the 107B layout's 10 stages, 856 GB a
node for each checkpoint round kept). With ``storage.checkpoints = "stages"`` a node of a chunked run keeps
only what it can vouch for alone and what names the rest:

* the checkpoint's *header* (the file's first bytes: its length field, the tensors' offsets and the run's
  metadata with every stage leaf), ``round-<t>.head``, served under :func:`header_key` of the content hash;
* its own attested stage shards ``shard-<t>-stage<s>.safetensors`` (kept already, for the assembly), each
  served also under :func:`stage_key` of the content hash and the stage;
* ``round-<t>.split.json``: which blobs those are (the aliases are the blob store's, in memory: a restart
  serves them again from it).

The record's content hash is computed as the file is streamed into a hash (:func:`checkpoint_digest`), byte
for byte what ``write_checkpoint`` would write. Whoever needs the whole file (``pull``, an auditor, a
seeder, a joiner's own stages) reads the header and each stage's shard from their holders, checks the
header's metadata against the run and its stage leaves against the record's weights root, checks every
stage's tensors against its leaf, writes the file with the same streaming writer and compares its sha256
with the record's (:func:`assemble_checkpoint`). A hashed run's momentum is in no record, so a hashed run
keeps whole files. In a header-hashed run (node/store/checkpoint_hash.py) the record's hash is the header's:
nobody hashes the whole file to sign, a header is checked against it and against the run document byte for
byte (:func:`verified_header`), and every stage against its leaf. Every byte read here is an adversary's
until checked (StateError naming it).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from node.errors import StateError
from node.store.checkpoint import MAX_JSON_DEPTH, Checkpoint, CheckpointTensors, RunLayout, write_checkpoint
from node.store.checkpoint_size import SPLIT_ABOVE_BYTES, tensor_bytes
from node.store.checkpoint_hash import checkpoint_header, file_record_hash, header_hash
from node.store.checkpoint_stage import (MAX_HEADER_BYTES, FetchRange, check_stage, checked_header,
                                         raw_header, read_header, stage_tensors)
from node.store.safetensors_stream import write_safetensors
from training.jsonbound import loads_bounded

logger = logging.getLogger(__name__)

SPLIT_FORMAT = 1


def checkpoint_bytes(layout: RunLayout) -> int:
    """The tensor bytes of the run's whole checkpoint: every stage's weights and outer momentum, float32."""
    return tensor_bytes(layout.stage_shapes, layout.outer_moments)


def keeps_split(setting: str, layout: RunLayout) -> bool:
    """Whether a node with ``storage.checkpoints = setting`` keeps this run's checkpoints split: never in a
    hashed run, always in a header-hashed one (its committers hold only their own stages); otherwise
    ``"stages"`` always, ``"whole"`` never, ``"auto"`` from :data:`SPLIT_ABOVE_BYTES` on."""
    if not layout.chunked or (setting == "whole" and not layout.header_hashed):
        return False
    if layout.header_hashed:
        return True
    return setting == "stages" or checkpoint_bytes(layout) >= SPLIT_ABOVE_BYTES
_HEADER_TAG = b"dlx-checkpoint-header/v1"
_STAGE_TAG = b"dlx-checkpoint-stage/v1"


def header_key(content_hash: bytes) -> str:
    """The blob key a holder serves the checkpoint ``content_hash``'s header under (sha256 hex)."""
    return hashlib.sha256(_HEADER_TAG + content_hash).hexdigest()


def stage_key(content_hash: bytes, stage: int) -> str:
    """The blob key a holder serves its shard of ``stage`` of the checkpoint ``content_hash`` under."""
    return hashlib.sha256(_STAGE_TAG + content_hash + stage.to_bytes(4, "big")).hexdigest()


def head_path(checkpoint_dir: Path, round_index: int) -> Path:
    return checkpoint_dir / f"round-{round_index:08d}.head"


def split_path(checkpoint_dir: Path, round_index: int) -> Path:
    return checkpoint_dir / f"round-{round_index:08d}.split.json"


def shard_path(checkpoint_dir: Path, round_index: int, stage: int) -> Path:
    return checkpoint_dir / f"shard-{round_index:08d}-stage{stage}.safetensors"


class _HashSink:
    """A write-only file that hashes what is written and keeps the first write (the safetensors header:
    :func:`write_safetensors` writes it in one call before any tensor)."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()
        self.header: bytes | None = None

    def write(self, data) -> int:
        if self.header is None:
            self.header = bytes(data)
        self.sha.update(data)
        return len(data)


def checkpoint_digest(checkpoint: Checkpoint) -> tuple[bytes, bytes]:
    """``(sha256 of the checkpoint's file, its header bytes)`` without writing the file: the bytes
    ``write_checkpoint`` writes, streamed into a hash one tensor at a time."""
    sink = _HashSink()
    write_safetensors(sink, CheckpointTensors(checkpoint), checkpoint._metadata())
    header = sink.header or b""
    if len(header) < 8 or int.from_bytes(header[:8], "little") != len(header) - 8:
        raise StateError("the checkpoint's header was not written first")  # write_safetensors' contract
    return sink.sha.digest(), header


def bytes_range(data: bytes) -> FetchRange:
    """A :data:`FetchRange` over bytes in memory (a header read whole)."""
    return lambda offset, length: data[offset:offset + length]


def file_range(path: Path) -> FetchRange:
    """A :data:`FetchRange` over a local file (a node directory's shard)."""
    def read(offset: int, length: int) -> bytes:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read(length)
    return read


def stage_from_shard(fetch: FetchRange, layout: RunLayout, ckpt: Checkpoint, leaf, stage: int):
    """``stage``'s (weights, momentum) read by ``fetch`` from a holder's stage shard (a safetensors file
    of the stage's ``weights.*`` and ``momentum.*``), checked against the stage's leaf and the header's
    stage hash. StateError naming what is wrong."""
    header, start = read_header(fetch)
    weights, momentum = stage_tensors(fetch, header, start, layout, stage)
    check_stage(ckpt, layout, stage, leaf, weights, momentum)
    return weights, momentum


def verified_header(fetch: FetchRange, layout: RunLayout, round_index: int, weights_root: bytes,
                    record_hash: bytes | None = None) -> tuple[Checkpoint, list]:
    """``(the checkpoint's metadata with no tensors, every stage's parsed leaf)`` from a header read by
    ``fetch``: its metadata the run's, its stage leaves giving ``weights_root``, and its bytes exactly the
    header the run document gives for that metadata (node/store/checkpoint_hash.py); in a header-hashed run
    they must also hash to ``record_hash``, the record's checkpointHash. StateError naming what is wrong."""
    raw = raw_header(fetch)
    if layout.header_hashed:
        if record_hash is None:
            raise StateError("a header-hashed run's checkpoint header is checked against the record's "
                             "checkpointHash, and none was given")
        if header_hash(raw) != record_hash:
            raise StateError(f"its header hashes to {header_hash(raw).hex()[:16]}, not the record's "
                             f"checkpointHash {record_hash.hex()[:16]}")
    ckpt, leaves, _header, _start = checked_header(bytes_range(raw), layout, round_index, weights_root)
    if checkpoint_header(layout, ckpt) != raw:
        raise StateError("its header is not the one the run document gives for its metadata (tensors, "
                         "shapes, offsets or metadata written otherwise)")
    return ckpt, leaves


def first_verified(sources: Iterable[FetchRange], parse: Callable[[FetchRange], object],
                   what: str) -> tuple[object | None, list[str]]:
    """``(parse(fetch), [])`` for the first of ``sources`` that verifies, else ``(None, why each failed)``.
    A source whose fetch failed in transport (a peer's stream or connection error, not a refused or wrong
    part) is asked once more after the others: a connection a loaded peer dropped is dialled again, so a
    busy machine makes the fetch slower, not failed."""
    why: list[str] = []
    again: list[FetchRange] = []
    for attempt, batch in enumerate((list(sources), again)):
        for fetch in batch:
            try:
                return parse(fetch), []
            except (StateError, OSError) as exc:
                why.append(f"{what}: {exc}")
            except Exception as exc:  # noqa: BLE001 - a peer's fetch error (p2p.errors): the next source
                why.append(f"{what}: {type(exc).__name__}: {exc}")
                if attempt == 0:
                    again.append(fetch)
    return None, why


def split_stages(headers: Iterable[FetchRange], shards: Callable[[int], Iterable[FetchRange]],
                 layout: RunLayout, round_index: int, weights_root: bytes,
                 stages: Iterable[int], record_hash: bytes | None = None) -> Checkpoint:
    """The checkpoint restricted to ``stages``: its header from the first of ``headers`` that verifies
    (:func:`verified_header`; ``record_hash``: the record's checkpointHash, which a header-hashed run's
    header must give), each stage from the first of ``shards(stage)`` that verifies (the others' errors are
    named if none does; :func:`first_verified`). Its ``stage_leaves`` are every stage's, its tensors those
    stages' only."""
    found, refused = first_verified(
        headers, lambda fetch: verified_header(fetch, layout, round_index, weights_root, record_hash),
        "header")
    if found is None:
        raise StateError("no checkpoint header verified: " + (" | ".join(refused) or "no source")[:1500])
    ckpt, leaves = found
    for stage in sorted(set(stages)):
        state, why = first_verified(
            shards(stage), lambda fetch, s=stage: stage_from_shard(fetch, layout, ckpt, leaves[s], s),
            f"stage {stage}")
        if state is None:
            raise StateError(f"no shard of stage {stage} verified against its leaf: "
                             + (" | ".join(why) or "no holder")[:1500])
        ckpt.weights.update(state[0])
        ckpt.momentum.update(state[1])
    return ckpt


def assemble_checkpoint(headers: Iterable[FetchRange], shards: Callable[[int], Iterable[FetchRange]],
                        layout: RunLayout, round_index: int, weights_root: bytes, content_hash: bytes,
                        dest: Path) -> Checkpoint:
    """Write the whole checkpoint of ``round_index`` to ``dest`` from its header and every stage's shard
    (:func:`split_stages`), and check it against the record's ``content_hash`` under the run's rule (its
    sha256, or in a header-hashed run its header's hash: node/store/checkpoint_hash.py); the file is removed
    and StateError raised if it differs. Holds the model's tensors in RAM while writing: what ``pull`` and
    an auditor hold of a checkpoint anyway."""
    ckpt = split_stages(headers, shards, layout, round_index, weights_root, range(layout.num_stages),
                        content_hash)
    digest = write_checkpoint(dest, ckpt)
    if layout.header_hashed:
        digest = file_record_hash(dest, True)
    if digest != content_hash:
        dest.unlink(missing_ok=True)
        raise StateError(f"the checkpoint assembled from its header and stage shards hashes to "
                         f"{digest.hex()[:16]}, not the record's {content_hash.hex()[:16]}")
    return ckpt


def assemble_from_files(header: Path, shards: Iterable[Path], content_hash: bytes, dest: Path) -> bool:
    """Write the whole checkpoint ``content_hash`` to ``dest`` from a kept header and stage shard files (a
    node directory's, an auditor's or a seeder's): the header's bytes, then each tensor's bytes, in the
    header's data order, from the shard that names it. True if the file is the record's (else nothing is
    left at ``dest``). Needs no run document: under the "file" rule the record's hash checks every byte, a
    header or shard from a damaged or hostile directory only fails it; under the "header" rule (the header
    hashes to ``content_hash``: node/store/checkpoint_hash.py) the hash checks the header only, and whoever
    uses the file checks its tensors against the header's stage leaves (``pull``, ``audit``: every chunk)."""
    try:
        size = header.stat().st_size
        if size > 8 + MAX_HEADER_BYTES:
            raise ValueError(f"a header file of {size} bytes (at most {8 + MAX_HEADER_BYTES})")
        head = header.read_bytes()
        parsed, start = read_header(bytes_range(head))
        if start != len(head):
            raise ValueError(f"{len(head)} bytes where its length field says {start}")
        where: dict[str, tuple[Path, int, int]] = {}
        for path in shards:
            fetch = file_range(path)
            shard_header, shard_start = read_header(fetch)
            for name, entry in shard_header.items():
                offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
                if name != "__metadata__" and isinstance(offsets, list) and len(offsets) == 2:
                    begin, end = int(offsets[0]), int(offsets[1])
                    where.setdefault(name, (path, shard_start + begin, end - begin))
        order = sorted(((e["data_offsets"][0], n) for n, e in parsed.items() if n != "__metadata__"))
    except (OSError, StateError, ValueError, TypeError, KeyError, IndexError) as exc:
        logger.warning("checkpoint %s not assembled from %s: %s", content_hash.hex()[:16], header, exc)
        return False
    sha = hashlib.sha256(head)
    header_rule = header_hash(head) == content_hash
    dest.parent.mkdir(parents=True, exist_ok=True)
    staged = dest.with_name(f".{dest.name}.part")
    try:
        with open(staged, "wb") as out:
            out.write(head)
            for _offset, name in order:
                path, offset, length = where[name]
                data = file_range(path)(offset, length)
                if len(data) != length:
                    raise ValueError(f"{path}: tensor {name[:80]!r} cut short")
                sha.update(data)
                out.write(data)
        if not header_rule and sha.digest() != content_hash:
            raise ValueError(f"the assembled file hashes to {sha.hexdigest()[:16]}")
        staged.replace(dest)
        return True
    except (OSError, KeyError, ValueError) as exc:
        logger.warning("checkpoint %s not assembled from %s: %s", content_hash.hex()[:16], header,
                       f"no shard holds {exc}" if isinstance(exc, KeyError) else exc)
        staged.unlink(missing_ok=True)
        return False


def assemble_from_blobs(headers: Iterable[bytes], shards: Callable[[int], Iterable[bytes]],
                        content_hash: bytes, workdir: Path) -> bytes | None:
    """The whole checkpoint ``content_hash`` from headers and stage shards offered as bytes (what peers serve
    under its keys: an auditor's link), by :func:`assemble_from_files`: the first header that names its
    stages (its metadata's stage leaves), every offered shard of each of them. None if they do not make the
    record's file. ``workdir`` holds the parts meanwhile (emptied after)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="keyed-", dir=workdir))
    try:
        head, stages = folder / "header", None
        for data in headers:
            try:
                parsed, _start = read_header(bytes_range(data))
                meta = loads_bounded(parsed["__metadata__"]["dlx"], MAX_JSON_DEPTH)
                stages = sorted(int(s) for s in meta["stage_leaves"])
            except (StateError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                continue
            head.write_bytes(data)
            break
        if stages is None:
            return None
        parts = []
        for stage in stages:
            for index, data in enumerate(shards(stage)):
                parts.append(folder / f"stage{stage}-{index}.safetensors")
                parts[-1].write_bytes(data)
        dest = folder / "assembled.safetensors"
        return dest.read_bytes() if assemble_from_files(head, parts, content_hash, dest) else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def assemble_in_dirs(dirs: Iterable[Path], round_index: int, content_hash: bytes, dest: Path) -> bool:
    """:func:`assemble_from_files` from what node directories ``dirs`` kept of a split checkpoint (each
    directory's own stages: together they may hold every stage)."""
    headers, shards = [], []
    for directory in map(Path, dirs):
        for folder in (directory / "checkpoints", directory):
            listing = split_path(folder, round_index)
            split = read_split(listing) if listing.is_file() else None
            if split is None or split["content_hash"] != content_hash:
                continue
            headers.append(head_path(folder, round_index))
            shards += [shard_path(folder, round_index, stage) for stage in split["stages"]]
    return any(assemble_from_files(head, shards, content_hash, dest) for head in headers[:2])


def write_split(checkpoint_dir: Path, round_index: int, content_hash: bytes, header: bytes,
                stages: Mapping[int, str]) -> tuple[Path, Path]:
    """Keep round ``round_index``'s header and the list of this node's shards that serve its stages
    (``stages``: stage -> the shard's sha256 hex). Returns (the header's path, the list's path)."""
    from node.fsutil import atomic_write_bytes

    head = head_path(checkpoint_dir, round_index)
    atomic_write_bytes(head, header)
    body = {"v": SPLIT_FORMAT, "round": round_index, "content_hash": content_hash.hex(),
            "header": hashlib.sha256(header).hexdigest(),
            "stages": {str(s): h for s, h in sorted(stages.items())}}
    listing = split_path(checkpoint_dir, round_index)
    atomic_write_bytes(listing, json.dumps(body, sort_keys=True).encode() + b"\n")
    return head, listing


def read_split(path: Path) -> dict | None:
    """A ``round-<t>.split.json`` as :func:`write_split` wrote it, checked; None (logged) if it is not."""
    try:
        body = loads_bounded(path.read_bytes(), 4)
        stages = {int(s): str(h) for s, h in body["stages"].items()}
        out = {"round": int(body["round"]), "content_hash": bytes.fromhex(body["content_hash"]),
               "header": str(body["header"]), "stages": stages}
        hexes = [out["header"], *stages.values()]
        if body.get("v") != SPLIT_FORMAT or len(out["content_hash"]) != 32 or min(stages, default=0) < 0 \
                or any(len(h) != 64 or set(h) - set("0123456789abcdef") for h in hexes):
            raise ValueError(f"not a version-{SPLIT_FORMAT} listing of sha256 hashes")
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        logger.warning("%s: not a checkpoint split listing (%s): its aliases are not served", path, exc)
        return None


def serve_split(host, checkpoint_dir: Path) -> int:
    """Serve again, after a start, every kept split checkpoint's header and shards under their keys
    (the blob store keeps the blobs; its aliases live in memory). Returns how many rounds."""
    served = 0
    for path in sorted(checkpoint_dir.glob("round-*.split.json")) if checkpoint_dir.is_dir() else []:
        split = read_split(path)
        if split is None:
            continue
        alias_split(host, split["content_hash"], split["header"], split["stages"])
        served += 1
    return served


def alias_split(host, content_hash: bytes, header_sha: str, stages: Mapping[int, str]) -> None:
    """Serve the header and each stage shard (stored blobs) under their keys of ``content_hash``, announced
    on the DHT (a puller outside the run finds the holders of each stage by its key); a blob this node no
    longer stores is skipped, an announcement that times out is logged (the keys are served anyway)."""
    from p2p.errors import P2PTimeout

    keys = [(header_key(content_hash), header_sha)]
    keys += [(stage_key(content_hash, stage), shard) for stage, shard in stages.items()]
    for key, blob in keys:
        if not host.has_blob(blob):
            continue
        try:
            host.provide_alias(key, blob, announce=True)
        except P2PTimeout as exc:
            logger.info("checkpoint %s: key %s served; its DHT announcement timed out: %s",
                        content_hash.hex()[:12], key[:12], exc)
