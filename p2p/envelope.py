"""Signed msgpack envelopes: every application message a node sends.

Layout (one msgpack map, keys in this order, nothing else allowed)::

    domain          bin   b"dlx-envelope-v1"   (domain separator: a signature over
                                                 an envelope can never be replayed
                                                 as a signature over anything else)
    version         int   1
    run_id          int   >= 0
    round           int   >= 0                  outer round (DiLoCo, arXiv 2311.08105 Alg. 1)
    kind            str   [a-z0-9_]{1,32}       "contribution", "announce", ...
    stage           int   >= -1                 pipeline stage, -1 if n/a
    replica         int   >= -1                 replica index, -1 if n/a
    sender          bin   32-byte ed25519 public key; the peer id derives from it
    payload         bin   inline payload
    payload_sha256  bin   32 bytes
    timestamp_ms    int   unix milliseconds at creation
    signature       bin   64-byte ed25519 signature of the signing bytes

The signing bytes are the msgpack array of every field but ``payload`` and
``signature``, prefixed by nothing else (the domain is its first element). The
payload is covered through its hash, so a signed *header* alone (without the
possibly tens-of-MB payload) is verifiable evidence, e.g. of equivocation.

Version 2, a payload in parts (a run whose ``diloco.exchange_parts`` is above 1;
docs/P2P.md, "Envelope version 2"), has the domain ``b"dlx-envelope-v2"`` and,
instead of ``payload_sha256``, two fields (the rest as above, in order)::

    parts_root      bin   32 bytes      Merkle root over the parts' sha256 (p2p/parts.py)
    part_sizes      bin   8 P bytes     the P parts' sizes, uint64 big-endian; P in [1, MAX_PARTS]

The parts are consecutive byte ranges of the payload (their concatenation is the
payload), so the whole envelope is decoded and checked like a version-1 one (the
payload cut by ``part_sizes``, the root recomputed), while a holder fetches the
header (the envelope with an empty payload, :func:`decode_header`) and each part
alone, checking every part as it arrives. :func:`decode_envelope` accepts both
versions unless its caller narrows ``versions``; :class:`EnvelopeValidator` (the
gossip's) accepts version 1 only unless told otherwise.

Decoding is strict: exact key set, exact types, bounded lengths, canonical
encoding (re-encoding gives the same bytes, so ``envelope_hash`` is unique per
message), payload hash and signature checked. Every failure raises
:class:`~p2p.errors.EnvelopeRejected` with a specific ``reason``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from collections.abc import Sequence
from typing import Any

import msgpack

from p2p.errors import EnvelopeRejected
from p2p.identity import Identity, peer_id_from_public_key, verify_signature
from p2p.parts import PartRejected, cut_at, pack_sizes, part_digests, parts_root, unpack_sizes

logger = logging.getLogger(__name__)

DOMAIN = b"dlx-envelope-v1"
VERSION = 1
#: Envelope version 2: a payload in parts under a signed Merkle root (module docstring).
DOMAIN_PARTS = b"dlx-envelope-v2"
VERSION_PARTS = 2
NO_INDEX = -1
_KIND_RE = re.compile(r"^[a-z0-9_]{1,32}$")
_MAX_UINT64 = (1 << 64) - 1
_FIELDS = (
    "domain",
    "version",
    "run_id",
    "round",
    "kind",
    "stage",
    "replica",
    "sender",
    "payload",
    "payload_sha256",
    "timestamp_ms",
    "signature",
)
_FIELDS_PARTS = (*_FIELDS[:9], "parts_root", "part_sizes", *_FIELDS[10:])


@dataclass(frozen=True)
class Envelope:
    """A decoded or freshly created, signature-checked envelope (see module docstring)."""

    run_id: int
    round: int
    kind: str
    stage: int
    replica: int
    sender: bytes
    payload: bytes
    payload_sha256: bytes
    timestamp_ms: int
    signature: bytes
    domain: bytes = DOMAIN
    version: int = VERSION
    parts_root: bytes = b""  # version 2 only (a version-1 envelope's wire has neither field)
    part_sizes: bytes = b""
    _encoded: bytes | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        identity: Identity,
        run_id: int,
        round: int,
        kind: str,
        payload: bytes,
        stage: int = NO_INDEX,
        replica: int = NO_INDEX,
        timestamp_ms: int | None = None,
        part_sizes: Sequence[int] | None = None,
    ) -> Envelope:
        """Build and sign an envelope with ``identity``'s key; with ``part_sizes`` (the sizes of consecutive
        parts of ``payload``, summing to its length) a version-2 envelope (module docstring)."""
        payload = bytes(payload)
        fields = {
            "run_id": run_id,
            "round": round,
            "kind": kind,
            "stage": stage,
            "replica": replica,
            "sender": identity.public_key_bytes,
            "payload": payload,
            "payload_sha256": hashlib.sha256(payload).digest(),
            "timestamp_ms": int(time.time() * 1000) if timestamp_ms is None else timestamp_ms,
            "signature": b"",
        }
        if part_sizes is not None:
            try:
                root = parts_root(part_digests(cut_at(payload, part_sizes)))
            except PartRejected as exc:
                raise EnvelopeRejected("malformed", str(exc)) from None
            fields.update(domain=DOMAIN_PARTS, version=VERSION_PARTS, payload_sha256=b"", parts_root=root,
                          part_sizes=pack_sizes(part_sizes))
        unsigned = cls(**fields)
        unsigned._check_fields()
        return replace(unsigned, signature=identity.sign(unsigned.signing_bytes()))

    def _check_fields(self) -> None:
        def need_int(name: str, low: int) -> None:
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= _MAX_UINT64:
                raise EnvelopeRejected("malformed", f"{name}={value!r}: must be an int in [{low}, 2^64)")

        for name, low in (("version", 0), ("run_id", 0), ("round", 0), ("timestamp_ms", 0)):
            need_int(name, low)
        for name in ("stage", "replica"):
            need_int(name, NO_INDEX)
        if type(self.kind) is not str or not _KIND_RE.fullmatch(self.kind):  # match() lets "hello\n" through
            raise EnvelopeRejected("bad_kind", f"kind={self.kind!r}: must match [a-z0-9_]{{1,32}}")
        for name, size in (("domain", len(DOMAIN)), ("sender", 32),
                           ("parts_root" if self.in_parts else "payload_sha256", 32)):
            value = getattr(self, name)
            if type(value) is not bytes or len(value) != size:
                raise EnvelopeRejected("malformed", f"{name}: must be {size} bytes")
        if type(self.payload) is not bytes:
            raise EnvelopeRejected("malformed", "payload: must be bytes")
        if type(self.signature) is not bytes or len(self.signature) not in (0, 64):
            raise EnvelopeRejected("malformed", "signature: must be 64 bytes")
        if self.in_parts:
            try:
                unpack_sizes(self.part_sizes)
            except PartRejected as exc:
                raise EnvelopeRejected("malformed", exc.detail) from None
            if self.payload_sha256:
                raise EnvelopeRejected("malformed", "payload_sha256 in a version-2 envelope")
        elif self.parts_root or self.part_sizes:
            raise EnvelopeRejected("malformed", f"parts in a version-{self.version} envelope")

    @property
    def in_parts(self) -> bool:
        """Whether it is a version-2 envelope (a payload in parts)."""
        return self.version == VERSION_PARTS and self.domain == DOMAIN_PARTS

    @property
    def fields(self) -> tuple[str, ...]:
        """This envelope's wire fields, in order (its version's)."""
        return _FIELDS_PARTS if self.in_parts else _FIELDS

    @property
    def sizes(self) -> list[int]:
        """A version-2 envelope's part sizes ([] for version 1)."""
        return unpack_sizes(self.part_sizes) if self.in_parts else []

    @property
    def payload_id(self) -> bytes:
        """What binds the payload: ``payload_sha256`` (version 1), ``parts_root || part_sizes`` (2)."""
        return self.parts_root + self.part_sizes if self.in_parts else self.payload_sha256

    def signing_bytes(self) -> bytes:
        """The exact bytes the sender signed: msgpack array of every field but payload and signature."""
        signed = [getattr(self, name) for name in self.fields if name not in ("payload", "signature")]
        return msgpack.packb(signed, use_bin_type=True)

    def to_bytes(self) -> bytes:
        """Canonical wire encoding (see module docstring)."""
        if self._encoded is None:
            encoded = msgpack.packb({name: getattr(self, name) for name in self.fields}, use_bin_type=True)
            object.__setattr__(self, "_encoded", encoded)
        return self._encoded  # type: ignore[return-value]

    @property
    def envelope_hash(self) -> str:
        """Hex sha256 of :meth:`to_bytes`: the envelope's unique id."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @property
    def sender_peer_id(self) -> str:
        """libp2p peer id of the sender's key."""
        return peer_id_from_public_key(self.sender)

    @property
    def payload_hash_hex(self) -> str:
        return self.payload_id.hex()

    def header(self) -> Envelope:
        """This envelope without its payload: still verifiable with :func:`verify_header`."""
        return replace(self, payload=b"", _encoded=None)

    def slot(self) -> tuple[bytes, int, int, str, int]:
        """(sender, run, round, kind, stage): a sender may sign one envelope per slot."""
        return (self.sender, self.run_id, self.round, self.kind, self.stage)


