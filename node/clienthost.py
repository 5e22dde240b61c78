"""A short-lived, client-only libp2p host for a command that fetches from a run's peers.

``dlx-node join`` fetches the run document and the prepared dataset's shards before its node exists. It
does so with a throwaway identity on a host that listens nowhere, so the peers learn no address of it to
dial once it is gone (docs/P2P.md, "Forgetting peers that are gone").
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from node.errors import NetworkUnreachable, NodeError

#: Seconds to dial each peer of the run.
DIAL_TIMEOUT_S = 10


@contextmanager
def client_host(
    peers: tuple[str, ...], workdir: Path, *, prefix: str, max_blob_bytes: int | None = None,
    unreachable: Callable[[str], NodeError] = NetworkUnreachable,
) -> Iterator[tuple[Any, list[Any], Path]]:
    """(host, the peers it reached, its staging directory): a client-only host with a throwaway identity, its
    blob store in a staging directory under ``workdir`` that is removed with the host.

    Raises ``unreachable(<each peer and why>)`` when no peer answers.
    """
    from p2p.config import P2PConfig
    from p2p.errors import P2PError
    from p2p.host import P2PHost
    from p2p.identity import Identity

    limits = {} if max_blob_bytes is None else {"max_blob_bytes": max_blob_bytes}
    config = P2PConfig(listen=False, gossip_resync_interval=0, **limits)
    workdir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=workdir))
    host = P2PHost.start(config, Identity.generate(), data_dir=staging)
    try:
        reached, failures = [], []
        for addr in peers:
            try:
                reached.append(host.connect(addr, timeout=DIAL_TIMEOUT_S))
            except P2PError as exc:
                failures.append(f"{addr}: {exc}")
        if not reached:
            raise unreachable("; ".join(failures))
        yield host, reached, staging
    finally:
        host.close()
        shutil.rmtree(staging, ignore_errors=True)
