"""Payloads of the round protocol's messages (see docs/PROTOCOL.md).

Each message travels inside a signed :mod:`p2p.envelope` whose ``kind`` names
the payload type below; ``round``/``stage``/``replica`` live in the envelope
header. Payloads are msgpack maps decoded strictly: exact keys, exact types,
bounded sizes. A bad payload raises :class:`ProtocolError` and is dropped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, get_type_hints

import msgpack

from node.errors import NodeError
from p2p.addrs import is_relayed_addr, parse_relayed_addr
from p2p.errors import RelayAddressError
from p2p.wire import container_bound

HELLO = "hello"
# a blob, not gossip: payload = ContributionBody (start state, data, applied, codec blob)
CONTRIBUTION = "contribution"
ANNOUNCE = "announce"
CLOSE = "close"
ATTESTATION = "attestation"
RECORD = "record"  # a member's EIP-712 signature over the round's on-chain record
EVIDENCE = "evidence"  # a blob, not gossip: a verifier's signed proof that a contribution does not re-execute
ACCUSATION = "accusation"  # 'this member's contribution failed my spot check; the evidence is this blob'
VERDICT = "verdict"  # a member's EIP-712 signature over the verdict on an accusation
# The sliced exchange (docs/PROTOCOL.md, "Sliced exchange"; diloco.exchange = "sliced"):
# a blob, not gossip: aggregator j's signed partial (training.slicemessages.partial_payload)
PARTIAL = "partial"
PARTIAL_ANNOUNCE = "partial_announce"  # 'my partial of slice j of (round, stage) is the blob with this hash'
# Taking over a close (docs/PROTOCOL.md, "Closing a round"): a lower-ranked coordinator whose turn came asks
# the coordinators ranked above it; each answers with its
# close or a yield ('I will not close this (round, stage)').
TAKEOVER = "takeover"
YIELD = "yield"
# A run whose contributions travel in parts (diloco.exchange_parts > 1; docs/P2P.md, "Envelope version 2"):
# 'my contribution's version-2 header and its parts' digests are these'.
PARTS_ANNOUNCE = "parts_announce"
KINDS = (HELLO, CONTRIBUTION, ANNOUNCE, CLOSE, ATTESTATION, RECORD, ACCUSATION, VERDICT, PARTIAL_ANNOUNCE,
         TAKEOVER, YIELD, PARTS_ANNOUNCE)


def run_topic(run_id: int) -> str:
    """The gossip topic of a run (docs/PROTOCOL.md: one topic per run)."""
    return f"/dlx/run/{run_id}/v1"

MAX_GOSSIP_PAYLOAD = 64 * 1024
#: An attestation's ``stage_leaf``: ledger.chunkproof.StageLeaf's ABI encoding (five 32-byte words).
STAGE_LEAF_BYTES = 160


class ProtocolError(NodeError):
    """A peer's message payload is malformed; it is dropped."""


@dataclass(frozen=True)
class Hello:
    """'I exist, this is my cluster, my account, my addresses and the round I train.'"""

    cluster: str
    cluster_size: int
    account: bytes  # 20-byte Ethereum address registered with this node's ed25519 key
    addrs: list[str]
    training_round: int  # the outer round this node is training now (-1: not yet)
    first_round: int  # the first round this node contributes to in this life (-1: not decided yet)


@dataclass(frozen=True)
class Announce:
    """'My contribution to (round, stage) is the blob with this envelope hash.'"""

    envelope_hash: bytes  # sha256 of the contribution envelope bytes
    size: int


@dataclass(frozen=True)
class PartsAnnounce:
    """'My contribution to (round, stage), the envelope with this hash and size, is in parts: its header (the
    version-2 envelope with an empty payload) and the parts' sha256 digests (a manifest, 32 bytes each).'"""

    envelope_hash: bytes
    size: int
    header: bytes
    manifest: bytes


@dataclass(frozen=True)
class PartialAnnounce:
    """'My partial of slice ``slice_index`` of (round, stage) is the PARTIAL envelope with this hash.'"""

    slice_index: int
    envelope_hash: bytes
    size: int


