"""Relayed addresses (``<relay>/p2p-circuit/p2p/<peer>``): build, recognise, check. Pure and light.

No libp2p import here (importing py-libp2p takes seconds): the run link parser and the config use it.
"""

from __future__ import annotations

import ipaddress

import base58

from p2p.errors import RelayAddressError

CIRCUIT = "/p2p-circuit"
#: A multiaddr longer than this is refused outright (a relayed address is ~120 characters).
MAX_ADDR_CHARS = 512
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


def is_relayed_addr(addr: str) -> bool:
    """True if ``addr`` goes through a relay (``.../p2p-circuit/...``)."""
    return CIRCUIT in str(addr)


def relayed_addr(relay_addr: str, peer_id: str) -> str:
    """The address of ``peer_id`` through the relay at ``relay_addr`` (which ends in ``/p2p/<relay>``)."""
    return f"{relay_addr}{CIRCUIT}/p2p/{peer_id}"


def is_peer_id(text: str) -> bool:
    """True if ``text`` is a base58 libp2p peer id: an identity multihash of a public key (ed25519 keys)
    or a sha2-256 multihash (larger keys)."""
    try:
        raw = base58.b58decode(text)
    except ValueError:
        return False
    if base58.b58encode(raw).decode() != text:
        return False
    if len(raw) >= 2 and raw[0] == 0x00:
        return raw[1] == len(raw) - 2 and 0 < raw[1] <= 64
    return len(raw) == 34 and raw[:2] == b"\x12\x20"


def check_direct_addr(addr: str, what: str = "address") -> str:
    """Check ``/ip4|ip6|dns*/<host>/tcp/<port>/p2p/<peer id>``: its peer id, or RelayAddressError."""
    parts = addr.split("/")
    if (len(parts) != 7 or parts[0] != "" or parts[1] not in _HOST_PROTOCOLS or parts[3] != "tcp"
            or parts[5] != "p2p"):
        raise RelayAddressError(f"{what} {addr!r}: expected /ip4/<ip>/tcp/<port>/p2p/<peer id>")
    host, port, peer = parts[2], parts[4], parts[6]
    try:
        if parts[1] == "ip4":
            ipaddress.IPv4Address(host)
        elif parts[1] == "ip6":
            ipaddress.IPv6Address(host)
        elif not host or len(host) > 253:
            raise ValueError("empty or overlong host name")
    except ValueError as exc:
        raise RelayAddressError(f"{what} {addr!r}: bad host {host!r} ({exc})") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise RelayAddressError(f"{what} {addr!r}: bad TCP port {port!r}")
    if not is_peer_id(peer):
        raise RelayAddressError(f"{what} {addr!r}: {peer!r} is not a peer id")
    return peer


def parse_relayed_addr(addr: str) -> tuple[str, str, str]:
    """Check a relayed address ``/ip4/<ip>/tcp/<port>/p2p/<relay>/p2p-circuit/p2p/<peer>``.

    Returns ``(relay multiaddr, relay peer id, peer id)``. Raises :class:`RelayAddressError` naming
    what is wrong: too long, not exactly one ``/p2p-circuit``, a relay part that is not a direct
    TCP address with a peer id, a malformed peer id, or the same peer on both sides. Used on every
    relayed address a peer or a run link hands us, before anything dials it.
    """
    if not isinstance(addr, str) or len(addr) > MAX_ADDR_CHARS:
        raise RelayAddressError(f"relayed address refused: not a string of at most {MAX_ADDR_CHARS} chars")
    if addr.count(CIRCUIT) != 1:
        raise RelayAddressError(f"relayed address {addr!r}: must contain /p2p-circuit exactly once")
    relay_part, _, tail = addr.partition(CIRCUIT)
    if not tail.startswith("/p2p/") or tail.count("/") != 2:
        raise RelayAddressError(f"relayed address {addr!r}: must end in /p2p-circuit/p2p/<peer id>")
    relay = check_direct_addr(relay_part, "relayed address: relay part of")
    peer = tail[len("/p2p/"):]
    if not is_peer_id(peer):
        raise RelayAddressError(f"relayed address {addr!r}: {peer!r} is not a peer id")
    if relay == peer:
        raise RelayAddressError(f"relayed address {addr!r}: relay and peer are the same")
    return relay_part, relay, peer
