"""The chain's records of what happened in a run, as :mod:`ledger.history` reads them from event logs:
checkpoints, disputes, equivocations, accusations, slashings and a run's whole history.

The records a transaction takes and the run's parameters are in :mod:`ledger.records`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ledger.records import CommitRecord, Membership, Position, Registration, RoundRecord
from ledger.runparams import RunInfo


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint, published with the committed record of its round (``checkpointHash`` nonzero)."""

    run_id: int
    round: int
    content_hash: bytes
    uri: str  # derived: dlx://blob/<content hash hex>
    publisher: str  # the commit's submitter
    block_number: int
    tx_hash: str


def checkpoint_uri(content_hash: bytes) -> str:
    """Where a checkpoint with ``content_hash`` is fetched from peers."""
    return f"dlx://blob/{content_hash.hex()}"


@dataclass(frozen=True)
class DisputeRecord:
    """A RoundDisputed event: a member's own signed record for a round, differing from the committed one."""

    run_id: int
    round: int
    disputer: str
    record: RoundRecord
    signature: bytes
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class EquivocationRecord:
    """An EquivocationReported event: ``account`` signed two records (their struct hashes) for one round."""

    run_id: int
    round: int
    account: str
    record_hash_a: bytes
    record_hash_b: bytes
    reporter: str
    block_number: int
    tx_hash: str


@dataclass(frozen=True)
class AccusationRecord:
    """An AccusationOpened event and, once decided, its AccusationResolved event."""

    run_id: int
    accused: str
    accuser: str
    evidence_hash: bytes
    opened_block: int
    opened_tx: str
    resolved_block: int | None = None
    guilty: bool | None = None
    signers: tuple[str, ...] = ()
    bond: int = 0
    deadline: int = 0  # the first block at which it lapses
    quorum: int = 0  # verdict signatures it needs
    expired_block: int | None = None  # AccusationExpired: it lapsed undecided (the bond was forfeited)

    @property
    def open(self) -> bool:
        return self.resolved_block is None and self.expired_block is None


@dataclass(frozen=True)
class SlashRecord:
    """A MemberSlashed event (the cause is the EquivocationRecord or AccusationRecord of the same tx)."""

    run_id: int
    account: str
    stake: int
    block_number: int
    log_index: int
    tx_hash: str


@dataclass(frozen=True)
class RunHistory:
    """Everything the chain records about one run, in chain order, plus its current head."""

    run: RunInfo
    head_hash: bytes  # the contract's current headOf(run_id)
    commits: list[CommitRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    memberships: list[Membership] = field(default_factory=list)
    disputes: list[DisputeRecord] = field(default_factory=list)
    equivocations: list[EquivocationRecord] = field(default_factory=list)
    accusations: list[AccusationRecord] = field(default_factory=list)
    slashings: list[SlashRecord] = field(default_factory=list)
    registrations: list[Registration] = field(default_factory=list)
    # round -> upheld, overturned, lapsed, proven wrong
    dispute_outcomes: dict[int, str] = field(default_factory=dict)
    block_number: int = 0  # the block the history was read at (its events go up to it)

    @property
    def last_round(self) -> int | None:
        """The last committed round, or None if nothing is committed."""
        return self.commits[-1].commit.round if self.commits else None

    def members_at(self, position: Position) -> list[Membership]:
        """The memberships in force at ``position`` (a signer set), in join order."""
        return [membership for membership in self.memberships if membership.in_force(position)]

    def counted_at(self, position: Position) -> list[Membership]:
        """The memberships whose signatures counted toward a quorum at ``position``, in join order."""
        return [membership for membership in self.memberships if membership.counted_at(position)]
