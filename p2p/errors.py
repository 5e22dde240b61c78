"""Errors of the networking layer, all under :class:`P2PError` (imports nothing from other packages)."""

from __future__ import annotations


class P2PError(Exception):
    """Root of every error raised by ``p2p/``."""


class P2PConfigError(P2PError, ValueError):
    """A ``[p2p]`` setting is missing, malformed or out of range."""


class IdentityError(P2PError):
    """The identity key file is missing, unreadable, corrupt or has the wrong type."""


class P2PTimeout(P2PError, TimeoutError):
    """A call on the host did not finish within its timeout."""


class HostClosed(P2PError):
    """The host was closed (or failed) and can no longer serve calls."""


class DialError(P2PError):
    """A peer could not be reached or refused the connection."""


class RelayAddressError(DialError, ValueError):
    """A relayed address (``<relay>/p2p-circuit/p2p/<peer>``) from a peer, a run link or a setting is
    malformed."""


class EnvelopeRejected(P2PError):
    """An envelope failed validation; ``reason`` is a short machine-readable code.

    Reason codes: ``malformed``, ``oversized``, ``non_canonical``, ``bad_domain``,
    ``bad_version``, ``bad_signature``, ``payload_hash_mismatch``, ``wrong_run``,
    ``stale_round``, ``future_round``, ``replayed``, ``equivocation``, ``bad_kind``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"envelope rejected ({reason})" + (f": {detail}" if detail else ""))


class BlobError(P2PError):
    """A blob could not be stored, served or fetched."""


class BlobNotFound(BlobError):
    """No provider (or no local copy) holds the requested blob."""


class BlobTooLarge(BlobError):
    """A blob exceeds ``P2PConfig.max_blob_bytes``."""


class BlobHashMismatch(BlobError):
    """Downloaded bytes do not hash to the requested sha256; they were discarded."""


class BlobStoreFull(BlobError):
    """This node's own disk took no more of a blob (ENOSPC, EDQUOT): the fetch stopped, no provider is at
    fault."""


class BlobUnavailable(BlobError):
    """Every provider failed before the blob was complete; what was received is kept for a retry."""


class ProviderTooSlow(BlobError):
    """A provider sent a range slower than ``P2PConfig.blob_min_rate`` allows: it is given to another."""
