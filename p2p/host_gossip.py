"""The gossip side of :class:`p2p.host.P2PHost`: topics, validators, delivery, and ``/dlx/sync`` resyncs.

Gossipsub carries small signed messages (:mod:`p2p.gossip` builds it and serves the sync protocol); this
mixin subscribes and publishes, screens every message with the topic's validator before it is delivered
or relayed, delivers each message once per topic (gossip and sync may both bring it), pulls what peers
hold (``resync``), and repairs py-libp2p's pubsub streams and subscription announcements.
"""

from __future__ import annotations

import hashlib
import logging
import queue
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.peer.id import ID

from p2p.errors import P2PError
from p2p.gossip import SYNC_ID_BYTES, SYNC_PROTOCOL, gossip_message_id, pull_recent, serve_recent

logger = logging.getLogger(__name__)

GossipValidator = Callable[[bytes, str], bool]
GOSSIP_PROTOCOL = "/meshsub"
_DELIVERED_MEMORY = 4096  # per topic: hashes of delivered messages, to drop gossip/sync duplicates
SUBSCRIPTION_REANNOUNCE_TICKS = 2  # re-announce our topics to every pubsub peer every 2 x 2 s


@dataclass
class Subscription:
    """One subscribed topic: its delivery queue, validator, delivered hashes and per-peer sync cursors."""

    queue: queue.Queue[tuple[bytes, str]]
    validator: GossipValidator | None
    #: None: every delivered message is served by /dlx/sync.
    keep_for_sync: Callable[[bytes], bool] | None = None
    delivered: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    sync_cursor: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # peer -> (epoch, seq)


class HostGossip:
    """Mixin of :class:`p2p.host.P2PHost`: the pubsub/gossip methods.

    Expects of the host: ``config``, ``peer_id``, ``stats``, ``_call`` (:class:`p2p.host_thread.HostThread`),
    ``_libp2p``, ``_pubsub``, ``_nursery``, ``_recent`` (:class:`p2p.gossip.RecentMessages`) and
    ``_subscriptions`` (topic -> :class:`Subscription`).
    """

    def subscribe(
        self,
        topic: str,
        validator: GossipValidator | None = None,
        timeout: float = 10.0,
        keep_for_sync: Callable[[bytes], bool] | None = None,
    ) -> queue.Queue:
        """Subscribe to ``topic``; messages arrive on the returned queue as ``(data, from_peer_id)``.

        ``validator(data, from_peer_id) -> bool`` runs on the network thread before a
        message is delivered *or relayed*; False (or an exception) drops it. It also
        screens messages pulled through ``/dlx/sync``. Our own published messages
        are delivered too (``from_peer_id == self.peer_id``) without validation.
        Duplicates (same bytes via gossip and sync) are delivered once.

        ``keep_for_sync(data) -> bool`` (default: keep all) decides which delivered
        messages this host keeps to serve over ``/dlx/sync``. Every peer re-serves every
        message it keeps to every other peer that pulls, so a topic's sync traffic per
        node grows with peers x messages: leave out messages that a newer one supersedes
        (liveness beacons). False or an exception: delivered, not kept.
        """
        return self._call(self._subscribe, topic, validator, keep_for_sync, timeout=timeout,
                          what=f"subscribe {topic}")

    async def _subscribe(self, topic: str, validator: GossipValidator | None,
                         keep_for_sync: Callable[[bytes], bool] | None = None) -> queue.Queue:
        existing = self._subscriptions.get(topic)
        if existing is not None:
            if validator is not None and validator != existing.validator:
                raise P2PError(f"topic {topic!r} is already subscribed with another validator")
            return existing.queue
        subscription = Subscription(queue.Queue(), validator, keep_for_sync)
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
        if self._keeps_for_sync(subscription, data):
            self._recent.add(topic, data)
        if sender != self.peer_id:
            self.stats.add(GOSSIP_PROTOCOL, received=len(data), messages_received=1)
        subscription.queue.put_nowait((data, sender))
        return True

    @staticmethod
    def _keeps_for_sync(subscription: Subscription, data: bytes) -> bool:
        if subscription.keep_for_sync is None:
            return True
        try:
            return bool(subscription.keep_for_sync(data))
        except Exception:  # a buggy predicate must not take the network thread down
            logger.exception("keep_for_sync raised; message not kept for /dlx/sync")
            return False

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
        message_id = gossip_message_id(data)

        async def send() -> bool:
            if topic not in self._subscriptions:
                self._recent.add(topic, data)  # still servable through /dlx/sync
            if self._pubsub.seen_messages.has(message_id):
                return False
            await self._pubsub.publish(topic, data)
            self.stats.add(GOSSIP_PROTOCOL, sent=len(data), messages_sent=1)
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

        held = {digest[:SYNC_ID_BYTES] for digest in subscription.delivered}

        async def pull(peer: ID) -> None:
            nonlocal new
            peer_text = peer.to_base58()
            epoch, after = subscription.sync_cursor.get(peer_text, (b"", 0))
            try:
                with trio.fail_after(5):
                    messages, cursor, offered = await pull_recent(self._libp2p, peer, topic, epoch, after,
                                                                  have=held.__contains__)
            # A peer without the protocol, or gone, must not end the other peers' pulls.
            except Exception as exc:  # noqa: BLE001 - a pull's task boundary
                logger.debug("sync of %s from %s failed: %s", topic, peer_text, exc)
                return
            subscription.sync_cursor[peer_text] = cursor
            self.stats.add(SYNC_PROTOCOL, received=offered)
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
                        except Exception as exc:  # noqa: BLE001 - a broken peer must not end the repair loop
                            logger.debug("re-announcing %s failed: %s", topic, exc)
            for peer_id in list(self._libp2p.get_network().connections):
                if peer_id in self._pubsub.peers:
                    continue
                with trio.move_on_after(5):
                    try:
                        await self._pubsub.ensure_peer_stream(peer_id, timeout=5.0)
                    except Exception as exc:  # noqa: BLE001 - a broken peer must not end the repair loop
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
