"""A run's parameters: what ``TrainingLedger.createRun`` takes (:class:`RunParams`) and what a run was created
with (:class:`RunInfo`, from its RunCreated event), their defaults and the contract's quorum rule
(docs/LEDGER.md, "Run parameters")."""

from __future__ import annotations

from dataclasses import dataclass

from ledger.records import BPS, UINT16_MAX, UINT32_MAX, UINT64_MAX, UINT128_MAX, check_bytes32, check_uint

#: The contract's shortest accusation deadline and dispute window (TrainingLedger.minWindowBlocks()).
MIN_WINDOW_BLOCKS = 8
#: The contract's longest unbonding period and window (TrainingLedger.maxUnbondingBlocks()).
MAX_UNBONDING_BLOCKS = 2**32
#: Defaults of :class:`RunParams` (docs/LEDGER.md, "Run parameters").
DEFAULT_ACCUSATION_BLOCKS = 64
DEFAULT_DISPUTE_BLOCKS = 64
DEFAULT_INACTIVITY_ROUNDS = 16
#: Rounds a joiner is in force before its signature counts toward quorums (founders count at once).
DEFAULT_TENURE_ROUNDS = 4
#: The security model's floor (docs/TRUST.md): at least this many counted signatures (k) and at least this
#: fraction of the counted members; weaker runs need ``allow_weak_quorum``.
SAFE_MIN_QUORUM = 2
SAFE_MIN_QUORUM_BPS = 5000
#: Without an explicit bond, an accuser or disputer deposits this fraction of the run's stake.
DEFAULT_BOND_DIVISOR = 10
#: ``RunParams.commitments`` when a run's creator names none: version 3, the number of the commitment scheme
#: ("normed") that a fraud-provable run's ``diloco.commitments = "auto"`` resolves to. The ledger knows only
#: numbers (the contract checks the range); their names, and what each version commits, are the node's
#: registry of commitment schemes (node/commitments/registry.py; tests/test_commitment_schemes.py checks
#: that the two agree).
DEFAULT_COMMITMENTS = 3
#: issue 62: the contract's bounds of a fraud proof's cost and the constants of its conservative formula
#: (LedgerCore.proofCost; measured by bench/fraud_proof_bounds.py, bench/results/fraud_proof_bounds.json).
PROOF_MAX_GAS = 10_000_000
PROOF_MAX_CALLDATA = 131_072
MAX_RANK = 64
PROOF_GAS_BASE, PROOF_GAS_PER_PIECE, PROOF_GAS_PER_RANK = 2_200_000, 430_000, 13_200
PROOF_BYTES_BASE, PROOF_BYTES_PER_PIECE, PROOF_BYTES_PER_RANK = 16_000, 1_700, 134
#: issue 79 (point 4): the most active members a run holds (TrainingLedger.maxSeats(); joinRun refuses more:
#: LedgerRunFull). A proof slashes every attester of its round: proof_cost counts PROOF_BASE_ATTESTERS, each
#: further seat adds at most PROOF_GAS_PER_ATTESTER (LedgerCore; tests/test_proof_at_full_seats.py measures
#: it).
MAX_SEATS = 256
PROOF_BASE_ATTESTERS, PROOF_GAS_PER_ATTESTER = 32, 32_000
PROOF_SEATS_GAS = (MAX_SEATS - PROOF_BASE_ATTESTERS) * PROOF_GAS_PER_ATTESTER
#: ``RunParams.max_rank`` when a creator names none: the decoder's (training/codec_wire.py MAX_RANK), the
#: only one safe while the decoder accepts any rank up to it (a lower one would make an honest round that
#: accepted a higher-rank contribution provably wrong).
DEFAULT_MAX_RANK = MAX_RANK


def proof_cost(max_contributions: int, max_rank: int) -> tuple[int, int]:
    """The contract's bound (``LedgerCore.proofCost``) on the gas and calldata of a run's worst proof."""
    gas = PROOF_GAS_BASE + max_contributions * (PROOF_GAS_PER_PIECE + max_rank * PROOF_GAS_PER_RANK)
    size = PROOF_BYTES_BASE + max_contributions * (PROOF_BYTES_PER_PIECE + max_rank * PROOF_BYTES_PER_RANK)
    return gas, size


