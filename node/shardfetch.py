"""Prepared datasets between peers: served by hash, fetched shard by shard, each one checked.

A run on a prepared dataset (:mod:`training.shards`) names it by ``manifest:<root>`` in its run
document. Every node serves its dataset over ``/dlx/blob/1.0.0`` (docs/P2P.md, "Prepared
datasets"): each shard file under its sha256 (the manifest's ``sha256``), from the dataset's
directory (not copied into the blob store), and ``manifest.json`` under its sha256 and, as an
alias, under the root.

A node that lacks shards (a joiner, or a starting node whose ``training.data_path`` holds the
manifest but not every shard) completes its directory with :func:`complete_dataset`:

1. the manifest: the directory's own, a local source's (``--data DIR``), or a peer's, fetched by the
   root and refused unless its recomputed Merkle root is the run's;
2. each shard missing or failing its check (size, header, sha256, ids below the vocabulary): copied
   from a local source whose file passes the check, else fetched from one peer at a time (the
   blob protocol streams it in ranges to a staging file and checks its sha256; the whole file is
   then checked against the manifest entry). A bad shard is refused with a message naming the file
   and the peer, and the next peer is asked. A bad shard already in the directory is replaced only
   by a copy that passed the check.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.clienthost import client_host
from node.errors import NodeError
from node.fsutil import atomic_write_bytes
from node.progress import TransferProgress, watch_host
from p2p.blobstore import link_or_copy

logger = logging.getLogger(__name__)

MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # ~100k shards; a peer offering more is not offering a manifest
DATASETS_DIR = "datasets"  # <data_dir>/datasets/<root>/: where a joiner keeps a dataset it fetched
SHARD_FETCH_TIMEOUT_S = 600.0
# a starting node asks its peers for missing shards for about a minute
START_ATTEMPTS, START_RETRY_S = 6, 10.0


class DatasetUnavailable(NodeError):
    """No local source and no peer gave a good copy of the dataset's manifest or of one of its shards."""


@dataclass
class DatasetFill:
    """What :func:`complete_dataset` did: shards kept, copied from local sources, fetched from peers."""

    directory: Path
    kept: int = 0
    copied: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    refusals: list[str] = field(default_factory=list)  # "shard-00001.bin from peer ...: <reason>"
    slow: set[str] = field(default_factory=set)  # peers that made a fetch wait out a deadline: asked last


def serve_dataset(host: Any, directory: str | os.PathLike) -> str:
    """Serve a verified dataset's shards by sha256 and its manifest by sha256 and by root; return the root."""
    from training.shards import MANIFEST_NAME
    from training.sharded_corpus import open_dataset

    corpus = open_dataset(directory)  # checks every shard (once per process) before any is served
    root = Path(corpus.source)
    manifest_hash = host.provide_blob((root / MANIFEST_NAME).read_bytes(), announce=False)
    host.provide_alias(corpus.manifest.root, manifest_hash)
    for entry in corpus.manifest.shards:
        host.provide_file(root / entry.file, entry.sha256)
    logger.info("serving dataset %s: %d shards", corpus.manifest.root[:16], len(corpus.manifest.shards))
    return corpus.manifest.root


def _local_manifest(directory: Path, root: str):
    """The manifest in ``directory`` if it is the dataset ``root``'s; None if there is none; refused if
    another."""
    from training.errors import ShardError
    from training.shards import MANIFEST_NAME
    from training.sharded_corpus import read_manifest

    if not (directory / MANIFEST_NAME).is_file():
        return None
    try:
        _, manifest = read_manifest(directory)
    except ShardError as exc:
        logger.warning("%s", exc)
        return None
    return manifest if manifest.root == root else None


def _manifest_from_peers(host: Any, peers: list[str], root: str, fill: DatasetFill):
    from p2p.errors import P2PError
    from training.errors import ShardError
    from training.shards import parse_manifest

    for peer in peers:
        source = f"manifest of dataset {root[:16]} from peer {peer}"
        try:
            data = host.fetch_alias(root, peer, MAX_MANIFEST_BYTES, timeout=60)
            manifest = parse_manifest(data, source)  # refuses a deep nesting before decoding it
        except (P2PError, ShardError) as exc:
            fill.refusals.append(f"{source}: {exc}")
            logger.warning("refused %s", fill.refusals[-1])
            continue
        if manifest.root != root:
            fill.refusals.append(f"{source}: root {manifest.root}, not the run's")
            logger.warning("refused %s", fill.refusals[-1])
            continue
        return manifest, data
    raise DatasetUnavailable(
        f"dataset {root}: no peer served its manifest ({'; '.join(fill.refusals) or 'no peer'})")