@dataclass(frozen=True)
class Close:
    """The round coordinator's decision: exactly these contributions are aggregated."""

    contributions: list[list[Any]]  # [[replica, peer_id, envelope_hash(bytes32), size], ...] canonical order
    # A time-bounded run's (diloco.round_budget_s, issue 44): per entry, the inner steps its envelope declares
    # inside the run's range, 0 for none (the aggregation excludes it: bad_steps); the record's tokens are
    # their sum over the last stage. Empty, and absent from
    # the wire, in a fixed-H run (its closes' bytes unchanged).
    steps: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Takeover:
    """'My turn to close (round, stage) came and I could close it: coordinators ranked above me, close or
    yield.'"""


@dataclass(frozen=True)
class Yield:
    """'I will not close (round, stage)': the signer's closes of it no longer count (a later one is
    refused)."""


@dataclass(frozen=True)
class Attestation:
    """A node's signed result for (round, stage): what it computed from the closed set."""

    weights_hash: bytes  # stage weights hash after the outer step
    contributions_root: bytes  # Merkle root of this stage's closed contribution hashes
    num_contributions: int
    train_loss: float  # mean inner loss of the replica (last stage only; nan elsewhere)
    eval_loss: float  # held-out loss of the replica (last stage only; nan elsewhere)
    tokens: int  # tokens this replica trained in the round
    shard_hash: bytes  # sha256 of the checkpoint shard of this stage (b"" if not a checkpoint round)
    checkpoint_hash: bytes  # sha256 of the assembled checkpoint (b"" if not known yet)
    # A chunked run's (diloco.commitments, issue 43): the stage's leaf of the record's version-2 weights root
    # (ledger.chunkproof.StageLeaf, 160 bytes). Empty, and absent from the wire, in a hashed run.
    stage_leaf: bytes = b""


@dataclass(frozen=True)
class RecordSignature:
    """A member's signature over the record of the envelope's round (ledger.records.RoundRecord).

    Run and round are the envelope's; the rest are the record's other fields. ``account`` is
    the signer's Ethereum address and ``signature`` its 65-byte EIP-712 signature
    (docs/LEDGER.md): the receiver recovers the signer and checks both.
    """

    prev_head: bytes
    weights_root: bytes
    contributions_root: bytes
    train_loss_micro: int
    eval_loss_micro: int
    tokens: int
    num_contributors: int
    checkpoint_hash: bytes
    account: bytes
    signature: bytes


@dataclass(frozen=True)
class Accusation:
    """'The contribution of (``outer_round``, ``replica``) did not re-execute; my evidence is blob
    ``evidence_hash``.'

    The evidence blob is an :data:`EVIDENCE` envelope signed by the accuser
    (:class:`Evidence`); ``evidence_hash`` (its sha256) is what the accusation on chain names.
    """

    outer_round: int  # the round of the contribution (the envelope's round is the sender's current one)
    accused: bytes  # the accused member's 20-byte account
    accused_peer: str  # the peer id that signed the contribution
    replica: int
    evidence_hash: bytes
    evidence_size: int


@dataclass(frozen=True)
class Evidence:
    """The payload of an :data:`EVIDENCE` envelope: a spot check's self-contained result.

    ``contributions``: the accused's signed contribution envelopes of the round, one per
    stage (they bind the start-state hashes, served by the accused, and the data
    commitment); ``verdict``/``reason``/``distances``: what the verifier's rerun found.
    """

    accused: bytes
    replica: int
    contributions: list[bytes]
    verdict: str
    reason: str
    distances: list[float]  # per stage, in stage order


@dataclass(frozen=True)
class VerdictSignature:
    """A member's signature over ``Verdict(runId, accused, evidenceHash, guilty)`` (docs/LEDGER.md)."""

    accused: bytes
    evidence_hash: bytes
    guilty: bool
    account: bytes
    signature: bytes


