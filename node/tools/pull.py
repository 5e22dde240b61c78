"""``dlx-node pull``: fetch a published checkpoint, verify it against the chain, write a transformers dir.

A checkpoint is published only inside an attested round record (its ``checkpointHash``: the sha256 of the
file, or in a header-hashed run the hash of the file's header, node/store/checkpoint_hash.py). ``pull``
first judges the round on the chain alone (:func:`node.tools.standing.round_standing`, re-exported here):
its commit links into the run's hash chain, its record was attested by ``quorum`` distinct members in force
at the commit, it lies within the run's ``maxRounds``, and no member disputed it or any round before it (a
checkpoint descends from every earlier round), unless a replay of the disputed round from ``--archive``
reproduces its committed record (:func:`cleared_disputes`; the output says which). By default it takes the
latest checkpoint whose round passes; ``--round`` asks for one round, refused with the failed check's error
(:class:`node.errors.RoundNotTrusted` and its subclasses) if it does not pass.

Then it takes the bytes from a local directory (``--archive``) or downloads them over libp2p from every
provider it finds (the ``--bootstrap`` peers and the DHT; :meth:`p2p.host.P2PHost.fetch_blob` fetches ranges
from several providers at once), and accepts them only if they hash to the record's ``checkpointHash`` (a
header-hashed run's: assembled from its stages' holders, the header's hash, every stage's tensors then
checked against the header's leaves), agree with the run document, fetched by the chain's ``configHash``
from the archives or the peers (every metadata field, the model config included, and the tensors are
exactly the run's stages), and their weights hash to the record's ``weightsRoot``
(:class:`node.errors.CheckpointInconsistent` otherwise; by default the next older trusted checkpoint is then
tried). Without the run document nothing is installed
(:class:`node.errors.RunDocumentMissing`). The exported config is the run document's, never the file's.
Anything else is refused: a download is deleted, nothing is written to ``OUT_DIR``, and the message names the
check that failed. The accepted weights are exported with :func:`training.export.export_hf` as a Hugging Face
directory of the model's family with the run's tokenizer (:mod:`node.tools.hf_export`).

The bytes come through the evidence layer shared with ``dlx-node audit`` (:mod:`node.tools.evidence`).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.errors import (
    DLX_ERRORS,
    CheckpointInconsistent,
    ConfigError,
    PullRefused,
    PullUnavailable,
    RoundNotTrusted,
    RunDocumentMissing,
)
from node.progress import host_progress
from node.tools.evidence import PeerFetcher, find_checkpoint_files
from node.tools.standing import chain_finality, round_standing

logger = logging.getLogger(__name__)


class NoCheckpoint(PullRefused):
    """The run has no published checkpoint (for the round asked): nothing to install (exit 9, a refusal)."""

    check = "published"


# ---------------------------------------------------------------------- pulling
@dataclass
class PullResult:
    """What :func:`pull_checkpoint` wrote."""

    out_dir: Path
    run_id: int
    round: int
    content_hash: str  # the record's checkpointHash (the file's sha256, or its header's: docs/PROTOCOL.md)
    source: str
    size: int
    block_size: int  # the model's context length (generation must fit in it)
    attesters: tuple[str, ...] = ()  # the members whose signatures committed the round's record
    submitter: str = ""
    skipped: list[str] = field(default_factory=list)  # newer checkpoints passed over by default, and why
    members_since: dict[str, int] = field(default_factory=dict)  # attester -> block its membership began
    cleared: dict[int, str] = field(default_factory=dict)  # disputed rounds a replay cleared, and how
    commit_block: int = 0
    final: bool = True  # the chain's isFinal when pulled (False only with final_only=False)
    final_from: int = 0  # the block its own proof window closes (TrainingLedger.proofWindowOf), as read
    file_sha256: str = ""  # the verified file's own sha256 (the content hash too, unless header-hashed)


def _candidates(
    history: Any, standing: dict[int, RoundNotTrusted | None], round_index: int | None
) -> tuple[list[Any], list[str]]:
    """The commit records whose checkpoint may be pulled, newest first, and why newer ones were passed over.

    Raises:
        NoCheckpoint: Nothing published (for ``round_index``).
        RoundNotTrusted: ``round_index`` (or, by default, every published round) fails a chain check.
    """
    run_id = history.run.run_id
    published = [record for record in history.commits if record.commit.has_checkpoint]
    if round_index is not None:
        chosen = [record for record in published if record.commit.round == round_index]
        if not chosen:
            rounds = [record.commit.round for record in published]
            committed = any(record.commit.round == round_index for record in history.commits)
            why = "it was committed without one (not a checkpoint round)" if committed else \
                "it is not committed"
            raise NoCheckpoint(
                f"run {run_id} has no checkpoint published for round {round_index} ({why}); published "
                f"rounds: {rounds or 'none'}: pass one of them to --round, or none for the latest"
            )
        if standing.get(round_index) is not None:
            raise standing[round_index]
        return chosen, []
    if not published:
        raise NoCheckpoint(
            f"run {run_id} has no published checkpoint yet: wait for the first checkpoint "
            "round (checkpoint_every) to be committed"
        )
    trusted, skipped = [], []
    for record in reversed(published):
        problem = standing.get(record.commit.round)
        if problem is None:
            trusted.append(record)
        else:
            skipped.append(f"round {record.commit.round}: {problem.check}: {problem}")
    if not trusted:
        latest = standing[published[-1].commit.round]
        raise type(latest)(
            f"no published checkpoint of run {run_id} is on a trusted round: {'; '.join(skipped)}")
    return trusted, skipped


def _verified_checkpoint(data: bytes, layout: Any, commit: Any, source: str) -> Any:
    """Parse ``data`` and check it is the checkpoint ``commit`` (a RoundRecord) publishes for the run whose
    document gave ``layout`` (a :class:`node.store.checkpoint.RunLayout`).

    Raises:
        PullRefused: The bytes do not hash to the record's ``checkpointHash``.
        CheckpointInconsistent: They do, but the file is unusable, or its metadata or tensors disagree with
            the run document, or its weights root is not the record's ``weightsRoot``.
    """
    from node.store.checkpoint import checkpoint_problems, parse_checkpoint
    from training.config import ModelConfig

    from node.store.checkpoint_hash import record_hash

    round_index, content_hash = commit.round, commit.checkpoint_hash
    got = record_hash(data, layout.header_hashed).hex()  # a header-hashed run's: its header's (checked below)
    if got != content_hash.hex():
        raise PullRefused(
            f"checkpoint of round {round_index} from {source} refused: expected content hash "
            f"{content_hash.hex()} (on chain), got {got}"
            + (" (the run's records hash the checkpoint's header)" if layout.header_hashed else "")
        )
    try:
        ckpt = parse_checkpoint(data)  # its hash was checked above (the header's, or the whole file's)
        problems = checkpoint_problems(ckpt, layout, round_index, commit.weights_root)
    except (*DLX_ERRORS, KeyError, TypeError) as exc:
        raise CheckpointInconsistent(
            f"checkpoint {got[:16]} from {source} has the record's content hash but is unusable: {exc}"
        ) from None
    if problems:
        raise CheckpointInconsistent(
            f"checkpoint {got[:16]} of round {round_index} from {source} contradicts the run document or its "
            f"record: {'; '.join(problems)}"
        )
    # the run document's config, never the file's; and the file's own sha256 (a header-hashed record's
    # checkpointHash is its header's, so the file's is told beside it)
    return ckpt, ModelConfig(**layout.model_config), hashlib.sha256(data).hexdigest()


def run_layout(history: Any, archives: Iterable[str | Path], fetcher: PeerFetcher | None) -> Any:
    """The :class:`node.store.checkpoint.RunLayout` of the run document whose sha256 is the chain's
    ``configHash``, from the first archive or peer that has it.

    Raises:
        RunDocumentMissing: No archive or peer has a copy that hashes to the ``configHash`` and loads.
    """
    from node.runconfig import parse_run_document
    from node.store.checkpoint import RunLayout
    from node.tools.evidence import ArchiveSource

    run = history.run
    expected = run.config_hash
    copies = [d for a in archives for d in ArchiveSource(a, run.run_id).run_documents()]
    if fetcher is not None and expected not in {hashlib.sha256(d).digest() for d in copies}:
        fetched = fetcher.fetch(expected.hex())  # peers only when no archive holds the document
        if fetched is not None:
            copies.append(fetched)
    problems = []
    for data in copies:
        if hashlib.sha256(data).digest() != expected:
            problems.append(f"a copy hashes to {hashlib.sha256(data).hexdigest()[:16]}")
            continue
        try:
            layout = RunLayout.of_document(run.run_id, expected, parse_run_document(data, expected))
        except DLX_ERRORS as exc:
            problems.append(f"it does not load: {exc}")
            continue
        if layout.num_stages != run.num_stages:
            problems.append(f"it says {layout.num_stages} stages, the run on chain {run.num_stages}")
            continue
        return layout
    raise RunDocumentMissing(
        f"the run document {expected.hex()[:16]} (the run's configHash) is not available"
        f"{': ' + '; '.join(problems) if problems else ''}: without it a checkpoint's "
        "config and tensors cannot "
        "be checked; pass --archive with a node's data directory or --bootstrap with a node's multiaddr"
    )


def cleared_disputes(client: Any, history: Any, archives: Iterable[str | Path]) -> dict[int, str]:
    """The disputed rounds that a replay from ``archives`` clears: round -> how.

    A round is cleared when the audit (:func:`node.tools.audit.audit_run`) finds every item of it ok: its
    contributions are the committed ones, and aggregating them from the replayed state of the round
    before gives the committed weights root (and its checkpoint, if any, verifies).
    """
    archives = list(archives)
    disputed = {d.round for d in history.disputes}
    if not disputed or not archives:
        return {}
    from node.tools.audit import audit_run
    from node.tools.report import OK

    report = audit_run(client, history.run.run_id, archives=archives, replay=True, check_code=False)
    checkpoint_ok = {}
    for check in report.checkpoints:
        checkpoint_ok[check.round] = checkpoint_ok.get(check.round, True) and check.status == OK
    cleared = {}
    for verdict in report.rounds:
        if verdict.round in disputed and verdict.status == OK and checkpoint_ok.get(verdict.round, True):
            cleared[verdict.round] = (
                f"replayed from the archives: the committed record of round {verdict.round} "
                "reproduces, the dispute does not")
    return cleared


def _fetch_verified(
    run: Any, layout: Any, commit: Any, out: Path, archives: Iterable[str | Path], fetcher: PeerFetcher | None
) -> tuple[Any, Any, str, str, int]:
    """The checkpoint ``commit`` publishes, from the first archive file or peer download that verifies: (the
    checkpoint, its model config, the file's sha256, the source, its size).

    Raises:
        CheckpointInconsistent: The record's bytes were found but contradict the record.
        PullRefused: Only other bytes were offered.
        NodeError: No source has the bytes.
    """
    from p2p.errors import BlobHashMismatch, P2PError

    expected = commit.checkpoint_hash.hex()
    refusals: list[PullRefused] = []
    for path in find_checkpoint_files(archives, commit.round, expected):
        try:
            return (*_verified_checkpoint(path.read_bytes(), layout, commit, str(path)), str(path),
                    path.stat().st_size)
        except PullRefused as exc:
            logger.warning("%s", exc)
            refusals.append(exc)
    fetch_error = "no provider found"
    if fetcher is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.download-", dir=out.parent))
        try:
            whole_failed = layout.header_hashed  # its record names no whole file: from its stages' holders
            if not whole_failed:
                try:
                    # size and rate on a terminal
                    with host_progress(fetcher.host, f"checkpoint of round {commit.round}"):
                        dest = fetcher.fetch_to(expected, staging / f"{expected}.safetensors")
                    data = dest.read_bytes()
                    return (*_verified_checkpoint(data, layout, commit, "peers"), "peers", len(data))
                except BlobHashMismatch as exc:
                    refusals.append(PullRefused(f"checkpoint of round {commit.round} downloaded from peers "
                                                f"refused and deleted: {exc}"))
                except PullRefused as exc:
                    refusals.append(type(exc)(f"{exc} (download deleted)"))
                except P2PError as exc:
                    logger.warning("checkpoint %s not downloaded whole: %s", expected[:16], exc)
                    fetch_error, whole_failed = str(exc), True
            split = _split_from_peers(fetcher, layout, commit, staging) if whole_failed and layout.chunked \
                else None
            if split is not None:
                return (*_verified_checkpoint(split.read_bytes(), layout, commit, "peers (assembled from its "
                                              "stages' holders)"), "peers", split.stat().st_size)
            if layout.header_hashed:
                fetch_error = "its header and stages were not all served by the peers found"
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # verified bytes are in memory; nothing half-kept
    if refusals:
        inconsistent = [r for r in refusals if isinstance(r, CheckpointInconsistent)]
        raise (inconsistent[0] if inconsistent else refusals[0]).__class__("; ".join(map(str, refusals)))
    where = "no --archive directory holds it" if fetcher is None else f"no peer served it ({fetch_error})"
    raise PullUnavailable(
        f"checkpoint {expected[:16]} of run {run.run_id} round {commit.round}: {where}; pass "
        "--bootstrap with a node's multiaddr (status.json 'listen_addrs') or --archive"
    )


def _split_from_peers(fetcher: PeerFetcher, layout: Any, commit: Any, staging: Path) -> Path | None:
    """The checkpoint ``commit`` names, assembled from its header and each stage's shard as the fetcher's
    peers serve them under their keys (a run whose nodes keep it split: node/store/checkpoint_split.py),
    each part checked against the record; None (logged) if they do not serve every stage."""
    from node.store.checkpoint_split import assemble_checkpoint, header_key, stage_key

    from p2p.errors import P2PError

    host, digest = fetcher.host, commit.checkpoint_hash
    known = [*fetcher.bootstrap_peers, *host.peers()]

    def remote(key: str) -> list:
        try:  # the holders announce each key on the DHT: the link's peers may hold some stages only
            found = host.find_providers(key, timeout=15)
        except P2PError as exc:
            logger.info("no DHT lookup of checkpoint key %s: %s", key[:12], exc)
            found = []
        return [lambda offset, length, peer=peer: host.fetch_blob_range(key, offset, length, peer, timeout=60)
                for peer in dict.fromkeys([*known, *found]) if peer != host.peer_id]

    dest = staging / f"{digest.hex()}.assembled.safetensors"
    try:
        assemble_checkpoint(remote(header_key(digest)), lambda stage: remote(stage_key(digest, stage)),
                            layout, commit.round, commit.weights_root, digest, dest)
    except DLX_ERRORS as exc:
        logger.warning("checkpoint %s not assembled from its stages' holders either: %s", digest.hex()[:16],
                       exc)
        return None
    return dest


def pull_checkpoint(
    client: Any,
    run_id: int,
    out_dir: str | Path,
    round_index: int | None = None,
    archives: Iterable[str | Path] = (),
    fetcher: PeerFetcher | None = None,
    rpc_url: str = "",
    peers: Iterable[str] = (),
    final_only: bool = True,
) -> PullResult:
    """Fetch, verify and export the checkpoint of ``round_index`` (None: the latest trusted one) of
    ``run_id``.

    The directory also gets a model card (``README.md``, with the provenance and the commands that audit the
    run and pull it again from ``rpc_url`` and ``peers``) and a generation config
    (:mod:`node.tools.model_card`).

    With ``final_only`` (the default) only final rounds are taken: dispute window closed, disputes settled
    (``pull --pending`` turns it off and says so). The round must pass :func:`round_standing` (by default,
    newer checkpoints whose round does not are passed
    over and listed in ``PullResult.skipped``, as are newer ones whose file contradicts their record). Local
    ``archives`` are tried first, then peers. ``out_dir`` is written only after verification, atomically.

    Raises:
        RoundNotTrusted: The round asked for (or every published round) fails a chain check; its subclass
            names the check (RoundUnattested, RoundDisputed, RoundBeyondMax, RoundNotLinked).
        CheckpointInconsistent: The file with the record's content hash contradicts the record.
        PullRefused: Only bytes other than the record's were offered (exit 9, as all refusals).
        NoCheckpoint: Nothing is published (for that round).
        NodeError: No source has the bytes, or ``out_dir`` is not empty.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not empty: choose a new output directory")
    archives = list(archives)
    history = client.history(run_id, with_registrations=False)
    cleared = cleared_disputes(client, history, archives)
    is_final = chain_finality(client, run_id)  # issue 79: final is what the chain's isFinal says
    standing = round_standing(history, client.chain_id, client.ledger_address, cleared, final_only=final_only,
                              is_final=is_final)
    candidates, skipped = _candidates(history, standing, round_index)
    layout = run_layout(history, archives, fetcher)
    record, (ckpt, model_cfg, file_sha256, source, size) = _first_verified(
        candidates, history.run, layout, out, archives, fetcher, skipped, insist=round_index is not None)
    commit = record.commit
    expected = commit.checkpoint_hash.hex()
    for reason in skipped:
        logger.warning("newer checkpoint passed over: %s", reason)
    provenance = {
        "run_id": run_id,
        "round": commit.round,
        "content_hash": expected,
        "weights_root": commit.weights_root.hex(),
        "attesters": list(record.attesters),
        "commit_tx": record.tx_hash,
        "chain_id": client.chain_id,
        "ledger": client.ledger_address,
        "registry": client.registry_address,
        "config_hash": ckpt.config_hash.hex(),
    }
    from node.tools.hf_export import find_tokenizer

    tokenizer = find_tokenizer(model_cfg.tokenizer, archives, fetcher)  # the run's, checked by its hash
    _write_model_dir(ckpt.weights, model_cfg, out, provenance, rpc_url, list(peers), tokenizer)
    logger.info("checkpoint of round %d (%s, %d bytes, from %s) exported to %s", commit.round, expected[:16],
                size, source, out)
    return PullResult(
        out, run_id, commit.round, expected, source, size, model_cfg.block_size,
        attesters=tuple(record.attesters), submitter=record.submitter, skipped=skipped,
        members_since=_members_since(history, record), cleared=cleared, commit_block=record.block_number,
        final=is_final(commit.round),
        final_from=client.proof_window_of(run_id, commit.round)[1], file_sha256=file_sha256,
    )


def _first_verified(candidates: list, run: Any, layout: Any, out: Path, archives: list, fetcher: Any,
                    skipped: list[str], insist: bool) -> tuple[Any, tuple]:
    """The newest candidate record whose checkpoint verifies, with what :func:`_fetch_verified` returned.

    A candidate whose file contradicts its record is passed over (added to ``skipped``) unless it is the
    last, or the round was asked for (``insist``): then CheckpointInconsistent is raised.
    """
    for record in candidates:
        try:
            return record, _fetch_verified(run, layout, record.commit, out, archives, fetcher)
        except CheckpointInconsistent as exc:
            if insist or record is candidates[-1]:
                raise
            logger.warning("passing over round %d: %s", record.commit.round, exc)
            skipped.append(f"round {record.commit.round}: {exc.check}: {exc}")
    raise NoCheckpoint("no checkpoint to pull")  # _candidates returns at least one or raises


def _members_since(history: Any, record: Any) -> dict[str, int]:
    """For each attester of ``record``: the block its membership in force at the commit began."""
    since = {}
    for membership in history.members_at(record.position):
        since[membership.account.lower()] = membership.joined[0]
    return {a: since.get(a.lower(), -1) for a in record.attesters}


def _write_model_dir(weights: Any, model_cfg: Any, out: Path, provenance: dict, rpc_url: str,
                     peers: list[str], tokenizer: Any = None) -> None:
    # the export, tokenizer and card (node/tools/hf_export.py)
    from node.tools.hf_export import write_model_dir

    write_model_dir(weights, model_cfg, out, provenance, rpc_url, peers, tokenizer)


