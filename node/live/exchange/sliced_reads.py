"""How a holder of the sliced exchange reads what others serve: partial envelopes, and a slice of a bundle.

A mixin of :class:`node.live.exchange.sliced.SlicedExchange` (docs/PROTOCOL.md, "Sliced exchange"): it uses
the exchange's host, timeouts and evidence directory, and its read-failure book (``_read_failed``, a
:class:`p2p.backoff.RetryBook`: a provider whose read failed is not asked again for ``BUNDLE_RETRY_S``;
``_missing_said``: a missing input is logged once per turn).
"""

from __future__ import annotations

import hashlib
import logging
import random

from node.fsutil import keep_evidence
from node.live.exchange.pool import FALLBACK_PROVIDERS
from p2p.errors import P2PError
from training.slice_plan import SliceError
from training.slicebundle import SliceReference, bundle_slices, parse_slice_record, record_range, \
    slice_declares

logger = logging.getLogger("node.live.exchange.sliced")  # one logger for the exchange's lines

#: A coordinator asks again for a bundle it could not fetch,
#: and an aggregator for a slice, after this many seconds.
BUNDLE_RETRY_S = 2.0


class SliceReads:
    """Fetches of partials and slice reads (module docstring)."""

    def _fetch(self, digest: bytes, provider: str | None) -> bytes | None:
        """The blob ``digest`` (its sha256 checked) from ``provider``, or from any provider when None."""
        dest = self.incoming / f"{digest.hex()}.slice"
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.host.fetch_blob(digest.hex(), dest, providers=None if provider is None else [provider],
                                 timeout=self.turn_timeout)
            return dest.read_bytes()
        except (P2PError, OSError) as exc:
            logger.info("blob %s from %s not fetched: %s", digest.hex()[:12],
                        "any provider" if provider is None else provider[-8:], exc)
            return None
        finally:
            dest.unlink(missing_ok=True)

    def _fetch_partial(self, digest: bytes, sender: str) -> bytes | None:
        """A partial envelope from its signer, else from a few live peers (the holders that applied it serve
        it): a signer that serves some holders and not others must not split them."""
        data = self._fetch(digest, sender)
        others = [p for p in self.pool.fallback_providers() if p not in (sender, self.peer_id)]
        for provider in random.sample(others, min(FALLBACK_PROVIDERS, len(others))):
            if data is not None:
                break
            data = self._fetch(digest, provider)
        return data

    def _say_missing(self, what: str, outer_round: int, stage: int, j: int, member: str, turn: int) -> None:
        key = (outer_round, stage, j, member, turn, what)
        if key not in self._missing_said:  # once per turn, not on every pass
            self._missing_said.add(key)
            logger.warning("round %d stage %d slice %d: %s of %s missing; trying again (turn %d)",
                           outer_round, stage, j, what, member[-8:], turn)

    def _read_slice(self, reference: SliceReference, j: int, provider: str) -> bytes | None:
        """Slice j of a contribution's bundle: its record and its bytes read by range and checked against the
        signed reference. None if it could not be read (yet); b"" if slice j of the bundle is proven bad.

        A range that does not check may be the provider's lie about a good bundle, so the whole
        bundle (bound by its sha256) decides (:func:`training.slicebundle.read_slice`): a bad slice
        is an absent input for every aggregator and auditor alike (it costs only its signer).
        """
        bundle = reference.bundle_digest.hex()
        failed = (reference.bundle_digest, provider)
        if self._read_failed.blocked(failed):
            return None  # it failed a moment ago: asked again on a later pass
        try:
            offset, length = record_range(reference.num_slices, j)
            record = self.host.fetch_blob_range(bundle, offset, length, provider, timeout=self.turn_timeout)
            digest, start, size = parse_slice_record(record, reference, j)
            blob = self.host.fetch_blob_range(bundle, start, size, provider, timeout=self.turn_timeout)
            if hashlib.sha256(blob).digest() != digest:
                raise SliceError("slice bytes do not match their record")
            if not slice_declares(blob, reference):
                raise SliceError("slice declares other inner steps than its reference")
            return blob
        except SliceError as exc:
            logger.warning("slice %d of bundle %s from %s does not check (%s): reading the whole bundle", j,
                           bundle[:12], provider[-8:], exc)
        except (P2PError, OSError) as exc:
            logger.info("slice %d of bundle %s from %s not read: %s", j, bundle[:12], provider[-8:], exc)
            self._read_failed.failed(failed)
            return None
        data = self._fetch(reference.bundle_digest, provider)
        if data is None:
            self._read_failed.failed(failed)
            return None
        try:
            blob = bundle_slices(data, reference)[j]
        except SliceError as exc:  # (fetch_blob checked the sha256: not reached)
            logger.warning("bundle %s of %s: %s", bundle[:12], provider[-8:], exc)
            return None
        if blob is None:
            logger.warning("slice %d of bundle %s of %s is bad: that input is absent", j, bundle[:12],
                           provider[-8:])
            # bound by the signed reference
            keep_evidence(self.evidence_dir / f"bundle-{bundle}.slices", data)
            return b""
        return blob