@dataclass(frozen=True)
class ContributionBody:
    """The payload of a contribution envelope: what re-executes it, then the encoded pseudo-gradient.

    Layout: ``b"dlx-contribution/3" || state_hash (32) || data_commitment (32) || applied_hash (32) || codec
    blob``, or, with the binding of a version-3 run (issue 62), ``b"dlx-contribution/4" || state_hash ||
    data_commitment || applied_hash || contributor (20) || binding (65) || codec blob``. ``state_hash`` is the
    stage's start state of the round (docs/DILOCOX.md section 11), ``data_commitment`` the sha256 of the
    round's token ids, ``applied_hash`` the stage's global weights hash of round t-1 its training applied
    before its encode (overlap, lookahead, eager: ``training.schedule.applies_before_encode``), else
    :data:`NO_APPLY` (docs/PROTOCOL.md, "When a node's weights leave the record"); the signature over the
    envelope binds all three to the pseudo-gradient, and the record's contributions root binds the envelope.
    ``contributor``: the sender's member account, ``binding``: its EIP-712 signature (r || s || v) of the
    ``Contribution`` message (ledger/contribution_binding.py) that the committers copy into the factors."""

    state_hash: bytes
    data_commitment: bytes
    blob: bytes
    applied_hash: bytes = bytes(32)
    contributor: bytes = b""
    binding: bytes = b""


CONTRIBUTION_MAGIC, BOUND_CONTRIBUTION_MAGIC = b"dlx-contribution/3", b"dlx-contribution/4"
#: ``applied_hash`` of a round whose training applied no earlier round before its encode.
NO_APPLY = bytes(32)
_BINDING_BYTES = 85  # the contributor's account (20) and its signature (65)


def encode_contribution_body(body: ContributionBody) -> bytes:
    if len(body.state_hash) != 32 or len(body.data_commitment) != 32 or len(body.applied_hash) != 32:
        raise ProtocolError("contribution state_hash, data_commitment and applied_hash must be 32 bytes")
    head = body.state_hash + body.data_commitment + body.applied_hash
    if not body.contributor and not body.binding:
        return CONTRIBUTION_MAGIC + head + body.blob
    if len(body.contributor) != 20 or len(body.binding) != 65:
        raise ProtocolError("a contribution's contributor must be 20 bytes and its binding 65")
    return BOUND_CONTRIBUTION_MAGIC + head + body.contributor + body.binding + body.blob


def decode_contribution_body(payload: bytes) -> ContributionBody:
    """Split a contribution envelope's payload; ProtocolError if it is not one."""
    head = len(CONTRIBUTION_MAGIC)
    extra = _BINDING_BYTES if isinstance(payload, bytes) and payload[:head] == BOUND_CONTRIBUTION_MAGIC else 0
    if (not isinstance(payload, bytes) or len(payload) < head + 96 + extra + 1
            or not (extra or payload.startswith(CONTRIBUTION_MAGIC))):
        raise ProtocolError("contribution payload is not dlx-contribution/3 (/4: bound), hashes and a blob")
    at = head + 96
    return ContributionBody(payload[head:head + 32], payload[head + 32:head + 64], payload[at + extra:],
                            payload[head + 64:at], payload[at:at + extra][:20], payload[at:at + extra][20:])


_TYPES = {HELLO: Hello, ANNOUNCE: Announce, CLOSE: Close, ATTESTATION: Attestation, RECORD: RecordSignature,
          ACCUSATION: Accusation, VERDICT: VerdictSignature, EVIDENCE: Evidence,
          PARTIAL_ANNOUNCE: PartialAnnounce, TAKEOVER: Takeover, YIELD: Yield, PARTS_ANNOUNCE: PartsAnnounce}


#: Fields a payload may leave out (then their default): each absent from the wire when empty.
_OPTIONAL = {Close: ("steps",), Attestation: ("stage_leaf",)}


def encode_payload(message: Any) -> bytes:
    fields_ = asdict(message)
    for name in _OPTIONAL.get(type(message), ()):
        if not fields_[name]:
            del fields_[name]
    return msgpack.packb(fields_, use_bin_type=True)


#: The longest ``str`` a payload holds, as a field (step 6) or inside a list (step 7: ``hello.addrs``).
MAX_STR = 512


