"""Construction of the py-libp2p host: TCP + Noise + yamux, nothing else.

``libp2p.new_host`` by default also offers TLS, secio and ``/plaintext/2.0.0``
security and mplex muxing, and may add QUIC; all of that is switched off here by
passing explicit ``sec_opt``, ``muxer_opt`` and ``transports``. Measured on
py-libp2p 0.8.1: yamux moves ~8x more than mplex, QUIC ~3 MB/s and once
truncated a transfer silently. Importing this module applies :mod:`p2p.fastpath`
(py-libp2p's TCP/Noise/yamux hot path, same bytes on the wire).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.io.trio import TrioTCPStream
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

# isort: off  (each of these patches py-libp2p on import: kept in the order they always applied)
from p2p import (
    fastpath,  # noqa: F401  (patches py-libp2p's data path on import)
    inbound,  # noqa: F401  (inbound connection handlers end with their connection)
    pubsub_fastpath,  # noqa: F401  (per-RPC signed peer records, checked once per bytes)
)

# isort: on
from p2p.errors import P2PError
from p2p.identity import Identity
from p2p.streams import CONNECTION_ERRORS

logger = logging.getLogger(__name__)

#: The only security protocol offered or accepted.
SECURITY_PROTOCOLS = (str(NOISE_PROTOCOL_ID),)
#: The only stream muxer offered or accepted.
MUXER_PROTOCOLS = (str(YAMUX_PROTOCOL_ID),)


# TCP streams per trio thread (one host per thread), so a host can close what py-libp2p forgot.
_TCP_STREAMS: dict[int, weakref.WeakSet[TrioTCPStream]] = {}
_TCP_STREAMS_LOCK = threading.Lock()


def _track_tcp_streams() -> None:
    """Record every TCP stream py-libp2p wraps, per thread.

    Under load, py-libp2p 0.8.1 sometimes drops a connection (seen after
    simultaneous dials and during shutdown) without closing its socket, which
    then lingers in CLOSE_WAIT after ``host.close()``.
    """
    original_init = TrioTCPStream.__init__
    if getattr(original_init, "_dlx_tracked", False):
        return

    def init(self: TrioTCPStream, stream: Any) -> None:
        original_init(self, stream)
        with _TCP_STREAMS_LOCK:
            _TCP_STREAMS.setdefault(threading.get_ident(), weakref.WeakSet()).add(self)

    init._dlx_tracked = True  # type: ignore[attr-defined]
    TrioTCPStream.__init__ = init  # type: ignore[method-assign]


_track_tcp_streams()


async def close_leftover_tcp_streams() -> int:
    """Close TCP sockets of this thread's host that are still open; call after the host closed."""
    with _TCP_STREAMS_LOCK:
        streams = list(_TCP_STREAMS.pop(threading.get_ident(), ()))
    closed = 0
    for stream in streams:
        if stream.stream.socket.fileno() == -1:
            continue
        closed += 1
        with trio.move_on_after(1):
            try:
                await stream.close()
            except CONNECTION_ERRORS:
                pass  # already broken: the socket is released either way
    if closed:
        logger.debug("closed %d TCP sockets py-libp2p left open", closed)
    return closed


#: Seconds a stream's protocol negotiation (multistream-select, both directions) may take.
#: py-libp2p's default is 10 s; a process starved of CPU (16 nodes on 2 cores: ~12% of a core
#: each) answered later than that, the stream failed, and the retry cost more than the wait.
#: Every protocol on top bounds its own transfer, so a slow peer only makes a round slower.
STREAM_NEGOTIATION_TIMEOUT_S = 30.0


#: py-libp2p's auto-connector dials peers of the peerstore it is not connected to whenever the connection
#: count is under its target (the midpoint of the watermarks, 200 by default), and polls every 10 s while
#: under ``min_connections`` (50): a node of a run with a handful of peers was always under both, so it
#: re-dialled every known unconnected peer (a member gone, made-up peers from DHT answers) every 10 s on
#: top of the host's own discovery, which dials with backoff and forgets peers that are gone
#: (p2p.dialbook). No floor here (never the 10 s poll) and a slow poll: discovery does the dialling.
AUTO_CONNECT_MIN_CONNECTIONS = 0
AUTO_CONNECT_INTERVAL_S = 300.0


