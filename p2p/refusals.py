"""Remember which protocols a connected peer refused, so the host stops asking it for a while.

A peer that answers multistream-select with ``na`` for ``/meshsub``, ``/dlx/sync`` or
Kademlia does not speak that protocol (a plain libp2p node, a tool, another application).
Without this memory the host asked again every few seconds (pubsub stream repair every
2 s, ``/dlx/sync`` resync every 5 s, DHT self-lookups) and py-libp2p logged each refusal
at ERROR: 31 records in 30 s for one such peer. Now the first refusal of a protocol set
on a connection is logged once at INFO, and the set is not asked for again on that
connection for 30 s, then 60, 120, ... up to 10 min (a peer may start a service late).
A new connection to the peer starts afresh. Only a definite refusal counts; a stream
that failed for any other reason (timeout, reset, muxer race) is retried as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from libp2p.host.exceptions import StreamFailure
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError

logger = logging.getLogger(__name__)

REFUSAL_BACKOFF_S = 30.0
REFUSAL_BACKOFF_MAX_S = 600.0
_MAX_ENTRIES = 4096


class ProtocolRefused(StreamFailure):
    """The peer refused these protocols on this connection recently; not asked again yet.

    A :class:`StreamFailure`, the exception py-libp2p's own callers (pubsub, DHT) expect
    from ``new_stream`` when negotiation fails.
    """


@dataclass
class _Refusal:
    connection: Any
    until: float
    backoff: float


def is_refusal(exc: BaseException) -> bool:
    """True if a ``new_stream`` failure is the peer's definite "na" to every protocol offered."""
    cause = exc.__cause__
    if isinstance(cause, ProtocolNotSupportedError):
        return True
    return isinstance(cause, MultiselectClientError) and str(cause).startswith("protocols not supported")


class RefusedProtocols:
    """Per (peer, protocol set): the connection it was refused on and when to ask again."""

    def __init__(
        self,
        initial_backoff: float = REFUSAL_BACKOFF_S,
        max_backoff: float = REFUSAL_BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self._clock = clock
        self._refusals: dict[tuple[str, tuple[str, ...]], _Refusal] = {}

    def blocked(self, peer: str, protocols: tuple[str, ...], connection: Any) -> bool:
        """True if ``peer`` refused ``protocols`` on ``connection`` and the backoff has not run out."""
        refusal = self._refusals.get((peer, protocols))
        return refusal is not None and refusal.connection is connection and self._clock() < refusal.until

    def refused(self, peer: str, protocols: tuple[str, ...], connection: Any) -> None:
        """Record a refusal; log it at INFO the first time on a connection, at DEBUG after."""
        key = (peer, protocols)
        previous = self._refusals.get(key)
        same_connection = previous is not None and previous.connection is connection
        backoff = min(previous.backoff * 2, self.max_backoff) if same_connection else self.initial_backoff
        if len(self._refusals) >= _MAX_ENTRIES:
            now = self._clock()
            for stale in [k for k, r in self._refusals.items() if r.until + self.max_backoff < now]:
                del self._refusals[stale]
        self._refusals[key] = _Refusal(connection, self._clock() + backoff, backoff)
        log = logger.debug if same_connection else logger.info
        log("peer %s does not speak %s; not asking it again for %.0f s", peer, ", ".join(protocols), backoff)

    def accepted(self, peer: str, protocols: tuple[str, ...]) -> None:
        self._refusals.pop((peer, protocols), None)


def guard_new_stream(host: Any, refusals: RefusedProtocols) -> None:
    """Route every ``host.new_stream`` (pubsub, DHT, ours) through ``refusals``.

    Replaces the bound method on this one host object: py-libp2p's pubsub and DHT call
    ``self.host.new_stream``, so they go through the guard too.
    """
    original = host.new_stream

    async def new_stream(peer_id: Any, protocol_ids: Sequence[Any]) -> Any:
        peer = str(peer_id)
        protocols = tuple(sorted(str(p) for p in protocol_ids))
        connections = host.get_network().connections.get(peer_id) or [None]
        connection = connections[0] if isinstance(connections, list) else connections
        if refusals.blocked(peer, protocols, connection):
            raise ProtocolRefused(f"peer {peer} refused {', '.join(protocols)} on this connection")
        try:
            stream = await original(peer_id, protocol_ids)
        except StreamFailure as exc:
            if is_refusal(exc):
                refusals.refused(peer, protocols, connection)
            raise
        refusals.accepted(peer, protocols)
        return stream

    host.new_stream = new_stream
