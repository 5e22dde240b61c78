"""The NodeRegistry contract's custom errors, one Python class each."""

from __future__ import annotations

from ledger.errors.base import ContractRevert


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
