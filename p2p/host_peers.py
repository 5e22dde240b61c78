"""The peer side of :class:`p2p.host.P2PHost`: dial (directly, else through a relay), connect, forget.

Streams are opened to a peer once connected to it (its address from the peerstore or the
DHT); a direct dial that fails or hangs falls back to a relay (:mod:`p2p.nat`). Peers
whose dials keep failing, or long without a connection, are forgotten
(:mod:`p2p.dialbook`): their addresses leave the peerstore and the DHT's routing table.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import multiaddr
import multiaddr.exceptions
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError

from p2p.addrs import parse_relayed_addr
from p2p.errors import DialError
from p2p.nat import split_addrs
from p2p.streams import CONNECTION_ERRORS

logger = logging.getLogger(__name__)

#: Seconds a direct dial may take when a relay could be tried next.
DIRECT_BEFORE_RELAY_S = 4.0
#: How often the host applies its :class:`~p2p.dialbook.DialBook` (forgets peers whose host is gone).
FORGET_SWEEP_S = 5.0
#: How often the DHT's provider records are trimmed (p2p.provider_records).
PROVIDER_TRIM_S = 60.0


class HostPeers:
    """Mixin of :class:`p2p.host.P2PHost`: dialling, connecting, forgetting and listing peers.

    Expects of the host: ``config``, ``dialbook`` (:class:`p2p.dialbook.DialBook`), ``_call``
    (:class:`p2p.host_thread.HostThread`), ``_closing``, ``_listen_addrs``, ``_libp2p``, ``_dht``,
    ``_nat`` (:class:`p2p.nat.NatTraversal`) and ``_trim_provider_records``
    (:class:`p2p.host_blobs.HostBlobs`).
    """

    # ------------------------------------------------------------------ streams

    async def _open_stream(self, peer: ID, protocol: TProtocol) -> Any:
        await self._ensure_connected(peer)
        return await self._libp2p.new_stream(peer, [protocol])

    async def _ensure_connected(self, peer: ID) -> None:
        if peer in self._libp2p.get_network().connections:
            return
        addrs = _addrs_of(self._libp2p.get_peerstore(), peer)
        if not addrs:
            with trio.move_on_after(10):
                info = await self._dht.find_peer(peer)
                if info is not None:
                    addrs = list(info.addrs)
        if not addrs and not self._nat.can_relay():
            raise DialError(f"no known address for peer {peer}")
        await self._dial(PeerInfo(peer, addrs))

    async def _dial(self, info: PeerInfo) -> None:
        """Connect directly where the peer has a direct address that answers, else through a relay
        (py-libp2p's swarm never dials /p2p-circuit addresses itself)."""
        direct, relayed = split_addrs(list(info.addrs))
        fallback = bool(relayed) or self._nat.can_relay()
        if direct:
            try:
                # A private address of a peer behind another NAT may blackhole the SYN: leave time
                # for the relay within the caller's own timeout.
                with trio.fail_after(DIRECT_BEFORE_RELAY_S) if fallback else contextlib.nullcontext():
                    await self._libp2p.connect(PeerInfo(info.peer_id, direct))
                return
            except trio.TooSlowError:
                if not fallback:
                    raise
                logger.debug("direct dial of %s timed out; trying relays", info.peer_id)
            except CONNECTION_ERRORS as exc:  # behind a NAT: try the relays before giving up
                if not fallback:
                    raise
                logger.debug("direct dial of %s failed (%s); trying relays", info.peer_id, exc)
        await self._nat.dial_relayed(info.peer_id, relayed)

    # ------------------------------------------------------------------ peers

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs of this host, each ending in ``/p2p/<peer id>``: where it listens, then its
        relayed addresses (``<relay>/p2p-circuit/p2p/<peer id>``) on relays holding a reservation for it."""
        nat = getattr(self, "_nat", None)
        return list(self._listen_addrs) + (nat.relayed_addrs if nat is not None else [])

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<id>`` multiaddr, or a relayed one
        (``<relay multiaddr>/p2p-circuit/p2p/<id>``); return the peer id. Raises DialError (RelayAddressError
        for a malformed relayed address) or P2PTimeout."""
        info = peer_info(addr)
        self._call(self._connect_info, info, timeout=timeout, what=f"connect {addr}")
        return info.peer_id.to_base58()

    async def _connect_info(self, info: PeerInfo) -> None:
        if info.peer_id == self._libp2p.get_id():
            return
        try:
            await self._dial(info)
        except BaseException as exc:  # a timeout arrives here as trio.Cancelled: a failed dial too
            self._dial_failed(info.peer_id)
            if isinstance(exc, (trio.TooSlowError, DialError)) or not isinstance(exc, Exception):
                raise
            raise DialError(f"cannot connect to {info.peer_id}: {type(exc).__name__}: {exc}") from None
        self.dialbook.dial_succeeded(info.peer_id.to_base58())
        with trio.move_on_after(5):
            await self._dht.add_peer(info.peer_id, skip_server_mode_check=True)

    # ------------------------------------------------------------------ forgetting peers that are gone

    def _forgotten(self, peer: ID) -> bool:
        return self.dialbook.forgotten(peer.to_base58())

    def _dial_failed(self, peer: ID) -> None:
        if self._closing is not None and self._closing.is_set():
            return  # cancelled by the host's own close
        if self.dialbook.dial_failed(peer.to_base58()):
            logger.info(
                "forgetting peer %s: %d dials in a row failed", peer, self.config.forget_after_failures
            )
            self._drop_addresses(peer)

    def _drop_addresses(self, peer: ID) -> None:
        """Nobody on this host dials ``peer`` again by itself: its addresses leave the peerstore (the
        auto-connector dials only peers with addresses) and it leaves the DHT's routing table."""
        self._libp2p.get_peerstore().clear_addrs(peer)
        self._dht.routing_table.remove_peer(peer)

    async def _forget_loop(self) -> None:
        """Apply the dial book every FORGET_SWEEP_S: forget peers long without a connection, and clear
        again the addresses of forgotten peers that came back through identify or DHT answers."""
        peerstore = self._libp2p.get_peerstore()
        me = self._libp2p.get_id()
        trimmed_at = time.monotonic()
        while True:
            await trio.sleep(min(FORGET_SWEEP_S, self.config.forget_after_s / 4))
            if time.monotonic() - trimmed_at >= min(PROVIDER_TRIM_S, self.config.provider_record_ttl / 2):
                trimmed_at = time.monotonic()
                dropped = await self._trim_provider_records()
                if dropped:
                    logger.debug("dropped %d DHT provider records older than %.0f s", dropped,
                                 self.config.provider_record_ttl)
            connections = self._libp2p.get_network().connections
            known = [p for p in peerstore.peer_ids() if p != me and _addrs_of(peerstore, p)]
            swept = self.dialbook.sweep([p.to_base58() for p in known], [p.to_base58() for p in connections])
            for peer in swept:
                logger.info("forgetting peer %s: no connection for %.0f s", peer, self.config.forget_after_s)
            for peer in known + list(self._dht.routing_table.get_peer_ids()):
                if peer not in connections and self.dialbook.forgotten(peer.to_base58()):
                    self._drop_addresses(peer)

    def known_addrs(self, peer_id: str, timeout: float = 5.0) -> list[str]:
        """The addresses this host's peerstore holds for ``peer_id`` (what it would dial)."""

        async def addrs() -> list[str]:
            return [str(a) for a in _addrs_of(self._libp2p.get_peerstore(), ID.from_base58(peer_id))]

        return self._call(addrs, timeout=timeout, what=f"known_addrs {peer_id}")

    def forgotten_peers(self, timeout: float = 5.0) -> list[str]:
        """Peer ids this host no longer dials by itself (p2p.dialbook), oldest first."""

        async def forgotten() -> list[str]:  # the book is the host thread's
            return self.dialbook.forgotten_peers()

        return self._call(forgotten, timeout=timeout, what="forgotten_peers")

    def failed_dials(self) -> int:
        """Dials of this host that failed, since start."""
        return self.dialbook.failed_dials

    def peers(self, timeout: float = 5.0) -> list[str]:
        """Peer ids with an open connection."""

        async def connected() -> list[str]:
            return sorted(p.to_base58() for p in self._libp2p.get_network().connections)

        return self._call(connected, timeout=timeout, what="peers")

    def disconnect(self, peer_id: str, timeout: float = 10.0) -> None:
        """Close every connection to ``peer_id``."""
        self._call(self._libp2p.disconnect, ID.from_base58(peer_id), timeout=timeout, what="disconnect")

    def find_peer(self, peer_id: str, timeout: float = 10.0) -> list[str]:
        """Addresses of ``peer_id`` found through the DHT (empty if unknown)."""

        async def find() -> list[str]:
            info = await self._dht.find_peer(ID.from_base58(peer_id))
            return [str(a) for a in info.addrs] if info else []

        return self._call(find, timeout=timeout, what=f"find_peer {peer_id}")

    # ------------------------------------------------------------------ NAT traversal

    def connection_paths(self, timeout: float = 5.0) -> dict[str, str]:
        """Each connected peer: ``"direct"``, ``"relayed"`` (through a relay) or ``"hole_punched"``
        (direct after a relayed connection: DCUtR upgraded it)."""

        async def paths() -> dict[str, str]:
            return self._nat.connection_paths()

        return self._call(paths, timeout=timeout, what="connection_paths")

    def reachability(self) -> str:
        """``"public"``, ``"private"`` or ``"unknown"``, as AutoNAT dial-backs from peers found it."""
        return self._nat.reachability()

    def relay_refusals(self) -> dict[str, int]:
        """With ``relay_serve``: requests this relay refused, by reason (``hop_rate``,
        ``reserve_for_other``, ``reserve_per_ip``)."""
        return dict(self._nat.relay.refused)


def _addrs_of(peerstore: Any, peer: ID) -> list:
    """The peerstore's addresses of ``peer``; none for a peer it does not hold (py-libp2p raises)."""
    try:
        return list(peerstore.addrs(peer))
    except PeerStoreError:  # not found or expired
        return []


def peer_info(addr: str) -> PeerInfo:
    """The peer and address of a multiaddr ending in ``/p2p/<peer id>``, direct or relayed; raises
    DialError (RelayAddressError for a malformed relayed address)."""
    if "/p2p-circuit" in addr:
        _relay, _relay_id, peer = parse_relayed_addr(addr)
        return PeerInfo(ID.from_base58(peer), [multiaddr.Multiaddr(addr)])
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except (ValueError, multiaddr.exceptions.Error) as exc:  # multiaddr, peer id or p2p part malformed
        raise DialError(f"bad multiaddr {addr!r}: {exc}") from None
