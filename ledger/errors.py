"""Errors of the ledger package.

``LedgerError`` is the root here (this package imports nothing from ``node/``). A contract revert becomes a
:class:`ContractRevert` subclass named exactly like the Solidity custom error (``LedgerRoundNotIncreasing``
and so on), whichever backend raised it: web3 raises ``ContractCustomError`` on a JSON-RPC node such as
anvil but eth-tester raises ``TransactionFailed`` on py-evm; ``ledger.tx.decode_revert`` maps both by the
error's 4-byte selector. The decoded arguments are in ``.values`` (a dict by parameter name).
"""

from __future__ import annotations


class LedgerError(Exception):
    """Root of the errors of ``ledger/``."""


class LedgerConfigError(LedgerError, ValueError):
    """A ``[ledger]`` setting is missing, malformed or out of range."""


class LedgerInputError(LedgerError, ValueError):
    """A value handed to the ledger client is malformed (wrong length, out of range)."""


class ChainUnavailable(LedgerError):
    """The chain's RPC endpoint cannot be reached (after retries), or a managed anvil will not start."""


class AccountError(LedgerError):
    """The node's Ethereum account cannot be loaded or created (keystore, password, dev key refused)."""


class RpcRejected(LedgerError):
    """The chain node refused a request outright (e.g. insufficient funds for gas, invalid transaction)."""


class DeploymentMismatch(LedgerError):
    """The configured addresses do not hold the expected dlx-node contracts on this chain."""


class TransactionTimeout(LedgerError):
    """A sent transaction was not mined in time; it may still be mined later."""


class CommitConflict(LedgerError):
    """The round is already committed on chain with different data than the node tried to commit."""

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


# NodeRegistry errors.
class RegistryError(ContractRevert):
    """A revert of the NodeRegistry contract."""


class RegistryAlreadyRegistered(RegistryError):
    """The account already holds a node key."""


class RegistryKeyTaken(RegistryError):
    """The node key is already bound to another account."""


class RegistryZeroKey(RegistryError):
    """The public key is all zero."""


class RegistryBadSignatureLength(RegistryError):
    """The binding signature is not 64 bytes."""


class RegistryStakeTooLow(RegistryError):
    """``register`` was sent with less than the minimum stake."""


class RegistryNotRegistered(RegistryError):
    """``unregister`` from an account that is not registered."""


class RegistryRefundFailed(RegistryError):
    """Returning the stake to the leaving account failed."""


# TrainingLedger errors.
class LedgerRevert(ContractRevert):
    """A revert of the TrainingLedger contract."""


class LedgerNotRegistered(LedgerRevert):
    """The caller is not a registered node."""


class LedgerUnknownRun(LedgerRevert):
    """No run has that id."""


class LedgerBadRunShape(LedgerRevert):
    """``numStages`` or ``innerSteps`` is zero."""


class LedgerZeroHash(LedgerRevert):
    """A config hash, root or content hash is all zero."""


class LedgerRoundNotIncreasing(LedgerRevert):
    """The round is not greater than the run's last committed round."""


class LedgerRoundNotCommitted(LedgerRevert):
    """A dispute names a round that was never committed."""


class LedgerCheckpointAhead(LedgerRevert):
    """A checkpoint names a round after the last committed one."""


class LedgerCheckpointExists(LedgerRevert):
    """A checkpoint was already published for that round."""


class LedgerDisputeMatchesCommit(LedgerRevert):
    """A dispute posts the same roots as the commit."""


class LedgerAlreadyDisputed(LedgerRevert):
    """The account already disputed that round."""


#: Every Python class that mirrors a Solidity custom error, by the error's name.
REVERT_CLASSES: dict[str, type[ContractRevert]] = {
    cls.__name__: cls
    for cls in (
        RegistryAlreadyRegistered,
        RegistryKeyTaken,
        RegistryZeroKey,
        RegistryBadSignatureLength,
        RegistryStakeTooLow,
        RegistryNotRegistered,
        RegistryRefundFailed,
        LedgerNotRegistered,
        LedgerUnknownRun,
        LedgerBadRunShape,
        LedgerZeroHash,
        LedgerRoundNotIncreasing,
        LedgerRoundNotCommitted,
        LedgerCheckpointAhead,
        LedgerCheckpointExists,
        LedgerDisputeMatchesCommit,
        LedgerAlreadyDisputed,
    )
}
