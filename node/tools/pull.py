"""``dlx-node pull``: fetch a published checkpoint, verify it against the chain, write a transformers dir.

The chain's ``CheckpointPublished`` record names the checkpoint by its content
hash (sha256 of the file). ``pull`` takes the bytes from a local directory
(``--archive``) or downloads them over libp2p from every provider it finds
(the ``--bootstrap`` peers and the DHT; :meth:`p2p.host.P2PHost.fetch_blob`
fetches ranges from several providers at once), and accepts them only if they
hash to the chain's value, belong to the run and round asked for, and their
weights hash to the weights root committed for that round. Anything else is
refused: a download is deleted, nothing is written to ``OUT_DIR``, and the
message names the hash expected and the hash received. The accepted weights
are exported with :func:`training.export.export_hf` as a Hugging Face GPT-2
directory with its byte-level tokenizer.

:class:`PeerFetcher`, :class:`ArchiveSource`, :class:`PeerSource` and
:func:`first_good_copy` are how both commands get content-addressed bytes
(checkpoints, and for :mod:`node.tools.audit` run documents, contribution lists and
envelopes) from local directories and peers without trusting either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, NodeError, PullRefused

logger = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 300.0
MAX_DHT_MISSES = 3



class NoCheckpoint(NodeError):
    """The run has no published checkpoint (for the round asked)."""


def find_checkpoint_files(dirs: Iterable[str | Path], round_index: int, content_hash_hex: str) -> list[Path]:
    """Candidate checkpoint files in ``dirs``: by round name or by content hash (unverified)."""
    names = [f"round-{round_index:08d}.safetensors", f"{content_hash_hex}.safetensors", content_hash_hex]
    found = []
    for directory in map(Path, dirs):
        for sub in (directory, directory / "checkpoints", directory / "blobs"):
            for name in names:
                path = sub / name
                if path.is_file() and path not in found:
                    found.append(path)
    return found


class PeerFetcher:
    """A short-lived libp2p host that fetches blobs by hash from the bootstrap peers and the DHT."""

    def __init__(self, host: Any, workdir: Path, bootstrap_peers: list[str]) -> None:
        self.host = host
        self.workdir = workdir
        self.bootstrap_peers = bootstrap_peers
        self.errors: dict[str, str] = {}  # hash -> why the last fetch failed
        self.dht_misses = 0  # consecutive DHT lookups that found nobody

    @classmethod
    def start(cls, bootstrap: list[str], connect_timeout: float = 10.0) -> PeerFetcher:
        """Start a host on an ephemeral loopback/any port and dial ``bootstrap`` (unreachable ones are logged)."""
        from p2p.config import P2PConfig
        from p2p.errors import P2PError
        from p2p.host import P2PHost
        from p2p.identity import Identity

        workdir = Path(tempfile.mkdtemp(prefix="dlx-fetch-"))
        host_ip = (
            "127.0.0.1"
            if all(a.startswith(("/ip4/127.", "/dns4/localhost")) for a in bootstrap)
            else "0.0.0.0"
        )
        host = P2PHost.start(
            P2PConfig(listen_host=host_ip, listen_port=0, gossip_resync_interval=0),
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
        return cls(host, workdir, peers)

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

    def close_lists(self, run_id: int) -> dict[int, dict[int, list[list[tuple[int, int, str, str]]]]]:
        """Contribution lists of the run's recent ``close`` messages: round -> stage -> [entries].

        Entries are (stage, replica, peer_id, envelope hash hex). Several coordinators
        may have closed one (round, stage); every distinct list is kept, and the
        auditor keeps the one whose Merkle root the chain records.
        """
        import queue

        from node.live import protocol as msg
        from node.live.protocol import run_topic
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


# ---------------------------------------------------------------------- evidence sources (the auditor's)
class ArchiveSource:
    """Evidence from a local directory: a node's data dir, its ``archive`` dir or a ``run-<id>`` dir.

    Reads the layout of :mod:`node.store.archive` (run document, per-round ``round.json``
    and ``<sha256>.env`` files) and checkpoints named ``round-XXXXXXXX.safetensors``
    (in ``checkpoints/`` or the directory itself). Nothing read is trusted: the
    auditor checks every byte against the chain.
    """

    def __init__(self, directory: str | Path, run_id: int) -> None:
        self.root = Path(directory)
        self.name = f"archive {self.root}"
        candidates = [self.root / "archive" / f"run-{run_id}", self.root / f"run-{run_id}", self.root]
        self.run_dir = next(
            (c for c in candidates if (c / "run.json").exists() or any(c.glob("round-*/"))), None
        )

    def run_documents(self) -> list[bytes]:
        if self.run_dir is None or not (self.run_dir / "run.json").exists():
            return []
        return [(self.run_dir / "run.json").read_bytes()]

    def round_lists(self, round_index: int) -> list[list[tuple[int, int, str, str]]]:
        """The archived contribution lists of ``round_index`` (0 or 1 list; entries (stage, replica, peer, hex))."""
        if self.run_dir is None:
            return []
        path = self.run_dir / f"round-{round_index:08d}" / "round.json"
        if not path.exists():
            return []
        try:
            doc = json.loads(path.read_text())
            entries = [(int(s), int(r), str(p), str(h).lower()) for s, r, p, h in doc["contributions"]]
            if int(doc.get("round", round_index)) != round_index:
                raise ValueError(f"it says round {doc.get('round')}")
            for _s, _r, _p, h in entries:
                if len(h) != 64 or set(h) - set("0123456789abcdef"):
                    raise ValueError(f"{h[:80]!r} is not a sha256 hex digest")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: round %d manifest unreadable: %s", self.name, round_index, exc)
            return []
        return [entries]

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        if self.run_dir is None:
            return None
        path = self.run_dir / f"round-{round_index:08d}" / f"{hash_hex}.env"
        try:
            return path.read_bytes()
        except OSError:
            return None

    def checkpoint(self, round_index: int, content_hash_hex: str) -> bytes | None:
        """The candidate file with the expected content, else the first candidate (reported as corrupt)."""
        first = None
        for path in find_checkpoint_files([self.root], round_index, content_hash_hex):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if hashlib.sha256(data).hexdigest() == content_hash_hex:
                return data
            first = data if first is None else first
        return first


class PeerSource:
    """Evidence fetched over libp2p: blobs by hash, and round lists from the run's recent ``close`` gossip.

    ``fetcher`` is a :class:`node.tools.pull.PeerFetcher` already connected to peers.
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

    def round_lists(self, round_index: int) -> list[list[tuple[int, int, str, str]]]:
        if self._closes is None:
            self._closes = self.fetcher.close_lists(self.run_id)
        by_stage = self._closes.get(round_index, {})
        return [entries for stage in sorted(by_stage) for entries in by_stage[stage]]

    def envelope(self, round_index: int, hash_hex: str) -> bytes | None:
        return self.fetcher.fetch(hash_hex)

    def checkpoint(self, round_index: int, content_hash_hex: str) -> bytes | None:
        return self.fetcher.fetch(content_hash_hex)


