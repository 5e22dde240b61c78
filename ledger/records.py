"""Plain dataclasses for what goes onto and comes back from the ledger (bytes, ints and hex addresses).

Losses are stored on chain as integers scaled by 1e6 ("micro"): :func:`to_micro` and :func:`from_micro`
convert. Hashes and roots are 32 raw bytes; addresses are checksummed 0x-hex strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eth_utils import is_address, to_checksum_address

from ledger.errors import LedgerInputError

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
UINT128_MAX = 2**128 - 1
MICRO = 1_000_000
BPS = 10_000


def to_micro(value: float) -> int:
    """``value`` x 1e6 rounded to an integer, as the ledger stores losses (must be finite and >= 0)."""
    if not math.isfinite(value) or value < 0:
        raise LedgerInputError(f"loss {value!r}: must be finite and >= 0 to be stored on the ledger")
    scaled = round(value * MICRO)
    if scaled > UINT64_MAX:
        raise LedgerInputError(f"loss {value!r}: too large for a uint64 micro value")
    return scaled


def from_micro(value: int) -> float:
    """Inverse of :func:`to_micro`."""
    return value / MICRO


def check_bytes32(name: str, value: bytes) -> bytes:
    """Return ``value`` if it is 32 bytes, else raise LedgerInputError naming ``name``."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != 32:
        raise LedgerInputError(f"{name}: must be 32 bytes, got {type(value).__name__} of length {len(value)}")
    return bytes(value)


def check_uint(name: str, value: int, maximum: int) -> int:
    """Return ``value`` if it is an int in [0, maximum], else raise LedgerInputError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise LedgerInputError(f"{name}={value!r}: must be an integer in [0, {maximum}]")
    return value


ZERO_HASH = bytes(32)
#: joinRun's ``platform`` of a member that declared none (training.declaration.NO_PLATFORM).
NO_PLATFORM = ZERO_HASH


def check_address(name: str, value: str) -> str:
    """Return ``value`` checksummed if it is a 0x-hex 20-byte address, else raise LedgerInputError."""
    if not isinstance(value, str) or not is_address(value):
        raise LedgerInputError(f"{name}={value!r}: must be a 0x-prefixed 20-byte hex address")
    return to_checksum_address(value)


@dataclass(frozen=True)
class RoundRecord:
    """One outer round's record, as members sign it and TrainingLedger.commitRound takes it.

    The EIP-712 type ``Record`` (:mod:`ledger.attest`). ``prev_head`` is the run's chain head before the round
    (``LedgerClient.head_of``), so a signature cannot be replayed on a later round; ``checkpoint_hash`` is
    the content hash of the round's checkpoint, or 32 zero bytes when the round publishes none.
    """

    run_id: int
    round: int
    prev_head: bytes  # 32 bytes: the run's head before this round
    weights_root: bytes  # 32 bytes: root over the stage weight hashes after the outer step
    contributions_root: bytes  # 32 bytes: ledger.merkle.merkle_root of the round's signed contributions
    train_loss_micro: int
    eval_loss_micro: int
    tokens: int
    num_contributors: int
    checkpoint_hash: bytes = ZERO_HASH  # 32 bytes; zero: no checkpoint this round

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, UINT64_MAX)
        for name in ("prev_head", "weights_root", "contributions_root", "checkpoint_hash"):
            object.__setattr__(self, name, check_bytes32(name, getattr(self, name)))
        check_uint("train_loss_micro", self.train_loss_micro, UINT64_MAX)
        check_uint("eval_loss_micro", self.eval_loss_micro, UINT64_MAX)
        check_uint("tokens", self.tokens, UINT64_MAX)
        check_uint("num_contributors", self.num_contributors, UINT32_MAX)

    @property
    def has_checkpoint(self) -> bool:
        """Whether the round publishes a checkpoint."""
        return self.checkpoint_hash != ZERO_HASH

    def fields(self) -> tuple:
        """The values in the order of the Solidity struct ``Record`` (and of its EIP-712 type)."""
        return (
            self.run_id,
            self.round,
            self.prev_head,
            self.weights_root,
            self.contributions_root,
            self.train_loss_micro,
            self.eval_loss_micro,
            self.tokens,
            self.num_contributors,
            self.checkpoint_hash,
        )

    @classmethod
    def from_fields(cls, values) -> RoundRecord:
        """The record of a decoded ``Record`` tuple (struct order)."""
        run_id, round, prev_head, weights, contributions, train, evaluation, tokens, contributors, \
            ckpt = values
        return cls(
            run_id,
            round,
            bytes(prev_head),
            bytes(weights),
            bytes(contributions),
            train,
            evaluation,
            tokens,
            contributors,
            bytes(ckpt),
        )


@dataclass(frozen=True)
class Verdict:
    """The outcome of an accusation, as members sign it (EIP-712 type ``Verdict``)."""

    run_id: int
    accused: str
    evidence_hash: bytes
    guilty: bool

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        object.__setattr__(self, "accused", check_address("accused", self.accused))
        object.__setattr__(self, "evidence_hash", check_bytes32("evidence_hash", self.evidence_hash))
        if not isinstance(self.guilty, bool):
            raise LedgerInputError(f"guilty={self.guilty!r}: must be a bool")

    def fields(self) -> tuple:
        """The values in the order of the Solidity struct ``Verdict``."""
        return (self.run_id, self.accused, self.evidence_hash, self.guilty)


@dataclass(frozen=True)
class RoundVerdict:
    """The settlement of a committed round's disputes, as the round's counted members sign it (EIP-712 type
    ``RoundVerdict``): ``upheld`` keeps the record, otherwise its attesters are slashed and the run halts."""

    run_id: int
    round: int
    record_hash: bytes  # the committed record's struct hash (recordHashOf)
    upheld: bool

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, UINT64_MAX)
        object.__setattr__(self, "record_hash", check_bytes32("record_hash", self.record_hash))
        if not isinstance(self.upheld, bool):
            raise LedgerInputError(f"upheld={self.upheld!r}: must be a bool")

    def fields(self) -> tuple:
        """The values in the order of the Solidity struct ``RoundVerdict``."""
        return (self.run_id, self.round, self.record_hash, self.upheld)


#: Dispute case states, as ``TrainingLedger.DisputeStatus`` numbers them.
DISPUTE_STATUSES = ("none", "open", "upheld", "overturned", "lapsed")


#: A point in chain order: (block number, log index). Comparing positions orders events and transactions.
Position = tuple[int, int]


def end_of_block(block_number: int) -> Position:
    """The position after every event of ``block_number``."""
    return (block_number, 2**63)


@dataclass(frozen=True)
class CommitRecord:
    """A RoundCommitted event: the record, who submitted it, who attested it and the chain head after it."""

    commit: RoundRecord
    submitter: str
    attesters: tuple[str, ...]  # ascending, as the contract checked them
    head_hash: bytes
    block_number: int
    log_index: int
    tx_hash: str

    @property
    def position(self) -> Position:
        return (self.block_number, self.log_index)


#: Member seat states, as ``TrainingLedger.MemberStatus`` numbers them.
MEMBER_STATUSES = ("none", "active", "unbonding", "slashed")
#: Accusation states, as ``TrainingLedger.AccusationStatus`` numbers them.
ACCUSATION_STATUSES = ("none", "open", "guilty", "cleared", "expired")


@dataclass(frozen=True)
class Member:
    """A seat as the contract holds it now (``memberOf``)."""

    run_id: int
    account: str
    node_key: bytes
    stake: int  # dispute bonds included
    unbonding_end: int  # first block at which the stake can be withdrawn (after leaving)
    open_accusations: int
    status: str  # one of MEMBER_STATUSES except "none"
    active_round: int = 0  # the first round it has not attested (ejectable once inactivity_rounds behind)
    join_round: int = 0  # the commit count when it joined: in force for this round and later ones
    left_round: int = 0  # the commit count when it left, was ejected or slashed (when not active)
    join_block: int = 0
    counted_block: int = 0  # block from which its signatures count toward quorums; 0: not counted

    @property
    def counted(self) -> bool:
        """Whether its signature counts toward the run's quorums now (active and counted)."""
        return self.status == "active" and self.counted_block != 0

    @property
    def active(self) -> bool:
        return self.status == "active"


