"""EIP-1559 fees: the policy a sender follows (cap, tip, replacement, confirmations) and the pure rule that
prices a transaction sent now (docs/LEDGER.md, "Chains that are not anvil"). The RPC reads and the sending
are :class:`ledger.tx.TransactionSender`'s."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ledger.errors import FeeCapTooLow, LedgerInputError


@dataclass(frozen=True)
class FeePolicy:
    """EIP-1559 fees and what to do while a transaction waits (docs/LEDGER.md, "Chains that are not anvil").

    Args:
        max_fee_cap: Highest ``maxFeePerGas`` ever offered, in wei per gas (0: no cap). While the base fee
            is above it nothing is sent and :class:`FeeCapTooLow` is raised once ``receipt_timeout`` passes.
        priority_fee: The tip in wei per gas; None asks the node (``eth_maxPriorityFeePerGas``).
        replace_after: Seconds a sent transaction may stay unmined before it is replaced by the same
            transaction (same nonce) with fees raised to the market and by at least ``bump``.
        bump: Factor by which a replacement raises both fees (nodes want at least 1.10).
        confirmations: Blocks, the transaction's own included, before a mined transaction counts as final
            (0 and 1: once mined). While it waits, a reorg that drops it makes it be broadcast again.
    """

    max_fee_cap: int = 0
    priority_fee: int | None = None
    replace_after: float = 20.0
    bump: float = 1.125
    confirmations: int = 1

    def __post_init__(self) -> None:
        if self.max_fee_cap < 0 or (self.priority_fee is not None and self.priority_fee < 0):
            raise LedgerInputError("fee cap and priority fee must be >= 0 wei")
        if self.replace_after <= 0 or self.bump < 1.1 or self.confirmations < 0:
            raise LedgerInputError("replace_after must be > 0 s, bump >= 1.1, confirmations >= 0")


DEFAULT_FEES = FeePolicy()


def market_fees(policy: FeePolicy, base_fee: int, priority: int, what: str,
                floor: dict | None = None) -> dict:
    """Fees for a transaction sent now at ``base_fee`` with tip ``priority`` (wei per gas): tip + twice the
    base fee (room for six full blocks' rise), at least ``policy.bump`` x ``floor`` (a replacement's), at most
    the cap. FeeCapTooLow if the cap is below the base fee: nothing offered under it could be mined."""
    max_fee = 2 * base_fee + priority
    if floor is not None:
        priority = max(priority, math.ceil(floor["maxPriorityFeePerGas"] * policy.bump) + 1)
        max_fee = max(max_fee, math.ceil(floor["maxFeePerGas"] * policy.bump) + 1, priority)
    cap = policy.max_fee_cap
    if cap:
        if base_fee >= cap:
            raise FeeCapTooLow(
                f"{what}: the chain's base fee is {base_fee / 1e9:g} gwei, at or above the fee "
                f"cap of {cap / 1e9:g} gwei (ledger.max_fee_gwei): raise the cap or wait")
        max_fee = min(max_fee, cap)
        priority = min(priority, max_fee - base_fee)
    return {"maxPriorityFeePerGas": priority, "maxFeePerGas": max_fee, "type": 2}
