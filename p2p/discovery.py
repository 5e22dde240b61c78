"""Finding peers: bootstrap dials, Kademlia self-lookups, mDNS (all run on the host's trio loop)."""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.peer.peerstore import PeerStoreError

from p2p.config import P2PConfig

logger = logging.getLogger(__name__)

Connect = Callable[[PeerInfo], Awaitable[None]]


class Discovery:
    """Keeps the host connected: bootstrap peers first, then whatever the DHT or mDNS reveals."""

    def __init__(self, host: IHost, dht: KadDHT, config: P2PConfig, connect: Connect,
                 forgotten: Callable[[Any], bool] = lambda _peer: False) -> None:
        self._host = host
        self._dht = dht
        self._config = config
        self._connect = connect
        self._forgotten = forgotten  # p2p.dialbook: peers whose host is gone are not dialled

    async def run(self) -> None:
        """Dial bootstrap peers (retrying: they may start later), then look for peers with backoff
        up to ``discovery_interval``."""
        pending = list(self._config.bootstrap)
        delay = 0.5
        while True:
            for addr in list(pending):
                info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
                try:
                    with trio.fail_after(10):
                        await self._connect(info)
                    pending.remove(addr)
                # Retried on the next round: an unreachable bootstrap peer must not end the loop.
                except Exception as exc:  # noqa: BLE001 - the bootstrap loop's boundary
                    logger.debug("bootstrap %s not reachable yet: %s", addr, exc)
            if self._host.get_network().connections:
                await self.discover_once()
            await trio.sleep(delay * (0.8 + 0.4 * random.random()))
            delay = min(delay * 2, self._config.discovery_interval)

    async def discover_once(self) -> None:
        """Look up our own id (this fills the routing tables on both sides), then dial new peers."""
        try:
            with trio.move_on_after(10):
                await self._dht.peer_routing.find_closest_peers_network(self._host.get_id().to_bytes())
        # A failing lookup is retried on the next round: it must not end the discovery loop.
        except Exception as exc:  # noqa: BLE001 - the discovery loop's boundary
            logger.debug("DHT self-lookup failed: %s", exc)
        await self._dial_new(self._dht.routing_table.get_peer_ids())

    async def run_mdns(self, mdns: Any) -> None:
        """Dial peers mDNS recorded (py-libp2p's listener only puts their addresses in the peerstore)."""
        while True:
            await trio.sleep(1.0)
            await self._dial_new([peer for peer, _seen in list(mdns.listener.discovered_services.values())])

    async def _dial_new(self, peers: list[Any]) -> None:
        network = self._host.get_network()
        for peer in peers:
            if len(network.connections) >= self._config.max_peers:
                return
            if peer in network.connections or peer == self._host.get_id() or self._forgotten(peer):
                continue
            try:
                addrs = self._host.get_peerstore().addrs(peer)
            except PeerStoreError:  # evicted meanwhile (a bounded peerstore) or expired
                continue
            if not addrs:
                continue
            try:
                with trio.fail_after(10):
                    await self._connect(PeerInfo(peer, addrs))
            # An unreachable peer (the DHT or mDNS will drop it eventually) must not end the loop.
            except Exception as exc:  # noqa: BLE001 - the discovery loop's boundary
                logger.debug("could not dial discovered peer %s: %s", peer, exc)
