"""NAT traversal: circuit relay v2, hole punching (DCUtR) and AutoNAT, from py-libp2p 0.8.1.

A node behind a home router or a cloud NAT cannot be dialled. It reserves a slot on a relay
(``p2p.relay_use``), a public node that runs the relay's hop side (``p2p.relay_serve``), and
advertises ``<relay>/p2p-circuit/p2p/<itself>``: peers dial that address, the relay splices the two
streams, and Noise + yamux run end to end over the splice (the relay sees ciphertext only). Once a
relayed connection is up, DCUtR (libp2p's "Direct Connection Upgrade through Relay") exchanges the
two sides' observed addresses over it and both dial at once from their listen ports (TCP
simultaneous open): where both NATs keep a mapping's port, that punches a direct connection, and the
relayed one is closed. AutoNAT asks peers to dial this node back to learn whether it is reachable.

py-libp2p's relay server counts reservations against one global cap and lets a RESERVE name any
peer id, so one peer with a few keys could hold every slot for an hour; :class:`GuardedRelay` refuses
a reservation for another peer, caps reservations per source IP and rate-limits the HOP streams of
each peer. See docs/P2P.md, "NAT traversal".
"""

from __future__ import annotations

import logging
import time
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.autonat import AutoNATService, AutoNATStatus
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from p2p.addrs import CIRCUIT, is_relayed_addr, parse_relayed_addr, relayed_addr
from p2p.config import P2PConfig
from p2p.errors import DialError, RelayAddressError
from p2p.ratelimit import Allowance
from p2p.streams import CONNECTION_ERRORS

logger = logging.getLogger(__name__)

#: Seconds between checks that every ``relay_use`` relay still holds our reservation.
RESERVATION_CHECK_S = 10.0
#: Seconds a relay (its dial and RESERVE) may take at start before the host reports ready anyway.
STARTUP_RESERVATION_S = 8.0
#: Seconds between AutoNAT dial-back requests to connected peers.
AUTONAT_EVERY_S = 60.0

#: Paths of a connection (``P2PHost.connection_paths``): direct from the start, through a relay, or
#: direct after a relayed connection to the same peer (hole punched by DCUtR).
DIRECT = "direct"
RELAYED = "relayed"
HOLE_PUNCHED = "hole_punched"


# ---------------------------------------------------------------------------- addresses


Addrs = list[multiaddr.Multiaddr]


def split_addrs(addrs: Addrs) -> tuple[Addrs, Addrs]:
    """(direct, relayed) addresses of a peer."""
    direct = [a for a in addrs if not is_relayed_addr(str(a))]
    return direct, [a for a in addrs if is_relayed_addr(str(a))]


def connection_is_relayed(conn: Any) -> bool:
    """True if a swarm connection runs through a relay (its transport address has /p2p-circuit)."""
    try:
        return any(is_relayed_addr(str(a)) for a in conn.get_transport_addresses())
    except (BaseLibp2pError, OSError, AttributeError):  # a connection closing under us
        return False


# ---------------------------------------------------------------------------- relay (hop side)