def verify_header(envelope: Envelope) -> bool:
    """True iff the signature is valid over the envelope's signed fields (payload not needed)."""
    return verify_signature(envelope.sender, envelope.signing_bytes(), envelope.signature)


def decode_envelope(data: bytes, max_size: int,
                    versions: tuple[int, ...] = (VERSION, VERSION_PARTS)) -> Envelope:
    """Strictly decode and verify one envelope (no replay or round checks: see EnvelopeValidator).

    ``versions``: the envelope versions accepted (another is ``bad_version``).
    Raises :class:`EnvelopeRejected` with reason ``oversized``, ``malformed``,
    ``non_canonical``, ``bad_domain``, ``bad_version``, ``bad_kind``,
    ``payload_hash_mismatch`` (version 2: ``parts_size_mismatch``, ``parts_root_mismatch``)
    or ``bad_signature``.
    """
    envelope = _decode(data, max_size, versions)
    if envelope.in_parts:
        sizes = envelope.sizes
        if sum(sizes) != len(envelope.payload):
            raise EnvelopeRejected("parts_size_mismatch",
                                   f"{len(envelope.payload)} bytes, parts of {sum(sizes)}")
        if parts_root(part_digests(cut_at(envelope.payload, sizes))) != envelope.parts_root:
            raise EnvelopeRejected("parts_root_mismatch")
    elif hashlib.sha256(envelope.payload).digest() != envelope.payload_sha256:
        raise EnvelopeRejected("payload_hash_mismatch")
    return _signed(envelope)


