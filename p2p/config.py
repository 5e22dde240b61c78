"""Configuration of the libp2p host (no libp2p import here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2p.addrs import check_direct_addr
from p2p.errors import P2PConfigError, RelayAddressError


@dataclass
class P2PConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: an ephemeral port
    key_file: str = "identity.key"  # relative paths resolve against the node's data_dir
    bootstrap: list[str] = field(default_factory=list)  # multiaddrs with /p2p/<peer id>
    mdns: bool = False
    mdns_interface: str = "lo"
    gossip_heartbeat: float = 1.0
    max_blob_bytes: int = 2 << 30
    blob_concurrency: int = 4
    transfer_timeout: float = 300.0
    rate_limit_bps: float = 0.0  # 0: no cap; else bytes/s per peer for blob traffic
    rate_limit_burst: float = 0.0  # bucket size in bytes; 0: max(10 ms of the rate, 2 MiB) (p2p.ratelimit)
    blob_dir: str = "blobs"  # relative paths resolve against the node's data_dir
    blob_stall_timeout: float = 15.0  # a blob stream idle this long is abandoned (resumed elsewhere)
    # A range of n bytes must arrive within blob_stall_timeout + n / this (bytes/s), else it is given to
    # another provider: a peer that trickles bytes forever cannot hold a download. 0 = no such floor.
    blob_min_rate: float = 65536.0
    # Write downloads without the page cache (O_DIRECT, p2p.staging): less CPU in the download,
    # but the blob's first read then comes from the disk; measured no cheaper in all (docs/P2P.md).
    blob_direct_io: bool = False
    gossip_max_message_bytes: int = 1_000_000  # larger messages are refused: send them as blobs
    gossip_max_msgs_per_sec: float = 200.0  # per peer and topic; gossipsub drops the excess
    gossip_resync_interval: float = 5.0  # pull recent messages from peers (/dlx/sync); 0 = only on request
    sync_cache_messages: int = 512  # recent messages kept per topic for /dlx/sync
    sync_cache_bytes: int = 8 << 20  # and at most this many bytes per topic
    discovery_interval: float = 30.0  # max seconds between DHT lookups for new peers
    # Other peers' DHT provider records are kept this long (p2p.provider_records), this host's own while it
    # serves the blob; py-libp2p alone keeps every record 48 h, a long run's memory growing by every blob.
    provider_record_ttl: float = 600.0
    max_peers: int = 64  # stop dialling discovered peers beyond this many connections
    # A peer whose host is gone is forgotten (p2p.dialbook): after this many failed dials in a row,
    # or after this many seconds without a connection while its addresses stay known.
    forget_after_failures: int = 3
    forget_after_s: float = 180.0
    # False: a client-only host (``dlx-node join``'s fetch, pull): it listens nowhere, so no peer
    # learns an address of it to dial back once it is gone.
    listen: bool = True
    # NAT traversal (p2p.nat, docs/P2P.md "NAT traversal").
    relay_serve: bool = False  # relay for others (circuit relay v2 hop): a node with a public address
    relay_use: list[str] = field(default_factory=list)  # relays to reserve a slot on: /ip4/.../p2p/<relay>
    relay_max_reservations: int = 64  # relay_serve: peers that may hold a slot at once
    relay_reservations_per_ip: int = 8  # relay_serve: slots held from one source IP
    relay_reservation_ttl: int = 3600  # relay_serve: seconds a slot lasts unless renewed
    relay_max_circuits_per_peer: int = 16  # relay_serve: relayed connections to one reserved peer at once
    relay_max_circuit_bytes: int = 4 << 30  # relay_serve: bytes one relayed connection may carry (both ways)
    relay_max_circuit_seconds: int = 0  # relay_serve: a relayed connection's lifetime; 0 = unlimited
    relay_hop_per_minute: float = 60.0  # relay_serve: HOP streams + requests a peer may make a minute
    hole_punch: bool = True  # DCUtR: upgrade a relayed connection to a direct one (TCP simultaneous open)
    autonat: bool = True  # answer AutoNAT dial-back requests and ask peers whether we are reachable

    def range_min_rate(self) -> float:
        """The floor a provider's range is held to (bytes/s; 0 = none): ``blob_min_rate``, but never above
        this host's own cap shared by its fetch streams (``rate_limit_bps / blob_concurrency``)."""
        if self.rate_limit_bps > 0 and self.blob_min_rate > 0:
            return min(self.blob_min_rate, self.rate_limit_bps / self.blob_concurrency)
        return self.blob_min_rate

    def __post_init__(self) -> None:
        if not 0 <= self.listen_port <= 65535:
            raise P2PConfigError(f"p2p.listen_port={self.listen_port}: must be in [0, 65535]")
        for addr in self.bootstrap:
            if not addr.startswith("/") or "/p2p/" not in addr:
                raise P2PConfigError(
                    f"p2p.bootstrap entry {addr!r}: must be a multiaddr ending in /p2p/<peer id>, "
                    "e.g. /ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."
                )
        if self.gossip_heartbeat <= 0:
            raise P2PConfigError(f"p2p.gossip_heartbeat={self.gossip_heartbeat}: must be > 0 seconds")
        if self.max_blob_bytes < 1:
            raise P2PConfigError(f"p2p.max_blob_bytes={self.max_blob_bytes}: must be >= 1")
        if self.blob_concurrency < 1:
            raise P2PConfigError(f"p2p.blob_concurrency={self.blob_concurrency}: must be >= 1")
        if self.transfer_timeout <= 0:
            raise P2PConfigError(f"p2p.transfer_timeout={self.transfer_timeout}: must be > 0 seconds")
        if self.blob_stall_timeout <= 0:
            raise P2PConfigError(f"p2p.blob_stall_timeout={self.blob_stall_timeout}: must be > 0 seconds")
        if not 1 <= self.gossip_max_message_bytes <= (1 << 20) - (16 << 10):
            raise P2PConfigError(
                f"p2p.gossip_max_message_bytes={self.gossip_max_message_bytes}: must be in [1, 1032192] "
                "(py-libp2p drops gossip RPCs over 1 MiB); send larger payloads as blobs"
            )
        if self.gossip_max_msgs_per_sec <= 0:
            raise P2PConfigError(f"p2p.gossip_max_msgs_per_sec={self.gossip_max_msgs_per_sec}: must be > 0")
        if self.gossip_resync_interval < 0:
            raise P2PConfigError(
                f"p2p.gossip_resync_interval={self.gossip_resync_interval}: must be >= 0 (0 = off)"
            )
        if self.sync_cache_messages < 1 or self.sync_cache_bytes < 1:
            raise P2PConfigError("p2p.sync_cache_messages and p2p.sync_cache_bytes: must be >= 1")
        if self.discovery_interval <= 0:
            raise P2PConfigError(f"p2p.discovery_interval={self.discovery_interval}: must be > 0 seconds")
        if self.provider_record_ttl <= 0:
            raise P2PConfigError(f"p2p.provider_record_ttl={self.provider_record_ttl}: must be > 0 seconds")
        if self.max_peers < 1:
            raise P2PConfigError(f"p2p.max_peers={self.max_peers}: must be >= 1")
        if self.forget_after_failures < 1:
            raise P2PConfigError(f"p2p.forget_after_failures={self.forget_after_failures}: must be >= 1")
        if self.forget_after_s <= 0:
            raise P2PConfigError(f"p2p.forget_after_s={self.forget_after_s}: must be > 0 seconds")
        for addr in self.relay_use:
            try:
                check_direct_addr(addr, "p2p.relay_use entry")
            except RelayAddressError as exc:
                raise P2PConfigError(
                    f"{exc}: a relay's own address, e.g. /ip4/203.0.113.7/tcp/4001/p2p/12D3KooW..."
                ) from None
        for name in ("relay_max_reservations", "relay_reservations_per_ip", "relay_reservation_ttl",
                     "relay_max_circuits_per_peer", "relay_max_circuit_bytes"):
            if getattr(self, name) < 1:
                raise P2PConfigError(f"p2p.{name}={getattr(self, name)}: must be >= 1")
        if self.relay_max_circuit_seconds < 0:
            raise P2PConfigError(
                f"p2p.relay_max_circuit_seconds={self.relay_max_circuit_seconds}: "
                "must be >= 0 (0 = unlimited)"
            )
        if self.relay_hop_per_minute < 1:
            raise P2PConfigError(f"p2p.relay_hop_per_minute={self.relay_hop_per_minute}: must be >= 1")
        if self.rate_limit_bps < 0:
            raise P2PConfigError(f"p2p.rate_limit_bps={self.rate_limit_bps}: must be >= 0 (0 = no cap)")
        if self.blob_min_rate < 0:
            raise P2PConfigError(
                f"p2p.blob_min_rate={self.blob_min_rate}: must be >= 0 bytes/s (0 = no floor)"
            )
        if self.rate_limit_burst < 0:
            raise P2PConfigError(
                f"p2p.rate_limit_burst={self.rate_limit_burst}: must be >= 0 (0 = the default)"
            )