def proof_gas_bound(max_contributions: int, max_rank: int) -> int:
    """The gas of a run's worst proof at its largest quorum (:data:`MAX_SEATS` attesters slashed): the
    contract's ``proofCost`` bound (at most :data:`PROOF_MAX_GAS` at createRun) and the seats beyond the
    :data:`PROOF_BASE_ATTESTERS` it counts."""
    return proof_cost(max_contributions, max_rank)[0] + PROOF_SEATS_GAS


def most_contributions(max_rank: int) -> int:
    """The most contributions a fraud-provable run of ``max_rank`` may list per stage and round (0: none)."""
    count = 0
    while count < UINT16_MAX:
        gas, size = proof_cost(count + 1, max_rank)
        if gas > PROOF_MAX_GAS or size > PROOF_MAX_CALLDATA:
            break
        count += 1
    return count


#: ``RunParams.max_contributions`` when a creator names none: the most the bounds allow at the default rank.
DEFAULT_MAX_CONTRIBUTIONS = most_contributions(DEFAULT_MAX_RANK)
#: ``RunParams.max_game_steps`` of hand-made parameters (issue 62): the bisection of a stage of up to 2^20
#: chunks, and four steps more (a sum tree, the factors, a stage leaf); create-run computes it from the model
#: (:func:`game_steps_for`).
DEFAULT_MAX_GAME_STEPS = 24
#: Steps a game takes beyond the bisection of the largest stage's chunks (the stage leaf, the factors, the
#: weights and momentum leaves of the differing chunk).
EXTRA_GAME_STEPS = 4


def game_steps_for(max_chunks: int) -> int:
    """``max_game_steps`` for a run whose largest stage has ``max_chunks`` chunks: ``ceil(log2(chunks))``
    openings find a differing chunk (ledger.availability.differing_subtree), plus :data:`EXTRA_GAME_STEPS`."""
    if max_chunks < 1:
        raise ValueError(f"max_chunks={max_chunks}: a stage has at least one chunk")
    return min((max_chunks - 1).bit_length() + EXTRA_GAME_STEPS, UINT16_MAX)


def proof_window_bound(dispute_blocks: int, accusation_blocks: int, max_game_steps: int) -> int:
    """The longest a round's proof window lasts after its commit (TrainingLedger.proofWindowOf; the
    contract's floor on ``unbonding_blocks``): the dispute window, a game of ``max_game_steps`` steps of two
    accusation windows each (the answer's deadline, then the fresh window for the next step), the last
    step's expiry window and a child's grace."""
    return dispute_blocks + (2 * max_game_steps + 2) * accusation_blocks


