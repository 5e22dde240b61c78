"""Construction of the py-libp2p host: TCP + Noise + yamux, nothing else.

``libp2p.new_host`` by default also offers TLS, secio and ``/plaintext/2.0.0``
security and mplex muxing, and may add QUIC; all of that is switched off here by
passing explicit ``sec_opt``, ``muxer_opt`` and ``transports``. Measured on
py-libp2p 0.8.1: yamux moves ~8x more than mplex, QUIC ~3 MB/s and once
truncated a transfer silently.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import threading
from typing import Any

from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from p2p.errors import P2PError
from p2p.identity import Identity

logger = logging.getLogger(__name__)

#: The only security protocol offered or accepted.
SECURITY_PROTOCOLS = (str(NOISE_PROTOCOL_ID),)
#: The only stream muxer offered or accepted.
MUXER_PROTOCOLS = (str(YAMUX_PROTOCOL_ID),)


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
    )


def interface_ipv4(interface: str) -> str:
    """IPv4 address of a network interface name (``lo``, ``eth0``) or an IPv4 literal."""
    try:
        return str(ipaddress.IPv4Address(interface))
    except ValueError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))  # SIOCGIFADDR
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