@dataclass
class EvidenceCopy:
    """The verified bytes of one item (None if no source had them) and the sources that offered others."""

    data: bytes | None
    bad: list[str]  # "<source>: bytes hash to <hex>"


def first_good_copy(sources: list, getter: Callable[[Any], bytes | None], expected_hex: str) -> EvidenceCopy:
    """The first copy among ``sources`` whose sha256 is ``expected_hex``, noting the corrupt ones."""
    bad = []
    for source in sources:
        try:
            data = getter(source)
        except DLX_ERRORS as exc:
            logger.debug("%s: %s", source.name, exc)
            data = None
        if data is None:
            continue
        got = hashlib.sha256(data).hexdigest()
        if got == expected_hex:
            return EvidenceCopy(data, bad)
        bad.append(f"{source.name}: bytes hash to {got}")
    return EvidenceCopy(None, bad)


# ---------------------------------------------------------------------- pulling
@dataclass
class PullResult:
    """What :func:`pull_checkpoint` wrote."""

    out_dir: Path
    run_id: int
    round: int
    content_hash: str
    source: str
    size: int
    block_size: int  # the model's context length (generation must fit in it)


def _checkpoint_record(client: Any, run_id: int, round_index: int | None) -> tuple[int, bytes]:
    if round_index is None or round_index < 0:
        record = client.latest_checkpoint(run_id)
        if record is None:
            raise NoCheckpoint(
                f"run {run_id} has no published checkpoint yet: wait for the first checkpoint "
                "round (checkpoint_every) to be committed"
            )
        return record.round, record.content_hash
    content_hash = client.checkpoint_of(run_id, round_index)
    if content_hash is None:
        published = sorted(c.round for c in client.history(run_id, with_registrations=False).checkpoints)
        raise NoCheckpoint(
            f"run {run_id} has no checkpoint published for round {round_index}; published rounds: "
            f"{published or 'none'}"
        )
    return round_index, content_hash


