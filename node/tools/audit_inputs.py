"""What an audit's replay needs besides the evidence of the rounds: an imported model's initial weights and
the run's tokenizer, both named by content in the run document.

A run started from a Hugging Face model (training/hf_import.py) replays round 0 from the weights the run
document names as ``model.init_weights = "sha256:<hex>"``; a run that tokenizes a text file with a BPE reads
it with the tokenizer ``model.tokenizer = "sha256:<hex>"`` names. The audit takes each from a local directory
(``--archive``: a node's data directory keeps them as ``initial/<hex>.safetensors`` and
``tokenizers/<hex>.json``) or, through a run link, from the run's peers (the nodes, the demo's seeder) over
``/dlx/blob/1.0.0``, exactly as a joining node does (:func:`node.initfetch.initial_weights`): a file
is used only if it hashes to the document's value, so an auditor verifies round 0 of an imported run from a
clone and the run link alone, and a wrong copy is refused, never replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS
from node.tools.report import OK, UNVERIFIABLE, Check

logger = logging.getLogger(__name__)

INITIAL_WEIGHTS = "initial weights"  # the audit's item for an imported model's start


def _archive_copy(archives: Iterable[str | Path], digest: str) -> tuple[Path | None, list[str]]:
    """The first archive file of the initial weights ``digest`` that hashes to it, and the copies that do
    not (refused, each named)."""
    from node.runconfig import file_sha256
    from training.hf_import import INIT_DIR

    refused = []
    for directory in archives:
        base = Path(directory).expanduser()
        for path in (base / INIT_DIR / f"{digest}.safetensors", base / f"{digest}.safetensors"):
            if not path.is_file():
                continue
            if file_sha256(path) == digest:
                return path, refused
            refused.append(f"{path} does not hash to it")
    return None, refused


def initial_weights_check(document: dict, archives: list, fetcher: Any) -> Check | None:
    """Make an imported run's initial weights findable by the replay (``training.hf_import.add_search_dir``
    of a checked copy): an archive's, else one fetched from the peers of ``fetcher`` (a
    :class:`node.tools.evidence.PeerFetcher`) into its scratch directory. The audit's item for them, or None
    for a run that draws its own initial weights."""
    from node.initfetch import initial_weights
    from training.hf_import import add_search_dir

    spec = str(document.get("model", {}).get("init_weights", ""))
    if not spec:
        return None
    digest = spec.removeprefix("sha256:")
    found, refused = _archive_copy(archives, digest)
    if found is not None:
        add_search_dir(found.parent, first=True)
        return Check(INITIAL_WEIGHTS, OK, f"{spec[:23]}... from {found} (hashes to the run document's)")
    addrs = tuple(getattr(fetcher, "addrs", ()) or ())
    why = "; ".join(refused)
    if addrs:
        try:
            path = Path(initial_weights(document, Path(fetcher.workdir), addrs))
        except DLX_ERRORS as exc:
            why = "; ".join([*refused, str(exc)])
        else:
            add_search_dir(path.parent, first=True)
            size = path.stat().st_size
            return Check(INITIAL_WEIGHTS, OK, f"{spec[:23]}... fetched from the run's peers ({size:,} bytes, "
                                              "hashing to the run document's)")
    return Check(INITIAL_WEIGHTS, UNVERIFIABLE,
                 f"the run starts from imported weights {spec[:23]}... and "
                 + (why or "no --archive holds them (initial/<sha256>.safetensors) and no peer was given")
                 + ": round 0 cannot be replayed")


def tokenizer_dirs(document: dict, archives: list, fetcher: Any) -> list[Path]:
    """Where the replay looks up the run's ``sha256:`` tokenizer (``training.tokenizer.load_tokenizer``): each
    archive's ``tokenizers/`` and the archive itself, and, when none holds it, the scratch directory of
    ``fetcher`` with a copy fetched from the run's peers and checked against its hash. A tokenizer that cannot
    be had is only logged: the replay names it where the training text needs it."""
    from node.tools.hf_export import TOKENIZER_DIR, find_tokenizer
    from training.tokenizer import parse_reference

    dirs = [d for a in archives for d in (Path(a).expanduser() / TOKENIZER_DIR, Path(a).expanduser())]
    reference = str(document.get("model", {}).get("tokenizer", "bytes"))
    try:
        digest = parse_reference(reference)
    except DLX_ERRORS:
        return dirs
    if digest is None or any((d / f"{digest}.json").is_file() for d in dirs) or fetcher is None:
        return dirs
    try:
        tokenizer = find_tokenizer(reference, (), fetcher)
    except DLX_ERRORS as exc:
        logger.warning("the run's tokenizer %s: %s", digest[:16], exc)
        return dirs
    kept = Path(fetcher.workdir) / TOKENIZER_DIR / f"{digest}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_bytes(tokenizer.data)
    return [*dirs, kept.parent]