def build_libp2p_host(identity: Identity) -> IHost:
    """A py-libp2p ``BasicHost`` keyed by ``identity``, speaking TCP + Noise + yamux only."""
    key_pair = create_new_key_pair(identity.seed)
    noise = NoiseTransport(key_pair, noise_privkey=create_new_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        transports=[TCP()],
        enable_mDNS=False,  # started by the host itself, bound to one interface (start_mdns)
        connection_config=ConnectionConfig(
            min_connections=AUTO_CONNECT_MIN_CONNECTIONS,
            auto_connect_interval=AUTO_CONNECT_INTERVAL_S,
            outbound_stream_protocol_negotiation_timeout=STREAM_NEGOTIATION_TIMEOUT_S,
            inbound_stream_protocol_negotiation_timeout=STREAM_NEGOTIATION_TIMEOUT_S,
        ),
    )


def spare_on_eviction(peerstore: Any, spared: Callable[[], Iterable[Any]]) -> None:
    """Never let ``peerstore`` evict the peers ``spared()`` names (connected and bootstrap peers).

    py-libp2p's peerstore holds ``max_peers`` (1000) peers; past that, each new one evicts the
    oldest peer that has addresses. A peer advertising a flood of made-up peers (a DHT answer
    carries 20, each lookup brings more) thus evicted a node's bootstrap peer and connected
    members, keys and addresses with them; discovery then looked one of them up and the host
    stopped (``tests/test_p2p_forget.py``). Here the same rule picks among the other peers only:
    those without addresses (forgotten ones, p2p.dialbook) first, then expired, then the oldest.
    """

    def enforce() -> None:
        excess = len(peerstore.peer_data_map) - peerstore.max_peers
        if excess <= 0:
            return
        keep = set(spared())

        def priority(item: tuple[Any, Any]) -> tuple[bool, bool]:
            return (not item[1].get_addrs(), item[1].is_expired())

        others = [item for item in peerstore.peer_data_map.items() if item[0] not in keep]
        for peer, _ in sorted(others, key=priority, reverse=True)[:excess]:  # (stable: oldest first)
            peerstore.peer_record_map.pop(peer, None)
            del peerstore.peer_data_map[peer]

    peerstore._enforce_peer_limit = enforce


def interface_ipv4(interface: str) -> str:
    """IPv4 address of a network interface name (``lo``, ``eth0``) or an IPv4 literal."""
    try:
        return str(ipaddress.IPv4Address(interface))
    except ValueError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15])
            )  # SIOCGIFADDR
        except OSError as exc:
            raise P2PError(f"p2p.mdns_interface={interface!r}: no IPv4 address ({exc})") from None
    return socket.inet_ntoa(packed[20:24])


_MDNS_PATCH_LOCK = threading.Lock()


def start_mdns(host: IHost, interface: str) -> Any:
    """Start py-libp2p's mDNS discovery bound to one interface; blocking (~2 s): run it off the loop.

    py-libp2p's ``MDNSDiscovery`` creates ``Zeroconf()`` on every interface; its
    module-level ``Zeroconf`` name is swapped for the duration of construction so
    it binds ``interface`` only. The caller dials what the listener records.
    """
    from libp2p.discovery.mdns import mdns as mdns_module
    from zeroconf import Zeroconf

    address = interface_ipv4(interface)
    with _MDNS_PATCH_LOCK:
        original = mdns_module.Zeroconf
        mdns_module.Zeroconf = lambda: Zeroconf(interfaces=[address])  # type: ignore[assignment,misc]
        try:
            discovery = mdns_module.create_mdns_discovery(host.get_network(), host=host)
        finally:
            mdns_module.Zeroconf = original  # type: ignore[misc]
    discovery.broadcaster.register()
    logger.info("mDNS discovery on %s (%s)", interface, address)
    return discovery


class _DropCleanDhtEof(logging.Filter):
    """py-libp2p 0.8.1 logs a WARNING with an empty message each time a peer closes a
    DHT stream normally (EOF surfaces as an exception without text); drop just those."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "Failed to read DHT message from stream: %s" and record.args:
            return str(record.args[0]) != ""
        return True


logging.getLogger("libp2p.kad_dht.kad_dht").addFilter(_DropCleanDhtEof())