def decode_header(data: bytes, max_size: int) -> Envelope:
    """A version-2 envelope's *header*: the envelope with an empty payload, as a holder of its parts fetches
    it first (:func:`assemble` then puts the checked parts in). Signature and fields checked as
    :func:`decode_envelope` checks them; the parts are the caller's to check (p2p/parts.py)."""
    envelope = _decode(data, max_size, (VERSION_PARTS,))
    if envelope.payload:
        raise EnvelopeRejected("malformed", "a header's payload must be empty")
    return _signed(envelope)


def assemble(header: Envelope, parts: Sequence[bytes]) -> Envelope:
    """The whole envelope of a version-2 ``header`` and its parts, in order (each already checked by the
    caller; its bytes are the sender's envelope's, so its hash is the one the record and the close name)."""
    return replace(header, payload=b"".join(parts), _encoded=None)


def payload_offset(header: Envelope, size: int) -> int:
    """Where the payload of ``size`` bytes starts in the bytes of ``header``'s whole envelope: a part of a
    version-2 envelope is a range of the whole envelope's blob, served by whoever holds the whole."""
    packer = msgpack.Packer(use_bin_type=True)
    fields = header.fields
    before = fields[:fields.index("payload")]
    return len(packer.pack_map_header(len(fields)) + b"".join(
        packer.pack(name) + packer.pack(getattr(header, name)) for name in before)
        + packer.pack("payload")) + (2 if size < 1 << 8 else 3 if size < 1 << 16 else 5)  # bin 8, 16, 32


def _signed(envelope: Envelope) -> Envelope:
    if not verify_header(envelope):
        raise EnvelopeRejected("bad_signature", f"from {envelope.sender_peer_id}")
    return envelope


