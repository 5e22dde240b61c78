"""``P2PHost``: a py-libp2p host on its own trio thread behind a small synchronous API.

This module builds and runs the host (lifecycle, statistics); its other methods
come from four mixins, one job each: :mod:`p2p.host_thread` (the trio thread and
the sync calls into it), :mod:`p2p.host_peers` (dial, connect, forget, list peers),
:mod:`p2p.host_gossip` (topics, validators, delivery, ``/dlx/sync``) and
:mod:`p2p.host_blobs` (store, announce, find, fetch). Byte counters are
:class:`p2p.transfer_stats.TransferStats`.

The host speaks TCP + Noise + yamux only (see :mod:`p2p.transport`), runs
gossipsub with envelope-checking topic validators (:mod:`p2p.gossip`), a
Kademlia DHT in server mode for peer routing and provider records, and the
``/dlx/blob/1.0.0`` bulk protocol (:mod:`p2p.blob_protocol`, served by :mod:`p2p.blob_server`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Self

import multiaddr
import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import ContentAddressedMessageIDGenerator, Pubsub
from libp2p.tools.anyio_service import background_trio_service

from p2p.blob_client import BlobFetcher
from p2p.blob_protocol import BLOB_PROTOCOL
from p2p.blob_server import BlobServer
from p2p.blobstore import BlobStore
from p2p.config import P2PConfig
from p2p.dialbook import DialBook
from p2p.discovery import Discovery
from p2p.errors import P2PError, P2PTimeout
from p2p.gossip import GOSSIP_RPC_LIMIT, SYNC_PROTOCOLS, RecentMessages, build_gossipsub
from p2p.host_blobs import HostBlobs
from p2p.host_gossip import HostGossip, Subscription
from p2p.host_peers import HostPeers
from p2p.host_thread import HostThread
from p2p.identity import Identity
from p2p.nat import NatTraversal
from p2p.ratelimit import PeerRateLimiter
from p2p.refusals import RefusedProtocols, guard_new_stream
from p2p.transfer_stats import TransferStats
from p2p.transport import build_libp2p_host, close_leftover_tcp_streams, spare_on_eviction, start_mdns

logger = logging.getLogger(__name__)


class P2PHost(HostGossip, HostBlobs, HostPeers, HostThread):
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
        """The host thread's event loop: build the services, run them until :meth:`close`, release all."""
        self._token = trio.lowlevel.current_trio_token()
        self._closing = trio.Event()
        self._build_services()
        config = self.config
        listen_addr = multiaddr.Multiaddr(f"/ip4/{config.listen_host}/tcp/{config.listen_port}")
        listen = [listen_addr] if config.listen else []
        self._mdns = None
        try:
            async with (
                self._libp2p.run(listen),
                background_trio_service(self._pubsub),
                background_trio_service(self._gossipsub),
            ):
                await self._pubsub.wait_until_ready()
                async with background_trio_service(self._dht), trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await self._serve_until_closed(nursery)
        finally:
            with trio.CancelScope(shield=True):
                if self._mdns is not None:
                    await self._run_blocking(self._mdns.stop)
                with trio.move_on_after(5):
                    await self._libp2p.close()
                await close_leftover_tcp_streams()
            self._pubsub.seen_messages.stop()  # py-libp2p never stops this cache's sweeper thread

    def _build_services(self) -> None:
        """Build the libp2p host, pubsub, the DHT, NAT traversal and the blob protocol's two sides."""
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

    async def _serve_until_closed(self, nursery: trio.Nursery) -> None:
        """With the host listening and pubsub and the DHT running: start the background tasks, mark the
        host ready, and once :meth:`close` asks, close connections and listeners and end the tasks."""
        config = self.config
        self._listen_addrs = [
            str(a) for a in self._libp2p.get_addrs() if "/p2p/" in str(a)
        ] or [f"{a}/p2p/{self.peer_id}" for a in self._libp2p.get_transport_addrs()]
        discovery = Discovery(self._libp2p, self._dht, config, self._connect_info, forgotten=self._forgotten)
        if config.mdns:
            self._mdns = await self._run_blocking(start_mdns, self._libp2p, config.mdns_interface)
            nursery.start_soon(discovery.run_mdns, self._mdns)
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
        # Connections and listeners close first, while pubsub still runs: a message read after its
        # service stopped raises in the swarm's task group ("Nursery is closed to new arrivals") and
        # ends the host with an error; on 100 ms links a peer's gossip is still in flight then
        # (tests/test_netlab_p2p.py). Closing again in _main is a no-op.
        with trio.move_on_after(5):
            await self._libp2p.close()
        nursery.cancel_scope.cancel()

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
