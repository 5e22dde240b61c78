"""Gossip for control messages: gossipsub settings and the ``/dlx/sync/1.0.0`` pull path.

Gossipsub in py-libp2p 0.8.1 drops silently: RPCs over 1 MiB, more than 10
messages/s per peer and topic (spam protection), more than 32 queued deliveries
per subscription, and its default heartbeat is 120 s. :func:`build_gossipsub`
sets the limits for this traffic instead; the host publishes only what fits and
drains subscriptions into unbounded queues at once.

Gossip is still best effort (a peer that joins late, or whose mesh was not
formed yet, misses messages), so each host keeps the recent messages of every
topic it subscribes to and answers ``/dlx/sync/1.0.0`` requests for them::

    request   {topic: str, epoch: bin, after: int}
    response  {epoch: bin, next: int, messages: [bin, ...]}

``epoch`` is random per host run and ``after`` a sequence number in it, so a
periodic pull returns only what the puller has not received from that peer yet.

``/dlx/sync/1.1.0`` offers before it sends (docs/P2P.md): every peer holds
most of what every other peer holds (gossip brought it), so re-sending whole
messages to every puller made sync the largest traffic of an 8-node run::

    request   {topic: str, epoch: bin, after: int}          (as 1.0.0)
    offer     {epoch: bin, next: int, ids: [bin 16, ...]}    ids: sha256(message)[:16], oldest first
    want      {want: [int, ...]}                             strictly increasing indices into ids
    response  {messages: [bin, ...]}                         the wanted messages, in that order
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import libp2p.pubsub.pubsub as _pubsub_module
import libp2p.pubsub.rpc_queue as _rpc_queue_module
import trio
from libp2p.abc import IHost
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, GossipSub

from p2p.streams import CONNECTION_ERRORS
from p2p.wire import ProtocolViolation, field, read_frame, write_frame

logger = logging.getLogger(__name__)

SYNC_PROTOCOL = TProtocol("/dlx/sync/1.0.0")
SYNC_OFFER_PROTOCOL = TProtocol("/dlx/sync/1.1.0")
#: Both, newest first: a puller negotiates 1.1.0 and falls back to 1.0.0 with a peer that lacks it.
SYNC_PROTOCOLS = (SYNC_OFFER_PROTOCOL, SYNC_PROTOCOL)
SYNC_MAX_RESPONSE_BYTES = 16 << 20
SYNC_ID_BYTES = 16
SYNC_MAX_OFFER_IDS = 1 << 16
SYNC_MAX_OFFER_BYTES = 64 + SYNC_MAX_OFFER_IDS * (SYNC_ID_BYTES + 2)
GOSSIP_RPC_LIMIT = 1 << 20  # py-libp2p's inbound RPC cap: larger RPCs are dropped
GOSSIP_RPC_OVERHEAD = 16 << 10  # protobuf framing, from/seqno/signature/key, topic name


#: Gossipsub v1.1 and v1.0 only. v1.2 adds IDONTWANT, which py-libp2p 0.8.1 sends to every
#: mesh peer for every message (go-libp2p: only above 1 KiB); for small round messages that
#: doubled the RPCs per message and, on 2 loaded cores, multiplied gossip latency.
GOSSIP_PROTOCOLS = (PROTOCOL_ID_V11, PROTOCOL_ID)

#: Queue depths py-libp2p hard-codes at 32 (per-peer outbound RPCs, per-subscription
#: deliveries) and drops beyond, silently. A burst of 60 envelopes lost half of them.
GOSSIP_QUEUE_DEPTH = 4096


def _raise_pubsub_queue_depths() -> None:
    """Raise py-libp2p 0.8.1's two 32-slot pubsub queues (module constant and default argument)."""
    _pubsub_module.SUBSCRIPTION_CHANNEL_SIZE = GOSSIP_QUEUE_DEPTH  # read at subscribe() time
    init = _rpc_queue_module.RpcQueue.__init__
    defaults = init.__defaults__
    if (
        defaults
        and len(defaults) == 2
        and defaults[0] in (_rpc_queue_module.OutBoundQueueSize, GOSSIP_QUEUE_DEPTH)
    ):
        init.__defaults__ = (GOSSIP_QUEUE_DEPTH, defaults[1])  # Pubsub builds RpcQueue() with defaults
    else:  # a different py-libp2p: leave it alone rather than patch blindly
        raise RuntimeError(f"unexpected RpcQueue.__init__ defaults {defaults}; p2p/gossip.py needs updating")