def _manifest_for(root: str, directory: Path, host: Any, peers: list[str], sources: list, fill: DatasetFill):
    """The manifest of dataset ``root``: ``directory``'s (refused if another dataset's), else a local source's
    or a peer's, written into ``directory``."""
    from training.errors import ShardError
    from training.shards import MANIFEST_NAME
    from training.sharded_corpus import read_manifest

    if (directory / MANIFEST_NAME).is_file():
        manifest = read_manifest(directory)[1]  # a broken manifest there raises ShardError, naming the file
        if manifest.root != root:
            raise ShardError(
                f"{directory / MANIFEST_NAME}: dataset root {manifest.root}, the run's is {root}")
        return manifest
    for source in map(Path, sources):
        manifest = _local_manifest(source, root)
        if manifest is not None:
            atomic_write_bytes(directory / MANIFEST_NAME, (source / MANIFEST_NAME).read_bytes())
            return manifest
    if host is None or not peers:
        raise DatasetUnavailable(f"dataset {root}: no manifest in {directory} and no peer to ask")
    manifest, data = _manifest_from_peers(host, list(peers), root, fill)
    atomic_write_bytes(directory / MANIFEST_NAME, data)
    return manifest


def _checked(path: Path, entry: Any, manifest: Any) -> str | None:
    """None when the shard file at ``path`` passes its check, else the reason."""
    from training.errors import ShardError
    from training.shards import verify_shard

    try:
        verify_shard(path, entry, manifest)
    except ShardError as exc:
        return str(exc)
    return None


def _made_us_wait(exc: Exception) -> bool:
    """Whether a failed fetch failed by a deadline (the whole fetch's, a range's minimum rate, a stream's
    stall): the peer then cost time, so it is asked last for the remaining shards."""
    from p2p.errors import P2PTimeout

    return isinstance(exc, P2PTimeout) \
        or any(word in str(exc) for word in ("ProviderTooSlow", "TooSlowError"))


def _fetch_shard(host: Any, peers: list[str], start: int, entry: Any, manifest: Any, target: Path,
                 fill: DatasetFill) -> None:
    """Fetch one shard from the peers in turn (starting at ``start``, peers in ``fill.slow`` last) until one
    passes its check."""
    from p2p.errors import P2PError

    part = target.with_name(f".{target.name}.part")
    reasons = []
    turns = [peers[(start + turn) % len(peers)] for turn in range(len(peers))]
    order = sorted(turns, key=lambda p: p in fill.slow)  # (stable: the others keep their turns)
    for turn, peer in enumerate(order):
        part.unlink(missing_ok=True)
        try:
            host.fetch_blob(entry.sha256, part, providers=[peer], timeout=SHARD_FETCH_TIMEOUT_S)
            reason = _checked(part, entry, manifest)
        except P2PError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if _made_us_wait(exc):
                fill.slow.add(peer)
        if reason is None:
            os.replace(part, target)
            host.remove_blob(entry.sha256)  # the file is in the dataset now; it is served from there
            fill.fetched += 1
            fill.fetched_bytes += target.stat().st_size
            return
        host.remove_blob(entry.sha256)  # never serve onward what failed its check
        part.unlink(missing_ok=True)
        refusal = f"{entry.file} from peer {peer}: {reason}"
        fill.refusals.append(refusal)
        reasons.append(refusal)
        logger.warning("refused %s; %s", refusal, "trying another peer" if turn + 1 < len(peers)
                       else "no peer left")
    raise DatasetUnavailable(f"{target}: no peer served a good copy ({'; '.join(reasons) or 'no peer'})")


def complete_dataset(root: str, directory: str | os.PathLike, host: Any = None, peers: list[str] = (),
                     sources: list[str | os.PathLike] = (), progress: TransferProgress | None = None,
                     tty: bool | None = None) -> DatasetFill:
    """Make ``directory`` a complete, checked copy of the dataset ``root`` (see the module docstring).

    ``host`` (a started :class:`p2p.host.P2PHost` connected to ``peers``, their peer ids) is needed only
    when a local copy is missing something. Raises :class:`DatasetUnavailable` (or ``ShardError`` for a
    manifest in ``directory`` of another dataset).
    """
    from training.shards import shard_size

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fill = DatasetFill(directory)
    manifest = _manifest_for(root, directory, host, peers, sources, fill)
    missing: list[tuple[int, Any, Path | None]] = []  # (shard index, entry, a local copy that passes)
    for index, entry in enumerate(manifest.shards):
        reason = _checked(directory / entry.file, entry, manifest)
        if reason is None:
            fill.kept += 1
            continue
        if (directory / entry.file).exists():
            logger.warning("%s: replacing it", reason)
        local = next((Path(s) / entry.file for s in sources
                      if _checked(Path(s) / entry.file, entry, manifest) is None), None)
        if local is None and (host is None or not peers):
            raise DatasetUnavailable(
                f"{directory / entry.file}: {reason}; no local copy passes its check and no "
                "peer to fetch it from: pass --data DIR with the dataset, or a peer")
        missing.append((index, entry, local))
    if not missing:
        return fill
    total = sum(shard_size(entry, manifest) for _, entry, _ in missing)
    show = progress or TransferProgress(f"{len(missing)} shard(s) of dataset {root[:16]}", total, tty=tty)
    watch = watch_host(show, host) if host is not None else None
    ok = False
    try:
        for index, entry, local in missing:
            if local is None:  # shard i is asked of peer i mod n first: the peers share the load
                _fetch_shard(host, list(peers), index, entry, manifest, directory / entry.file, fill)
                continue
            link_or_copy(local, directory / entry.file)
            fill.copied += 1
            if watch is not None:
                watch.extra += shard_size(entry, manifest)
            else:
                show.advance(shard_size(entry, manifest))
        ok = True
    finally:
        if watch is not None:
            watch.stop()
        show.close(ok=ok, note=f"{fill.copied} copied, {fill.fetched} fetched from peers" if ok else "")
    return fill


