"""The run link: where a run lives, as one copy-pasteable line.

``dlx://<chain_id>/<ledger>/<run_id>?rpc=<url>&peer=<multiaddr>``: printed by
``dlx-node demo`` and the local launcher, read by ``dlx-node join``. A peer behind a NAT appears by
its relayed address, ``<relay multiaddr>/p2p-circuit/p2p/<peer id>`` (docs/P2P.md, "NAT traversal").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, urlsplit

from node.errors import ConfigError
from p2p.addrs import is_relayed_addr, parse_relayed_addr
from p2p.errors import RelayAddressError

LINK_SCHEME = "dlx"
#: Node settings (not part of the run document) a run link may carry because every member must share them.
LINK_SETTINGS = ("checkpoint_every",)


@dataclass(frozen=True)
class RunLink:
    """Where a run lives: chain id, ledger address, run id, an RPC URL and peers to bootstrap from."""

    chain_id: int
    ledger: str
    run_id: int
    rpc_url: str
    peers: tuple[str, ...] = ()
    settings: dict[str, int] = field(default_factory=dict)  # LINK_SETTINGS the run's operator stated

    def __str__(self) -> str:
        return run_link(self.chain_id, self.ledger, self.run_id, self.rpc_url, self.peers, **self.settings)


def run_link(chain_id: int, ledger: str, run_id: int, rpc_url: str, peers=(), **settings: int) -> str:
    """The copy-pasteable link of a run: ``dlx://<chain_id>/<ledger>/<run_id>?rpc=...&peer=...``.

    ``/`` and ``:`` stay readable in the query (RFC 3986 allows them there); anything else that is
    not URL-safe is percent-encoded.
    """
    query = [f"rpc={quote(rpc_url, safe=':/')}"] + [f"peer={quote(p, safe=':/')}" for p in peers]
    query += [f"{k}={int(v)}" for k, v in settings.items() if k in LINK_SETTINGS]
    return f"{LINK_SCHEME}://{chain_id}/{ledger}/{run_id}?" + "&".join(query)


def parse_run_link(text: str) -> RunLink:
    """Parse a run link; every malformed part is refused with what it should look like."""
    example = "dlx://31337/0xLEDGER/1?rpc=http://HOST:8545&peer=/ip4/HOST/tcp/PORT/p2p/12D3KooW..."
    parts = urlsplit(text.strip())
    if parts.scheme != LINK_SCHEME:
        raise ConfigError(f"run link {text!r}: must start with {LINK_SCHEME}://, e.g. {example}")
    if not parts.netloc.isdigit():
        raise ConfigError(
            f"run link {text!r}: {parts.netloc!r} is not a chain id (an integer), e.g. {example}")
    path = parts.path.strip("/").split("/")
    if len(path) != 2:
        raise ConfigError(f"run link {text!r}: expected dlx://<chain_id>/<ledger address>/<run id>?..., "
                          f"e.g. {example}")
    ledger, run = path
    check_address(ledger, f"run link {text!r}: ledger")
    if not run.isdigit():
        raise ConfigError(f"run link {text!r}: run id {run!r} is not an integer")
    try:
        query = parse_qs(parts.query, strict_parsing=bool(parts.query), keep_blank_values=False)
    except ValueError as exc:
        raise ConfigError(f"run link {text!r}: malformed query ({exc})") from None
    unknown = sorted(set(query) - {"rpc", "peer", *LINK_SETTINGS})
    if unknown:
        raise ConfigError(f"run link {text!r}: unknown parameter(s) {unknown}; known: rpc, peer, "
                          f"{', '.join(LINK_SETTINGS)}")
    rpc = query.get("rpc", [])
    if len(rpc) != 1:
        raise ConfigError(f"run link {text!r}: needs exactly one rpc=<chain JSON-RPC URL>")
    settings: dict[str, int] = {}
    for key in LINK_SETTINGS:
        values = query.get(key, [])
        if len(values) > 1 or (values and not values[0].isdigit()) or (values and int(values[0]) < 1):
            raise ConfigError(f"run link {text!r}: {key} must appear at most once, as an integer >= 1")
        if values:
            settings[key] = int(values[0])
    peers = tuple(query.get("peer", []))
    for peer in peers:
        check_multiaddr(peer)
    return RunLink(int(parts.netloc), ledger, int(run), rpc[0], peers, settings)


def check_address(value: str, what: str) -> None:
    """Refuse anything but a 0x-prefixed 20-byte hex address (``what`` names it in the error)."""
    if not (value.startswith("0x") and len(value) == 42):
        raise ConfigError(f"{what} {value!r}: must be a 0x-prefixed 20-byte hex address")
    try:
        bytes.fromhex(value[2:])
    except ValueError:
        raise ConfigError(f"{what} {value!r}: not hexadecimal") from None


def check_multiaddr(addr: str) -> None:
    """Refuse anything but a multiaddr ending in /p2p/<peer id>: a direct one, or a relayed one
    (``<relay multiaddr>/p2p-circuit/p2p/<peer id>``, a node behind a NAT; checked in full)."""
    if not addr.startswith("/") or "/p2p/" not in addr:
        raise ConfigError(f"peer {addr!r}: must be a multiaddr ending in /p2p/<peer id>, e.g. "
                          "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooW... (a node's status.json, listen_addrs)")
    if is_relayed_addr(addr):
        try:
            parse_relayed_addr(addr)
        except RelayAddressError as exc:
            raise ConfigError(
                f"peer {exc}; a relayed peer looks like "
                "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW<relay>/p2p-circuit/p2p/12D3KooW<peer>"
            ) from None


def relays_of(peers: tuple[str, ...] | list[str]) -> list[str]:
    """The relays the link's relayed peers sit behind (their direct addresses): what a joiner behind
    a NAT puts in ``p2p.relay_use`` to be reachable the same way."""
    return list(dict.fromkeys(parse_relayed_addr(p)[0] for p in peers if is_relayed_addr(p)))