def required_quorum(k: int, quorum_bps: int, counted: int) -> int:
    """The contract's quorum rule: ``max(k, ceil(quorum_bps / 10000 x counted))`` member signatures.

    ``counted`` is the number of members able to sign: the active members for a commit, the active
    counted members (the accused included) when an accusation is opened (its verdict's quorum).
    """
    return max(k, -(-quorum_bps * counted // BPS))


@dataclass(frozen=True)
class RunParams:
    """What ``TrainingLedger.createRun`` takes (Solidity struct ``RunParams``); a run's parameters never
    change.

    ``bond=None`` is a tenth of ``min_stake``; ``unbonding_blocks=None`` is the contract's floor, the longest
    proof window (:func:`proof_window_bound`). Only ranges are checked here; the contract's rules (floors,
    ceilings, ``quorum_bps <= 10000``) are left to it, so a refusal is its named custom error.
    """

    config_hash: bytes
    num_stages: int
    inner_steps: int
    min_stake: int = 0
    quorum: int = SAFE_MIN_QUORUM  # k: the fewest counted signatures a commit or a verdict needs
    quorum_bps: int = SAFE_MIN_QUORUM_BPS  # the quorum is also at least this fraction (bps) of members
    bond: int | None = None  # wei an accuser or disputer deposits
    unbonding_blocks: int | None = None
    accusation_blocks: int = DEFAULT_ACCUSATION_BLOCKS
    dispute_blocks: int = DEFAULT_DISPUTE_BLOCKS
    inactivity_rounds: int = DEFAULT_INACTIVITY_ROUNDS
    max_rounds: int = 0
    tenure_rounds: int = DEFAULT_TENURE_ROUNDS
    commitments: int = DEFAULT_COMMITMENTS  # the run's commitment scheme's version (its document's)
    # issue 62: per-round values (node/commitments/values.py derives them from a run document; LEDGER.md)
    schedule_root: bytes = bytes(32)  # root over each round's (round, lr bits, mu bits) leaf
    schedule_rounds: int = 0  # the schedule's leaves; 0: the values are unbound (only hand-made runs)
    nesterov: bool = True
    norm_clip_bits: int = 0  # the run's norm_clip, float64 bits
    genesis_root: bytes = bytes(32)  # round 0's start (zero: round 0 cannot be proven)
    max_contributions: int = DEFAULT_MAX_CONTRIBUTIONS
    max_rank: int = DEFAULT_MAX_RANK

    #: The per-round values' field names (issue 62), shared by RunParams and RunInfo.
    VALUES = ("schedule_root", "schedule_rounds", "nesterov", "norm_clip_bits", "genesis_root",
              "max_contributions", "max_rank")
    # issue 62: the clock
    max_game_steps: int = DEFAULT_MAX_GAME_STEPS  # steps of one availability game (game_steps_for)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config_hash", check_bytes32("config_hash", self.config_hash))
        check_uint("max_contributions", self.max_contributions, UINT16_MAX)
        check_uint("commitments", self.commitments, 255)
        check_uint("num_stages", self.num_stages, UINT32_MAX)
        check_uint("inner_steps", self.inner_steps, UINT32_MAX)
        check_uint("min_stake", self.min_stake, 2**256 - 1)
        check_uint("quorum", self.quorum, UINT16_MAX)
        check_uint("quorum_bps", self.quorum_bps, UINT16_MAX)
        check_uint("accusation_blocks", self.accusation_blocks, UINT64_MAX)
        check_uint("dispute_blocks", self.dispute_blocks, UINT64_MAX)
        check_uint("inactivity_rounds", self.inactivity_rounds, UINT32_MAX)
        check_uint("max_rounds", self.max_rounds, UINT64_MAX)
        check_uint("tenure_rounds", self.tenure_rounds, UINT32_MAX)
        check_uint("max_game_steps", self.max_game_steps, UINT16_MAX)
        if self.bond is None:
            object.__setattr__(self, "bond", min(self.min_stake // DEFAULT_BOND_DIVISOR, UINT128_MAX))
        check_uint("bond", self.bond, UINT128_MAX)
        if self.unbonding_blocks is None:
            object.__setattr__(self, "unbonding_blocks", proof_window_bound(
                self.dispute_blocks, self.accusation_blocks, self.max_game_steps))
        check_uint("unbonding_blocks", self.unbonding_blocks, UINT64_MAX)
        object.__setattr__(self, "schedule_root", check_bytes32("schedule_root", self.schedule_root))
        object.__setattr__(self, "genesis_root", check_bytes32("genesis_root", self.genesis_root))
        check_uint("schedule_rounds", self.schedule_rounds, UINT64_MAX)
        check_uint("norm_clip_bits", self.norm_clip_bits, UINT64_MAX)
        check_uint("max_contributions", self.max_contributions, UINT16_MAX)
        check_uint("max_rank", self.max_rank, 255)

    def fields(self) -> tuple:
        """The values in the order of the Solidity struct ``RunParams``."""
        return (
            self.config_hash,
            self.num_stages,
            self.inner_steps,
            self.min_stake,
            self.quorum,
            self.quorum_bps,
            self.bond,
            self.unbonding_blocks,
            self.accusation_blocks,
            self.dispute_blocks,
            self.inactivity_rounds,
            self.max_rounds,
            self.tenure_rounds,
            self.commitments,
            self.schedule_root,
            self.schedule_rounds,
            bool(self.nesterov),
            self.norm_clip_bits,
            self.genesis_root,
            self.max_contributions,
            self.max_rank,
            self.max_game_steps,
        )

    def weaknesses(self) -> list[str]:
        """What these parameters give up against the security model (docs/TRUST.md); empty when safe."""
        weak = []
        if self.quorum < SAFE_MIN_QUORUM:
            weak.append(f"k={self.quorum}: one member alone commits any record and decides any verdict "
                        f"(safe: k >= {SAFE_MIN_QUORUM})")
        if self.quorum_bps < SAFE_MIN_QUORUM_BPS:
            weak.append(f"quorum_bps={self.quorum_bps}: a quorum can be fewer than half of the counted "
                        f"members, so a minority commits and slashes (safe: >= {SAFE_MIN_QUORUM_BPS})")
        if self.min_stake == 0:
            weak.append("min_stake=0: seats cost nothing, so anyone can take as many as it likes")
        return weak


@dataclass(frozen=True)
class RunInfo:
    """A run as created on chain (from its RunCreated event); its parameters never change."""

    run_id: int
    config_hash: bytes
    creator: str
    num_stages: int
    inner_steps: int
    min_stake: int  # wei each member stakes
    quorum: int  # k: the fewest member signatures a commit or a verdict needs
    unbonding_blocks: int  # blocks between leaving and withdrawing the stake
    max_rounds: int  # rounds 0 .. max_rounds-1 may be committed; 0: open-ended
    genesis_head: bytes
    config_uri: str
    block_number: int
    tx_hash: str
    quorum_bps: int = 0  # the quorum is also at least this fraction (basis points) of the members counted
    bond: int = 0  # wei an accuser or a disputer deposits
    accusation_blocks: int = 0  # blocks an accusation stays open before it lapses
    dispute_blocks: int = 0  # blocks after a commit during which it can be disputed
    inactivity_rounds: int = 0  # committed rounds without a member's signature before it can be ejected
    tenure_rounds: int = 0  # rounds a joiner is in force before its signature counts (founders at once)
    commitments: int = DEFAULT_COMMITMENTS  # its commitment scheme's version (node.commitments)
    # issue 62: per-round values (RunParams')
    schedule_root: bytes = bytes(32)
    schedule_rounds: int = 0
    nesterov: bool = True
    norm_clip_bits: int = 0
    genesis_root: bytes = bytes(32)
    max_contributions: int = 0
    max_rank: int = 0
    # issue 62: the clock
    max_game_steps: int = DEFAULT_MAX_GAME_STEPS  # steps of one availability game

    @property
    def min_unbonding_blocks(self) -> int:
        """The contract's floor on ``unbonding_blocks``: the longest proof window
        (:func:`proof_window_bound`), itself at least the accusation deadline plus the dispute window."""
        return proof_window_bound(self.dispute_blocks, self.accusation_blocks, self.max_game_steps)

    def quorum_for(self, counted: int) -> int:
        """The signatures a commit (or verdict) needs with ``counted`` members able to sign."""
        return required_quorum(self.quorum, self.quorum_bps, counted)


def case_course_blocks(accusation_blocks: int) -> int:
    """Blocks a contribution case (issue 78, StepProver.openCase) takes from its opening to its end: claims
    for one clock, then a challenge and a full game on the last claim (each side's clock), the clock being the
    run's ``accusation_blocks``: 4 clocks and a block. A case is refused unless it ends inside the round's
    proof window, which closes at least ``dispute_blocks`` after the commit."""
    return 4 * accusation_blocks + 1


def case_dispute_blocks(accusation_blocks: int) -> int:
    """create-run's default ``dispute_blocks`` for a run whose clock is ``accusation_blocks``: a case's course
    and one clock more to notice a wrong contribution and commit and open its case (320 at the default 64)."""
    return case_course_blocks(accusation_blocks) + accusation_blocks - 1


def case_room(accusation_blocks: int, dispute_blocks: int) -> int:
    """Blocks after a round's commit in which a contribution case can still be opened (its commitment sent in
    the commit's block at the earliest, its opening a block later) and end in the proof window; 0: none."""
    return max(0, dispute_blocks - case_course_blocks(accusation_blocks) - 1)