def fetch_dataset(peers: tuple[str, ...], root: str, directory: Path, workdir: Path,
                  sources: list[str | os.PathLike] = (), tty: bool | None = None) -> DatasetFill:
    """:func:`complete_dataset` for a command (``dlx-node join``): a short-lived, client-only host with a
    throwaway identity (:func:`node.clienthost.client_host`) dials ``peers`` (multiaddrs) only if something
    is missing locally."""
    try:
        return complete_dataset(root, directory, sources=sources, tty=tty)
    except DatasetUnavailable:
        if not peers:
            raise

    def unreachable(failures: str) -> DatasetUnavailable:
        return DatasetUnavailable(f"dataset {root[:16]}: no peer of the run is reachable ({failures})")

    with client_host(peers, workdir, prefix=".join-dataset-", unreachable=unreachable) as (host, reached,
                                                                                           _staging):
        return complete_dataset(root, directory, host, reached, sources, tty=tty)


def dataset_for_join(root: str, data: str, data_dir: Path, peers: tuple[str, ...] = (),
                     tty: bool | None = None) -> Path:
    """The directory of the run's dataset ``root`` for a joiner, complete and checked.

    ``data`` (``--data DIR``): a prepared dataset of that root, whose missing or bad shards are fetched
    from ``peers`` into it; empty: ``<data_dir>/datasets/<root>/``, filled from ``peers``.
    Raises ConfigError (``data`` is not that dataset, or nothing to fetch from) or DatasetUnavailable.
    """
    from node.errors import ConfigError
    from training.errors import ShardError
    from training.sharded_corpus import open_dataset, read_manifest

    if data:
        directory = Path(data).expanduser()
        if not (directory.is_dir() and (directory / "manifest.json").is_file()):
            raise ConfigError(
                f"--data {data}: the run trains on a prepared dataset (manifest:{root}); this is "
                "not one (a directory with a manifest.json)")
        try:
            found = read_manifest(directory)[1].root
        except ShardError as exc:
            raise ConfigError(f"--data {data}: {exc}") from None
        if found != root:
            raise ConfigError(f"--data {data}: dataset root {found}, the run's is {root}")
    elif peers:
        directory = data_dir / DATASETS_DIR / root
    else:
        raise ConfigError(f"the run trains on a prepared dataset (a directory) with manifest:{root}: pass "
                          "--data with it, or a peer that serves it (the run's operator can give you both)")
    try:
        fetch_dataset(peers, root, directory, data_dir, tty=tty)
        open_dataset(directory, expected_root=root)
    except ShardError as exc:
        raise ConfigError(f"--data {data or directory}: {exc}") from None
    return directory


def provide_run_dataset(host: Any, data_path: str, document: dict, peers: list[str]) -> None:
    """A starting node's side: when the run trains on a prepared dataset, complete ``data_path`` from
    ``peers`` (connected peer ids) if it lacks shards, then serve it. Nothing for other runs.

    Raises DatasetUnavailable or ShardError when the dataset cannot be completed (the node cannot train).
    """
    from training.errors import ShardError
    from training.shards import ROOT_PREFIX

    wanted = str(document.get("training", {}).get("data_sha256", ""))
    if not wanted.startswith(ROOT_PREFIX) or not data_path:
        return
    root = wanted[len(ROOT_PREFIX):]
    try:
        serve_dataset(host, data_path)  # the usual case: complete (each shard is read once per process)
        return
    except ShardError as exc:
        logger.warning("%s: completing the dataset from the peers", exc)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            fill = complete_dataset(root, data_path, host, peers)
            break
        except DatasetUnavailable as exc:  # peers started beside this node may not serve it yet
            if attempt == START_ATTEMPTS or not peers:
                raise
            logger.warning("%s; asking again in %.0f s (%d/%d)", exc, START_RETRY_S, attempt, START_ATTEMPTS)
            time.sleep(START_RETRY_S)
    if fill.copied or fill.fetched:
        logger.info("dataset %s completed: %d shard(s) fetched from peers (%d bytes), %d kept", root[:16],
                    fill.fetched, fill.fetched_bytes, fill.kept)
    serve_dataset(host, data_path)
