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

The bytes come through the evidence layer shared with ``dlx-node audit``
(:mod:`node.tools.evidence`).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, NodeError, PullRefused
from node.tools.evidence import PeerFetcher, find_checkpoint_files, reader_client

logger = logging.getLogger(__name__)


class NoCheckpoint(NodeError):
    """The run has no published checkpoint (for the round asked)."""


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


def _verified_checkpoint(
    data: bytes, client: Any, run_id: int, round_index: int, content_hash: bytes, source: str
) -> Any:
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
                *_verified_checkpoint(path.read_bytes(), client, run_id, round_index, content_hash, str(path)),
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
                *_verified_checkpoint(data, client, run_id, round_index, content_hash, "peers"),
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
