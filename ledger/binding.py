"""The registry binding: the bytes a node's ed25519 key signs to bind itself to an Ethereum account on one
registry of one chain, and the check of such a signature (the contract cannot check it: the EVM has no
ed25519 precompile, so the audit does, :func:`ledger.checks.check_registrations`)."""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from eth_utils import to_checksum_address

from ledger.records import Registration, check_uint

#: Domain tag that starts every registry binding message.
BINDING_DOMAIN = b"dlx-node/registry-binding/v1"


def binding_message(chain_id: int, registry_address: str, account_address: str) -> bytes:
    """The exact bytes a node's ed25519 key signs to bind itself to an Ethereum account.

    Layout (104 bytes)::

        b"dlx-node/registry-binding/v1"   28 bytes, ASCII domain tag
        chain_id                          32 bytes, unsigned big-endian
        registry_address                  20 bytes, the NodeRegistry contract
        account_address                   20 bytes, the Ethereum account that calls register()

    Binding the chain and registry prevents replaying a signature on another deployment; binding the account
    stops anyone else from registering the key to their own account with a valid signature.
    """
    check_uint("chain_id", chain_id, 2**256 - 1)
    return (
        BINDING_DOMAIN
        + chain_id.to_bytes(32, "big")
        + bytes.fromhex(to_checksum_address(registry_address)[2:])
        + bytes.fromhex(to_checksum_address(account_address)[2:])
    )


def verify_binding(registration: Registration, chain_id: int, registry_address: str) -> bool:
    """Whether ``registration``'s signature is its key's valid ed25519 signature over the binding message."""
    if len(registration.pubkey) != 32 or len(registration.signature) != 64:
        return False
    message = binding_message(chain_id, registry_address, registration.account)
    try:
        Ed25519PublicKey.from_public_bytes(registration.pubkey).verify(registration.signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True
