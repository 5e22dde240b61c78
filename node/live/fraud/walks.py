"""A withheld committed state, or sum tree, opened one leaf at a time through availability challenges
(docs/FRAUD_PROOF.md, "The data-availability challenge"): what a walk of node/live/fraud/challenges.py has
learnt so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from ledger.availability import WEIGHTS, sums_which
from ledger.chunkproof import Factors, StageLeaf, StageState
from ledger.records import RoundRecord


@dataclass
class Walk:
    """A withheld committed state opened one leaf at a time through availability challenges
    (docs/FRAUD_PROOF.md, "The data-availability challenge"): each answer's path says which subtree of the
    committed tree differs from this node's (:func:`ledger.availability.differing_subtree`), so a differing
    chunk is found in at most ``log2(chunks)`` challenges; then the chunk's leaf of the other tree is opened
    too (or is this node's, where that tree's committed root is), and the proof is built from the opened
    leaves."""

    outer_round: int
    stage: int
    record: RoundRecord
    prev_record: RoundRecord
    prev_stages: list[StageLeaf]
    stages: list[StageLeaf]
    prev: StageState  # this node's state of round t - 1 (the committed one), held here for the proof
    own: StageState
    which: int = WEIGHTS  # the open challenge's tree and chunk
    chunk: int = 0
    # which -> (chunk, leaf, path)
    opened: dict[int, tuple[int, bytes, list[bytes]]] = field(default_factory=dict)


@dataclass
class SumWalk:
    """A withheld sum tree of a version-3 round opened one leaf at a time through availability challenges
    (``which = 2 + M + j``): contribution ``contribution`` of the committed ``factors`` (this node's
    ``mine``), whose committed tree or total is not this node's. Each answer's path carries its siblings'
    sums, so it shows the committed tree's total (a total other than the factors' is proven at any chunk) and
    which subtree holds a leaf other than this node's (:func:`ledger.normproof.differing_sum_subtree`): a lied
    leaf is found in at most ``ceil(log2(chunks)) + 1`` challenges. Then, where the committed weights leaf of
    that chunk is not had (this node's own where the weights root is, or the state an attester serves), it is
    challenged too (``WEIGHTS``)."""

    outer_round: int
    stage: int
    record: RoundRecord
    leaves: list[bytes]  # the round's committed stage leaves, encoded
    factors: Factors  # the committed factors (published through a FACTORS challenge, or served)
    own: StageState
    contribution: int
    mine: int
    chunk: int = 0
    opened: tuple[bytes, list[bytes]] | None = None  # the lied sum leaf found, with its sum path

    @property
    def which(self) -> int:
        """The tree the next challenge names: the contribution's sum tree, then the weights."""
        return sums_which(len(self.factors.envelopes), self.contribution) if self.opened is None else WEIGHTS
