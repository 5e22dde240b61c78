"""The transformers directory ``dlx-node pull`` writes: the model by family, the run's tokenizer, the model
card.

:func:`find_tokenizer` gets the tokenizer a checkpoint's model config names: the byte tokenizer, or the
file of ``sha256:<hex>`` from a local directory (``--archive``: ``<dir>/tokenizers/<hex>.json``,
``<dir>/<hex>.json``, or a prepared dataset's ``tokenizer.json``) or from peers as the blob ``<hex>``,
refused unless its bytes hash to ``<hex>``. :func:`write_model_dir` exports the weights with it
(:func:`training.export.export_hf`: ``GPT2LMHeadModel`` or ``LlamaForCausalLM``), adds the provenance,
model card and generation config (:mod:`node.tools.model_card`) and moves the directory into place in
one rename.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from node.errors import NodeError, PullRefused, PullUnavailable

logger = logging.getLogger(__name__)

TOKENIZER_DIR = "tokenizers"  # a node keeps its run's tokenizer as <data_dir>/tokenizers/<sha256>.json


def _local_candidates(directory: Path, digest: str) -> list[Path]:
    found = [directory / TOKENIZER_DIR / f"{digest}.json", directory / f"{digest}.json"]
    found += sorted(directory.glob("*/tokenizer.json")) + [directory / "tokenizer.json"]
    return [path for path in found if path.is_file()]


def find_tokenizer(reference: str, archives: Iterable[str | Path] = (), fetcher: Any = None) -> Any:
    """The tokenizer ``reference`` (a checkpoint's ``model.tokenizer``) names, verified by its hash.

    Raises:
        PullRefused: A peer sent bytes that are not the tokenizer.
        NodeError: No local directory and no peer has it.
    """
    from training.errors import TokenizerError
    from training.tokenizer import ByteTokenizer, load_tokenizer, parse_reference, tokenizer_from_bytes

    if reference == "bytes":
        return ByteTokenizer()
    try:
        digest = parse_reference(reference)
    except TokenizerError as exc:
        raise NodeError(f"checkpoint names tokenizer {reference[:80]!r}: {exc}") from None
    if digest is None:  # a node that named its tokenizer by a path: usable only where that path exists
        try:
            return load_tokenizer(reference)
        except TokenizerError as exc:
            raise NodeError(
                f"the checkpoint names its tokenizer by a path on the training machine, not by its "
                f"hash ({exc}): put the run's tokenizer.json at that path") from None
    for directory in archives:
        for path in _local_candidates(Path(directory).expanduser(), digest):
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == digest:
                return tokenizer_from_bytes(data, digest, source=str(path))
    if fetcher is not None:
        from p2p.errors import P2PError

        with tempfile.TemporaryDirectory(prefix=".dlx-tokenizer-") as staging:
            try:
                path = fetcher.fetch_to(digest, Path(staging) / f"{digest}.json")
                return tokenizer_from_bytes(path.read_bytes(), digest, source="peers")
            except TokenizerError as exc:
                raise PullRefused(f"tokenizer {digest[:16]} from peers refused: {exc}") from None
            except P2PError as exc:
                logger.warning("tokenizer %s not downloaded: %s", digest[:16], exc)
    raise PullUnavailable(f"the run's tokenizer sha256:{digest} was found neither in --archive directories "
                    f"({TOKENIZER_DIR}/{digest}.json or a dataset's tokenizer.json) nor on peers")


def model_summary(model_cfg: Any, tokenizer: Any) -> dict[str, Any]:
    """What the model card says about the model."""
    from training.export import special_token_id
    from training.model import count_params

    summary = {"params": count_params(model_cfg), "n_layer": model_cfg.n_layer, "n_embd": model_cfg.n_embd,
               "n_head": model_cfg.n_head, "block_size": model_cfg.block_size, "family": model_cfg.family,
               "special_token_id": special_token_id(tokenizer)}
    if model_cfg.family == "llama":
        summary["n_kv_head"] = model_cfg.n_kv_head
    if tokenizer.sha256 != "bytes":
        summary["tokenizer"] = (f"byte-level BPE of {tokenizer.vocab_size:,} tokens (sha256 "
                                f"{tokenizer.sha256[:16]}...)")
    return summary


def write_model_dir(weights: Any, model_cfg: Any, out: Path, provenance: dict, rpc_url: str, peers: list[str],
                    tokenizer: Any = None) -> None:
    """Export, add the provenance, model card and generation config, then move the directory into place
    (one rename: a crash leaves no half-written ``out``). ``tokenizer``: default, ``model_cfg.tokenizer``
    loaded (the byte tokenizer, or a path)."""
    from node.fsutil import atomic_write_json
    from node.tools.model_card import write_model_extras
    from training.export import export_hf
    from training.tokenizer import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(model_cfg.tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.pull-", dir=out.parent))
    try:
        model_dir = export_hf(weights, model_cfg, staging / "model", tokenizer=tokenizer)
        atomic_write_json(model_dir / "dlx_provenance.json", provenance)
        write_model_extras(model_dir, provenance, model_summary(model_cfg, tokenizer), rpc_url, peers)
        if out.exists():
            out.rmdir()  # empty (checked before anything was fetched)
        os.replace(model_dir, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
