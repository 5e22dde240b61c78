"""A light libp2p host that serves a finished run's archives, so ``pull`` and ``audit`` work from a run link.

After ``dlx-node demo --keep`` the nodes have ended (their run is over); only the chain stays. The seeder
serves, by hash over ``/dlx/blob/1.0.0``, what the nodes left in their data directories: the run document (its
sha256 is the on-chain ``configHash``), every checkpoint file, every archived contribution envelope, the start
state each binds (a file of a node's blob store, or a packed blob read back and checked), the evidence of
accusations (what ``audit LINK --reexecute`` reruns from) and the run's tokenizer. Each round's list of
contributions (what the nodes sealed in ``round.json``) is served under its Merkle root, the commit's
``contributionsRoot``, the key an auditor knows from the chain (``audit LINK`` needs the lists: the
coordinators' ``close`` gossip that carried them is gone with the nodes). It trains nothing, holds no stake
and signs nothing; every byte a client fetches is checked by that client against the chain, so serving a
wrong file would only make it refuse the download.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _start_state(envelope: Path) -> str:
    """The sha256 hex of the start state an archived contribution envelope binds ("" if it is none)."""
    from node import protocol as msg
    from p2p.envelope import decode_envelope
    from p2p.errors import EnvelopeRejected

    try:
        env = decode_envelope(envelope.read_bytes(), 1 << 32)
        if env.kind != msg.CONTRIBUTION:
            return ""
        return msg.decode_contribution_body(env.payload).state_hash.hex()
    except (OSError, EnvelopeRejected, msg.ProtocolError, ValueError):
        return ""


def archived_files(node_dirs: Iterable[Path], run_id: int) -> dict[str, Path]:
    """sha256 hex -> a file to serve: each node's run document, checkpoints, contribution envelopes and the
    start states they bind (the blob store's ``<sha256>``: ``audit LINK --reexecute`` reruns from them), the
    evidence of its accusations, the run's tokenizer and an imported model's initial weights."""
    found: dict[str, Path] = {}
    node_dirs = list(map(Path, node_dirs))
    for directory in node_dirs:
        run_dir = directory / "archive" / f"run-{run_id}"
        envelopes = sorted(run_dir.glob("round-*/*.env"))
        states = sorted({directory / "blobs" / state for state in map(_start_state, envelopes) if state})
        # (a state the node kept packed has no such file: packed_states)
        # the run's tokenizer too (join and pull fetch it by its sha256: the run document's model.tokenizer)
        paths = [run_dir / "run.json", *sorted((directory / "checkpoints").glob("round-*.safetensors")),
                 *envelopes, *states, *sorted((directory / "evidence").glob("*")),
                 *sorted((directory / "tokenizers").glob("*.json")),
                 *sorted((directory / "initial").glob("*.safetensors"))]  # an imported model's start
        for path in paths:
            if path.is_file():
                found.setdefault(_sha256(path), path)
    found.update({digest: path for digest, path in _split_checkpoints(node_dirs) if digest not in found})
    return found


def _split_checkpoints(node_dirs: list[Path]) -> list[tuple[str, Path]]:
    """(sha256 hex, file) of each file-hashed checkpoint the nodes kept split (storage.checkpoints = "stages":
    each a header and its own stages, node/store/checkpoint_split.py), assembled whole from all of them: a
    puller downloads it by the record's hash. A header-hashed record names no whole file: its parts are
    served under their keys instead (:func:`split_parts`)."""
    from node.tools.evidence import find_checkpoint_files

    out = []
    for round_index, digest in sorted({(split["round"], split["content_hash"].hex())
                                       for _folder, split in _split_listings(node_dirs)}):
        out += [(digest, path) for path in find_checkpoint_files(node_dirs, round_index, digest)[:1]
                if _sha256(path) == digest]
    return out


def _split_listings(node_dirs: list[Path]) -> list[tuple[Path, dict]]:
    """(checkpoints folder, listing) of every split listing the nodes kept, checked (read_split)."""
    from node.store.checkpoint_split import read_split

    found = []
    for directory in node_dirs:
        for listing in sorted((directory / "checkpoints").glob("round-*.split.json")):
            split = read_split(listing)
            if split is not None:
                found.append((listing.parent, split))
    return found


def split_parts(node_dirs: Iterable[Path]) -> list[tuple[bytes, Path, dict[int, Path]]]:
    """(content hash, header file, stage -> shard file) of each checkpoint round the nodes kept split: what a
    seeder serves under the checkpoint's header and stage keys (node/store/checkpoint_split.py), so that
    ``pull`` assembles it from the seeder as from the run's nodes (the only way for a header-hashed one)."""
    from node.store.checkpoint_split import head_path, shard_path

    parts: dict[bytes, tuple[Path, dict[int, Path]]] = {}
    for folder, split in _split_listings(list(map(Path, node_dirs))):
        head = head_path(folder, split["round"])
        if not head.is_file():
            continue
        _header, shards = parts.setdefault(split["content_hash"], (head, {}))
        for stage in split["stages"]:
            shard = shard_path(folder, split["round"], stage)
            if shard.is_file():
                shards.setdefault(stage, shard)
    return [(digest, head, shards) for digest, (head, shards) in parts.items()]


def packed_states(node_dirs: Iterable[Path], run_id: int) -> dict[str, Path]:
    """sha256 hex -> the blob store holding it, of each start state an archived contribution binds that its
    node kept packed (p2p/blobpack.py: a node's own start states) rather than as a file of its own."""
    from p2p.blobpack import MANIFEST_SUFFIX, PACKED_DIR

    found: dict[str, Path] = {}
    for directory in map(Path, node_dirs):
        blobs = directory / "blobs"
        for envelope in sorted((directory / "archive" / f"run-{run_id}").glob("round-*/*.env")):
            state = _start_state(envelope)
            if state and not (blobs / state).is_file() and \
                    (blobs / PACKED_DIR / f"{state}{MANIFEST_SUFFIX}").is_file():
                found.setdefault(state, blobs)
    return found


def round_lists(node_dirs: Iterable[Path], run_id: int) -> dict[str, bytes]:
    """contributions root hex -> a round's list as JSON (``{"round", "contributions"}``, round.json's layout):
    each archive's sealed list and, per round, their union (a node of a split cluster seals only its stages),
    each in canonical order (stage, replica, peer id, hash) and keyed by its Merkle root."""
    from ledger.merkle import merkle_root
    from node.tools.evidence import listed_entries

    lists: dict[int, list[set[tuple]]] = {}
    for directory in map(Path, node_dirs):
        for path in sorted((directory / "archive" / f"run-{run_id}").glob("round-*/round.json")):
            try:
                round_index = int(path.parent.name.removeprefix("round-"))
                entries = set(listed_entries(path.read_bytes(), round_index))
            except (ValueError, KeyError, TypeError, OSError, RecursionError) as exc:
                # not a list an auditor could use (it checks every list it gets anyway); the round is not
                # served an empty list in its place (it was: an unreadable list still opened its round)
                logger.warning("%s: not served: %s: %s", path, type(exc).__name__, exc)
                continue
            lists.setdefault(round_index, []).append(entries)
    served: dict[str, bytes] = {}
    for round_index, sets in lists.items():
        for entries in [*sets, set().union(*sets)]:
            ordered = sorted(entries)
            root = merkle_root([bytes.fromhex(h) for _s, _r, _p, h in ordered]).hex()
            served.setdefault(root, json.dumps({"round": round_index, "contributions": ordered}).encode())
    return served


class ArchiveSeeder:
    """A listening host serving :func:`archived_files` of ``node_dirs``; ``multiaddr`` to give to clients."""

    def __init__(self, host, workdir: Path, served: dict[str, Path]) -> None:
        self.host = host
        self.workdir = workdir
        self.served = served

    @classmethod
    def start(cls, node_dirs: Iterable[Path], run_id: int, listen_host: str = "127.0.0.1",
              listen_port: int = 0, datasets: Iterable[Path] = ()) -> ArchiveSeeder:
        """Serve the archives of ``node_dirs`` and the prepared ``datasets`` the run trained on (its shards
        and manifest, as a node serves them: an audit of the run reads its batches from them)."""
        from p2p.config import P2PConfig
        from p2p.errors import P2PError
        from p2p.host import P2PHost
        from node.shardfetch import serve_dataset
        from p2p.identity import Identity
        from training.errors import ShardError

        from p2p.blobpack import MANIFEST_SUFFIX, PACKED_DIR, read_packed
        from node.store.checkpoint_split import alias_split

        node_dirs = list(node_dirs)
        served = archived_files(node_dirs, run_id)
        packed = packed_states(node_dirs, run_id)
        lists = round_lists(node_dirs, run_id)
        workdir = Path(tempfile.mkdtemp(prefix="dlx-seeder-"))
        host = P2PHost.start(P2PConfig(listen_host=listen_host, listen_port=listen_port,
                                       gossip_resync_interval=0),
                             Identity.generate(), data_dir=workdir)
        try:
            for sha256_hex, path in served.items():
                host.provide_file(path, sha256_hex)
            for sha256_hex, blobs in packed.items():  # a copy in the seeder's own store, one at a time
                data = read_packed(blobs, sha256_hex)  # checked against its hash (None: damaged)
                if data is not None and sha256_hex not in served:
                    served[sha256_hex] = blobs / PACKED_DIR / f"{sha256_hex}{MANIFEST_SUFFIX}"
                    host.provide_blob(data, announce=False)
                del data
            for root_hex, data in lists.items():
                host.provide_alias(root_hex, host.provide_blob(data, announce=False))
            for digest, head, shards in split_parts(node_dirs):  # each part checked by whoever reads it
                # stored (hard-linked where the file system allows) so that its keys can alias it
                header_sha = host.provide_blob(head, announce=False, link=True)
                stages = {stage: host.provide_blob(path, announce=False, link=True)
                          for stage, path in shards.items()}
                alias_split(host, digest, header_sha, stages)
            for directory in datasets:
                serve_dataset(host, directory)
        except (P2PError, OSError, ShardError):
            host.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        logger.info("seeder %s serves %d archived files and %d round lists of run %d", host.peer_id,
                    len(served), len(lists), run_id)
        return cls(host, workdir, served)

    @property
    def multiaddr(self) -> str:
        addr = self.host.listen_addrs[0]
        return addr if "/p2p/" in addr else f"{addr}/p2p/{self.host.peer_id}"

    def close(self) -> None:
        self.host.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
