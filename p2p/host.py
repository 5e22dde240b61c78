"""``P2PHost``: a py-libp2p host on its own trio thread behind a small synchronous API.

py-libp2p is trio-based, the rest of the node is plain threads (and torch), so
the host runs ``trio.run`` in a dedicated thread and every public method hands a
coroutine to it with ``trio.from_thread.run`` (~50 µs per call) under a timeout.
Blocking work the loop must not do (disk I/O, hashing) runs on a small thread
pool the host owns, so :meth:`P2PHost.close` can join every thread it started.

The host speaks TCP + Noise + yamux only (see :mod:`p2p.transport`), runs
gossipsub with envelope-checking topic validators (:mod:`p2p.gossip`), a
Kademlia DHT in server mode for peer routing and provider records, and the
``/dlx/blob/1.0.0`` bulk protocol (:mod:`p2p.blob_protocol`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import logging
import os
import queue
import random
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.pubsub import ContentAddressedMessageIDGenerator, Pubsub
from libp2p.tools.anyio_service import background_trio_service

from p2p.blob_protocol import BLOB_PROTOCOL, BlobService
from p2p.blobstore import BlobStore, check_sha256_hex
from p2p.config import P2PConfig
from p2p.discovery import Discovery
from p2p.errors import BlobError, BlobNotFound, DialError, HostClosed, P2PError, P2PTimeout
from p2p.gossip import (
    GOSSIP_RPC_LIMIT,
    SYNC_PROTOCOL,
    RecentMessages,
    build_gossipsub,
    pull_recent,
    serve_recent,
)
from p2p.identity import Identity
from p2p.ratelimit import PeerRateLimiter
from p2p.transport import build_libp2p_host, close_leftover_tcp_streams, start_mdns
from p2p.wire import ProtocolViolation

logger = logging.getLogger(__name__)

T = TypeVar("T")
GossipValidator = Callable[[bytes, str], bool]
GOSSIP_PROTOCOL = "/meshsub"
_DELIVERED_MEMORY = 4096  # per topic: hashes of delivered messages, to drop gossip/sync duplicates
_PROVIDER_QUERY_FANOUT = 32  # connected peers asked directly for a blob's providers
SUBSCRIPTION_REANNOUNCE_TICKS = 2  # re-announce our topics to every pubsub peer every 2 x 2 s


class TransferStats:
    """Bytes sent/received per protocol, and blob bytes per peer (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, list[int]] = {}
        self._peers: dict[str, list[int]] = {}

    def add_peer(self, peer_id: str, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            counters = self._peers.setdefault(peer_id, [0, 0])
            counters[0] += sent
            counters[1] += received

    def peers_snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {peer: {"sent": c[0], "received": c[1]} for peer, c in self._peers.items()}

    def add(self, protocol: str, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            counters = self._counters.setdefault(str(protocol), [0, 0])
            counters[0] += sent
            counters[1] += received

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: {"sent": c[0], "received": c[1]} for name, c in self._counters.items()}


@dataclass
class _Subscription:
    queue: queue.Queue[tuple[bytes, str]]
    validator: GossipValidator | None
    delivered: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    sync_cursor: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # peer -> (epoch, seq)


class P2PHost:
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
        self._limiter = PeerRateLimiter(config.rate_limit_bps)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(2, config.blob_concurrency), thread_name_prefix=f"p2p-io-{self.peer_id[-6:]}"
        )
        self._recent = RecentMessages(config.sync_cache_messages, config.sync_cache_bytes)
        self._subscriptions: dict[str, _Subscription] = {}
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._closing: trio.Event | None = None
        self._closed = False
        self._listen_addrs: list[str] = []
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

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start() or logged; the thread must end cleanly
            if not self._ready.is_set():
                self._startup_error = exc
            else:
                logger.exception("p2p host %s stopped with an error", self.peer_id)
        finally:
            self._closed = True
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._closing = trio.Event()
        config = self.config
        self._libp2p = build_libp2p_host(self.identity)
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
        self._blobs = BlobService(
            self.store,
            self._open_stream,
            self._run_blocking,
            self._limiter,
            self.stats,
            config.blob_concurrency,
            config.blob_stall_timeout,
        )
        self._libp2p.set_stream_handler(BLOB_PROTOCOL, self._blobs.handle_stream)
        self._libp2p.set_stream_handler(SYNC_PROTOCOL, self._handle_sync)
        listen = multiaddr.Multiaddr(f"/ip4/{config.listen_host}/tcp/{config.listen_port}")
        mdns = None
        try:
            async with self._libp2p.run([listen]):
                async with background_trio_service(self._pubsub):
                    async with background_trio_service(self._gossipsub):
                        await self._pubsub.wait_until_ready()
                        async with background_trio_service(self._dht):
                            async with trio.open_nursery() as nursery:
                                self._nursery = nursery
                                self._listen_addrs = [
                                    str(a) for a in self._libp2p.get_addrs() if "/p2p/" in str(a)
                                ] or [f"{a}/p2p/{self.peer_id}" for a in self._libp2p.get_transport_addrs()]
                                discovery = Discovery(self._libp2p, self._dht, config, self._connect_info)
                                if config.mdns:
                                    mdns = await self._run_blocking(
                                        start_mdns, self._libp2p, config.mdns_interface
                                    )
                                    nursery.start_soon(discovery.run_mdns, mdns)
                                nursery.start_soon(discovery.run)
                                nursery.start_soon(self._pubsub_repair_loop)
                                if config.gossip_resync_interval > 0:
                                    nursery.start_soon(self._resync_loop)
                                self._ready.set()
                                await self._closing.wait()
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

    def _request_close(self) -> None:
        assert self._closing is not None
        self._closing.set()

    def __enter__(self) -> P2PHost:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _call(self, fn: Callable[..., Any], *args: Any, timeout: float, what: str) -> Any:
        if self._closed or self._token is None:
            raise HostClosed(f"p2p host {self.peer_id} is closed")

        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await fn(*args)

        try:
            return trio.from_thread.run(bounded, trio_token=self._token)
        except trio.TooSlowError:
            raise P2PTimeout(f"{what} did not finish within {timeout} s") from None
        except trio.RunFinishedError:
            raise HostClosed(f"p2p host {self.peer_id} is closed") from None

    async def _run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the host's own thread pool without blocking the event loop."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = self._executor.submit(fn, *args, **kwargs)
        def wake(_: concurrent.futures.Future) -> None:
            try:
                token.run_sync_soon(done.set, idempotent=True)
            except trio.RunFinishedError:
                pass  # the host closed meanwhile; nobody waits for this result

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    async def _open_stream(self, peer: ID, protocol: TProtocol) -> Any:
        await self._ensure_connected(peer)
        return await self._libp2p.new_stream(peer, [protocol])

    async def _ensure_connected(self, peer: ID) -> None:
        if peer in self._libp2p.get_network().connections:
            return
        addrs = self._libp2p.get_peerstore().addrs(peer)
        if not addrs:
            with trio.move_on_after(10):
                info = await self._dht.find_peer(peer)
                if info is not None:
                    addrs = list(info.addrs)
        if not addrs:
            raise DialError(f"no known address for peer {peer}")
        await self._libp2p.connect(PeerInfo(peer, addrs))

    # ------------------------------------------------------------------ peers

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs of this host, each ending in ``/p2p/<peer id>``."""
        return list(self._listen_addrs)

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<id>`` multiaddr; return the peer id. Raises DialError/P2PTimeout."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # multiaddr raises several types on bad text
            raise DialError(f"bad multiaddr {addr!r}: {exc}") from None
        self._call(self._connect_info, info, timeout=timeout, what=f"connect {addr}")
        return info.peer_id.to_base58()

    async def _connect_info(self, info: PeerInfo) -> None:
        if info.peer_id == self._libp2p.get_id():
            return
        try:
            await self._libp2p.connect(info)
        except trio.TooSlowError:
            raise
        except Exception as exc:  # libp2p dial errors have no common base
            raise DialError(f"cannot connect to {info.peer_id}: {type(exc).__name__}: {exc}") from None
        with trio.move_on_after(5):
            await self._dht.add_peer(info.peer_id, skip_server_mode_check=True)

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

    def _check_open(self) -> None:
        if self._closed:
            raise HostClosed(f"p2p host {self.peer_id} is closed")

    # ------------------------------------------------------------------ gossip

    def subscribe(
        self, topic: str, validator: GossipValidator | None = None, timeout: float = 10.0
    ) -> queue.Queue:
        """Subscribe to ``topic``; messages arrive on the returned queue as ``(data, from_peer_id)``.

        ``validator(data, from_peer_id) -> bool`` runs on the network thread before a
        message is delivered *or relayed*; False (or an exception) drops it. It also
        screens messages pulled through ``/dlx/sync``. Our own published messages
        are delivered too (``from_peer_id == self.peer_id``) without validation.
        Duplicates (same bytes via gossip and sync) are delivered once.
        """
        return self._call(self._subscribe, topic, validator, timeout=timeout, what=f"subscribe {topic}")

    async def _subscribe(self, topic: str, validator: GossipValidator | None) -> queue.Queue:
        existing = self._subscriptions.get(topic)
        if existing is not None:
            if validator is not None and validator != existing.validator:
                raise P2PError(f"topic {topic!r} is already subscribed with another validator")
            return existing.queue
        subscription = _Subscription(queue.Queue(), validator)
        self._subscriptions[topic] = subscription
        if validator is not None:
            self._pubsub.set_topic_validator(topic, self._pubsub_validator(validator), False)
        pubsub_subscription = await self._pubsub.subscribe(topic)
        self._nursery.start_soon(self._pump, topic, pubsub_subscription)
        return subscription.queue

    def _pubsub_validator(self, validator: GossipValidator) -> Callable[[ID, Any], bool]:
        my_id = self._libp2p.get_id().to_bytes()

        def check(forwarder: ID, msg: Any) -> bool:
            if msg.from_id == my_id:
                return True  # our own publish: the node validated it when it built it
            return self._run_validator(validator, msg.data, ID(msg.from_id).to_base58())

        return check

    @staticmethod
    def _run_validator(validator: GossipValidator, data: bytes, sender: str) -> bool:
        try:
            return bool(validator(data, sender))
        except Exception:  # a buggy validator must not take the network thread down
            logger.exception("gossip validator raised; message from %s dropped", sender)
            return False

    async def _pump(self, topic: str, pubsub_subscription: Any) -> None:
        """Move messages out of pubsub's 32-slot channel at once (it drops when full)."""
        async for msg in pubsub_subscription:
            self._deliver(topic, msg.data, ID(msg.from_id).to_base58())

    def _deliver(self, topic: str, data: bytes, sender: str) -> bool:
        subscription = self._subscriptions.get(topic)
        if subscription is None:
            return False
        key = hashlib.sha256(data).digest()
        if key in subscription.delivered:
            return False
        subscription.delivered[key] = None
        if len(subscription.delivered) > _DELIVERED_MEMORY:
            subscription.delivered.popitem(last=False)
        self._recent.add(topic, data)
        if sender != self.peer_id:
            self.stats.add(GOSSIP_PROTOCOL, received=len(data))
        subscription.queue.put_nowait((data, sender))
        return True

    def unsubscribe(self, topic: str, timeout: float = 10.0) -> None:
        """Leave ``topic`` (its queue receives nothing more)."""

        async def leave() -> None:
            if self._subscriptions.pop(topic, None) is not None:
                self._pubsub.remove_topic_validator(topic)
                await self._pubsub.unsubscribe(topic)
                self._recent.drop(topic)

        self._call(leave, timeout=timeout, what=f"unsubscribe {topic}")

    def publish(self, topic: str, data: bytes, timeout: float = 10.0) -> bool:
        """Gossip ``data`` on ``topic``; return False if these exact bytes were already gossiped.

        Message ids are content-addressed, so publishing identical bytes again within
        pubsub's 120 s seen window is a no-op (False): peers that missed them get them
        through ``/dlx/sync`` (:meth:`resync`, and every ``gossip_resync_interval``).
        Raises P2PError if ``data`` exceeds ``gossip_max_message_bytes`` (gossipsub would
        drop it silently: send large payloads as blobs and gossip their hash).
        """
        if len(data) > self.config.gossip_max_message_bytes:
            raise P2PError(
                f"gossip message of {len(data)} bytes exceeds p2p.gossip_max_message_bytes="
                f"{self.config.gossip_max_message_bytes}: send it as a blob and gossip its hash"
            )
        data = bytes(data)
        message_id = base64.b64encode(hashlib.sha256(data).digest())  # ContentAddressedMessageIDGenerator

        async def send() -> bool:
            if topic not in self._subscriptions:
                self._recent.add(topic, data)  # still servable through /dlx/sync
            if self._pubsub.seen_messages.has(message_id):
                return False
            await self._pubsub.publish(topic, data)
            self.stats.add(GOSSIP_PROTOCOL, sent=len(data))
            return True

        return self._call(send, timeout=timeout, what=f"publish on {topic}")

    def topic_peers(self, topic: str, timeout: float = 5.0) -> list[str]:
        """Peers known to be subscribed to ``topic``."""

        async def subscribed() -> list[str]:
            return sorted(p.to_base58() for p in self._pubsub.peer_topics.get(topic, set()))

        return self._call(subscribed, timeout=timeout, what="topic_peers")

    def resync(self, topic: str, timeout: float = 10.0) -> int:
        """Pull recent messages of ``topic`` from every connected peer over ``/dlx/sync/1.0.0``.

        New, valid messages go to the topic's queue (``from_peer_id`` is then the peer
        that served them). Returns how many were new.
        """
        return self._call(self._resync, topic, timeout=timeout, what=f"resync {topic}")

    async def _resync(self, topic: str) -> int:
        subscription = self._subscriptions.get(topic)
        if subscription is None:
            raise P2PError(f"resync of {topic!r}: not subscribed")
        new = 0

        async def pull(peer: ID) -> None:
            nonlocal new
            peer_text = peer.to_base58()
            epoch, after = subscription.sync_cursor.get(peer_text, (b"", 0))
            try:
                with trio.fail_after(5):
                    messages, cursor = await pull_recent(self._libp2p, peer, topic, epoch, after)
            except Exception as exc:  # a peer without the protocol or gone: others still answer
                logger.debug("sync of %s from %s failed: %s", topic, peer_text, exc)
                return
            subscription.sync_cursor[peer_text] = cursor
            for data in messages:
                self.stats.add(SYNC_PROTOCOL, received=len(data))
                if hashlib.sha256(data).digest() in subscription.delivered:
                    continue
                if subscription.validator is not None and not self._run_validator(
                    subscription.validator, data, peer_text
                ):
                    continue
                if self._deliver(topic, data, peer_text):
                    new += 1

        async with trio.open_nursery() as nursery:
            for peer in list(self._libp2p.get_network().connections):
                nursery.start_soon(pull, peer)
        return new

    async def _handle_sync(self, stream: Any) -> None:
        sent = await serve_recent(stream, self._recent)
        self.stats.add(SYNC_PROTOCOL, sent=sent)

    async def _pubsub_repair_loop(self) -> None:
        """Give every connected peer a pubsub stream, retrying.

        py-libp2p opens the pubsub stream once, from the ``connected`` notification; if
        that open fails (it can race the muxer handshake under load) the peer never
        joins pubsub, never learns our subscriptions and never gets our gossip, for as
        long as the connection lives. Seen as a 4-host test whose subscriptions never
        completed. ``ensure_peer_stream`` is idempotent for peers that have one.

        It also re-announces our subscriptions to every pubsub peer now and then. A peer
        forgets our subscriptions when one of the two pubsub streams between us dies
        (py-libp2p's dead-peer handling; for example when simultaneous dials leave two
        connections and one is closed): it re-opens its own stream, but ours is still
        alive, so nothing would ever tell it our topics again and it would leave us out
        of its gossip for good. A subscription it already knows is a no-op there.
        """
        ticks = 0
        while True:
            await trio.sleep(2.0)
            ticks += 1
            if ticks % SUBSCRIPTION_REANNOUNCE_TICKS == 0:
                for topic in list(self._subscriptions):
                    # _build_announce_rpc is private but libp2p is pinned (pyproject.toml).
                    packet, subopt = self._pubsub._build_announce_rpc(topic, subscribe=True)
                    with trio.move_on_after(5):
                        try:
                            await self._pubsub.message_all_peers(packet.SerializeToString(), announce=subopt)
                        except Exception as exc:  # a broken peer must not end the loop
                            logger.debug("re-announcing %s failed: %s", topic, exc)
            for peer_id in list(self._libp2p.get_network().connections):
                if peer_id in self._pubsub.peers:
                    continue
                with trio.move_on_after(5):
                    try:
                        await self._pubsub.ensure_peer_stream(peer_id, timeout=5.0)
                    except Exception as exc:  # a broken peer must not end the loop
                        logger.debug("pubsub stream to %s not opened: %s", peer_id, exc)

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(self.config.gossip_resync_interval)
            for topic in list(self._subscriptions):
                with trio.move_on_after(self.config.gossip_resync_interval):
                    try:
                        await self._resync(topic)
                    except P2PError:
                        pass  # unsubscribed meanwhile

    # ------------------------------------------------------------------ blobs

    def provide_blob(
        self, source: bytes | str | os.PathLike[str], announce: bool = True, timeout: float = 30.0
    ) -> str:
        """Store ``source`` (bytes or a file path) in the blob dir and announce it on the DHT.

        Returns the sha256 hex. Hashing and copying happen on the calling thread,
        never on the event loop. The blob is served as soon as it is stored, even
        if the DHT announcement times out (that raises P2PTimeout after storing).
        """
        self._check_open()
        if isinstance(source, (bytes, bytearray, memoryview)):
            sha256_hex = self.store.put_bytes(bytes(source))
        else:
            sha256_hex = self.store.put_file(source)
        if announce:
            self._call(self._announce, sha256_hex, timeout=timeout, what=f"announce blob {sha256_hex[:16]}")
        return sha256_hex

    async def _announce(self, sha256_hex: str) -> None:
        key = _dht_key(sha256_hex)
        ok = await self._dht.provider_store.provide(key)
        if not ok:
            logger.info("blob %s stored; no DHT peer took the provider record yet", sha256_hex[:16])

    def has_blob(self, sha256_hex: str) -> bool:
        return self.store.has(sha256_hex)

    def blob_path(self, sha256_hex: str) -> Path:
        """Path of a locally stored blob (read-only use)."""
        if not self.store.has(sha256_hex):
            raise BlobNotFound(f"blob {sha256_hex} is not stored locally")
        return self.store.path(sha256_hex)

    def remove_blob(self, sha256_hex: str) -> bool:
        """Delete a local blob (it is no longer served); True if it existed."""
        sha256_hex = check_sha256_hex(sha256_hex)
        existed = self.store.remove(sha256_hex)
        if existed and not self._closed and self._token is not None:
            try:
                self._call(self._forget_provided, sha256_hex, timeout=5, what="forget blob")
            except P2PError:
                pass  # the local record expires anyway; we no longer serve the blob
        return existed

    async def _forget_provided(self, sha256_hex: str) -> None:
        key = _dht_key(sha256_hex)
        store = self._dht.provider_store
        store.providing_keys.discard(key)  # stops the DHT's periodic re-announcement
        store.providers.get(key, {}).pop(str(self._libp2p.get_id()), None)

    def find_providers(self, sha256_hex: str, timeout: float = 10.0) -> list[str]:
        """Peer ids announcing ``sha256_hex`` (deduplicated; includes this host if it holds the blob)."""
        sha256_hex = check_sha256_hex(sha256_hex)
        found = self._call(
            self._find_providers, sha256_hex, timeout=timeout, what=f"find_providers {sha256_hex[:16]}"
        )
        return [p.to_base58() for p in found]

    async def _find_providers(self, sha256_hex: str) -> list[ID]:
        key = _dht_key(sha256_hex)
        store = self._dht.provider_store
        infos = list(store.get_providers(key))
        # py-libp2p's lookup stops at the local record store as soon as it holds one
        # provider, so also ask every connected peer directly (a small network: the
        # k closest peers are all of them), then run the iterative lookup.
        ask = list(self._libp2p.get_network().connections)[:_PROVIDER_QUERY_FANOUT]

        async def ask_peer(peer: ID) -> None:
            with trio.move_on_after(5):
                try:
                    providers, _closer = await store._get_providers_from_peer_with_closers(peer, key)
                except Exception as exc:  # a peer without the DHT protocol, or gone
                    logger.debug("GET_PROVIDERS from %s failed: %s", peer, exc)
                    return
                infos.extend(providers)

        async with trio.open_nursery() as nursery:
            for peer in ask:
                nursery.start_soon(ask_peer, peer)
        if not infos:
            with trio.move_on_after(5):
                infos += await store.find_providers(key, 20)
        peerstore = self._libp2p.get_peerstore()
        my_id = self._libp2p.get_id()
        unique: dict[ID, None] = {}
        for info in infos:
            if info.peer_id == my_id and not self.store.has(sha256_hex):
                continue
            if info.addrs and info.peer_id != my_id:
                peerstore.add_addrs(info.peer_id, info.addrs, 3600)
            unique[info.peer_id] = None
        return list(unique)

    def fetch_blob(
        self,
        sha256_hex: str,
        dest_path: str | os.PathLike[str],
        providers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Path:
        """Download a blob (parallel ranges from all providers), verify its sha256, put it at ``dest_path``.

        Without ``providers`` they are looked up on the DHT. The blob is also kept in
        the blob dir (so this host can serve it). Raises BlobNotFound, BlobTooLarge,
        BlobUnavailable (every provider failed), BlobHashMismatch or P2PTimeout
        (``timeout`` defaults to ``p2p.transfer_timeout``).
        """
        sha256_hex = check_sha256_hex(sha256_hex)
        timeout = self.config.transfer_timeout if timeout is None else timeout
        if not self.store.has(sha256_hex):
            peer_ids = [ID.from_base58(p) for p in providers] if providers else None
            self._call(
                self._fetch, sha256_hex, peer_ids, timeout=timeout, what=f"fetch blob {sha256_hex[:16]}"
            )
        return self.store.export(sha256_hex, dest_path)

    async def _fetch(self, sha256_hex: str, providers: list[ID] | None) -> Path:
        if providers is None:
            with trio.move_on_after(10):
                providers = await self._find_providers(sha256_hex)
        my_id = self._libp2p.get_id()
        candidates = [p for p in dict.fromkeys(providers or []) if p != my_id]
        random.shuffle(candidates)  # spread load when many fetch the same blob
        try:
            return await self._blobs.download(sha256_hex, candidates, self.config.max_blob_bytes)
        except BlobError:
            raise
        except ProtocolViolation as exc:
            raise BlobError(f"blob {sha256_hex[:16]}: {exc}") from None

    # ------------------------------------------------------------------ introspection

    def transfer_stats(self) -> dict[str, dict[str, int]]:
        """Application bytes sent/received per protocol (``/dlx/blob/1.0.0``, ``/dlx/sync/1.0.0``,
        ``/meshsub``)."""
        return self.stats.snapshot()

    def blob_peer_stats(self) -> dict[str, dict[str, int]]:
        """Blob bytes sent to / received from each peer since start."""
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


def _dht_key(sha256_hex: str) -> bytes:
    """DHT provider key of a blob: the sha2-256 multihash (0x12 0x20 + digest), as IPFS uses."""
    return b"\x12\x20" + bytes.fromhex(check_sha256_hex(sha256_hex))
