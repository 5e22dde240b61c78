"""``TransferStats``: bytes (and messages) a host sent and received, per protocol and per peer."""

from __future__ import annotations

import threading

#: Peers whose blob bytes are counted at most; past this, the peer updated longest ago is dropped (every
#: ``dlx-node join`` fetch host is a new peer id, so the table would grow with every join for the node's
#: life).
MAX_PEER_STATS = 1024


class TransferStats:
    """Bytes (and messages, where a protocol counts them) sent/received per protocol, and blob bytes per
    peer (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, list[int]] = {}
        self._peers: dict[str, list[int]] = {}

    def add_peer(self, peer_id: str, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            counters = self._peers.pop(peer_id, None) or [0, 0]
            self._peers[peer_id] = counters  # last: the dict runs from the peer updated longest ago
            if len(self._peers) > MAX_PEER_STATS:
                del self._peers[next(iter(self._peers))]
            counters[0] += sent
            counters[1] += received

    def peers_snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {peer: {"sent": c[0], "received": c[1]} for peer, c in self._peers.items()}

    def add(self, protocol: str, sent: int = 0, received: int = 0, messages_sent: int = 0,
            messages_received: int = 0) -> None:
        with self._lock:
            counters = self._counters.setdefault(str(protocol), [0, 0, 0, 0])
            counters[0] += sent
            counters[1] += received
            counters[2] += messages_sent
            counters[3] += messages_received

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: {"sent": c[0], "received": c[1], "messages_sent": c[2], "messages_received": c[3]}
                    for name, c in self._counters.items()}
