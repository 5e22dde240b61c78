"""Retention: how a node bounds what it keeps on disk (``[storage]`` of node.toml).

Two kinds of files grow with a run: the archive (one directory of signed contribution
envelopes per sealed round, :mod:`node.store.archive`) and the checkpoints (a full
checkpoint ``round-<t>.safetensors`` and a shard per held stage ``shard-<t>-stage<s>.safetensors``
per checkpoint round, in ``<data_dir>/checkpoints``). Both are also served to peers as blobs,
so what is deleted must stop being served as well (``forget_blob``).

What is never deleted, whatever the settings:

* a sealed round that is not committed on chain yet: a restarted node re-applies the rounds
  it sealed from its archive (docs/PROTOCOL.md, "Joining") and serves their contributions
  again, so every round still commits once;
* checkpoints of rounds not committed yet, and the newest checkpoint of a committed round:
  a joiner or a restarted peer downloads the chain's latest checkpoint from the live peers.

Deletion is crash-safe: blobs are forgotten first (a crash then leaves a file that the next
pruning deletes), an archive round directory is renamed out of the archive's namespace in one
``rename`` before it is removed (a crash never leaves a half-deleted round that looks sealed),
and leftovers of an interrupted removal are swept the next time.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from pathlib import Path

from node.store.archive import Archive

logger = logging.getLogger(__name__)

_CHECKPOINT_FILE = re.compile(r"^(?:round-(\d{8})|shard-(\d{8})-stage\d+)\.safetensors$")


def checkpoint_files(checkpoint_dir: Path) -> dict[int, list[Path]]:
    """The checkpoint files (full checkpoints and shards) of ``checkpoint_dir``, by round."""
    out: dict[int, list[Path]] = {}
    if not checkpoint_dir.is_dir():
        return out
    for path in checkpoint_dir.iterdir():
        match = _CHECKPOINT_FILE.match(path.name)
        if match:
            out.setdefault(int(match.group(1) or match.group(2)), []).append(path)
    return out


def prune_archive(archive: Archive, keep_rounds: int, committed_through: int,
                  forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete sealed rounds beyond the newest ``keep_rounds``, never one after ``committed_through``.

    ``keep_rounds`` 0 keeps everything. Returns the rounds deleted; each deleted envelope's blob is
    forgotten (``forget_blob(sha256 hex)``) before its file goes (:meth:`Archive.prune`).
    """
    doomed = sorted(archive.prune(keep_rounds, committed_through, forget_blob))
    if doomed:
        logger.info("retention: pruned archive rounds %s (keep_rounds=%d)", _span(doomed), keep_rounds)
    return doomed


def prune_checkpoints(checkpoint_dir: Path, keep_checkpoints: int, committed_through: int,
                      forget_blob: Callable[[str], object] = lambda _hex: None) -> list[int]:
    """Delete checkpoint rounds beyond the newest ``keep_checkpoints`` committed ones.

    Rounds after ``committed_through`` are always kept, and so is the newest committed round that
    has a full checkpoint file (what a joiner downloads) even if shard-only rounds are newer.
    ``keep_checkpoints`` 0 keeps everything. Returns the rounds deleted.
    """
    if keep_checkpoints <= 0:
        return []
    files = checkpoint_files(checkpoint_dir)
    committed = sorted(r for r in files if r <= committed_through)
    keep = set(committed[-keep_checkpoints:])
    full = [r for r in committed if any(p.name.startswith("round-") for p in files[r])]
    if full:
        keep.add(full[-1])
    doomed = [r for r in committed if r not in keep]
    for round_index in doomed:
        for path in sorted(files[round_index]):
            try:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
            except OSError:
                continue
            forget_blob(digest)
            path.unlink(missing_ok=True)
    if doomed:
        logger.info("retention: pruned checkpoints of rounds %s (keep_checkpoints=%d)",
                    _span(doomed), keep_checkpoints)
    return doomed


def _span(rounds: list[int]) -> str:
    return f"{rounds[0]}..{rounds[-1]}" if len(rounds) > 1 else str(rounds[0])
