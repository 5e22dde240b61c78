"""An imported model's initial weights, fetched by their sha256 from a run's peers (``join``, and ``audit``
through a run link: node/tools/audit_inputs.py), as the run document names them (``model.init_weights``,
training/hf_import.py). Neither a command nor a tool: both use it."""

from __future__ import annotations

from pathlib import Path

from node.clienthost import client_host
from node.errors import NetworkUnreachable, NodeError

MAX_INIT_WEIGHTS_BYTES = 64 * 1024**3  # an imported model's float32 weights (16G parameters)
INIT_WEIGHTS_TIMEOUT_S = 3600.0


def initial_weights(document: dict, data_dir: Path, peers: tuple[str, ...],
                    timeout: float = INIT_WEIGHTS_TIMEOUT_S) -> str:
    """The path of an imported model's initial weights (the run document's ``model.init_weights``,
    ``sha256:<hex>``; "" for a run that draws its own), kept as ``<data_dir>/initial/<hex>.safetensors``:
    a copy already there is used when it hashes to ``<hex>``, else the file is fetched from ``peers`` (the
    organizer's node, the seeder, members) over ``/dlx/blob/1.0.0``, piece by piece, checked, and moved
    into place (never read into memory whole)."""
    import os

    from node.errors import ConfigError
    from node.runconfig import file_sha256
    from p2p.errors import P2PError
    from training.hf_import import INIT_DIR

    spec = str(document.get("model", {}).get("init_weights", ""))
    if not spec:
        return ""
    digest = spec.removeprefix("sha256:")
    if not spec.startswith("sha256:") or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
        raise ConfigError(f"the run document's model.init_weights={spec[:80]!r}: not sha256:<64 hex digits>")
    kept = data_dir / INIT_DIR / f"{digest}.safetensors"
    if kept.is_file():
        if file_sha256(kept) == digest:
            return str(kept.resolve())
        raise ConfigError(f"{kept}: not the run's initial weights (its sha256 is not {digest[:16]}...): "
                          "delete it to fetch them again")
    if not peers:
        raise ConfigError(f"the run starts from imported weights sha256:{digest[:16]}...: no peer to fetch "
                          "them from")
    kept.parent.mkdir(parents=True, exist_ok=True)

    def unreachable(failures: str) -> NodeError:
        return NetworkUnreachable(f"no peer of the run is reachable ({failures})")

    with client_host(peers, data_dir, prefix=".init-fetch-", max_blob_bytes=MAX_INIT_WEIGHTS_BYTES,
                     unreachable=unreachable) as (host, reached, staging):
        try:
            path = host.fetch_blob(digest, staging / "blob", providers=reached, timeout=timeout)
        except P2PError as exc:
            raise NetworkUnreachable(f"the run's initial weights {digest[:16]} could not be fetched from "
                                     f"{len(reached)} peer(s): {exc}") from None
        if file_sha256(Path(path)) != digest:  # the blob protocol checked it; a second look is cheap
            raise NodeError(f"the initial weights fetched do not hash to {digest[:16]}")
        os.replace(path, kept)
    return str(kept.resolve())