def _verify(data: bytes, client: Any, run_id: int, round_index: int, content_hash: bytes, source: str) -> Any:
    """Parse ``data`` and check it is the chain's checkpoint of ``round_index``; raise PullRefused otherwise."""
    from node.store.checkpoint import parse_checkpoint
    from training.config import ModelConfig
    from training.hashing import stage_weights_hash, weights_root
    from training.stages import split_stages, stage_param_names

    got = hashlib.sha256(data).hexdigest()
    if got != content_hash.hex():
        raise PullRefused(
            f"checkpoint of round {round_index} from {source} refused: expected content hash "
            f"{content_hash.hex()} (on chain), got {got}"
        )
    try:
        ckpt = parse_checkpoint(data, content_hash)
        run = client.run_info(run_id)
        model_cfg = ModelConfig(**ckpt.model_config)
        specs = split_stages(model_cfg.n_layer, run.num_stages)
        hashes = [
            stage_weights_hash({n: ckpt.weights[n] for n in stage_param_names(model_cfg, spec)})
            for spec in specs
        ]
    except (*DLX_ERRORS, KeyError, TypeError) as exc:
        raise PullRefused(
            f"checkpoint {got[:16]} from {source} has the chain's content hash but is unusable: {exc}"
        ) from None
    if (ckpt.run_id, ckpt.round, ckpt.config_hash) != (run_id, round_index, run.config_hash):
        raise PullRefused(
            f"checkpoint {got[:16]} says run {ckpt.run_id} round {ckpt.round}, expected run {run_id} "
            f"round {round_index} with configHash {run.config_hash.hex()[:16]}"
        )
    commit = client.commit_of(run_id, round_index)
    if commit is None or weights_root(hashes) != commit.weights_root:
        raise PullRefused(
            f"checkpoint {got[:16]}: its weights root {weights_root(hashes).hex()} is not the one "
            f"committed for round {round_index} "
            f"({commit.weights_root.hex() if commit else 'no commit'})"
        )
    return ckpt, model_cfg