@dataclass(frozen=True)
class AccusationState:
    """An accusation as the contract holds it now (``accusationOf``)."""

    run_id: int
    accused: str
    evidence_hash: bytes
    status: str  # one of ACCUSATION_STATUSES
    accuser: str
    opened_block: int
    deadline: int  # the first block at which it lapses and takes no verdict
    quorum: int  # verdict signatures it needs
    bond: int

    @property
    def open(self) -> bool:
        return self.status == "open"


@dataclass(frozen=True)
class Membership:
    """One period of an account's membership of a run, rebuilt from events.

    It starts at MemberJoined and ends (as a signer) at MemberLeft or MemberSlashed; ``withdrawn_block`` is
    set once the stake is taken back. An account that withdrew may join again: that is another Membership.
    """

    run_id: int
    account: str
    node_key: bytes
    stake: int
    joined: Position
    joined_tx: str
    left: Position | None = None  # MemberLeft
    unbonding_end: int | None = None
    slashed: Position | None = None  # MemberSlashed
    withdrawn_block: int | None = None
    ejected: Position | None = None  # MemberEjected (a MemberLeft follows it): ejected for inactivity
    counted: Position | None = None  # MemberCounted: its signatures count toward quorums from here on
    platform: bytes = NO_PLATFORM  # MemberJoined's declaration: the hash of the platform it trains on

    @property
    def ended(self) -> Position | None:
        """Where the account stopped being able to sign (left or slashed), or None."""
        ends = [end for end in (self.left, self.slashed) if end is not None]
        return min(ends) if ends else None

    def in_force(self, position: Position) -> bool:
        """Whether the account was a signing member at ``position`` (e.g. a commit's (block, log index)).

        The rule of the contract: joined before and neither left nor slashed before.
        """
        ended = self.ended
        return self.joined < position and (ended is None or ended > position)

    def counted_at(self, position: Position) -> bool:
        """Whether the account's signature counted toward a quorum at ``position``: counted before it and
        neither left nor slashed before it (a commit's own MemberCounted events come before its
        RoundCommitted)."""
        ended = self.ended
        return self.counted is not None and self.counted < position and (ended is None or ended > position)


@dataclass(frozen=True)
class Registration:
    """A NodeRegistered event; ``unregistered_block`` is set if the account left again later."""

    account: str
    pubkey: bytes  # raw 32-byte ed25519 public key
    signature: bytes  # 64-byte ed25519 signature over ledger.binding.binding_message(...)
    stake: int
    block_number: int
    tx_hash: str
    unregistered_block: int | None = None

    @property
    def active(self) -> bool:
        """Whether the registration was still in force when it was read."""
        return self.unregistered_block is None

    def in_force(self, first_block: int, last_block: int | None = None) -> bool:
        """Whether the registration was in force at some block of ``[first_block, last_block]``.

        The one rule of the project: registered at or before the range's last block and not unregistered
        by its first. ``last_block=None`` asks about the single block ``first_block``.
        """
        last_block = first_block if last_block is None else last_block
        return self.block_number <= last_block and (
            self.unregistered_block is None or self.unregistered_block > first_block
        )