_raise_pubsub_queue_depths()


#: What :class:`_GossipSub` keeps of py-libp2p's per-topic delivery times: the last minute (what its adaptive
#: gossip reads), and never more than this many per topic.
DELIVERY_TIMES_S = 60.0
DELIVERY_TIMES_KEPT = 1024


class _GossipSub(GossipSub):
    """py-libp2p 0.8.1's gossipsub with its per-topic delivery times bounded.

    ``publish`` (every message this host sends or forwards) appends the time to
    ``recent_message_deliveries[topic]``, a list trimmed only by the adaptive gossip's health check,
    which :func:`build_gossipsub` turns off: one float more per message for the life of the host
    (~100 a round on a 3-node run, 3 kB a round; more with more members). Trimmed here after every
    publish to the minute that check would read.
    """

    async def publish(self, msg_forwarder: ID, pubsub_msg: Any) -> None:
        try:
            await super().publish(msg_forwarder, pubsub_msg)
        finally:
            cutoff = time.time() - DELIVERY_TIMES_S
            for topic in pubsub_msg.topicIDs:
                times = self.recent_message_deliveries.get(topic)
                if times:  # appended in time order (a clock stepped back: the count still bounds it)
                    del times[:max(bisect.bisect_left(times, cutoff), len(times) - DELIVERY_TIMES_KEPT)]


def build_gossipsub(heartbeat: float, max_msgs_per_sec: float, degree: int = 6) -> GossipSub:
    """Gossipsub v1.1/1.0 tuned for a few dozen peers exchanging round messages.

    Adaptive gossip is off because it rewrites the heartbeat to >= 30 s when it
    judges the network unhealthy (a small test network always looks unhealthy);
    eclipse protection is off because it wants >= 3 distinct IPs in a mesh,
    which a single-machine or single-LAN cluster never has.
    """
    return _GossipSub(
        protocols=list(GOSSIP_PROTOCOLS),
        degree=degree,
        degree_low=max(1, degree - 2),
        degree_high=degree * 2,
        time_to_live=60,
        gossip_window=3,
        gossip_history=5,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=heartbeat,  # type: ignore[arg-type]  # trio.sleep takes floats
        adaptive_gossip_enabled=False,
        spam_protection_enabled=True,
        max_messages_per_topic_per_second=max_msgs_per_sec,
        eclipse_protection_enabled=False,
    )


def gossip_message_id(data: bytes) -> bytes:
    """The gossipsub message id of ``data``: base64 (standard alphabet, padded) of its sha256.

    The same function as py-libp2p's ``ContentAddressedMessageIDGenerator``, which the host
    installs: every implementation on a run topic must use it, or IHAVE/IWANT gossip and the
    seen-message cache do not recognise the same message (docs/P2P.md, "Gossip").
    """
    return base64.b64encode(hashlib.sha256(data).digest())


def sync_id(data: bytes) -> bytes:
    """The ``/dlx/sync/1.1.0`` id of a message: the first 16 bytes of its sha256."""
    return hashlib.sha256(data).digest()[:SYNC_ID_BYTES]


@dataclass
class _Cached:
    seq: int
    data: bytes
    id: bytes = b""


