"""``P2PHost``: a py-libp2p host on its own trio thread behind a small synchronous API.

This module builds and runs the host (lifecycle, peers, streams, statistics); its
methods come from three mixins, one job each: :mod:`p2p.host_thread` (the trio
thread and the sync calls into it), :mod:`p2p.host_gossip` (topics, validators,
delivery, ``/dlx/sync``) and :mod:`p2p.host_blobs` (store, announce, find, fetch).

The host speaks TCP + Noise + yamux only (see :mod:`p2p.transport`), runs
gossipsub with envelope-checking topic validators (:mod:`p2p.gossip`), a
Kademlia DHT in server mode for peer routing and provider records, and the
``/dlx/blob/1.0.0`` bulk protocol (:mod:`p2p.blob_protocol`, served by :mod:`p2p.blob_server`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.pubsub import ContentAddressedMessageIDGenerator, Pubsub
from libp2p.tools.anyio_service import background_trio_service

from p2p.addrs import parse_relayed_addr
from p2p.blob_client import BlobFetcher
from p2p.blob_protocol import BLOB_PROTOCOL
from p2p.blob_server import BlobServer
from p2p.blobstore import BlobStore
from p2p.config import P2PConfig
from p2p.dialbook import DialBook
from p2p.discovery import Discovery
from p2p.errors import DialError, P2PError, P2PTimeout
from p2p.gossip import GOSSIP_RPC_LIMIT, SYNC_PROTOCOLS, RecentMessages, build_gossipsub
from p2p.host_blobs import HostBlobs
from p2p.host_gossip import HostGossip, Subscription
from p2p.host_thread import HostThread
from p2p.identity import Identity
from p2p.nat import NatTraversal, split_addrs
from p2p.ratelimit import PeerRateLimiter
from p2p.refusals import RefusedProtocols, guard_new_stream
from p2p.transport import build_libp2p_host, close_leftover_tcp_streams, spare_on_eviction, start_mdns

logger = logging.getLogger(__name__)

#: Seconds a direct dial may take when a relay could be tried next.
DIRECT_BEFORE_RELAY_S = 4.0
#: How often the host applies its :class:`~p2p.dialbook.DialBook` (forgets peers whose host is gone).
FORGET_SWEEP_S = 5.0
#: How often the DHT's provider records are trimmed (p2p.provider_records).
PROVIDER_TRIM_S = 60.0


#: Peers whose blob bytes are counted at most; past this, the peer updated longest ago is dropped (every
#: ``dlx-node join`` fetch host is a new peer id, so the table would grow with every join for the node's life).
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


class P2PHost(HostGossip, HostBlobs, HostThread):
    """A running libp2p host; create with :meth:`start`, stop with :meth:`close`.

    Every method is synchronous, must not be called from the host's own thread,
    and takes a ``timeout`` (seconds) after which it raises :class:`P2PTimeout`.
    """

    def __init__(self, config: P2PConfig, identity: Identity, blob_dir: Path) -> None:
        self.config = config
        self.identity = identity
        self.peer_id: str = identity.peer_id
        self.stats = TransferStats()
        self.store = BlobStore(blob_dir, config.max_blob_bytes)
        self._limiter = PeerRateLimiter(config.rate_limit_bps, config.rate_limit_burst or None)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, config.blob_concurrency), thread_name_prefix=f"p2p-io-{self.peer_id[-6:]}"
        )
        self._recent = RecentMessages(config.sync_cache_messages, config.sync_cache_bytes)
        self._subscriptions: dict[str, Subscription] = {}
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._closing: trio.Event | None = None
        self._closed = False
        self._listen_addrs: list[str] = []
        #: Peers forgotten after failed dials or a long disconnection (p2p.dialbook); host thread only.
        self.dialbook = DialBook(config.forget_after_failures, config.forget_after_s)
        self.dialbook.protect(addr.rsplit("/p2p/", 1)[1] for addr in config.bootstrap)
        self._thread = threading.Thread(
            target=self._thread_main, name=f"p2p-host-{self.peer_id[-6:]}", daemon=True
        )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(
        cls,
        config: P2PConfig,
        identity: Identity,
        data_dir: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
    ) -> P2PHost:
        """Start a host listening on ``config.listen_host:listen_port`` and dial the bootstrap peers.

        ``config.blob_dir`` is resolved against ``data_dir`` (default: the current
        directory). Returns once the host listens and pubsub runs; bootstrap dials
        continue in the background.
        """
        blob_dir = Path(config.blob_dir)
        if not blob_dir.is_absolute():
            blob_dir = Path(data_dir or ".") / blob_dir
        _check_port_free(config.listen_host, config.listen_port)
        host = cls(config, identity, blob_dir)
        host._thread.start()
        if not host._ready.wait(timeout):
            host.close()
            raise P2PTimeout(f"p2p host did not start within {timeout} s")
        if host._startup_error is not None:
            host._thread.join(timeout)
            host._executor.shutdown(wait=True)
            raise P2PError(f"p2p host failed to start: {host._startup_error}") from host._startup_error
        logger.info("p2p host %s listening on %s", host.peer_id, host._listen_addrs)
        return host

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._closing = trio.Event()
        config = self.config
        self._libp2p = build_libp2p_host(self.identity)
        # A peer that refuses /meshsub, /dlx/sync or Kademlia is not asked again at once.
        self.refused_protocols = RefusedProtocols()
        guard_new_stream(self._libp2p, self.refused_protocols)
        # Pubsub and the DHT register their notifees and stream handlers before the
        # host listens: a connection made before pubsub exists never joins the mesh.
        self._gossipsub = build_gossipsub(config.gossip_heartbeat, config.gossip_max_msgs_per_sec)
        self._pubsub = Pubsub(
            self._libp2p,
            self._gossipsub,
            strict_signing=True,
            msg_id_constructor=ContentAddressedMessageIDGenerator(),
            max_inbound_rpc_size=GOSSIP_RPC_LIMIT,
        )
        # py-libp2p seeds the seqno counter with time.time() in *seconds* and adds one per
        # message, so a node publishing more than once a second that restarts reuses seqnos
        # of its previous life: gossipsub's equivocation check (from + seqno) then drops its
        # messages and penalises it. Seed with nanoseconds, as go-libp2p does.
        self._pubsub.counter = time.time_ns()
        self._dht = KadDHT(self._libp2p, DHTMode.SERVER, enable_random_walk=False)
        bootstrap = {ID.from_base58(addr.rsplit("/p2p/", 1)[1]) for addr in config.bootstrap}
        spare_on_eviction(self._libp2p.get_peerstore(),
                          lambda: bootstrap.union(self._libp2p.get_network().connections))
        self._nat = NatTraversal(self._libp2p, config)
        self._blob_server = BlobServer(
            self.store,
            self._run_blocking,
            self._limiter,
            self.stats,
            config.blob_concurrency,
            config.blob_stall_timeout,
        )
        self._blobs = BlobFetcher(
            self.store,
            self._open_stream,
            self._run_blocking,
            self._limiter,
            self.stats,
            config.blob_concurrency,
            config.blob_stall_timeout,
            direct_io=config.blob_direct_io,
            min_rate=config.range_min_rate(),
        )
        self._libp2p.set_stream_handler(BLOB_PROTOCOL, self._blob_server.handle_stream)
        for protocol in SYNC_PROTOCOLS:  # 1.1.0 offers ids first; 1.0.0 for older peers
            self._libp2p.set_stream_handler(protocol, self._handle_sync)
        listen = [multiaddr.Multiaddr(f"/ip4/{config.listen_host}/tcp/{config.listen_port}")] if config.listen else []
        mdns = None
        try:
            async with self._libp2p.run(listen):
                async with background_trio_service(self._pubsub):
                    async with background_trio_service(self._gossipsub):
                        await self._pubsub.wait_until_ready()
                        async with background_trio_service(self._dht):
                            async with trio.open_nursery() as nursery:
                                self._nursery = nursery
                                self._listen_addrs = [
                                    str(a) for a in self._libp2p.get_addrs() if "/p2p/" in str(a)
                                ] or [f"{a}/p2p/{self.peer_id}" for a in self._libp2p.get_transport_addrs()]
                                discovery = Discovery(self._libp2p, self._dht, config, self._connect_info,
                                                      forgotten=self._forgotten)
                                if config.mdns:
                                    mdns = await self._run_blocking(
                                        start_mdns, self._libp2p, config.mdns_interface
                                    )
                                    nursery.start_soon(discovery.run_mdns, mdns)
                                nat_ready = trio.Event()
                                nursery.start_soon(self._nat.run, nat_ready)
                                await nat_ready.wait()  # relays tried: listen_addrs has the relayed ones
                                nursery.start_soon(discovery.run)
                                nursery.start_soon(self._pubsub_repair_loop)
                                nursery.start_soon(self._forget_loop)
                                if config.gossip_resync_interval > 0:
                                    nursery.start_soon(self._resync_loop)
                                self._ready.set()
                                await self._closing.wait()
                                # Connections and listeners close first, while pubsub still runs: a
                                # message read after its service stopped raises in the swarm's task
                                # group ("Nursery is closed to new arrivals") and ends the host with an
                                # error; on 100 ms links a peer's gossip is still in flight then
                                # (tests/test_netlab_p2p.py). Closing again below is a no-op.
                                with trio.move_on_after(5):
                                    await self._libp2p.close()
                                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if mdns is not None:
                    await self._run_blocking(mdns.stop)
                with trio.move_on_after(5):
                    await self._libp2p.close()
                await close_leftover_tcp_streams()
            self._pubsub.seen_messages.stop()  # py-libp2p never stops this cache's sweeper thread

    def close(self, timeout: float = 10.0) -> None:
        """Stop the host: close connections and listeners, join its threads. Idempotent."""
        if self._thread.is_alive() and self._token is not None:
            try:
                trio.from_thread.run_sync(self._request_close, trio_token=self._token)
            except (trio.RunFinishedError, RuntimeError):
                pass
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("p2p host thread %s did not stop within %s s", self.peer_id, timeout)
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> P2PHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
            except Exception as exc:  # behind a NAT: try the relays before giving up
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
            logger.info("forgetting peer %s: %d dials in a row failed", peer, self.config.forget_after_failures)
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
            for peer in self.dialbook.sweep([p.to_base58() for p in known], [p.to_base58() for p in connections]):
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

    # ------------------------------------------------------------------ introspection

    def transfer_stats(self) -> dict[str, dict[str, int]]:
        """Application bytes sent/received per protocol (``/dlx/blob/1.0.0``, ``/dlx/sync/1.0.0``,
        ``/meshsub``), and for ``/meshsub`` the messages this node published and the distinct messages
        delivered to it (by gossip or sync): ``messages_sent``, ``messages_received``. Gossipsub's own
        forwarding and control frames are not counted."""
        return self.stats.snapshot()

    def blob_peer_stats(self) -> dict[str, dict[str, int]]:
        """Blob bytes sent to / received from each peer since start (of the ``MAX_PEER_STATS`` peers updated
        last)."""
        return self.stats.peers_snapshot()

    def __repr__(self) -> str:
        return f"P2PHost({self.peer_id}, {'closed' if self._closed else 'open'})"


def _addrs_of(peerstore: Any, peer: ID) -> list:
    """The peerstore's addresses of ``peer``; none for a peer it does not hold (py-libp2p raises)."""
    try:
        return list(peerstore.addrs(peer))
    except Exception:  # PeerStoreError: not found or expired
        return []


def peer_info(addr: str) -> PeerInfo:
    """The peer and address of a multiaddr ending in ``/p2p/<peer id>``, direct or relayed; raises
    DialError (RelayAddressError for a malformed relayed address)."""
    if "/p2p-circuit" in addr:
        _relay, _relay_id, peer = parse_relayed_addr(addr)
        return PeerInfo(ID.from_base58(peer), [multiaddr.Multiaddr(addr)])
    try:
        return info_from_p2p_addr(multiaddr.Multiaddr(addr))
    except Exception as exc:  # multiaddr raises several types on bad text
        raise DialError(f"bad multiaddr {addr!r}: {exc}") from None


def _check_port_free(listen_host: str, port: int) -> None:
    """Refuse a fixed port another process (or host) already listens on.

    py-libp2p listens with SO_REUSEPORT, so a second node on the same port would
    start silently and the kernel would split incoming connections between them.
    A probe bind without SO_REUSEPORT fails in exactly that case.
    """
    if port == 0:
        return
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        probe.bind((listen_host, port))
    except OSError as exc:
        raise P2PError(
            f"p2p.listen_port={port}: {listen_host}:{port} is already in use ({exc.strerror})"
        ) from None
    finally:
        probe.close()
