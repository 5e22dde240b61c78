"""What a node holds on disk and in memory, by kind (bench/bench_retention.py's measurements; issue 75).

:func:`disk_bytes` walks a node's data directory (each file once: a hard link counts once) and sorts its
files and packed blobs by kind (:func:`file_kind`, :func:`packed_kinds`); :func:`memory_kib` reads a
process's resident and peak memory; :func:`summarise` turns a node's samples into the run's multiples.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from p2p.blobpack import MANIFEST_MAGIC, MANIFEST_SUFFIX, PACKED_DIR, PIECES_DIR, parse_manifest
from p2p.errors import BlobError

PARTS = ("archive", "checkpoints", "blobs", "chunk-states", "spotchecks")
START_STATE_MAGIC = b"dlx-replica-state-v1"


def file_kind(part: str, path: str, st: os.stat_result) -> str:
    """What a file of a node's data directory is (``part``: its top-level folder): ``checkpoint`` (a full
    checkpoint or a shard, in ``checkpoints/`` and linked into the store), ``start_state`` (a start state the
    node serves), ``published_state`` (a chunked run's stage state it serves: a safetensors blob not linked),
    ``chunk_spill`` (``chunk-states/``: the states a fraud proof reads), ``archive`` (envelopes and
    ``round.json``), ``other_blob`` (envelopes served, a version-3 stage's factors and sum trees, evidence),
    ``packed_piece`` and ``packed_manifest`` (packed blobs, p2p/blobpack.py, that :func:`packed_kinds`
    does not name), the spot checker's files (:func:`_spotcheck_kind`), ``other`` (logs, the node's state
    files)."""
    if part in ("checkpoints", "archive"):
        return "checkpoint" if part == "checkpoints" else "archive"
    if part == "chunk-states":
        return "chunk_spill"
    if part == "spotchecks":
        return _spotcheck_kind(path)
    if part != "blobs":
        return "other"
    if f"{os.sep}{PIECES_DIR}{os.sep}" in path:
        return "packed_piece"
    if f"{os.sep}{PACKED_DIR}{os.sep}" in path:
        return "packed_manifest"
    if st.st_nlink > 1:
        return "checkpoint"
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(START_STATE_MAGIC))
    except OSError:
        return "other_blob"
    if head == START_STATE_MAGIC:
        return "start_state"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < st.st_size:
        return "published_state"
    return "other_blob"


def _spotcheck_kind(path: str) -> str:
    """A file of the spot checker's work directory: ``held_claimant_state`` (another replica's start state
    held from an exact rerun of round t to round t+1's chain check, ``linkable/``), ``state_being_written``
    (the node's own start state before it is packed, ``start-states/``), ``rebuild_job`` (a rebuild's
    inputs and output, node/live/checks/staterebuild.py), ``spot_check_job`` (a rerun's inputs), ``other``."""
    parts = path.split(os.sep)
    if "linkable" in parts:
        return "held_claimant_state"
    if "start-states" in parts:
        return "state_being_written"
    if any(p.startswith("rebuild-") for p in parts):
        return "rebuild_job"
    if any(p.startswith("round-") for p in parts):
        return "spot_check_job"
    return "other"


#: Which kind a piece shared by packed blobs of several kinds counts as: the first in this order.
PACKED_ORDER = ("start_state", "published_state", "sum_trees", "packed_other")


def packed_kinds(blobs: Path) -> tuple[dict[str, str], dict[str, int]]:
    """The kind of each packed blob's manifest and pieces in the blob store ``blobs`` (path -> kind), and the
    blobs of each kind: ``start_state`` (a start state, and every piece one names: its tensors' data),
    ``published_state`` (a chunked run's published stage state: its weights and momentum, pieces no start
    state names), ``sum_trees`` (a version-3 stage's factors and sum trees, kept as compressed pieces),
    ``packed_other``. A manifest that does not parse (being written or removed) is skipped."""
    kinds: dict[str, str] = {}
    counts: dict[str, int] = {}
    for manifest in sorted((blobs / PACKED_DIR).glob(f"*{MANIFEST_SUFFIX}")):
        try:
            blob = parse_manifest(manifest.read_bytes(), manifest.name[:64], blobs / PIECES_DIR)
            head = blob.pread(0, 32)
        except (OSError, BlobError):
            continue
        if head.startswith(START_STATE_MAGIC):
            kind = "start_state"
        elif any(part[0] == "z" for part in blob.parts):
            kind = "sum_trees"
        elif head[8:9] == b"{":
            kind = "published_state"
        else:
            kind = "packed_other"
        counts[kind] = counts.get(kind, 0) + 1
        kinds[str(manifest)] = kind
        for piece in blob.pieces():
            path = str(blobs / PIECES_DIR / piece)
            if path not in kinds or PACKED_ORDER.index(kind) < PACKED_ORDER.index(kinds[path]):
                kinds[path] = kind
    return kinds, counts


def packed_size(path: str) -> int:
    """The size of the blob a packed manifest (p2p/blobpack.py) stands for; 0 if it cannot be read."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(MANIFEST_MAGIC) + 8)
    except OSError:
        return 0
    if not head.startswith(MANIFEST_MAGIC) or len(head) < len(MANIFEST_MAGIC) + 8:
        return 0
    return int.from_bytes(head[len(MANIFEST_MAGIC):], "little")


def disk_bytes(data_dir: Path) -> dict:
    """Bytes under ``data_dir`` (each inode once) and under each of PARTS, the newest start state's, per kind
    of file (:func:`packed_kinds`, :func:`file_kind`) its files and bytes, and the packed blobs of each
    kind held (``held``: how many rounds of start states and published states the node keeps)."""
    packed, held = packed_kinds(data_dir / "blobs")
    seen: set[tuple[int, int]] = set()
    total = 0
    parts = dict.fromkeys(PARTS, 0)
    kinds: dict[str, list[int]] = {}
    start_state = 0
    for root, _dirs, names in os.walk(data_dir):
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            rel = os.path.relpath(path, data_dir).split(os.sep)[0]
            if rel in parts:
                parts[rel] += st.st_size
            kind = packed.get(path) or file_kind(rel, path, st)
            count = kinds.setdefault(kind, [0, 0])
            count[0] += 1
            count[1] += st.st_size
            if kind == "start_state" and path in packed:  # kept as pieces: its size is in its manifest
                start_state = max(start_state, packed_size(path) if path.endswith(MANIFEST_SUFFIX) else 0)
            elif kind == "start_state":
                start_state = max(start_state, st.st_size)
    return {"total": total, **parts, "start_state": start_state, "held": held,
            "kinds": {k: {"files": v[0], "bytes": v[1]} for k, v in sorted(kinds.items())}}


REBUILT = re.compile(r"start state of round (\d+) rebuilt from round (\d+)'s \((\d+) rounds replayed, "
                     r"([0-9.]+) s\)")
NOT_REBUILT = re.compile(r"start state of round \d+ not rebuilt")
SPOT = re.compile(r"spot check of replica \d+ round \d+: (\w+)")
NOT_DONE = re.compile(r"spot check of replica \d+ round \d+ not done")


def rebuilds(data_dir: Path) -> dict:
    """From a node's logs: the start states it rebuilt when asked (node/live/checks/staterebuild.py: how
    many, the rounds replayed, the seconds each took, the ones that failed) and its spot checks' verdicts."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(data_dir.glob("node-*.log")))
    done = [(int(m[2]), float(m[3])) for m in REBUILT.findall(text)]
    seconds = sorted(s for _r, s in done)
    verdicts: dict[str, int] = {}
    for verdict in SPOT.findall(text):
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    return {"rebuilt": len(done), "rounds_replayed": sum(r for r, _s in done),
            "max_rounds_replayed": max((r for r, _s in done), default=0),
            "seconds_median": seconds[len(seconds) // 2] if seconds else None,
            "seconds_max": seconds[-1] if seconds else None,
            "failed": len(NOT_REBUILT.findall(text)),
            "spot_checks": verdicts, "spot_checks_not_done": len(NOT_DONE.findall(text))}


def unnamed_bytes(pid: int | None, data_dir: Path) -> int:
    """Bytes of the files without a name under ``data_dir`` that the process ``pid`` holds open (each inode
    once): the spilled tensors of training/spilled.py (the outer state between outer steps, the start
    state's copies of the trainer's tensors, the transmitted updates), made with O_TMPFILE or unlinked at
    once, which :func:`disk_bytes`'s walk cannot see; 0 if the process is gone."""
    return sum(size for size, _count in unnamed_by_dir(pid, data_dir).values())


def unnamed_by_dir(pid: int | None, data_dir: Path) -> dict[str, list[int]]:
    """:func:`unnamed_bytes` by the directory each file was made in (relative to ``data_dir``; a checkpoint
    removed while still open shows as its own name): directory -> [bytes, files]."""
    if pid is None:
        return {}
    root, seen, out = str(data_dir.resolve()), set(), {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not (target.startswith(root + os.sep) and target.endswith(" (deleted)")):
                continue
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            rel = os.path.relpath(target[:-len(" (deleted)")], root)
            where = os.path.dirname(rel) if os.path.basename(rel).startswith("#") else rel
            entry = out.setdefault(where, [0, 0])
            entry[0] += st.st_size
            entry[1] += 1
    return out


def memory_kib(pid: int | None) -> dict:
    if pid is None:
        return {}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_kib": int(fields["VmRSS"].split()[0]), "peak_rss_kib": int(fields["VmHWM"].split()[0])}


def stage_bytes(stages: int = 1, preset: str = "tiny") -> int:
    """fp32 bytes of the largest stage's weights of the ``preset`` model cut in ``stages`` (one stage: all of
    them; a node holds one stage)."""
    import math

    from node.config import load_config
    from node.runconfig import run_document
    from node.store.checkpoint import RunLayout

    cfg = load_config(None, [f"model.preset={preset}", f"pipeline.num_stages={stages}"])
    layout = RunLayout.of_document(0, b"\0" * 32, run_document(cfg))
    return max(4 * sum(math.prod(s) for s in shapes.values()) for shapes in layout.stage_shapes)


def summarise(samples: list[dict], stage: int, flat_from: int) -> dict:
    out = {}
    names = sorted(samples[-1]["nodes"]) if samples else []
    for name in names:
        series = [(s["round"], s["nodes"][name]) for s in samples if name in s["nodes"]]
        totals = [(r, n["disk"]["total"]) for r, n in series if n.get("disk")]
        after = [t for r, t in totals if r >= flat_from]
        start_state = max((n["disk"]["start_state"] for _r, n in series if n.get("disk")), default=0)
        peak = max((n.get("peak_rss_kib", 0) for _r, n in series), default=0)
        unnamed = [(r, n["disk"]["total"] + n["disk"].get("unnamed", 0)) for r, n in series
                   if n.get("disk") and "unnamed" in n["disk"]]
        out[name] = {
            "disk_max_bytes": max(t for _r, t in totals) if totals else None,
            # with the files without a name (unnamed_bytes: the spilled outer state, tensors), where sampled
            "disk_with_unnamed_max_over_stage_bytes": round(max(t for _r, t in unnamed) / stage, 2)
            if unnamed else None,
            "unnamed_max_over_stage_bytes": round(max(n["disk"]["unnamed"] for _r, n in series
                                                      if "unnamed" in n.get("disk", {})) / stage, 2)
            if unnamed else None,
            "disk_last_bytes": totals[-1][1] if totals else None,
            "disk_max_over_stage_bytes": round(max(t for _r, t in totals) / stage, 2) if totals else None,
            "disk_max_over_start_state": round(max(t for _r, t in totals) / start_state, 2)
            if totals and start_state else None,
            # the stage's training state: fp32 weights, gradients and AdamW's two moments (4 x the weights)
            "disk_max_over_training_state": round(max(t for _r, t in totals) / (4 * stage), 2)
            if totals else None,
            "held_last": series[-1][1].get("disk", {}).get("held") if series else None,
            f"disk_from_round_{flat_from}": [min(after), max(after)] if after else None,
            "start_state_bytes": start_state,
            "peak_rss_mib": round(peak / 1024, 1),
            "last_by_kind": _kinds_over_stage(series[-1][1].get("disk", {}), stage) if series else None,
            # what the node held when its disk was largest, from flat_from on (what the multiple is made of)
            "at_max_from_flat": _at_max([(r, n) for r, n in series if r >= flat_from and n.get("disk")],
                                        stage),
        }
    return out


def _at_max(series: list[tuple[int, dict]], stage: int) -> dict | None:
    """The round of the largest disk in ``series`` and its kinds of files over the stage's bytes."""
    if not series:
        return None
    outer_round, node = max(series, key=lambda item: item[1]["disk"]["total"])
    kinds = _kinds_over_stage(node["disk"], stage) or {}
    return {"round": outer_round, "over_stage_bytes": round(node["disk"]["total"] / stage, 2),
            "kinds": {k: v["over_stage_bytes"] for k, v in kinds.items()}}


def _kinds_over_stage(disk: dict, stage: int) -> dict | None:
    """A sample's kinds of files: files, bytes and bytes over the stage's bytes (None for older samples)."""
    kinds = disk.get("kinds")
    if not kinds:
        return None
    return {k: {**v, "over_stage_bytes": round(v["bytes"] / stage, 2)} for k, v in kinds.items()}
