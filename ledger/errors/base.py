"""The ledger package's own errors: the root, configuration, input, the chain's RPC and transactions,
and the base of every contract revert."""

from __future__ import annotations

class LedgerError(Exception):
    """Root of the errors of ``ledger/``."""


class LedgerConfigError(LedgerError, ValueError):
    """A ``[ledger]`` setting is missing, malformed or out of range."""


class LedgerInputError(LedgerError, ValueError):
    """A value handed to the ledger client is malformed (wrong length, out of range)."""


class LedgerDecodeError(LedgerError, ValueError):
    """A log from the chain's RPC does not decode against the contract's ABI (wrong topics, bad ABI data)."""


class ChainUnavailable(LedgerError):
    """The chain's RPC endpoint cannot be reached (after retries), or a managed anvil will not start."""


class ChainWaitStopped(ChainUnavailable):
    """The caller asked to stop while waiting for an unreachable RPC (a node stopped during start-up)."""


class AccountError(LedgerError):
    """The node's Ethereum account cannot be loaded or created (keystore, password, dev key refused)."""


class RpcRejected(LedgerError):
    """The chain node refused a request outright (e.g. insufficient funds for gas, invalid transaction)."""


class DeploymentMismatch(LedgerError):
    """The configured addresses do not hold the expected dlx-node contracts on this chain."""


class TransactionTimeout(LedgerError):
    """A sent transaction was not mined in time; it may still be mined later."""


class FeeCapTooLow(TransactionTimeout):
    """The chain's base fee is above the configured fee cap (``ledger.max_fee_gwei``): nothing is mined
    until the market falls below it or the cap is raised. A TransactionTimeout: a node retries later."""


class TransactionDropped(TransactionTimeout):
    """A mined transaction left the chain in a reorg and its nonce was then taken by another transaction,
    so it cannot be broadcast again: the caller re-checks the chain and sends anew."""


class CommitConflict(LedgerError):
    """The round is already committed on chain with a different record than the node tried to commit."""

    def __init__(self, message: str, *, on_chain: object = None, attempted: object = None):
        super().__init__(message)
        self.on_chain = on_chain
        self.attempted = attempted


class AuditError(LedgerError):
    """An auditor check found the on-chain record inconsistent (broken hash chain, bytecode mismatch)."""


class ContractRevert(LedgerError):
    """A contract call reverted. Subclasses are named after the Solidity custom error.

    Attributes:
        values: The error's decoded arguments by parameter name.
        data: The raw revert data (selector + ABI-encoded arguments).
    """

    def __init__(self, message: str, *, values: dict | None = None, data: bytes = b""):
        super().__init__(message)
        self.values = dict(values or {})
        self.data = data


class UnknownRevert(ContractRevert):
    """A revert whose data matches no custom error of the dlx-node contracts (or carries no data)."""


class LedgerWeakParams(LedgerInputError):
    """Run parameters below the security model's floor (k < 2 or quorum fraction < 1/2) without an explicit
    ``allow_weak_quorum``."""
