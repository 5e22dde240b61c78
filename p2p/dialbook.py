"""Which peers a host still dials: a peer whose host is gone is forgotten, not dialled for ever.

A peer's addresses reach the peerstore and the DHT's routing table from every
connection it ever made (identify) and from other peers' answers, and
py-libp2p keeps them: its auto-connector and our discovery then dial a peer
that went away (a ``dlx-node join`` fetch host, a member that left) once a
minute for as long as the node runs. :class:`DialBook` is the rule that ends
it (docs/P2P.md, "Forgetting peers that are gone"): a peer is forgotten after
``forget_after_failures`` failed dials in a row, or once it has had no
connection for ``forget_after_s`` while its addresses stayed known. A
configured bootstrap peer is exempt until a connection to it opened once (it
may start later than this node; discovery retries it with backoff). A
forgotten peer is not dialled by discovery and its addresses are cleared
again whenever they come back, until it connects (or an explicit connect to
it succeeds). Pure bookkeeping: the host applies it on its own thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

#: At most this many forgotten peers are remembered (the oldest go first): a flood of
#: made-up peer ids in DHT answers must not grow the book without bound.
MAX_FORGOTTEN = 4096
#: At most this many peers are tracked as failing or disconnected at once.
MAX_TRACKED = 8192


class DialBook:
    """Failed dials and disconnection times per peer (str ids), and the peers forgotten."""

    def __init__(self, forget_after_failures: int, forget_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if forget_after_failures < 1 or forget_after_s <= 0:
            raise ValueError(f"forget_after_failures={forget_after_failures} must be >= 1 and "
                             f"forget_after_s={forget_after_s} > 0")
        self.forget_after_failures = forget_after_failures
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._failures: dict[str, int] = {}
        self._unconnected_since: dict[str, float] = {}
        self._forgotten: dict[str, float] = {}  # peer -> when (insertion order: oldest first)
        self._protected: set[str] = set()  # bootstrap peers not reached yet
        #: Dials that failed, in all (what a test counts).
        self.failed_dials = 0

    # -- what the host reports ------------------------------------------------------------
    def protect(self, peers: Iterable[str]) -> None:
        """``peers`` (the configured bootstrap peers) are not forgotten before a connection to them opened."""
        self._protected |= set(peers)

    def dial_failed(self, peer: str) -> bool:
        """A dial of ``peer`` failed; True if that made it forgotten."""
        self.failed_dials += 1
        if peer in self._forgotten or peer in self._protected:
            return False
        count = self._failures.get(peer, 0) + 1
        if count >= self.forget_after_failures:
            self._forget(peer)
            return True
        if len(self._failures) >= MAX_TRACKED and peer not in self._failures:
            return False
        self._failures[peer] = count
        return False

    def dial_succeeded(self, peer: str) -> None:
        """A connection to ``peer`` is open: it is remembered again, with a clean slate."""
        self._failures.pop(peer, None)
        self._unconnected_since.pop(peer, None)
        self._forgotten.pop(peer, None)
        self._protected.discard(peer)

    def sweep(self, known: Iterable[str], connected: Iterable[str]) -> list[str]:
        """Look at the peers with known addresses and those connected now; return the peers newly
        forgotten for having had no connection for ``forget_after_s``."""
        now = self._clock()
        connected = set(connected)
        for peer in connected:
            self.dial_succeeded(peer)
        newly = []
        for peer in known:
            if peer in connected or peer in self._forgotten or peer in self._protected:
                continue
            since = self._unconnected_since.get(peer)
            if since is None:
                if len(self._unconnected_since) < MAX_TRACKED:
                    self._unconnected_since[peer] = now
            elif now - since >= self.forget_after_s:
                self._forget(peer)
                newly.append(peer)
        return newly

    # -- what the host asks ---------------------------------------------------------------
    def forgotten(self, peer: str) -> bool:
        return peer in self._forgotten

    def forgotten_peers(self) -> list[str]:
        return list(self._forgotten)

    def sizes(self) -> dict[str, int]:
        """How many peers the book holds, by kind (each bounded: MAX_FORGOTTEN, MAX_TRACKED, MAX_TRACKED,
        and the configured bootstrap peers)."""
        return {"forgotten": len(self._forgotten), "failing": len(self._failures),
                "unconnected": len(self._unconnected_since), "protected": len(self._protected)}

    def _forget(self, peer: str) -> None:
        self._failures.pop(peer, None)
        self._unconnected_since.pop(peer, None)
        self._forgotten[peer] = self._clock()
        while len(self._forgotten) > MAX_FORGOTTEN:
            del self._forgotten[next(iter(self._forgotten))]