def _decode(data: bytes, max_size: int, versions: tuple[int, ...]) -> Envelope:
    """The strict checks before the payload's (the key set, the domain, the version, the types, canonical)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise EnvelopeRejected("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise EnvelopeRejected("oversized", f"{len(data)} bytes > limit {max_size}")
    data = bytes(data)
    maps = [0]

    def one_map(pairs: list) -> dict:
        # An envelope is one flat map. Nested maps would be built before any check (~20x their
        # bytes in Python dicts: gigabytes for a contribution-sized blob), so the first one stops decoding.
        maps[0] += 1
        if maps[0] > 1:
            raise ValueError("nested map")
        value = dict(pairs)
        if len(value) != len(pairs):
            raise ValueError("a key twice")
        return value

    def no_array(value: list) -> list:
        # max_array_len=0 refuses an array with entries at its header; this refuses the empty one too,
        # so "no array anywhere" holds whichever field it stands in (even the domain, checked next).
        raise ValueError("array")

    try:
        decoded: Any = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=max_size,
            max_str_len=64,
            max_array_len=0,
            max_map_len=len(_FIELDS_PARTS),  # version 2's 13 (version 1's 12: the key set says which)
            max_ext_len=0,
            object_pairs_hook=one_map,
            list_hook=no_array,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # msgpack's errors on bad input
        raise EnvelopeRejected("malformed", f"not a msgpack envelope: {type(exc).__name__}: {exc}") from None
    if not isinstance(decoded, dict):
        raise EnvelopeRejected("malformed", "top level must be a map")
    # The checks' order is the wire's (docs/P2P.md): key set, domain, version. The key set with parts_root is
    # version 2's; any other is checked as version 1's (as before version 2 existed).
    version = decoded.get("version")
    in_parts = "parts_root" in decoded
    if in_parts and not (version == VERSION_PARTS and type(version) is int and VERSION_PARTS in versions):
        raise EnvelopeRejected("bad_version",
                               f"version={version!r} with parts: this node takes {list(versions)}")
    expected = _FIELDS_PARTS if in_parts else _FIELDS
    if set(decoded) != set(expected):
        missing = sorted(set(expected) - set(decoded))
        unknown = sorted(map(str, set(decoded) - set(expected)))
        raise EnvelopeRejected("malformed", f"missing fields {missing}, unknown fields {unknown}")
    if decoded["domain"] != (DOMAIN_PARTS if in_parts else DOMAIN):
        raise EnvelopeRejected("bad_domain", f"domain={decoded['domain']!r}")
    if not in_parts and (decoded["version"] != VERSION or VERSION not in versions):
        raise EnvelopeRejected("bad_version",
                               f"version={decoded['version']!r}, this node speaks {list(versions)}")
    envelope = Envelope(**decoded) if not in_parts else Envelope(payload_sha256=b"", **decoded)
    envelope._check_fields()
    if len(envelope.signature) != 64:
        raise EnvelopeRejected("malformed", "signature: must be 64 bytes")
    if envelope.to_bytes() != data:
        raise EnvelopeRejected("non_canonical", "re-encoding differs (field order or integer width)")
    return envelope


@dataclass(frozen=True)
class Equivocation:
    """Two different validly signed envelopes from one sender for the same slot.

    Both are kept as headers (payload stripped, signature still verifiable with
    :func:`verify_header`), which is enough to prove the double-signing.
    """

    sender_peer_id: str
    run_id: int
    round: int
    kind: str
    stage: int
    first: Envelope
    second: Envelope


class EnvelopeValidator:
    """Stateful checks for one run on top of :func:`decode_envelope`.

    Rejects envelopes of another run (``wrong_run``), older than ``min_round``
    (``stale_round``), more than ``max_rounds_ahead`` past it (``future_round``),
    already seen (``replayed``), or conflicting with an earlier envelope of the
    same sender and slot (``equivocation``; both kept in :attr:`equivocations`).
    Kinds in ``equivocation_exempt_kinds`` may be re-signed freely (e.g. periodic
    "hello"). Thread-safe: the host calls it from its network thread.
    """

    def __init__(
        self,
        run_id: int,
        max_size: int,
        min_round: int = 0,
        max_rounds_ahead: int = 2,
        equivocation_exempt_kinds: frozenset[str] | set[str] | tuple[str, ...] = ("hello",),
        allowed_kinds: frozenset[str] | set[str] | tuple[str, ...] | None = None,
        max_clock_skew_s: float | None = None,
        versions: tuple[int, ...] = (VERSION,),
    ) -> None:
        self.run_id = run_id
        self.versions = versions  # envelope versions accepted (gossip: version 1 alone)
        self.max_size = max_size
        self.min_round = min_round
        self.max_rounds_ahead = max_rounds_ahead
        self.equivocation_exempt_kinds = frozenset(equivocation_exempt_kinds)
        self.allowed_kinds = None if allowed_kinds is None else frozenset(allowed_kinds)
        self.max_clock_skew_s = max_clock_skew_s
        self.equivocations: list[Equivocation] = []
        self.rejections: Counter[str] = Counter()
        self._seen: dict[int, set[str]] = {}  # round -> envelope hashes
        self._slots: dict[tuple[bytes, int, int, str, int], tuple[str, Envelope]] = {}
        self._lock = threading.Lock()

    def check(self, data: bytes) -> Envelope:
        """Decode, verify and record ``data``; raise EnvelopeRejected on any failure."""
        try:
            envelope = decode_envelope(data, self.max_size, self.versions)
            return self._check_state(envelope)
        except EnvelopeRejected as exc:
            with self._lock:
                self.rejections[exc.reason] += 1
            raise

    def accepts(self, data: bytes, sender_peer_id: str = "") -> bool:
        """:meth:`check` as a boolean (the shape of a gossip topic validator); logs the reason."""
        try:
            self.check(data)
        except EnvelopeRejected as exc:
            logger.debug("dropped envelope relayed by %s: %s", sender_peer_id or "?", exc)
            return False
        return True

    def _check_state(self, envelope: Envelope) -> Envelope:
        if envelope.run_id != self.run_id:
            raise EnvelopeRejected("wrong_run", f"run_id={envelope.run_id}, expected {self.run_id}")
        if self.allowed_kinds is not None and envelope.kind not in self.allowed_kinds:
            raise EnvelopeRejected("bad_kind", f"kind={envelope.kind!r} not accepted here")
        if self.max_clock_skew_s is not None:
            skew = abs(envelope.timestamp_ms / 1000 - time.time())
            if skew > self.max_clock_skew_s:
                raise EnvelopeRejected("bad_timestamp", f"clock skew {skew:.1f} s")
        envelope_hash = envelope.envelope_hash
        with self._lock:
            if envelope.round < self.min_round:
                raise EnvelopeRejected("stale_round", f"round={envelope.round} < {self.min_round}")
            if envelope.round > self.min_round + self.max_rounds_ahead:
                raise EnvelopeRejected(
                    "future_round", f"round={envelope.round} > {self.min_round}+{self.max_rounds_ahead}"
                )
            seen = self._seen.setdefault(envelope.round, set())
            if envelope_hash in seen:
                raise EnvelopeRejected("replayed", envelope_hash[:16])
            if envelope.kind not in self.equivocation_exempt_kinds:
                slot = envelope.slot()
                previous = self._slots.get(slot)
                if previous is not None and previous[0] != envelope_hash and (
                        previous[1].payload_id == envelope.payload_id):
                    # The same message signed again (a restarted sender re-sends what it said
                    # before): nothing new, and no contradiction either.
                    raise EnvelopeRejected("replayed", "same payload re-signed")
                if previous is not None and previous[0] != envelope_hash:
                    evidence = Equivocation(
                        envelope.sender_peer_id,
                        envelope.run_id,
                        envelope.round,
                        envelope.kind,
                        envelope.stage,
                        previous[1],
                        envelope.header(),
                    )
                    self.equivocations.append(evidence)
                    logger.warning(
                        "equivocation by %s in run %d round %d kind %s stage %d",
                        evidence.sender_peer_id,
                        envelope.run_id,
                        envelope.round,
                        envelope.kind,
                        envelope.stage,
                    )
                    raise EnvelopeRejected("equivocation", f"by {evidence.sender_peer_id}")
                self._slots[slot] = (envelope_hash, envelope.header())
            seen.add(envelope_hash)
        return envelope

    def advance(self, min_round: int) -> None:
        """Move the round floor; forget replay/slot state of older rounds (bounds memory)."""
        with self._lock:
            self.min_round = max(self.min_round, min_round)
            for round_index in [r for r in self._seen if r < self.min_round]:
                del self._seen[round_index]
            for slot in [s for s in self._slots if s[2] < self.min_round]:
                del self._slots[slot]