class RecentMessages:
    """Recent messages per topic, bounded by count and bytes, numbered for incremental pulls."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.epoch = os.urandom(8)
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._topics: dict[str, deque[_Cached]] = {}
        self._bytes: dict[str, int] = {}
        self._seq = 0

    def add(self, topic: str, data: bytes) -> None:
        self._seq += 1
        entries = self._topics.setdefault(topic, deque())
        entries.append(_Cached(self._seq, data, sync_id(data)))
        self._bytes[topic] = self._bytes.get(topic, 0) + len(data)
        while entries and (len(entries) > self.max_messages or self._bytes[topic] > self.max_bytes):
            self._bytes[topic] -= len(entries.popleft().data)

    def since(self, topic: str, epoch: bytes, after: int, budget: int,
              max_count: int | None = None) -> tuple[int, list[bytes]]:
        """Messages newer than ``after`` (all of them if ``epoch`` is not ours), up to ``budget`` bytes."""
        last, entries = self._entries_since(topic, epoch, after, budget, max_count)
        return last, [entry.data for entry in entries]

    def offer_since(self, topic: str, epoch: bytes, after: int, budget: int,
                    max_count: int) -> tuple[int, list[bytes], list[bytes]]:
        """As :meth:`since`, with each message's sync id: (next cursor, ids, messages)."""
        last, entries = self._entries_since(topic, epoch, after, budget, max_count)
        return last, [entry.id for entry in entries], [entry.data for entry in entries]

    def _entries_since(self, topic: str, epoch: bytes, after: int, budget: int,
                       max_count: int | None) -> tuple[int, list[_Cached]]:
        if epoch != self.epoch:
            after = 0
        out: list[_Cached] = []
        used = 0
        last = after
        for entry in self._topics.get(topic, ()):
            if entry.seq <= after:
                continue
            if used + len(entry.data) > budget or (max_count is not None and len(out) >= max_count):
                break
            out.append(entry)
            used += len(entry.data)
            last = entry.seq
        return last, out

    def drop(self, topic: str) -> None:
        self._topics.pop(topic, None)
        self._bytes.pop(topic, None)


def sync_request_frame(topic: str, epoch: bytes, after: int) -> dict[str, Any]:
    """A ``/dlx/sync/1.0.0`` request: ``topic`` messages after sequence ``after`` of ``epoch``."""
    return {"topic": topic, "epoch": epoch, "after": after}


def sync_response_frame(epoch: bytes, next_seq: int, messages: list[bytes]) -> dict[str, Any]:
    """A ``/dlx/sync/1.0.0`` response: the server's epoch, the cursor to send next time, the messages."""
    return {"epoch": epoch, "next": next_seq, "messages": messages}


def sync_offer_frame(epoch: bytes, next_seq: int, ids: list[bytes]) -> dict[str, Any]:
    """A ``/dlx/sync/1.1.0`` offer: the server's epoch, the cursor after these messages, their ids."""
    return {"epoch": epoch, "next": next_seq, "ids": ids}


def sync_want_frame(want: list[int]) -> dict[str, Any]:
    """A ``/dlx/sync/1.1.0`` want: indices into the offer's ids, strictly increasing."""
    return {"want": want}


def sync_messages_frame(messages: list[bytes]) -> dict[str, Any]:
    """The ``/dlx/sync/1.1.0`` response to a want: the wanted messages, in order."""
    return {"messages": messages}


def parse_sync_offer(frame: dict[str, Any]) -> tuple[list[bytes], tuple[bytes, int]]:
    """(ids, (epoch, next)) of a ``/dlx/sync/1.1.0`` offer; raises ProtocolViolation on a bad one."""
    ids = field(frame, "ids", list)
    if len(ids) > SYNC_MAX_OFFER_IDS or any(type(i) is not bytes or len(i) != SYNC_ID_BYTES for i in ids):
        raise ProtocolViolation(f"sync offer: ids must be at most {SYNC_MAX_OFFER_IDS} bin {SYNC_ID_BYTES}")
    return ids, (field(frame, "epoch", bytes), field(frame, "next", int, 0))


def parse_sync_want(frame: dict[str, Any], offered: int) -> list[int]:
    """The indices of a ``/dlx/sync/1.1.0`` want into an offer of ``offered`` ids; raises
    ProtocolViolation."""
    want = field(frame, "want", list)
    if any(type(i) is not int for i in want) or any(b <= a for a, b in itertools.pairwise(want)) \
            or (want and not 0 <= want[0] <= want[-1] < offered):
        raise ProtocolViolation(f"sync want: indices must be strictly increasing ints in [0, {offered})")
    return want


def want_frame_limit(offered: int) -> int:
    """Largest want body for an offer of ``offered`` ids (a map, an array, one uint32 per index)."""
    return 64 + 5 * offered