def pull_checkpoint(
    client: Any,
    run_id: int,
    out_dir: str | Path,
    round_index: int | None = None,
    archives: Iterable[str | Path] = (),
    fetcher: PeerFetcher | None = None,
) -> PullResult:
    """Fetch, verify and export the checkpoint of ``round_index`` (None: the latest) of ``run_id``.

    Local ``archives`` are tried first, then peers. Raises :class:`PullRefused`
    (exit 9) if no source offers the chain's bytes and some offered other bytes,
    :class:`NoCheckpoint` if nothing is published, :class:`NodeError` if no source
    has it. ``out_dir`` is written only after verification, atomically.
    """
    from node.fsutil import atomic_write_json
    from p2p.errors import BlobHashMismatch, P2PError
    from training.export import export_hf

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NodeError(f"{out} exists and is not empty: choose a new output directory")
    round_index, content_hash = _checkpoint_record(client, run_id, round_index)
    expected = content_hash.hex()
    refusals: list[str] = []
    accepted = None
    for path in find_checkpoint_files(archives, round_index, expected):
        try:
            accepted = (
                *_verify(path.read_bytes(), client, run_id, round_index, content_hash, str(path)),
                str(path),
                path.stat().st_size,
            )
            break
        except PullRefused as exc:
            logger.warning("%s", exc)
            refusals.append(str(exc))
    fetch_error = "no provider found"
    if accepted is None and fetcher is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.download-", dir=out.parent))
        try:
            dest = fetcher.fetch_to(expected, staging / f"{expected}.safetensors")
            data = dest.read_bytes()
            accepted = (
                *_verify(data, client, run_id, round_index, content_hash, "peers"),
                "peers",
                len(data),
            )
        except BlobHashMismatch as exc:
            refusals.append(
                f"checkpoint of round {round_index} downloaded from peers refused and deleted: {exc}"
            )
        except PullRefused as exc:
            refusals.append(f"{exc} (download deleted)")
        except P2PError as exc:
            logger.warning("checkpoint %s not downloaded: %s", expected[:16], exc)
            fetch_error = str(exc)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # verified bytes are in memory; nothing half-kept
    if accepted is None:
        if refusals:
            raise PullRefused("; ".join(refusals))
        where = "no --archive directory holds it" if fetcher is None else f"no peer served it ({fetch_error})"
        raise NodeError(
            f"checkpoint {expected[:16]} of run {run_id} round {round_index}: {where}; pass "
            "--bootstrap with a node's multiaddr (status.json 'listen_addrs') or --archive"
        )
    ckpt, model_cfg, source, size = accepted
    export_hf(ckpt.weights, model_cfg, out, overwrite=out.exists())
    atomic_write_json(
        out / "dlx_provenance.json",
        {
            "run_id": run_id,
            "round": round_index,
            "content_hash": expected,
            "chain_id": client.chain_id,
            "ledger": client.ledger_address,
            "registry": client.registry_address,
            "config_hash": ckpt.config_hash.hex(),
        },
    )
    logger.info(
        "checkpoint of round %d (%s, %d bytes, from %s) exported to %s",
        round_index,
        expected[:16],
        size,
        source,
        out,
    )
    return PullResult(out, run_id, round_index, expected, source, size, model_cfg.block_size)


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


def run_pull(args: Any) -> int:
    """``dlx-node pull``: exit 0 with the model written, 9 if only wrong bytes were offered."""
    client = reader_client(args)
    fetcher = PeerFetcher.start(args.bootstrap) if args.bootstrap else None
    try:
        result = pull_checkpoint(
            client,
            args.run,
            args.out_dir,
            None if args.round < 0 else args.round,
            archives=args.archive,
            fetcher=fetcher,
        )
    finally:
        if fetcher is not None:
            fetcher.close()
    out = str(result.out_dir)
    print(
        f"verified checkpoint of run {result.run_id} round {result.round} (sha256 {result.content_hash}, "
        f"{result.size} bytes, from {result.source}) -> {out}"
    )
    print(
        f'from transformers import AutoModelForCausalLM, AutoTokenizer; tok = AutoTokenizer.from_pretrained("{out}"); '
        f'model = AutoModelForCausalLM.from_pretrained("{out}")'
    )
    new_tokens = max(1, min(40, result.block_size - 8))  # prompt + new tokens must fit the context
    print(
        f'print(tok.decode(model.generate(**tok("To be", return_tensors="pt"), max_new_tokens={new_tokens}, '
        "do_sample=False)[0]))"
    )
    return 0
