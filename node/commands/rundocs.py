"""Fetching a run's blobs by hash from its peers (``join``, ``start``'s pre-flight): the run document, whose
sha256 is the chain's ``configHash``, and the run's tokenizer (an imported model's initial weights:
node/initfetch.py)."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from node.clienthost import client_host
from node.errors import NetworkUnreachable, NodeError, NoPeerReachable

logger = logging.getLogger(__name__)

#: A run document is a few hundred bytes of JSON; a peer offering more is not offering one.
MAX_RUN_DOCUMENT_BYTES = 64 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # a tokenizer.json of a 256k vocabulary is ~20 MB
FETCH_TIMEOUT_S = 60.0
#: How long ``join`` dials a run's peers again while none answers (the organizer's node may be starting: its
#: first minute goes to loading torch and checking the chain), and how often it says so (seconds).
PEER_WAIT_S = 120.0
PEER_RETRY_EVERY_S = 3.0


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
        return NoPeerReachable(f"no peer of the run is reachable ({failures}): check the peer multiaddrs "
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
                       timeout: float = FETCH_TIMEOUT_S, peer_wait: float = 0.0) -> bytes:
    """The run document whose sha256 is ``config_hash`` (the chain's), from ``peers``: every node serves
    it. While no peer answers, dial them again for up to ``peer_wait`` seconds, saying so at once and at each
    try (issue 80: a join right after the organizer's start found no node listening yet)."""
    started, said = time.monotonic(), None
    while True:
        try:
            return fetch_blob(peers, config_hash.hex(), workdir, MAX_RUN_DOCUMENT_BYTES,
                              "the run document (the run's configHash)", timeout)
        except NoPeerReachable as exc:
            waited = time.monotonic() - started
            if waited >= peer_wait:
                if not peer_wait:
                    raise
                raise NoPeerReachable(f"{exc} (dialled for {waited:.0f}s; --peer-wait SECONDS waits longer "
                                      "for a run whose nodes are starting)") from None
            if said is None:
                logger.warning("%s: dialling again for up to %.0fs (its nodes may be starting)", exc,
                               peer_wait)
            else:
                logger.warning("no peer of the run answers yet: dialled for %.0fs of up to %.0fs", waited,
                               peer_wait)
            said = waited
            time.sleep(max(0.0, min(PEER_RETRY_EVERY_S, peer_wait - waited)))