def _check(value: Any, annotation: Any, where: str) -> Any:
    text = str(annotation)
    if annotation is bytes or text == "bytes":
        ok = isinstance(value, bytes)
    elif annotation is bool or text == "bool":
        ok = isinstance(value, bool)
    elif annotation is int or text == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation is float or text == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif annotation is str or text == "str":
        ok = isinstance(value, str) and len(value) <= MAX_STR
    elif text.startswith("list"):
        ok = isinstance(value, list) and len(value) <= 4096
    else:
        ok = True
    if not ok:
        raise ProtocolError(f"{where}: unexpected {type(value).__name__}")
    return value


#: Evidence carries the accused's contribution envelopes: a blob, bounded by the blob limit.
MAX_EVIDENCE_PAYLOAD = 64 * 1024 * 1024


def decode_payload(kind: str, data: bytes) -> Any:
    """Strictly decode the payload of a gossip message (or an evidence blob) of ``kind``."""
    cls = _TYPES.get(kind)
    if cls is None:
        raise ProtocolError(f"kind {kind!r} carries no gossip payload")
    limit = MAX_EVIDENCE_PAYLOAD if kind == EVIDENCE else MAX_GOSSIP_PAYLOAD
    if len(data) > limit:
        raise ProtocolError(f"{kind} payload of {len(data)} bytes exceeds {limit}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=limit,
                              **_container_bound(cls))
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"{kind} payload is not msgpack: {exc}") from None
    names = [f.name for f in fields(cls)]
    optional = _OPTIONAL.get(cls, ())
    # A set, not sorted(): keys may mix str and bin (strict_map_key allows both), which do not order.
    if not isinstance(raw, dict) or not set(names) - set(optional) <= set(raw) <= set(names):
        raise ProtocolError(f"{kind} payload must have exactly the keys {names}"
                            + (f" ({', '.join(optional)} optional)" if optional else ""))
    if any(name in raw and not raw[name] for name in optional):
        raise ProtocolError(f"{kind} payload: an empty optional field is left out, not sent")
    hints = get_type_hints(cls)
    values = {name: _check(raw[name], hints[name], f"{kind}.{name}") for name in names if name in raw}
    message = cls(**values)
    _validate(message)
    return message


