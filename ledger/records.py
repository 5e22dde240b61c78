"""Plain dataclasses for what goes onto and comes back from the ledger (bytes, ints and hex addresses).

Losses are stored on chain as integers scaled by 1e6 ("micro"): :func:`to_micro` and :func:`from_micro`
convert. Hashes and roots are 32 raw bytes; addresses are checksummed 0x-hex strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ledger.errors import LedgerInputError

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
MICRO = 1_000_000


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


@dataclass(frozen=True)
class RoundCommit:
    """One outer round's commitment, as the node submits it (see TrainingLedger.commitRound)."""

    run_id: int
    round: int
    weights_root: bytes  # 32 bytes: root over the stage weight hashes after the outer step
    contributions_root: bytes  # 32 bytes: ledger.merkle.merkle_root of the round's signed contributions
    train_loss_micro: int
    eval_loss_micro: int
    tokens: int
    num_contributors: int

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, UINT64_MAX)
        object.__setattr__(self, "weights_root", check_bytes32("weights_root", self.weights_root))
        object.__setattr__(
            self, "contributions_root", check_bytes32("contributions_root", self.contributions_root)
        )
        check_uint("train_loss_micro", self.train_loss_micro, UINT64_MAX)
        check_uint("eval_loss_micro", self.eval_loss_micro, UINT64_MAX)
        check_uint("tokens", self.tokens, UINT64_MAX)
        check_uint("num_contributors", self.num_contributors, UINT32_MAX)

    def fields(self) -> tuple:
        """The commit's values in ``TrainingLedger.commitRound``'s argument order (also the hash-chain link's)."""
        return (
            self.run_id,
            self.round,
            self.weights_root,
            self.contributions_root,
            self.train_loss_micro,
            self.eval_loss_micro,
            self.tokens,
            self.num_contributors,
        )


@dataclass(frozen=True)
class RunInfo:
    """A run as created on chain (from its RunCreated event)."""

    run_id: int
    config_hash: bytes
    creator: str
    num_stages: int
    inner_steps: int
    genesis_head: bytes
    config_uri: str
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class CommitRecord:
    """A RoundCommitted event: the commit plus who made it and the chain head after it."""

    commit: RoundCommit
    committer: str
    head_hash: bytes
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class Registration:
    """A NodeRegistered event; ``unregistered_block`` is set if the account left again later."""

    account: str
    pubkey: bytes  # raw 32-byte ed25519 public key
    signature: bytes  # 64-byte ed25519 signature over ledger.client.binding_message(...)
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


@dataclass(frozen=True)
class CheckpointRecord:
    """A CheckpointPublished event."""

    run_id: int
    round: int
    content_hash: bytes
    uri: str
    publisher: str
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class DisputeRecord:
    """A RoundDisputed event."""

    run_id: int
    round: int
    disputer: str
    computed_weights_root: bytes
    computed_contributions_root: bytes
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class RunHistory:
    """Everything the chain records about one run, in chain order, plus its current head."""

    run: RunInfo
    head_hash: bytes  # the contract's current headOf(run_id)
    commits: list[CommitRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    disputes: list[DisputeRecord] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)

    @property
    def last_round(self) -> int | None:
        """The last committed round, or None if nothing is committed."""
        return self.commits[-1].commit.round if self.commits else None
