"""py-libp2p's inbound connection handlers, ended when their connection ends.

py-libp2p 0.8.1's ``Swarm._do_handle_inbound_connection`` upgrades an accepted TCP
connection (Noise, yamux) and then waits for the swarm to finish ("intentional
barrier: keep handler alive"), whatever becomes of the connection. So every inbound
connection a node ever accepted kept, for the node's life, its handler's trio task and
frame, the ``RawConnection``, the ``TrioTCPStream`` and with it this host's 0.4-1.1 MiB
receive buffer (:mod:`p2p.fastpath`), plus a slot of the swarm's inbound limiter
(``max_connections - min_connections``: past that many inbound connections in a life,
every further one is refused). A peer that restarts, a ``dlx-node join`` fetch host,
a reconnection after a reset: each left one behind on every node it connected to
(bench/churn_memory.py; docs/P2P.md, "What a surviving node keeps per churn event").

Patched here: the handler runs beside a watcher that waits for the yamux connection the
upgrade built to close (``event_closed``, set on a clean close and on a connection
lost alike, after the secured and raw connections were closed) and then cancels it, so
the handler returns and releases its limiter slot. Nothing on the wire changes. Applied
by importing the module (``p2p.transport`` does); a py-libp2p of another version is
left as it is, with a warning.

The holder that hands the upgraded connection to the watcher lives in a context variable of the handler's
task; it is taken out of the context as soon as the upgrade returned and emptied when the handler ends, since
every trio task started from that task copies its context (below: a task that outlives the connection would
otherwise keep the whole closed connection, as 19-20 reset connections were kept in a loaded run).
"""

from __future__ import annotations

import contextvars
import importlib.metadata
import logging
from typing import Any

import trio
from libp2p.network.swarm import Swarm

logger = logging.getLogger(__name__)

PATCHED_LIBP2P_VERSION = "0.8.1"

#: The upgrade of the inbound connection the current task handles puts its muxed connection here.
_UPGRADED: contextvars.ContextVar[list | None] = contextvars.ContextVar("dlx_inbound_upgraded", default=None)

applied: list[str] = []  # the patches in force (checked by the tests)


async def _wait_closed(upgraded: list, ready: trio.Event) -> None:
    """Wait for the upgrade to hand over its muxed connection, then for that connection to close."""
    await ready.wait()
    await upgraded[0].event_closed.wait()


def _ended_with_connection() -> None:
    original_handle = Swarm._do_handle_inbound_connection
    original_upgrade = Swarm.upgrade_inbound_raw_conn

    async def upgrade_inbound_raw_conn(self: Swarm, raw_conn: Any, maddr: Any) -> Any:
        muxed = await original_upgrade(self, raw_conn, maddr)
        holder = _UPGRADED.get()
        if holder is not None and not holder[0] and hasattr(muxed, "event_closed"):
            holder[0].append(muxed)
            holder[1].set()
        # Every task started from here on (the swarm's connection tasks, the stream handlers they start, and
        # whatever those start, some for the host's life) copies this task's context: with the holder still
        # in it, each would keep this connection (Yamux, SwarmConn, Noise, buffers) alive after it closed.
        _UPGRADED.set(None)
        return muxed

    async def handle(self: Swarm, read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
        upgraded: list = []
        ready = trio.Event()
        token = _UPGRADED.set([upgraded, ready])
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await _wait_closed(upgraded, ready)
                    nursery.cancel_scope.cancel()  # the handler's barrier: nothing left to keep open

                nursery.start_soon(watch)
                await original_handle(self, read_write_closer, maddr, failure_event)
                nursery.cancel_scope.cancel()  # it returned (a failed upgrade): the watcher is not needed
        finally:
            upgraded.clear()  # a task that copied the context before the upgrade returned keeps an empty list
            _UPGRADED.reset(token)

    upgrade_inbound_raw_conn._dlx_original = original_upgrade  # type: ignore[attr-defined]
    handle._dlx_original = original_handle  # type: ignore[attr-defined]
    Swarm.upgrade_inbound_raw_conn = upgrade_inbound_raw_conn  # type: ignore[method-assign]
    Swarm._do_handle_inbound_connection = handle  # type: ignore[method-assign]
    applied.append("inbound handler ends with its connection")


if importlib.metadata.version("libp2p") == PATCHED_LIBP2P_VERSION:
    _ended_with_connection()
else:
    logger.warning("py-libp2p %s is not the pinned %s: inbound connection handlers are kept until the host "
                   "closes (memory per connection ever accepted)", importlib.metadata.version("libp2p"),
                   PATCHED_LIBP2P_VERSION)
