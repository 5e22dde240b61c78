"""Fetching a run's blobs by hash from its peers (``join``, ``start``'s pre-flight): the run document, whose
sha256 is the chain's ``configHash``, and the run's tokenizer (an imported model's initial weights:
node/initfetch.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from node.clienthost import client_host
from node.errors import NetworkUnreachable, NodeError

#: A run document is a few hundred bytes of JSON; a peer offering more is not offering one.
MAX_RUN_DOCUMENT_BYTES = 64 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # a tokenizer.json of a 256k vocabulary is ~20 MB
FETCH_TIMEOUT_S = 60.0


def fetch_blob(peers: tuple[str, ...], hash_hex: str, workdir: Path, max_bytes: int, what: str,
               timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The blob whose sha256 is ``hash_hex`` (``what``, for messages), from ``peers`` over
    ``/dlx/blob/1.0.0``.

    A short-lived, client-only host with a throwaway identity (the node's own starts later, with its
    own connections): it listens nowhere, so the peers learn no address of it to dial once it is
    gone (docs/P2P.md, "Forgetting peers that are gone"). Its blob size limit is ``max_bytes``, so a
    peer that offers gigabytes under that hash is refused from the reply header, before any byte is
    written.
    """
    from p2p.errors import P2PError

    def unreachable(failures: str) -> NodeError:
        return NetworkUnreachable(f"no peer of the run is reachable ({failures}): check the peer multiaddrs "
                                  "and that this machine can reach them")

    with client_host(peers, workdir, prefix=".join-fetch-", max_blob_bytes=max_bytes,
                     unreachable=unreachable) as (host, reached, staging):
        try:
            path = host.fetch_blob(hash_hex, staging / "blob", providers=reached, timeout=timeout)
        except P2PError as exc:
            raise NetworkUnreachable(
                f"{what} {hash_hex[:16]} could not be fetched from {len(reached)} peer(s): {exc}") from None
        data = path.read_bytes()
    # the blob protocol checked it; a second look costs nothing
    if hashlib.sha256(data).hexdigest() != hash_hex:
        raise NodeError(f"the {what} fetched does not hash to {hash_hex[:16]}")
    return data


def fetch_run_document(peers: tuple[str, ...], config_hash: bytes, workdir: Path,
                       timeout: float = FETCH_TIMEOUT_S) -> bytes:
    """The run document whose sha256 is ``config_hash`` (the chain's), from ``peers``: every node serves
    it."""
    return fetch_blob(peers, config_hash.hex(), workdir, MAX_RUN_DOCUMENT_BYTES,
                      "the run document (the run's configHash)", timeout)
