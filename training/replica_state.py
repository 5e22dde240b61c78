"""A replica's complete training state at the start of an outer round, as canonical bytes.

Re-execution (:mod:`training.reexec`) reruns round ``t`` of replica ``i`` and
compares the result with the contribution the replica signed. For that the
contribution commits (by hash) to everything the round's H inner steps and the
encode read, for every stage ``s`` of the replica:

* the live local weights ``theta_i`` (``param/<name>``);
* the inner optimizer's state: AdamW's step count and both moments (``adam.step/<name>``,
  ``adam.exp_avg/<name>``, ``adam.exp_avg_sq/<name>``), and with ``training.optimizer = "muon"``
  the hidden matrices' Muon momentum (``muon.momentum_buffer/<name>``) in place of AdamW's
  (training/muon.py); absent before the first inner step of the run;
* the :class:`~training.stage_engine.StageEngine` state: global weights and outer
  momentum of the last applied round (``global/``, ``momentum/``), the
  error-feedback residual (``residual/``), the local snapshot of the round
  start (``round_start/``), the snapshots of rounds encoded but not applied
  yet (``round_end.<r>/``), the decoded updates it transmitted for rounds not
  applied yet and the last applied one (``sent.<r>/``: a contribution the close
  left out goes back into the residual, :meth:`~training.stage_engine.StageEngine.contribution_dropped`),
  and the "eager" correction's own decoded contributions (``own_decoded.<r>/``)
  and the others' previous sum (``others_previous/``), and with encoder "v3" or "v4"
  its memo: each tensor's coding (``encoder.choice/<name>``, float32
  ``[codec id, rank, bits]``) and, "v3", the low-rank ones' Ritz bases
  (``encoder.basis/<name>``, ``k x c``) or, "v4", every candidate's estimated
  relative error from the last selection (``encoder.estimate/<name>``, float32);
* the round's position: outer round, replica, stages, H, the inner-lr
  schedule's horizon, the torch intra-op thread count and, for a replica split
  over several processes, the pipeline's micro-batch count (metadata);
* the platform the replica trains on (``platform``, a
  :class:`training.fingerprint.PlatformFingerprint`: device, precision, library
  versions, deterministic flags), which decides whether a rerun must be
  bit-exact (docs/GPU.md).

Byte layout of one stage's part (all integers little-endian)::

    b"dlx-replica-state-v1"                20 bytes, domain separation
    u32 len(meta) || meta                  canonical JSON: sorted keys, no spaces, ASCII:
                                           {"engine", "meta", "stage", "v": 1} without a platform (the
                                           bytes of every state made before issue 32), or
                                           {"engine", "meta", "platform", "stage", "v": 2} with one
    u32 number of tensors
    for each tensor, names in ascending order of their UTF-8 bytes:
        the record of training.hashing.stage_weights_hash (name, dtype tag, dims, data)

    stage_state_hash  = sha256(the bytes above)
    replica_state_root = sha256(b"dlx-replica-state-root-v1" || u32 S || hash_0 || ... || hash_{S-1})

A node holding one stage of a split replica captures, archives and serves only
its stage's part; the contribution of stage ``s`` binds ``stage_state_hash`` of
that part. A verifier fetches every part, checks each against its envelope and
re-executes the replica whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import BinaryIO
from dataclasses import asdict, dataclass

import numpy as np
import torch

from training.errors import PlatformError, ReplicaStateError
from training.fingerprint import PlatformFingerprint, parse_fingerprint
from training.hashing import tensor_le_array
from training.jsonbound import loads_bounded

logger = logging.getLogger(__name__)

STATE_MAGIC = b"dlx-replica-state-v1"
STATE_ROOT_MAGIC = b"dlx-replica-state-root-v1"
STATE_VERSION = 1  # header without a platform fingerprint
STATE_VERSION_PLATFORM = 2  # header with one (issue 32)
_MAX_META_BYTES = 1 << 16
_MAX_TENSORS = 1 << 16


@dataclass(frozen=True)
class RoundMeta:
    """Where in the run a start state sits, and how the replica computed the round.

    ``lr_total_steps``: the horizon of the inner-lr schedule (``rounds * H``; 0 for an
    open-ended run). ``threads``: ``torch.get_num_threads()`` while training (the
    verifier uses the same count to be bit-exact). ``micro_batches``: 0 if every stage
    ran chained in one process, else the GPipe micro-batch count of the split pipeline.
    ``platform``: where the inner steps ran (None: not recorded, a state made before
    fingerprints existed; such a state's bytes are exactly what they were).
    """

    outer_round: int
    replica: int
    num_stages: int
    inner_steps: int
    lr_total_steps: int
    threads: int
    micro_batches: int
    platform: PlatformFingerprint | None = None

    def __post_init__(self) -> None:
        if self.platform is not None and not isinstance(self.platform, PlatformFingerprint):
            raise ReplicaStateError(
                f"round meta platform={self.platform!r}: must be a PlatformFingerprint or None"
            )
        for name, value in self.counters().items():
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
                raise ReplicaStateError(f"round meta {name}={value!r}: must be an integer in [0, 2**63)")
        if self.num_stages < 1 or self.inner_steps < 1 or self.threads < 1:
            raise ReplicaStateError(
                f"round meta: num_stages={self.num_stages}, inner_steps={self.inner_steps}, "
                f"threads={self.threads} must all be >= 1"
            )

    def counters(self) -> dict[str, int]:
        """The integer fields (the header's ``meta`` object)."""
        out = asdict(self)
        del out["platform"]
        return out


@dataclass(frozen=True)
class StageStartState:
    """One stage's part of a replica start state: metadata plus named float32 tensors."""

    meta: RoundMeta
    stage_index: int
    engine_counters: tuple[int, int, int]  # (last_encoded, last_applied, others_previous count or -1)
    tensors: Mapping[str, torch.Tensor]

    def to_bytes(self) -> bytes:
        """The canonical bytes of the module docstring (one copy of the tensors' data)."""
        return b"".join(self._pieces())

    def _pieces(self) -> Iterator[bytes | memoryview]:
        """:meth:`to_bytes` in order, each tensor's data a view of its little-endian array (no copy)."""
        return (piece for piece, _data in self.parts())

    def parts(self) -> Iterator[tuple[bytes | memoryview, bool]]:
        """:meth:`to_bytes` in order as ``(bytes, is a tensor's data)``: what a store that keeps the tensors'
        data as pieces shared with other states writes from, never the whole state at once (a tensor's data is
        a view of its little-endian array, no copy)."""
        header = {
            "v": STATE_VERSION,
            "stage": self.stage_index,
            "meta": self.meta.counters(),
            "engine": list(self.engine_counters),
        }
        if self.meta.platform is not None:
            header.update(v=STATE_VERSION_PLATFORM, platform=self.meta.platform.document())
        meta = _canonical_json(header)
        yield STATE_MAGIC + struct.pack("<I", len(meta)) + meta + struct.pack("<I", len(self.tensors)), False
        for name in sorted(self.tensors, key=lambda n: n.encode("utf-8")):
            record, data = _tensor_record(name, self.tensors[name])
            yield record, False
            yield data, True

    def write_to(self, out: BinaryIO) -> bytes:
        """Write :meth:`to_bytes` to the binary file ``out`` piece by piece and return their sha256: the same
        bytes and hash without holding them whole (each tensor's data goes out as a view of its array)."""
        digest = hashlib.sha256()
        for piece in self._pieces():
            digest.update(piece)
            out.write(piece)
        return digest.digest()

    def state_hash(self) -> bytes:
        """sha256 of :meth:`to_bytes` (what the stage's contribution envelope binds), without building them.
        """
        digest = hashlib.sha256()
        for piece in self._pieces():
            digest.update(piece)
        return digest.digest()

    @property
    def num_bytes(self) -> int:
        return sum(memoryview(piece).nbytes for piece in self._pieces())

    def group(self, prefix: str) -> dict[str, torch.Tensor]:
        """The tensors under ``prefix/`` with the prefix removed (e.g. ``"param"``)."""
        head = prefix + "/"
        return {name[len(head):]: value for name, value in self.tensors.items() if name.startswith(head)}

    def rounds_of(self, kind: str) -> list[int]:
        """The rounds ``r`` of the ``<kind>.<r>/`` groups (``round_end``, ``own_decoded``, ``sent``)."""
        head = kind + "."
        return sorted(
            {int(name[len(head) :].split("/", 1)[0]) for name in self.tensors if name.startswith(head)}
        )


@dataclass(frozen=True)
class ReplicaStartState:
    """Every stage's part of one replica's start state of one round (stage-index order)."""

    stages: tuple[StageStartState, ...]

    def __post_init__(self) -> None:
        if not self.stages:
            raise ReplicaStateError("a replica start state needs at least one stage")
        meta = self.stages[0].meta
        if [s.stage_index for s in self.stages] != list(range(meta.num_stages)):
            raise ReplicaStateError(
                f"stages {[s.stage_index for s in self.stages]}: a replica start state needs every stage "
                f"0..{meta.num_stages - 1} in order"
            )
        if any(s.meta != meta for s in self.stages):
            raise ReplicaStateError(
                "the stages' round metadata disagree (round, replica, H, threads, micro-batches)"
            )

    @property
    def meta(self) -> RoundMeta:
        return self.stages[0].meta

    def stage_hashes(self) -> list[bytes]:
        return [stage.state_hash() for stage in self.stages]

    def state_hash(self) -> bytes:
        """:func:`replica_state_root` of the stage hashes."""
        return replica_state_root(self.stage_hashes())

    @property
    def num_bytes(self) -> int:
        return sum(stage.num_bytes for stage in self.stages)


def replica_state_root(stage_hashes: Sequence[bytes]) -> bytes:
    """sha256 over the per-stage state hashes in stage-index order."""
    digest = hashlib.sha256(STATE_ROOT_MAGIC + struct.pack("<I", len(stage_hashes)))
    for index, stage_hash in enumerate(stage_hashes):
        if not isinstance(stage_hash, (bytes, bytearray)) or len(stage_hash) != 32:
            raise ReplicaStateError(f"stage state hash {index} is not 32 bytes")
        digest.update(bytes(stage_hash))
    return digest.digest()


# ----------------------------------------------------------------------------- bytes


def parse_stage_state(data: bytes | memoryview, *, tensors: bool = True,
                      data_ranges: list[tuple[int, int]] | None = None) -> StageStartState:
    """Parse :meth:`StageStartState.to_bytes` strictly; raise :class:`ReplicaStateError` on anything else.

    ``tensors=False`` checks all of it the same way but reads no tensor's data (the state's ``tensors`` is
    then empty): what a caller that needs only the header (its platform, its round) uses to refuse what
    the full parse refuses, without a copy of a state that is about 40 bytes per parameter
    (:func:`check_stage_state_file` for a file). Each tensor read is one copy of its bytes.
    ``data_ranges``: a list each tensor's data gets appended to as ``(offset, length)`` in ``data``.
    """
    view = memoryview(data).cast("B")
    position = 0

    def take(count: int, what: str, copy: bool = True) -> bytes | memoryview:
        nonlocal position
        if count < 0 or position + count > len(view):
            raise ReplicaStateError(f"replica state truncated in {what} (at byte {position} of {len(view)})")
        chunk = view[position:position + count]
        position += count
        return bytes(chunk) if copy else chunk

    def u32(what: str) -> int:
        return struct.unpack("<I", take(4, what))[0]

    try:  # the views of ``data`` are let go whatever happens (a mapped file can then be closed)
        if take(len(STATE_MAGIC), "magic") != STATE_MAGIC:
            raise ReplicaStateError("not a replica state (bad magic)")
        meta_len = u32("meta length")
        if meta_len > _MAX_META_BYTES:
            raise ReplicaStateError(f"replica state meta of {meta_len} bytes is too large")
        raw_meta = take(meta_len, "meta")
        meta, stage_index, counters = _parse_header(raw_meta)
        count = u32("tensor count")
        if count > _MAX_TENSORS:
            raise ReplicaStateError(f"replica state holds {count} tensors, more than {_MAX_TENSORS}")
        read: dict[str, torch.Tensor] = {}
        previous = None
        for _ in range(count):
            name_bytes = take(u32("name length"), "name")
            if previous is not None and name_bytes <= previous:
                raise ReplicaStateError("replica state tensors are not in ascending name order")
            previous = name_bytes
            try:
                name = name_bytes.decode("utf-8", errors="strict")
            except UnicodeDecodeError:
                raise ReplicaStateError("replica state tensor name is not UTF-8") from None
            tag = take(struct.unpack("<B", take(1, "dtype length"))[0], "dtype")
            if tag != b"float32":
                raise ReplicaStateError(f"{name!r}: dtype {tag!r}, only float32 is stored")
            ndim = u32("ndim")
            if ndim > 8:
                raise ReplicaStateError(f"{name!r}: {ndim} dimensions")
            shape = struct.unpack(f"<{ndim}Q", take(8 * ndim, "dims"))
            if any(dim >= 2**31 for dim in shape):  # torch takes int64 sizes; no real tensor is that long
                raise ReplicaStateError(f"{name!r}: dimension out of range in {shape}")
            size = struct.unpack("<Q", take(8, "data length"))[0]
            numel = 1
            for dim in shape:
                numel *= dim
            if size != 4 * numel:
                raise ReplicaStateError(f"{name!r}: {size} data bytes for shape {shape}")
            if data_ranges is not None:
                data_ranges.append((position, size))
            data_view = take(size, name, copy=False)
            if tensors:  # one copy: from the (little-endian) bytes into a native float32 array
                array = np.frombuffer(data_view, dtype="<f4").astype(np.float32)
                read[name] = torch.from_numpy(array).reshape(shape)
            del data_view
            _release_mapped(data, position - size, size)
        if position != len(view):
            raise ReplicaStateError(f"replica state has {len(view) - position} trailing bytes")
    finally:
        view.release()
    return StageStartState(meta, stage_index, counters, read)


def _release_mapped(data, start: int, length: int) -> None:
    """Drop the pages of ``data[start:start + length]`` from this process's resident set when ``data`` is a
    read-only map of a file (:func:`mapped_state_files`): the bytes were copied, and a mapped page once read
    stays resident (and counted) until the map is closed, which for a rerun's state is after the rerun: the
    whole state (about 40 bytes per parameter of the replica) beside its parsed copy (issue 75). The pages
    stay in the page cache; a later read faults them in again."""
    if not isinstance(data, mmap.mmap):
        return
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the range only
    end = (start + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        data.madvise(mmap.MADV_DONTNEED, first, end - first)


@contextlib.contextmanager
def _read_only_map(file):
    """A read-only map of ``file``, closed on exit unless a view of it is still alive: then it is unmapped
    when that view goes. A sampling profiler (node/live/costprofile.py) holds threads' frames while it walks
    their stacks, and a frame that returns meanwhile keeps its locals (a slice of the map) a moment longer;
    ``mmap.close`` then raises BufferError, which must not fail a read that succeeded."""
    mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        yield mapped
    finally:
        try:
            mapped.close()
        except BufferError:
            pass


@contextlib.contextmanager
def mapped_state_files(paths):
    """Read-only maps of the state files at ``paths`` (a list of buffers :func:`parse_stage_state` takes),
    closed on exit: a rerun parses each state straight from the page cache, so a state (about 40 bytes per
    parameter of the stages it holds) is not also held whole as ``bytes``. An empty file maps to ``b""``."""
    with contextlib.ExitStack() as stack:
        maps = []
        for path in paths:
            file = stack.enter_context(open(path, "rb"))
            if os.fstat(file.fileno()).st_size == 0:
                maps.append(b"")
                continue
            maps.append(stack.enter_context(_read_only_map(file)))
        yield maps


def check_stage_state_file(path, data_ranges: list[tuple[int, int]] | None = None) -> StageStartState:
    """:func:`parse_stage_state` of the file at ``path`` with ``tensors=False``: every check, through a
    read-only map of the file (no copy of it in memory); OSError if it cannot be read. ``data_ranges``: as
    for :func:`parse_stage_state` (where each tensor's data lies in the file)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return parse_stage_state(b"", tensors=False)
        with _read_only_map(file) as mapped:
            view = memoryview(mapped)
            try:
                return parse_stage_state(view, tensors=False, data_ranges=data_ranges)
            finally:
                view.release()


def _parse_header(raw_meta: bytes) -> tuple[RoundMeta, int, tuple[int, ...]]:
    """The canonical JSON header of a stage's state: ``(meta, stage index, engine counters)``."""
    try:
        header = loads_bounded(raw_meta.decode("ascii"), 8)  # nests 3 deep; deeper is a peer's attack
        if _canonical_json(header) != raw_meta:
            raise ReplicaStateError("replica state meta is not canonical JSON")
        keys = {"v", "stage", "meta", "engine"}
        if not ((set(header) == keys and header["v"] == STATE_VERSION)
                or (set(header) == keys | {"platform"} and header["v"] == STATE_VERSION_PLATFORM)):
            raise ReplicaStateError(f"replica state meta keys {sorted(header)} or version unsupported")
        if not isinstance(header["meta"], dict) or "platform" in header["meta"]:
            raise ReplicaStateError("replica state meta is not an object of counters")
        platform = parse_fingerprint(header["platform"]) if "platform" in header else None
        meta = RoundMeta(**header["meta"], platform=platform)
        stage_index = header["stage"]
        counters = tuple(header["engine"])
        if (not isinstance(stage_index, int) or not 0 <= stage_index < meta.num_stages or len(counters) != 3
                or not all(isinstance(c, int) and -1 <= c < 2**63 for c in counters)):
            raise ReplicaStateError(
                f"replica state: bad stage {stage_index!r} or engine counters {counters!r}"
            )
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:  # RecursionError: deep JSON
        if isinstance(exc, ReplicaStateError):
            raise
        if isinstance(exc, PlatformError):
            raise ReplicaStateError(f"replica state {exc}"[:300]) from None
        raise ReplicaStateError(
            f"replica state meta is malformed: {type(exc).__name__}: {exc}"[:300]
        ) from None
    return meta, stage_index, counters


def _canonical_json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _tensor_record(name: str, tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    """(header, data) of one tensor's record: the data a view of its little-endian float32 array."""
    if tensor.dtype != torch.float32:
        raise ReplicaStateError(f"{name!r}: dtype {tensor.dtype}, the replica state stores float32 only")
    name_bytes = name.encode("utf-8")
    data = memoryview(tensor_le_array(tensor)).cast("B")
    dims = struct.pack(f"<{tensor.dim()}Q", *tensor.shape)
    return (b"".join((struct.pack("<I", len(name_bytes)), name_bytes, struct.pack("<B", 7), b"float32",
                      struct.pack("<I", tensor.dim()), dims, struct.pack("<Q", data.nbytes))), data)