async def pull_recent(
    host: IHost, peer: ID, topic: str, epoch: bytes, after: int,
    have: Callable[[bytes], bool] | None = None,
) -> tuple[list[bytes], tuple[bytes, int], int]:
    """Ask ``peer`` for ``topic`` messages newer than (epoch, after).

    Returns (messages, next cursor, bytes of the exchange's own framing: the offer's ids).
    ``have(sync_id)``: whether the puller already holds a message; with a peer that
    speaks ``/dlx/sync/1.1.0`` only the others are sent.
    """
    stream = await host.new_stream(peer, list(SYNC_PROTOCOLS))
    try:
        await write_frame(stream, sync_request_frame(topic, epoch, after))
        if stream.get_protocol() != SYNC_OFFER_PROTOCOL:
            # One map and one array: nothing else may be built from the peer's 16 MiB (docs/P2P.md).
            reply = await read_frame(stream, SYNC_MAX_RESPONSE_BYTES, max_containers=2)
            messages, cursor = parse_sync_response(reply)
            return messages, cursor, 0
        ids, cursor = parse_sync_offer(await read_frame(stream, SYNC_MAX_OFFER_BYTES, max_containers=2))
        want = [index for index, message_id in enumerate(ids) if have is None or not have(message_id)]
        await write_frame(stream, sync_want_frame(want))
        reply = await read_frame(stream, SYNC_MAX_RESPONSE_BYTES, max_containers=2)
        messages = [m for m in field(reply, "messages", list) if type(m) is bytes]
        # Only messages that were offered and wanted count (a server cannot push others through sync).
        wanted = {ids[index] for index in want}
        messages = [m for m in messages if sync_id(m) in wanted]
        return messages, cursor, len(ids) * SYNC_ID_BYTES
    finally:
        await stream.close()


def parse_sync_request(frame: dict[str, Any]) -> tuple[str, bytes, int]:
    """(topic, epoch, after) of a ``/dlx/sync/1.0.0`` request; raises ProtocolViolation."""
    return field(frame, "topic", str), field(frame, "epoch", bytes), field(frame, "after", int, 0)


def parse_sync_response(frame: dict[str, Any]) -> tuple[list[bytes], tuple[bytes, int]]:
    """(messages, (epoch, next)) of a ``/dlx/sync/1.0.0`` response (entries that are not bytes are
    dropped); raises ProtocolViolation."""
    messages = [m for m in field(frame, "messages", list) if type(m) is bytes]
    return messages, (field(frame, "epoch", bytes), field(frame, "next", int, 0))


async def serve_recent(stream: Any, recent: RecentMessages) -> int:
    """Answer one ``/dlx/sync/1.0.0`` or ``1.1.0`` request from ``recent``; return the payload bytes sent."""
    try:
        with trio.fail_after(10):
            request = await read_frame(stream, 4096)
            topic, epoch, after = parse_sync_request(request)
            if stream.get_protocol() == SYNC_OFFER_PROTOCOL:
                last, ids, messages = recent.offer_since(topic, epoch, after, SYNC_MAX_RESPONSE_BYTES - 4096,
                                                         SYNC_MAX_OFFER_IDS)
                await write_frame(stream, sync_offer_frame(recent.epoch, last, ids))
                want = parse_sync_want(await read_frame(stream, want_frame_limit(len(ids))), len(ids))
                messages = [messages[index] for index in want]
                await write_frame(stream, sync_messages_frame(messages))
                await stream.close()
                return sum(len(m) for m in messages) + len(ids) * SYNC_ID_BYTES
            last, messages = recent.since(topic, epoch, after, SYNC_MAX_RESPONSE_BYTES - 4096)
            await write_frame(stream, sync_response_frame(recent.epoch, last, messages))
            await stream.close()
            return sum(len(m) for m in messages)
    # A bad request or a dropped peer ends this stream only, never the host's handler.
    except Exception as exc:  # noqa: BLE001 - the stream handler's boundary
        logger.debug("sync request failed: %s", exc)
        with trio.move_on_after(1):
            try:
                await stream.reset()
            except CONNECTION_ERRORS:
                pass  # already broken: nothing left to tell the peer
        return 0