def _validate(message: Any) -> None:
    if isinstance(message, Hello):
        if len(message.account) != 20:
            raise ProtocolError("hello.account must be 20 bytes")
        if message.cluster_size < 1 or message.training_round < -1 or message.first_round < -1:
            raise ProtocolError("hello.cluster_size/training_round out of range")
        if not all(isinstance(a, str) and len(a) <= MAX_STR for a in message.addrs):
            raise ProtocolError(f"hello.addrs must be strings of at most {MAX_STR} characters")
        for addr in message.addrs:
            if is_relayed_addr(addr):
                try:
                    parse_relayed_addr(addr)
                except RelayAddressError as exc:
                    raise ProtocolError(f"hello.addrs: {exc}") from None
    elif isinstance(message, Announce):
        if len(message.envelope_hash) != 32 or message.size < 1:
            raise ProtocolError("announce.envelope_hash must be 32 bytes and size >= 1")
    elif isinstance(message, PartsAnnounce):
        if len(message.envelope_hash) != 32 or message.size < 1 or not message.header \
                or not message.manifest or len(message.manifest) % 32:
            raise ProtocolError("parts_announce.envelope_hash must be 32 bytes, size >= 1, a header and a "
                                "manifest of 32-byte digests")
    elif isinstance(message, PartialAnnounce):
        if len(message.envelope_hash) != 32 or message.size < 1 or not 0 <= message.slice_index < 1 << 16:
            raise ProtocolError(
                "partial_announce.envelope_hash must be 32 bytes, size >= 1, slice_index < 2^16")
    elif isinstance(message, Close):
        for item in message.contributions:
            # type() is int: a bool is not an int (true is not replica 1), as everywhere on the wire.
            if (not isinstance(item, list) or len(item) != 4 or type(item[0]) is not int
                    or not isinstance(item[1], str) or not isinstance(item[2], bytes)
                    or len(item[2]) != 32 or type(item[3]) is not int):
                raise ProtocolError("close.contributions entries must be [replica, peer_id, hash32, size]")
            if not 0 <= item[0] < 1 << 64 or not 1 <= item[3] < 1 << 64:
                raise ProtocolError("close.contributions: replica must be in [0, 2^64) and size in [1, 2^64)")
        if message.steps and (len(message.steps) != len(message.contributions)
                              or not all(type(n) is int and 0 <= n < 1 << 32 for n in message.steps)):
            raise ProtocolError("close.steps must be one whole number in [0, 2^32) per contribution")
    elif isinstance(message, RecordSignature):
        for name in ("prev_head", "weights_root", "contributions_root", "checkpoint_hash"):
            if len(getattr(message, name)) != 32:
                raise ProtocolError(f"record.{name} must be 32 bytes")
        for name in ("train_loss_micro", "eval_loss_micro", "tokens", "num_contributors"):
            if not 0 <= getattr(message, name) < 1 << 64:
                raise ProtocolError(f"record.{name} must be in [0, 2^64)")
        if len(message.account) != 20 or len(message.signature) != 65:
            raise ProtocolError("record.account must be 20 bytes and record.signature 65 bytes")
    elif isinstance(message, Accusation):
        if len(message.accused) != 20 or len(message.evidence_hash) != 32:
            raise ProtocolError("accusation.accused must be 20 bytes and evidence_hash 32 bytes")
        if message.replica < 0 or message.outer_round < 0 \
                or not 0 < message.evidence_size <= MAX_EVIDENCE_PAYLOAD + 4096:
            raise ProtocolError("accusation.replica must be >= 0 and evidence_size in (0, limit]")
    elif isinstance(message, VerdictSignature):
        if len(message.accused) != 20 or len(message.evidence_hash) != 32 or len(message.account) != 20:
            raise ProtocolError("verdict.accused/account must be 20 bytes and evidence_hash 32 bytes")
        if len(message.signature) != 65:
            raise ProtocolError("verdict.signature must be 65 bytes")
    elif isinstance(message, Evidence):
        if len(message.accused) != 20 or message.replica < 0 or not 1 <= len(message.contributions) <= 64:
            raise ProtocolError("evidence.accused must be 20 bytes, replica >= 0, 1..64 contributions")
        if not all(isinstance(c, bytes) for c in message.contributions):
            raise ProtocolError("evidence.contributions must be envelope bytes")
        if len(message.distances) != len(message.contributions) or not all(
                isinstance(d, (int, float)) and not isinstance(d, bool) for d in message.distances):
            raise ProtocolError("evidence.distances must be one number per contribution")
    elif isinstance(message, Attestation):
        for name in ("weights_hash", "contributions_root"):
            if len(getattr(message, name)) != 32:
                raise ProtocolError(f"attestation.{name} must be 32 bytes")
        for name in ("shard_hash", "checkpoint_hash"):
            if len(getattr(message, name)) not in (0, 32):
                raise ProtocolError(f"attestation.{name} must be empty or 32 bytes")
        if len(message.stage_leaf) not in (0, STAGE_LEAF_BYTES):
            raise ProtocolError(f"attestation.stage_leaf must be empty or {STAGE_LEAF_BYTES} bytes")
        for name in ("num_contributions", "tokens"):  # the record's ranges (RecordSignature)
            if not 0 <= getattr(message, name) < 1 << 64:
                raise ProtocolError(f"attestation.{name} must be in [0, 2^64)")


def _container_bound(cls: type) -> dict[str, Any]:
    """msgpack hooks refusing more maps and arrays than a payload of ``cls`` can hold.

    Checked while decoding: containers are built before any key is looked at, and a payload of
    nested empty arrays costs ~60 bytes of Python list per byte (129 MiB for 2 MiB).
    """
    hints = get_type_hints(cls)
    lists = sum(1 for f in fields(cls) if str(hints[f.name]).startswith("list"))
    bound = 1 + lists + (4096 if cls is Close else 0)  # a close holds up to 4096 entry lists
    return container_bound(bound, lambda: ValueError(f"more than {bound} maps and arrays"))