class GuardedRelay(CircuitV2Protocol):
    """py-libp2p's circuit relay v2 with the limits its server lacks (see the module docstring).

    Every node runs one: the STOP side (accepting a relayed connection addressed to this node) is
    always on; the HOP side (relaying for others) only with ``p2p.relay_serve``.
    """

    def __init__(self, host: IHost, config: P2PConfig) -> None:
        limits = RelayLimits(
            duration=config.relay_max_circuit_seconds,
            data=config.relay_max_circuit_bytes,
            max_circuit_conns=config.relay_max_circuits_per_peer,
            max_reservations=config.relay_max_reservations,
            reservation_ttl=config.relay_reservation_ttl,
        )
        super().__init__(host, limits=limits, allow_hop=config.relay_serve)
        self.config = config
        self._hop_buckets: dict[ID, Allowance] = {}
        self._hop_buckets_seen: dict[ID, float] = {}
        self._reserved_ip: dict[ID, str] = {}
        self.refused: dict[str, int] = {}  # reason -> count, for tests and status
        self.relayed_peers: set[ID] = set()  # peers that reached this node through a relay

    def _refuse(self, reason: str, peer: ID, detail: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self.refused[reason] & (self.refused[reason] - 1) == 0:  # log the 1st, 2nd, 4th, 8th...
            logger.warning("relay refused %s from %s: %s (%d so far)", reason, peer, detail,
                           self.refused[reason])

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        if self.allow_hop:
            # Registered after the base class's own handler, so ours (rate limit first) wins.
            async def install() -> None:
                await self.event_started.wait()
                self.host.set_stream_handler(HOP_PROTOCOL_ID, self.handle_hop_stream)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(install)
                await super().run(task_status=task_status)
        else:
            await super().run(task_status=task_status)

    def _allow(self, peer: ID) -> bool:
        """May ``peer`` open one more HOP stream or make one more request (``relay_hop_per_minute``)?"""
        bucket = self._hop_buckets.get(peer)
        if bucket is None:
            if len(self._hop_buckets) > 4096:  # forget the longest idle half of a flood of peer ids
                for old in sorted(self._hop_buckets_seen, key=self._hop_buckets_seen.get)[:2048]:
                    self._hop_buckets.pop(old, None)
                    self._hop_buckets_seen.pop(old, None)
            per_minute = self.config.relay_hop_per_minute
            bucket = self._hop_buckets[peer] = Allowance(per_minute / 60.0, burst=per_minute)
        self._hop_buckets_seen[peer] = time.monotonic()
        if bucket.take():
            return True
        self._refuse("hop_rate", peer, f"more than {self.config.relay_hop_per_minute:g} HOP streams and "
                                       "requests a minute")
        return False

    async def handle_hop_stream(self, stream: INetStream) -> None:
        """A HOP stream: refused unread beyond the peer's allowance, otherwise handled by py-libp2p
        (which reads requests on it until it closes: each request is counted again, below)."""
        if not self._allow(stream.muxed_conn.peer_id):
            await self._deny(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        await self._handle_hop_stream(stream)

    async def _handle_connect(self, stream: INetStream, msg: HopMessage) -> None:
        if not self._allow(stream.muxed_conn.peer_id):
            await self._deny(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        await super()._handle_connect(stream, msg)

    async def _deny(self, stream: INetStream, code: StatusCode) -> None:
        with trio.move_on_after(2):
            try:
                await self._send_status(stream, code, "refused")
            except CONNECTION_ERRORS:
                pass  # the peer is gone: nothing to tell it
        try:
            await stream.reset()
        except CONNECTION_ERRORS:
            pass  # already broken

    async def handle_incoming_connection(self, stream: INetStream, remote_peer_id: bytes) -> None:
        """A relayed connection to this node (STOP side): noted, then upgraded by py-libp2p."""
        await super().handle_incoming_connection(stream, remote_peer_id)
        if len(self.relayed_peers) < 65536:
            self.relayed_peers.add(ID(remote_peer_id))

    async def _handle_reserve(self, stream: INetStream, msg: HopMessage) -> None:
        peer = stream.muxed_conn.peer_id
        if not self._allow(peer):
            await self._deny(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED)
            return
        if msg.HasField("peer") and msg.peer.id and msg.peer.id != peer.to_bytes():
            self._refuse("reserve_for_other", peer, "a RESERVE naming another peer id")
            await self._send_status(stream, StatusCode.PERMISSION_DENIED, "reserve only for yourself")
            return
        ip = _remote_ip(stream)
        if not self.resource_manager.has_reservation(peer):
            self._reserved_ip = {p: i for p, i in self._reserved_ip.items()
                                 if self.resource_manager.get_reservation(p) is not None}
            same_ip = sum(1 for i in self._reserved_ip.values() if i == ip)
            if ip is not None and same_ip >= self.config.relay_reservations_per_ip:
                self._refuse("reserve_per_ip", peer, f"{same_ip} reservations already held from {ip}")
                await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, "too many from this IP")
                return
        await super()._handle_reserve(stream, msg)
        if self.resource_manager.get_reservation(peer) is not None and ip is not None:
            self._reserved_ip[peer] = ip


def _remote_ip(stream: INetStream) -> str | None:
    try:
        remote = stream.get_remote_address()
    except (BaseLibp2pError, OSError, AttributeError):  # a stream closing under us, or without a socket
        return None
    return remote[0] if remote else None


# ---------------------------------------------------------------------------- the node's side


class NatTraversal:
    """The NAT side of :class:`p2p.host.P2PHost`, run on its trio loop.

    Owns the relay protocol (:class:`GuardedRelay`), the circuit transport (dialling
    ``/p2p-circuit`` addresses, which py-libp2p's swarm skips), reservations on the
    ``relay_use`` relays, DCUtR and AutoNAT.
    """

    def __init__(self, host: IHost, config: P2PConfig) -> None:
        self._host = host
        self._config = config
        self.relay = GuardedRelay(host, config)
        # STOP only: dialling through a relay must not take a reservation on it as py-libp2p's
        # CLIENT role does; reservations are made explicitly, on the relay_use relays only.
        self._transport = CircuitV2Transport(host, self.relay, RelayConfig(roles=RelayRole.STOP))
        self._dcutr = DCUtRProtocol(host) if config.hole_punch else None
        self._autonat = (AutoNATService(host, serve=config.autonat, confirmations=1)
                         if config.autonat else None)
        self._relays = [info_from_p2p_addr(multiaddr.Multiaddr(a)) for a in config.relay_use]
        self._relay_addrs = {info.peer_id: addr for info, addr in zip(self._relays, config.relay_use)}
        self._reserved: dict[ID, float] = {}  # relay -> when we last reserved there
        self._relayed_addrs: list[str] = []
        self._nursery: trio.Nursery | None = None
        # Peers ever connected through a relay (either way): a later direct connection was punched.
        self._was_relayed = self.relay.relayed_peers

    async def run(self, ready: trio.Event) -> None:
        """Run the relay and DCUtR services and keep reservations fresh; sets ``ready`` once the first
        reservations were tried (bounded by :data:`STARTUP_RESERVATION_S`)."""
        async with background_trio_service(self.relay):
            await self.relay.event_started.wait()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._dcutr is not None:
                    await nursery.start(self._run_dcutr)
                with trio.move_on_after(STARTUP_RESERVATION_S):
                    await self.reserve_all()
                ready.set()
                nursery.start_soon(self._keep_reservations)
                if self._autonat is not None:
                    nursery.start_soon(self._autonat_loop)

    async def _run_dcutr(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        assert self._dcutr is not None
        async with background_trio_service(self._dcutr):
            await self._dcutr.event_started.wait()
            task_status.started()
            await trio.sleep_forever()

    # ------------------------------------------------------------------ reservations

    @property
    def relayed_addrs(self) -> list[str]:
        """This node's addresses through the relays that hold a reservation for it."""
        return list(self._relayed_addrs)

    async def reserve_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for info in self._relays:
                nursery.start_soon(self._reserve, info)

    async def _reserve(self, info: PeerInfo) -> None:
        me = self._host.get_id().to_base58()
        try:
            with trio.fail_after(10):
                await self._host.connect(info)
                stream = await self._host.new_stream(info.peer_id, [HOP_PROTOCOL_ID])
                assert self._nursery is not None
                try:
                    ok = await self._transport.reserve(stream, info.peer_id, self._nursery)
                finally:
                    await stream.close()
        # Unreachable relay, refused protocol: retried by _keep_reservations, whose loop must go on.
        except Exception as exc:  # noqa: BLE001 - the reservation loop's boundary
            ok = False
            logger.info("relay %s: no reservation yet (%s: %s)", info.peer_id, type(exc).__name__, exc)
        addr = relayed_addr(self._relay_addrs[info.peer_id], me)
        if ok:
            if info.peer_id not in self._reserved:
                logger.info("reserved a slot on relay %s: reachable at %s", info.peer_id, addr)
            self._reserved[info.peer_id] = time.monotonic()
            if addr not in self._relayed_addrs:
                self._relayed_addrs = self._relayed_addrs + [addr]
        else:
            self._reserved.pop(info.peer_id, None)
            self._relayed_addrs = [a for a in self._relayed_addrs if a != addr]

    async def _keep_reservations(self) -> None:
        """Re-reserve where the connection to a relay dropped (a relay forgets the reservation of a
        peer it is no longer connected to) and well before the reservation's TTL runs out."""
        network = self._host.get_network()
        while True:
            await trio.sleep(RESERVATION_CHECK_S)
            renew_after = max(RESERVATION_CHECK_S, self._config.relay_reservation_ttl / 2)
            for info in self._relays:
                stale = time.monotonic() - self._reserved.get(info.peer_id, -1e9) > renew_after
                if stale or info.peer_id not in network.connections:
                    await self._reserve(info)

    # ------------------------------------------------------------------ dialling

    async def dial_relayed(self, peer: ID, addrs: list[multiaddr.Multiaddr]) -> None:
        """Connect to ``peer`` through a relay: its relayed addresses first, then each of our relays
        (a peer that reserved on the run's relay is reachable through it without saying so).
        Raises DialError with every failure."""
        target = peer.to_base58()
        # A peerstore keeps a relayed address without its final /p2p/<peer>: put it back.
        candidates = [str(a) + (f"/p2p/{target}" if str(a).endswith(CIRCUIT) else "")
                      for a in addrs if is_relayed_addr(str(a))]
        candidates += [relayed_addr(self._relay_addrs[info.peer_id], target)
                       for info in self._relays if info.peer_id != peer]
        errors = []
        for addr in dict.fromkeys(candidates):
            try:
                if parse_relayed_addr(addr)[2] != target:
                    raise RelayAddressError(f"relayed address {addr!r} is not {target}'s")
                with trio.fail_after(15):
                    await self._transport.dial(multiaddr.Multiaddr(addr))
                self._was_relayed.add(peer)
                return
            except trio.TooSlowError:
                errors.append(f"{addr}: timed out")
            except (*CONNECTION_ERRORS, ValueError) as exc:  # RelayAddressError, a refused CONNECT
                errors.append(f"{addr}: {type(exc).__name__}: {exc}")
        if not candidates:
            raise DialError(f"no relay to reach {peer} through (set p2p.relay_use)")
        raise DialError(f"cannot reach {peer} through a relay: " + "; ".join(errors))

    def can_relay(self) -> bool:
        return bool(self._relays)

    # ------------------------------------------------------------------ introspection

    def connection_paths(self) -> dict[str, str]:
        """Each connected peer: :data:`RELAYED` if all its connections go through a relay, else
        :data:`HOLE_PUNCHED` if it was reached through a relay before, else :data:`DIRECT`."""
        paths = {}
        for peer, conns in list(self._host.get_network().connections.items()):
            conns = conns if isinstance(conns, list) else [conns]
            if not conns:
                continue
            if all(connection_is_relayed(c) for c in conns):
                self._was_relayed.add(peer)
                paths[peer.to_base58()] = RELAYED
            else:
                paths[peer.to_base58()] = HOLE_PUNCHED if peer in self._was_relayed else DIRECT
        return paths

    def reachability(self) -> str:
        """``"public"``, ``"private"`` (AutoNAT: peers could not dial us back) or ``"unknown"``."""
        if self._autonat is None:
            return "unknown"
        return {AutoNATStatus.PUBLIC: "public", AutoNATStatus.PRIVATE: "private"}.get(
            self._autonat.get_status(), "unknown")

    async def _autonat_loop(self) -> None:
        """Ask directly connected peers to dial this node back; one verdict is enough here (a run has
        few peers; the spec's four would leave most small runs 'unknown')."""
        assert self._autonat is not None
        while True:
            await trio.sleep(2.0)
            network = self._host.get_network()
            servers = [ID.from_base58(p) for p, path in self.connection_paths().items() if path != RELAYED]
            servers = [s for s in servers if s in network.connections][:4]
            if servers:
                with trio.move_on_after(30):
                    await self._autonat.check_reachability(servers)
                await trio.sleep(AUTONAT_EVERY_S)
