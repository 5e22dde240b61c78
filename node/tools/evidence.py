"""The evidence layer of ``dlx-node audit`` and ``dlx-node pull``: content-addressed bytes from untrusted
places.

Both commands trust no node and no directory. They ask for an item by the hash the chain records and take
the first copy that hashes to it (:func:`first_good_copy`), noting the sources that offered other bytes.

* :class:`ArchiveSource` -- a local directory: a node's data dir, its ``archive`` dir or a ``run-<id>`` dir
  (run documents, contribution lists, envelopes, checkpoints).
* :class:`PeerSource` -- peers over libp2p, through a :class:`PeerFetcher` (a short-lived host that
  fetches blobs by hash from the bootstrap peers and the DHT, and the run's recent ``close`` gossip).
* :func:`find_checkpoint_files` -- candidate checkpoint files in directories (unverified).
* :func:`reader_client` -- the read-only :class:`ledger.client.LedgerClient` both commands judge against.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS
from training.jsonbound import loads_bounded

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 300.0
MAX_DHT_MISSES = 3
MAX_LIST_BYTES = 1 << 20  # a round's contribution list served under its root (JSON, ~150 bytes an entry)
MAX_LIST_DEPTH = 8  # round.json's layout nests 3 deep; deeper is not a list (and could overflow the decoder)


def find_checkpoint_files(dirs: Iterable[str | Path], round_index: int, content_hash_hex: str,
                          split_dirs: Iterable[str | Path] | None = None) -> list[Path]:
    """Candidate checkpoint files in ``dirs``: by round name or by content hash (unverified); where none is,
    the checkpoint assembled from what ``split_dirs`` (default ``dirs``) kept of it split."""
    dirs = list(map(Path, dirs))
    names = [f"round-{round_index:08d}.safetensors", f"{content_hash_hex}.safetensors", content_hash_hex]
    found = []
    for directory in dirs:
        for sub in (directory, directory / "checkpoints", directory / "blobs"):
            for name in names:
                path = sub / name
                if path.is_file() and path not in found:
                    found.append(path)
    if not found:  # kept split by its nodes (storage.checkpoints = "stages"): their headers and shards
        assembled = _assembled(dirs if split_dirs is None else list(map(Path, split_dirs)), round_index,
                               content_hash_hex)
        found += [assembled] if assembled is not None else []
    return found


_ASSEMBLED: dict[tuple, Path | None] = {}  # what this process assembled (None: could not), by dirs and round


def _assembled(dirs: list[Path], round_index: int, content_hash_hex: str) -> Path | None:
    """The checkpoint ``content_hash_hex`` assembled from what ``dirs`` kept of it split
    (node/store/checkpoint_split.py), in a directory of this process removed at its exit; None if they
    do not hold every stage of it."""
    import atexit

    from node.store.checkpoint_split import assemble_in_dirs

    key = (tuple(dirs), round_index, content_hash_hex)
    if key in _ASSEMBLED and (_ASSEMBLED[key] is None or _ASSEMBLED[key].is_file()):
        return _ASSEMBLED[key]
    try:
        content_hash = bytes.fromhex(content_hash_hex)
    except ValueError:
        return None
    listing = f"round-{round_index:08d}.split.json"
    if not any((d / sub / listing).is_file() for d in dirs for sub in ("checkpoints", "")):
        return None
    workdir = Path(tempfile.mkdtemp(prefix="dlx-assembled-"))
    atexit.register(shutil.rmtree, workdir, True)
    dest = workdir / f"round-{round_index:08d}.safetensors"
    _ASSEMBLED[key] = dest if assemble_in_dirs(dirs, round_index, content_hash, dest) else None
    return _ASSEMBLED[key]


class LazyPeerFetcher:
    """A :class:`PeerFetcher` started on its first use: a command whose --archive holds everything (pull)
    dials no peer of the link, dead or alive (issue 80 point 7: it logged SwarmDialAllFailedError)."""

    def __init__(self, bootstrap: list[str]) -> None:
        self.bootstrap = bootstrap
        self._fetcher: PeerFetcher | None = None

    def _started(self) -> PeerFetcher:
        if self._fetcher is None:
            self._fetcher = PeerFetcher.start(self.bootstrap)
        return self._fetcher

    def __getattr__(self, name: str) -> Any:  # host, fetch, fetch_to, errors...: the started fetcher's
        return getattr(self._started(), name)

    def close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()


class PeerFetcher:
    """A short-lived libp2p host that fetches blobs by hash from the bootstrap peers and the DHT."""

    def __init__(self, host: Any, workdir: Path, bootstrap_peers: list[str],
                 addrs: Iterable[str] = ()) -> None:
        self.host = host
        self.workdir = workdir
        self.bootstrap_peers = bootstrap_peers
        # the multiaddrs dialed: a fetch over a host of its own dials them again (an imported model's
        # initial weights, over this host's max_blob_bytes: node/tools/audit_inputs.py)
        self.addrs = tuple(addrs)
        self.errors: dict[str, str] = {}  # hash -> why the last fetch failed
        self.dht_misses = 0  # consecutive DHT lookups that found nobody

    @classmethod
    def start(cls, bootstrap: list[str], connect_timeout: float = 10.0) -> PeerFetcher:
        """Start a client-only host and dial ``bootstrap`` (unreachable ones are logged)."""
        from p2p.config import P2PConfig
        from p2p.errors import P2PError
        from p2p.host import P2PHost
        from p2p.identity import Identity

        workdir = Path(tempfile.mkdtemp(prefix="dlx-fetch-"))
        # Client-only: it listens nowhere, so the run's peers learn no address of it to dial once it is
        # gone (docs/P2P.md, "Forgetting peers that are gone"); it reaches them over its own connections.
        host = P2PHost.start(
            P2PConfig(listen=False, gossip_resync_interval=0),
            Identity.generate(),
            data_dir=workdir,
        )
        peers = []
        for addr in bootstrap:
            try:
                peers.append(host.connect(addr, timeout=connect_timeout))
            except P2PError as exc:
                logger.warning("bootstrap peer %s unreachable: %s", addr, exc)
        if bootstrap and not peers:
            logger.warning("no bootstrap peer reachable; only the DHT of this host can be asked")
        return cls(host, workdir, peers, bootstrap)

    def close(self) -> None:
        self.host.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def fetch_to(self, hash_hex: str, dest: Path, timeout: float = FETCH_TIMEOUT_S) -> Path:
        """Download blob ``hash_hex`` (hash-verified by the blob protocol) to ``dest``; raises P2PError.

        Every bootstrap peer that holds the blob serves ranges of it in parallel;
        only if none holds it are providers looked up on the DHT (a lookup costs
        seconds, a bootstrap peer's answer milliseconds). After
        ``MAX_DHT_MISSES`` lookups in a row found nobody, the DHT is not asked
        again: an audit of a long, pruned history must not spend seconds per blob.
        """
        from p2p.errors import BlobNotFound, P2PError

        try:
            try:
                if not self.bootstrap_peers:
                    raise BlobNotFound("no bootstrap peers")
                return self.host.fetch_blob(hash_hex, dest, providers=self.bootstrap_peers, timeout=timeout)
            except BlobNotFound:
                providers: list[str] = []
                if self.dht_misses >= MAX_DHT_MISSES:
                    raise BlobNotFound(f"blob {hash_hex[:16]}: no bootstrap peer holds it") from None
                try:
                    providers = [
                        p
                        for p in self.host.find_providers(hash_hex, timeout=15)
                        if p not in self.bootstrap_peers
                    ]
                except P2PError as exc:
                    logger.debug("DHT lookup of %s failed: %s", hash_hex[:16], exc)
                self.dht_misses = 0 if providers else self.dht_misses + 1
                if not providers:
                    raise BlobNotFound(
                        f"blob {hash_hex[:16]}: no bootstrap peer holds it and the DHT knows no provider"
                    ) from None
                logger.info("fetching %s from %d DHT provider(s)", hash_hex[:16], len(providers))
                return self.host.fetch_blob(hash_hex, dest, providers=providers, timeout=timeout)
        finally:
            self.host.remove_blob(hash_hex)  # the copy at dest is ours; do not serve what we only audit

    def fetch(self, hash_hex: str, timeout: float = FETCH_TIMEOUT_S) -> bytes | None:
        """The blob's bytes, or None if no peer could serve them (the reason is kept in ``errors``)."""
        from p2p.errors import P2PError

        dest = self.workdir / "incoming" / hash_hex
        try:
            self.fetch_to(hash_hex, dest, timeout)
            return dest.read_bytes()
        except P2PError as exc:
            self.errors[hash_hex] = str(exc)
            logger.info("blob %s not fetched: %s", hash_hex[:16], exc)
            return None
        finally:
            dest.unlink(missing_ok=True)

    def fetch_keyed(self, key_hex: str, max_bytes: int, timeout: float = 30.0) -> Iterator[bytes]:
        """What each bootstrap peer that has it serves under ``key_hex`` (a name that is not the content's
        sha256, such as a round's contributions root), unverified, one peer at a time as the caller reads."""
        from p2p.errors import P2PError

        for peer in self.bootstrap_peers:
            try:
                yield self.host.fetch_alias(key_hex, peer, max_bytes, timeout=timeout)
            except P2PError as exc:
                logger.debug("%s under %s: %s", peer[-8:], key_hex[:16], exc)

    def close_lists(self, run_id: int) -> dict[int, dict[int, list[list[tuple[int, int, str, str]]]]]:
        """Contribution lists of the run's recent ``close`` messages: round -> stage -> [entries].

        Entries are (stage, replica, peer_id, envelope hash hex). Several coordinators
        may have closed one (round, stage); every distinct list is kept, and the
        auditor keeps the one whose Merkle root the chain records.
        """
        import queue

        from node import protocol as msg
        from node.protocol import run_topic
        from p2p.envelope import decode_envelope
        from p2p.errors import EnvelopeRejected, P2PError

        topic = run_topic(run_id)
        try:
            inbox = self.host.subscribe(topic)
            self.host.resync(topic, timeout=15)
        except P2PError as exc:
            logger.warning("could not pull the run's recent messages from peers: %s", exc)
            return {}
        out: dict[int, dict[int, list[list[tuple[int, int, str, str]]]]] = {}
        while True:
            try:
                data, _sender = inbox.get_nowait()
            except queue.Empty:
                break
            try:
                env = decode_envelope(data, msg.MAX_GOSSIP_PAYLOAD + 4096)
                if env.kind != msg.CLOSE or env.run_id != run_id:
                    continue
                close = msg.decode_payload(msg.CLOSE, env.payload)
            except (EnvelopeRejected, msg.ProtocolError):
                continue
            entries = sorted(
                (env.stage, int(r), str(p), bytes(h).hex()) for r, p, h, _size in close.contributions
            )
            lists = out.setdefault(env.round, {}).setdefault(env.stage, [])
            if entries not in lists:
                lists.append(entries)
        return out


def listed_entries(data: bytes, round_index: int) -> list[tuple[int, int, str, str]]:
    """A round's contribution list from round.json's layout (``{"round", "contributions"}``), checked for
    shape only (the caller checks its Merkle root against the chain); raises ValueError, KeyError or
    TypeError."""
    doc = loads_bounded(data, MAX_LIST_DEPTH)
    entries = [(int(s), int(r), str(p), str(h).lower()) for s, r, p, h in doc["contributions"]]
    if int(doc.get("round", round_index)) != round_index:
        raise ValueError(f"it says round {doc.get('round')}")
    for _s, _r, _p, h in entries:
        if len(h) != 64 or set(h) - set("0123456789abcdef"):
            raise ValueError(f"{h[:80]!r} is not a sha256 hex digest")
    return entries


class ArchiveSource:
    """Evidence from a local directory: a node's data dir, its ``archive`` dir or a ``run-<id>`` dir.

    Reads the layout of :mod:`node.store.archive` (run document, per-round ``round.json``
    and ``<sha256>.env`` files) and checkpoints named ``round-XXXXXXXX.safetensors``
    (in ``checkpoints/`` or the directory itself). Nothing read is trusted: the
    auditor checks every byte against the chain.
    """

    def __init__(self, directory: str | Path, run_id: int, siblings: Iterable[str | Path] = ()) -> None:
        self.root = Path(directory)
        # every archive of the audit: a checkpoint their nodes kept split is assembled from all of them
        self.siblings = [Path(s) for s in siblings] or [self.root]
        self.name = f"archive {self.root}"
        candidates = [self.root / "archive" / f"run-{run_id}", self.root / f"run-{run_id}", self.root]
        self.run_dir = next(
            (c for c in candidates if (c / "run.json").exists() or any(c.glob("round-*/"))), None
        )

    def run_documents(self) -> list[bytes]:
        if self.run_dir is None or not (self.run_dir / "run.json").exists():
            return []
        return [(self.run_dir / "run.json").read_bytes()]

    def round_lists(self, round_index: int, root_hex: str = "") -> list[list[tuple[int, int, str, str]]]:
        """The archived contribution lists of ``round_index`` (0 or 1 list; entries (stage, replica, peer,
        hex))."""
        if self.run_dir is None:
            return []
        path = self.run_dir / f"round-{round_index:08d}" / "round.json"
        if not path.exists():
            return []
        try:
            return [listed_entries(path.read_bytes(), round_index)]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            logger.warning("%s: round %d manifest unreadable: %s", self.name, round_index, exc)
            return []

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        if self.run_dir is None:
            return None
        path = self.run_dir / f"round-{round_index:08d}" / f"{hash_hex}.env"
        try:
            return path.read_bytes()
        except OSError:
            return None

    def round_blobs(self, round_index: int, suffix: str) -> list[bytes]:
        """Every ``*.<suffix>`` blob archived for a round (the sliced exchange's ``partial`` envelopes)."""
        if self.run_dir is None:
            return []
        out = []
        for path in sorted((self.run_dir / f"round-{round_index:08d}").glob(f"*.{suffix}")):
            try:
                out.append(path.read_bytes())
            except OSError:
                continue
        return out

    def round_blob(self, round_index: int, hash_hex: str, suffix: str) -> bytes | None:
        """The archived ``<hash_hex>.<suffix>`` of a round (a sliced contribution's ``slice`` blob), if
        any."""
        if self.run_dir is None:
            return None
        try:
            return (self.run_dir / f"round-{round_index:08d}" / f"{hash_hex}.{suffix}").read_bytes()
        except OSError:
            return None

    def proofs(self, round_index: int) -> list[bytes]:
        """The fraud proofs of ``round_index`` a node's prover kept (``proofs/`` of its data dir),
        unchecked."""
        found = []
        for path in sorted((self.root / "proofs").glob(f"round-{round_index:08d}-stage*.json")):
            try:
                found.append(path.read_bytes())
            except OSError:
                continue
        return found

    def checkpoint(self, round_index: int, content_hash_hex: str) -> bytes | None:
        """The candidate file with the expected content (its sha256, or its header's hash: the record's
        under either rule, node/store/checkpoint_hash.py), else the first candidate (reported as corrupt)."""
        from node.store.checkpoint_hash import names_record

        first = None
        for path in find_checkpoint_files([self.root], round_index, content_hash_hex, self.siblings):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if names_record(data, bytes.fromhex(content_hash_hex)):
                return data
            first = data if first is None else first
        return first


class PeerSource:
    """Evidence fetched over libp2p: blobs by hash, and round lists from the run's recent ``close`` gossip.

    ``fetcher`` is a :class:`PeerFetcher` already connected to peers.
    Close messages are the coordinators' signed lists of what each stage
    aggregated; peers keep only recent ones, so old rounds need archives.
    """

    def __init__(self, fetcher: Any, run_id: int) -> None:
        self.fetcher = fetcher
        self.run_id = run_id
        self.name = "peers"
        self._closes: dict[int, dict[int, list[list[tuple[int, int, str, str]]]]] | None = None

    def run_documents(self) -> list[bytes]:
        return []  # fetched by hash in _run_document (needs the chain's configHash)

    def blob(self, hash_hex: str) -> bytes | None:
        return self.fetcher.fetch(hash_hex)

    def round_lists(self, round_index: int, root_hex: str = "") -> list[list[tuple[int, int, str, str]]]:
        """The round's lists in the run's recent ``close`` gossip; else (a finished run's peers gossip no
        more) the list a peer serves under the commit's contributions root ``root_hex`` (a seeder:
        node/commands/seeder.py)."""
        if self._closes is None:
            self._closes = self.fetcher.close_lists(self.run_id)
        by_stage = self._closes.get(round_index, {})
        lists = [entries for stage in sorted(by_stage) for entries in by_stage[stage]]
        if lists or not root_hex:
            return lists
        for data in self.fetcher.fetch_keyed(root_hex, MAX_LIST_BYTES):
            try:
                return [listed_entries(data, round_index)]
            except (ValueError, KeyError, TypeError, RecursionError) as exc:
                logger.info("round %d: a peer's list under %s is unusable: %s", round_index, root_hex[:16],
                            exc)
        return []

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        return self.fetcher.fetch(hash_hex)

    def round_blob(self, round_index: int, hash_hex: str, suffix: str) -> bytes | None:
        return self.fetcher.fetch(hash_hex)  # a sliced contribution's slice blob, served by its sender

    def checkpoint(self, round_index: int, content_hash_hex: str) -> bytes | None:
        """The file by its hash, else assembled from its header and stage shards as the bootstrap peers serve
        them under their keys (a run whose nodes keep it split; a header-hashed record names no whole file):
        node/store/checkpoint_split.py."""
        from node.store.checkpoint_split import assemble_from_blobs, header_key, stage_key

        data = self.fetcher.fetch(content_hash_hex)
        if data is not None:
            return data
        digest, most = bytes.fromhex(content_hash_hex), self.fetcher.host.config.max_blob_bytes
        return assemble_from_blobs(self.fetcher.fetch_keyed(header_key(digest), most),
                                   lambda stage: self.fetcher.fetch_keyed(stage_key(digest, stage), most),
                                   digest, self.fetcher.workdir)


@dataclass
class EvidenceCopy:
    """The verified bytes of one item (None if no source had them) and the sources that offered others."""

    data: bytes | None
    bad: list[str]  # "<source>: bytes hash to <hex>"


def first_good_copy(sources: list, getter: Callable[[Any], bytes | None], expected_hex: str,
                    digest: Callable[[bytes], str] | None = None) -> EvidenceCopy:
    """The first copy among ``sources`` whose sha256 (or ``digest``: a header-hashed checkpoint's,
    :func:`checkpoint_digest`) is ``expected_hex``, noting the corrupt ones."""
    bad = []
    for source in sources:
        try:
            data = getter(source)
        except DLX_ERRORS as exc:
            logger.debug("%s: %s", source.name, exc)
            data = None
        if data is None:
            continue
        got = digest(data) if digest is not None else hashlib.sha256(data).hexdigest()
        if got == expected_hex:
            return EvidenceCopy(data, bad)
        bad.append(f"{source.name}: bytes hash to {got}")
    return EvidenceCopy(None, bad)


def checkpoint_digest(layout: Any, expected_hex: str) -> Callable[[bytes], str]:
    """How a checkpoint file is matched with its record's ``checkpointHash`` ``expected_hex``: under the run's
    rule (``layout``, the run document's :class:`node.store.checkpoint.RunLayout`), or under either where no
    run document was verified (the item is unverifiable then anyway: node/store/checkpoint_hash.py)."""
    from node.store.checkpoint_hash import names_record, record_hash

    if layout is not None:
        return lambda data: record_hash(data, layout.header_hashed).hex()
    expected = bytes.fromhex(expected_hex)
    return lambda data: expected_hex if names_record(data, expected) else hashlib.sha256(data).hexdigest()


def reader_client(args: Any) -> Any:
    """A LedgerClient for the deployment named by --deployment or --registry/--ledger (read-only account)."""
    from ledger.chain import connect_rpc
    from ledger.client import LedgerClient
    from node.errors import ConfigError

    registry, ledger = args.registry, args.ledger
    if args.deployment:
        try:
            deployment = json.loads(Path(args.deployment).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--deployment {args.deployment}: cannot read it ({exc})") from None
        registry = registry or deployment.get("registry", "")
        ledger = ledger or deployment.get("ledger", "")
    if not (registry and ledger):
        raise ConfigError(
            "the contract addresses are missing: pass --deployment deployment.json, or both "
            "--registry and --ledger"
        )
    w3 = connect_rpc(args.rpc, wait=10)
    return LedgerClient(w3, None, registry, ledger)  # read-only: an auditor never sends a transaction
