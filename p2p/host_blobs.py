"""The blob side of :class:`p2p.host.P2PHost`: store, announce, find and fetch content-addressed blobs.

Blobs are files named by their sha256. They are stored in the host's :class:`p2p.blobstore.BlobStore`,
announced as provider records on the Kademlia DHT (key: the sha2-256 multihash, as IPFS uses), and
downloaded in parallel ranges from every provider over ``/dlx/blob/1.0.0`` (:mod:`p2p.blob_client`),
which verifies the hash before anything is kept.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from p2p.blobstore import check_sha256_hex
from p2p.errors import BlobError, BlobNotFound, BlobTooLarge, P2PError
from p2p.provider_records import record_count, trim_provider_records
from p2p.wire import ProtocolViolation

logger = logging.getLogger(__name__)

_PROVIDER_QUERY_FANOUT = 32  # connected peers asked directly for a blob's providers


class HostBlobs:
    """Mixin of :class:`p2p.host.P2PHost`: the blob methods.

    Expects of the host: ``config``, ``store`` (:class:`p2p.blobstore.BlobStore`), ``_call`` and
    ``_check_open`` (:class:`p2p.host_thread.HostThread`), ``_closed``, ``_token``, ``_libp2p``, ``_dht`` and
    ``_blobs`` (:class:`p2p.blob_client.BlobFetcher`).
    """

    def provide_blob(
        self, source: bytes | str | os.PathLike[str], announce: bool = True, timeout: float = 30.0,
        link: bool = False,
    ) -> str:
        """Store ``source`` (bytes or a file path) in the blob dir and announce it on the DHT.

        Returns the sha256 hex. Hashing and copying happen on the calling thread,
        never on the event loop. The blob is served as soon as it is stored, even
        if the DHT announcement times out (that raises P2PTimeout after storing).
        ``link``: a file path is hard-linked, not copied (:meth:`p2p.blobstore.BlobStore.put_file`).
        """
        self._check_open()
        if isinstance(source, (bytes, bytearray, memoryview)):
            sha256_hex = self.store.put_bytes(bytes(source))
        else:
            sha256_hex = self.store.put_file(source, link=link)
        if announce:
            self._call(self._announce, sha256_hex, timeout=timeout, what=f"announce blob {sha256_hex[:16]}")
        return sha256_hex

    def provide_packed(self, path: str | os.PathLike[str], cuts: list[tuple[int, int]],
                       compress: bool = False) -> str:
        """Store the file at ``path`` as a packed blob (its ``cuts`` shared by content with other packed
        blobs, the rest compressed where ``compress`` and it pays: :meth:`p2p.blobstore.BlobStore.put_packed`)
        and serve it; not announced on the DHT. The file is left where it is. Returns the sha256 hex."""
        self._check_open()
        return self.store.put_packed(path, cuts, compress)

    def provide_packed_parts(self, parts) -> str:
        """Store the blob whose bytes ``parts`` gives in order (``(bytes, shared)``: :meth:`p2p.blobstore.
        BlobStore.put_packed_parts`) as a packed blob, never written whole, and serve it; not announced on the
        DHT. Returns the sha256 hex."""
        self._check_open()
        return self.store.put_packed_parts(parts)

    def provide_file(self, path: str | os.PathLike[str], sha256_hex: str) -> str:
        """Serve the file at ``path``, verified by the caller to hash to ``sha256_hex``, from where it is (no
        copy: :meth:`p2p.blobstore.BlobStore.serve_file`); not announced on the DHT. Returns the sha256."""
        self._check_open()
        self.store.serve_file(sha256_hex, path)
        return sha256_hex

    def provide_alias(self, key_hex: str, sha256_hex: str, announce: bool = False, timeout: float = 30.0
                      ) -> None:
        """Serve the stored blob ``sha256_hex`` also under ``key_hex``, a hash that names it by other means
        (a dataset's Merkle root names its manifest); fetchers read it with :meth:`fetch_alias`.
        ``announce``: also announce ``key_hex`` on the DHT (P2PTimeout after the alias is in place), so
        that a fetcher that knows only the key finds this host (:meth:`find_providers`)."""
        self._check_open()
        if not self.store.has(sha256_hex) and self.store.packed(sha256_hex) is None:
            raise BlobNotFound(f"blob {sha256_hex} is not stored locally")
        self.store.alias(key_hex, sha256_hex)
        if announce:
            self._call(self._announce, check_sha256_hex(key_hex), timeout=timeout,
                       what=f"announce key {key_hex[:16]}")

    def fetch_alias(self, key_hex: str, provider: str, max_bytes: int, timeout: float | None = None) -> bytes:
        """The whole blob ``provider`` serves under ``key_hex``, unverified: the caller checks it against the
        key (its sha256 is not the key). Refused from the reply header when it is over ``max_bytes``.
        Raises BlobNotFound (the provider does not serve the key), BlobTooLarge, BlobError or P2PTimeout."""
        key_hex = check_sha256_hex(key_hex)
        timeout = self.config.transfer_timeout if timeout is None else timeout
        total = self._call(
            self._stat, key_hex, provider, timeout=timeout, what=f"size of blob {key_hex[:16]}"
        )
        if total > max_bytes:
            raise BlobTooLarge(f"blob {key_hex[:16]} from {provider[-8:]}: {total} bytes, over {max_bytes}")
        if total == 0:
            raise BlobError(f"blob {key_hex[:16]} from {provider[-8:]} is empty")
        return self.fetch_blob_range(key_hex, 0, total, provider, timeout=timeout)

    async def _stat(self, key_hex: str, provider: str) -> int:
        try:
            return await self._blobs.stat(ID.from_base58(provider), key_hex)
        # A refusal (not_found), a protocol violation, a dropped stream, any failure of the provider's:
        # node/ gets a BlobError, never a library's exception that would end its thread.
        except Exception as exc:  # noqa: BLE001 - the boundary between a provider and node/
            if getattr(exc, "status", None) == "not_found":
                raise BlobNotFound(f"blob {key_hex[:16]}: {provider[-8:]} does not serve it") from None
            raise BlobError(
                f"blob {key_hex[:16]} from {provider[-8:]}: {type(exc).__name__}: {exc}"
            ) from None

    async def _announce(self, sha256_hex: str) -> None:
        key = _dht_key(sha256_hex)
        store = self._dht.provider_store
        ok = await store.provide(key)
        if not ok:  # its republish time stays unset: the DHT's next maintenance pass announces it again
            logger.info("blob %s stored; no DHT peer took the provider record yet", sha256_hex[:16])
            return
        # py-libp2p's provide() leaves the key's republish time unset (0), and its maintenance loop (every
        # ROUTING_TABLE_REFRESH_INTERVAL, 600 s) republishes every providing key whose last republish is over
        # 22 hours ago: so every blob announced was announced again at the next pass, a network lookup and
        # an ADD_PROVIDER to each of the k closest peers, one key after another on the DHT's own loop. The
        # 22 hours count from this announcement.
        store._last_republish[key] = time.time()

    def set_blob_rebuilder(self, rebuilder) -> None:
        """Serve the blobs ``rebuilder`` makes when asked for them
        (:meth:`p2p.blobstore.BlobStore.set_rebuilder`)."""
        self.store.set_rebuilder(rebuilder)

    def has_blob(self, sha256_hex: str) -> bool:
        return self.store.has(sha256_hex)

    def read_blob(self, sha256_hex: str) -> bytes:
        """The bytes of a locally held blob, stored as a file or packed (p2p/blobpack.py); BlobNotFound if
        neither (a packed blob whose piece is gone: BlobError). Read whole: the caller bounds it."""
        return self.store.read(sha256_hex)

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

    def stop_announcing(self, sha256_hex: str, timeout: float = 5.0) -> None:
        """Keep serving the stored blob ``sha256_hex`` but no longer announce it: drop this host's provider
        record of it and its periodic re-announcement. A fetcher that names this host as a provider still
        gets it; a DHT lookup no longer finds it here. For blobs a run keeps (an audit reads them) but no
        peer looks up any more: announced for ever, they grew the provider store by every round's blobs and
        py-libp2p would re-announce them all 22 hours on."""
        sha256_hex = check_sha256_hex(sha256_hex)
        if not self._closed and self._token is not None:
            self._call(self._forget_provided, sha256_hex, timeout=timeout, what="stop announcing blob")

    async def _forget_provided(self, sha256_hex: str) -> None:
        key = _dht_key(sha256_hex)
        store = self._dht.provider_store
        store.providing_keys.discard(key)  # stops the DHT's periodic re-announcement
        store.providers.get(key, {}).pop(str(self._libp2p.get_id()), None)

    async def _trim_provider_records(self, now: float | None = None) -> int:
        """Bound the DHT's provider records (:mod:`p2p.provider_records`) as of ``now`` (wall clock, as the
        records' timestamps; default: the present); returns how many were dropped."""
        own = PeerInfo(self._libp2p.get_id(), list(self._libp2p.get_addrs()))
        return trim_provider_records(self._dht.provider_store, str(own.peer_id), own,
                                     self.config.provider_record_ttl, time.time() if now is None else now)

    def provider_records(self, timeout: float = 5.0) -> int:
        """How many DHT provider records this host holds (all keys, all peers)."""

        async def count() -> int:  # the store is the host thread's
            return record_count(self._dht.provider_store)

        return self._call(count, timeout=timeout, what="provider_records")

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
                # A peer without the DHT protocol, or gone, must not end the other peers' queries.
                except Exception as exc:  # noqa: BLE001 - a provider query's task boundary
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

    def fetch_blob_range(
        self, sha256_hex: str, offset: int, length: int, provider: str, timeout: float | None = None
    ) -> bytes:
        """Bytes ``[offset, offset+length)`` of a blob, from this host's store or from ``provider``.

        Unverified: a range cannot be checked against the blob's sha256, so the caller checks it
        (the sliced exchange checks a Merkle path to a signed root). Nothing is stored. Raises
        BlobError (the provider refused or misbehaved) or P2PTimeout.
        """
        sha256_hex = check_sha256_hex(sha256_hex)
        if offset < 0 or length < 1 or length > self.config.max_blob_bytes:
            raise BlobError(f"blob {sha256_hex[:16]}: range {offset}+{length} refused")
        if self.store.has(sha256_hex):
            with open(self.store.path(sha256_hex), "rb") as handle:
                data = os.pread(handle.fileno(), length, offset)
            if len(data) != length:
                raise BlobError(f"blob {sha256_hex[:16]}: range {offset}+{length} past its end")
            return data
        timeout = self.config.transfer_timeout if timeout is None else timeout
        return self._call(self._fetch_range, sha256_hex, offset, length, provider, timeout=timeout,
                          what=f"fetch range of blob {sha256_hex[:16]}")

    async def _fetch_range(self, sha256_hex: str, offset: int, length: int, provider: str) -> bytes:
        try:
            return await self._blobs.fetch_range(
                ID.from_base58(provider), bytes.fromhex(sha256_hex), offset, length
            )
        except BlobError:
            raise
        # A refusal (ProviderFailed), a protocol violation, a dropped stream, any failure of the provider's:
        # node/ gets a BlobError, never a library's exception that would end its thread.
        except Exception as exc:  # noqa: BLE001 - the boundary between a provider and node/
            raise BlobError(f"blob {sha256_hex[:16]} range from {provider[-8:]}: "
                            f"{type(exc).__name__}: {exc}") from None

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


def _dht_key(sha256_hex: str) -> bytes:
    """DHT provider key of a blob: the sha2-256 multihash (0x12 0x20 + digest), as IPFS uses."""
    return b"\x12\x20" + bytes.fromhex(check_sha256_hex(sha256_hex))
