"""A run's per-round values on chain (issue 62; docs/FRAUD_PROOF.md, "The run's values"): the outer schedule's
tree, whose root and leaf count are ``RunParams.scheduleRoot`` and ``scheduleRounds``.

One leaf per round ``t`` of ``0 .. rounds - 1``::

    leaf(t) = abi.encode(uint64 t, uint32 lrBits, uint32 muBits)

the float32 bit patterns of the outer learning rate and momentum the step multiplies by in round ``t``
(training/schedule.py, rounded as training/diloco.py rounds them); a round past the end takes the last leaf,
so a schedule that is constant from some round on needs no more leaves than that. The tree is
:mod:`ledger.merkle`'s; a proof carries the leaf of ``min(t, rounds - 1)`` and its path
(``AggregationProof.schedule_leaf``, ``schedule_path``).
"""

from __future__ import annotations

from dataclasses import dataclass

from eth_abi import encode

from ledger.errors import LedgerInputError
from ledger.merkle import merkle_proof, merkle_root
from ledger.records import check_uint

SCHEDULE_LEAF_TYPES = ("uint64", "uint32", "uint32")


def schedule_leaf(round_: int, lr_bits: int, mu_bits: int) -> bytes:
    """The schedule leaf of round ``round_``."""
    check_uint("round", round_, 2**64 - 1)
    check_uint("lr_bits", lr_bits, 2**32 - 1)
    check_uint("mu_bits", mu_bits, 2**32 - 1)
    return encode(SCHEDULE_LEAF_TYPES, [round_, lr_bits, mu_bits])


@dataclass(frozen=True)
class Schedule:
    """A run's outer schedule as committed: ``bits[t] = (lr_bits, mu_bits)`` for rounds ``0 .. len - 1``."""

    bits: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.bits:
            raise LedgerInputError("a schedule has at least one round")

    @property
    def rounds(self) -> int:
        return len(self.bits)

    def leaves(self) -> list[bytes]:
        return [schedule_leaf(t, lr, mu) for t, (lr, mu) in enumerate(self.bits)]

    @property
    def root(self) -> bytes:
        cached = self.__dict__.get("_root")
        if cached is None:
            cached = merkle_root(self.leaves())
            object.__setattr__(self, "_root", cached)
        return cached

    def of_round(self, round_: int) -> tuple[int, int]:
        """The (lr_bits, mu_bits) the run commits for round ``round_``."""
        return self.bits[min(round_, self.rounds - 1)]

    def opening(self, round_: int) -> tuple[bytes, list[bytes]]:
        """The leaf a proof of round ``round_`` carries and its path."""
        index = min(round_, self.rounds - 1)
        leaves = self.leaves()
        return leaves[index], [sibling for sibling, _left in merkle_proof(leaves, index)]
