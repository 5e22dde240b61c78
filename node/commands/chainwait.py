"""``dlx-node start``'s wait for a chain that does not answer (issue 80): said at once, with its URL, and
every few seconds, and bounded.

A node and its chain may start in any order, so a start waits for the chain's RPC. How long: ``--chain-wait
SECONDS`` when given; else, on a node's first start (no ``state.json`` in its directory yet: most often a
mistyped URL, or a chain that is not up), at most :data:`FIRST_START_WAIT_S`; else (a restart, whose chain
may be restarting with it) ``ledger.startup_wait``. Each line names the URL, how long it has waited and for
how long it will; past the wait, the start fails with exit 5 and what to check.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from pathlib import Path

from ledger.errors import ChainUnavailable

logger = logging.getLogger(__name__)

#: The longest a node's first start waits for its chain unless ``--chain-wait`` says otherwise (seconds).
FIRST_START_WAIT_S = 30.0
#: A progress line this often in the first minute of a wait, then every :data:`LATER_EVERY_S` (seconds).
FIRST_EVERY_S = 5.0
LATER_EVERY_S = 30.0
#: Seconds between two probes of the chain, and the longest one probe may take.
PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 5.0


def chain_wait_for(lc, data_dir: Path, chain_wait: float | None) -> tuple[float, str]:
    """(seconds to wait for the chain, why that long) for the ledger settings ``lc``."""
    if chain_wait is not None:
        return chain_wait, "--chain-wait"
    if (data_dir / "state.json").exists():
        return lc.startup_wait, "a restart: ledger.startup_wait"
    return (min(lc.startup_wait, FIRST_START_WAIT_S),
            "a first start; --chain-wait SECONDS waits longer for a chain that is starting")


def wait_for_chain(url: str, wait: float, why: str, request_timeout: float = PROBE_TIMEOUT_S) -> None:
    """Return once the JSON-RPC endpoint ``url`` answers; log a line at once and every few seconds while it
    does not; ChainUnavailable past ``wait`` seconds. What answers but not as a chain (a web server) counts
    as answering: the connection that follows says what it is."""
    from ledger.chain import connect_rpc
    from ledger.errors import LedgerConfigError

    started = time.monotonic()
    said_at = None
    while True:
        try:
            connect_rpc(url, timeout=min(request_timeout, PROBE_TIMEOUT_S))
            if said_at is not None:
                logger.warning("the chain at %s answers after %.0fs", url, time.monotonic() - started)
            return
        except LedgerConfigError:
            return  # a bad URL, or no JSON-RPC there: NodeChain.connect says so
        except ChainUnavailable as exc:
            waited = time.monotonic() - started
            if waited >= wait:
                raise _unreachable(url, wait, exc) from None
            every = FIRST_EVERY_S if waited < 60 else LATER_EVERY_S
            if said_at is None:
                logger.warning("no chain answers at %s: waiting up to %.0fs for it (%s)", url, wait, why)
                said_at = waited
            elif waited - said_at >= every:
                logger.warning("no chain answers at %s yet: waited %.0fs of up to %.0fs", url, waited, wait)
                said_at = waited
            time.sleep(max(0.0, min(PROBE_EVERY_S, wait - waited)))


def _unreachable(url: str, wait: float, exc: Exception) -> ChainUnavailable:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    from ledger.chain import short_reason

    return ChainUnavailable(
        f"chain RPC {url} unreachable: nothing answers at host {parts.hostname}, port {port} "
        f"({short_reason(exc.__cause__ or exc)}; waited {wait:.0f}s): check that the chain's node runs there "
        "and that [ledger] rpc_url names it (--chain-wait SECONDS waits longer for a chain that is starting)")
