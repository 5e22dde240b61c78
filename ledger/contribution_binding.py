"""A contribution bound to a member (issue 62; docs/FRAUD_PROOF.md, "The binding").

A version-3 round's factors list, for each accepted contribution, the member account that made it and that
account's EIP-712 signature (domain: the run's TrainingLedger, as a record's) of the typed message::

    Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)

``payloadRoot`` and ``normRoot`` are the contribution's own payload-piece root and sum-tree root (what the
factors list beside it), ``steps`` its declared inner steps in a run bounded by time (0 in a fixed-H run). The
contributor signs when it sends the contribution; the signature travels with it, every peer checks it, and the
committers copy it into the factors. ``AggregationProver`` (contracts/src/ProverBinding.sol) recovers every
listed signer with ``ecrecover``: a listed contribution nobody sent (a fabricated one) has no member's
signature, so the round is provably wrong. The factors hold each signature in EIP-2098's compact form
(``r``, ``vs``: two words), which :func:`compact` and :func:`expand` convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eth_abi import encode
from eth_utils import keccak, to_checksum_address

from ledger.attest import (
    SIGNATURE_LENGTH,
    domain_separator,
    recover_digest_signer,
    sign_digest,
    typed_message,
)
from ledger.errors import LedgerInputError
from ledger.records import check_bytes32, check_uint

CONTRIBUTION_TYPE = (
    "Contribution(uint256 runId,uint64 round,uint32 stage,bytes32 payloadRoot,bytes32 normRoot,uint32 steps)"
)
_FIELD_TYPES = ("bytes32", "uint256", "uint64", "uint32", "bytes32", "bytes32", "uint32")
#: The message's fields as EIP-712 typed data names them (:data:`CONTRIBUTION_TYPE`'s order).
_TYPED_FIELDS = (("runId", "uint256"), ("round", "uint64"), ("stage", "uint32"), ("payloadRoot", "bytes32"),
                 ("normRoot", "bytes32"), ("steps", "uint32"))
_HIGH_BIT = 1 << 255


@dataclass(frozen=True)
class ContributionClaim:
    """What a contributor signs of one contribution to one stage of one round (module docstring)."""

    run_id: int
    round: int
    stage: int
    payload_root: bytes
    norm_root: bytes
    steps: int = 0  # declared inner steps in a run bounded by time; 0 in a fixed-H run

    def __post_init__(self) -> None:
        check_uint("run_id", self.run_id, 2**256 - 1)
        check_uint("round", self.round, 2**64 - 1)
        check_uint("stage", self.stage, 2**32 - 1)
        check_uint("steps", self.steps, 2**32 - 1)
        object.__setattr__(self, "payload_root", check_bytes32("payload_root", self.payload_root))
        object.__setattr__(self, "norm_root", check_bytes32("norm_root", self.norm_root))

    def struct_hash(self) -> bytes:
        values = [keccak(text=CONTRIBUTION_TYPE), self.run_id, self.round, self.stage, self.payload_root,
                  self.norm_root, self.steps]
        return keccak(encode(_FIELD_TYPES, values))

    def digest(self, chain_id: int, ledger_address: str) -> bytes:
        """The 32-byte EIP-712 digest the contributor signs."""
        return keccak(b"\x19\x01" + domain_separator(chain_id, ledger_address) + self.struct_hash())

    def typed_data(self, chain_id: int, ledger_address: str) -> dict:
        """The message as ``eth_signTypedData_v4`` typed data (what a wallet or another client signs)."""
        values = (self.run_id, self.round, self.stage, self.payload_root, self.norm_root, self.steps)
        return typed_message("Contribution", _TYPED_FIELDS, values, chain_id, ledger_address)


def sign_contribution(account: Any, claim: ContributionClaim, chain_id: int, ledger_address: str) -> bytes:
    """``account``'s 65-byte signature (r || s || v, low s) of ``claim`` (an eth_account LocalAccount: the
    member's account, the one that joined the run)."""
    if not isinstance(claim, ContributionClaim):
        raise LedgerInputError(f"sign_contribution needs a ContributionClaim, got {type(claim).__name__}")
    return sign_digest(account, claim.digest(chain_id, ledger_address))


def recover_contributor(claim: ContributionClaim, signature: bytes, chain_id: int,
                        ledger_address: str) -> str:
    """The checksummed address that signed ``claim``; LedgerInputError for a signature that is malformed,
    malleable or recovers nothing (what the contract holds unbound)."""
    return recover_digest_signer(claim.digest(chain_id, ledger_address), signature)


def compact(signature: bytes) -> tuple[bytes, bytes]:
    """A 65-byte low-s signature as EIP-2098's ``(r, vs)``: ``vs`` is ``s`` with ``v - 27`` in its top bit."""
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_LENGTH:
        raise LedgerInputError(f"signature: must be {SIGNATURE_LENGTH} bytes (r || s || v)")
    if signature[64] not in (27, 28) or signature[32] & 0x80:
        raise LedgerInputError("signature: not a low-s signature with v 27 or 28")
    vs = int.from_bytes(signature[32:64], "big") | (_HIGH_BIT if signature[64] == 28 else 0)
    return bytes(signature[:32]), vs.to_bytes(32, "big")


def expand(r: bytes, vs: bytes) -> bytes:
    """The 65-byte signature of EIP-2098's ``(r, vs)``."""
    word = int.from_bytes(check_bytes32("vs", vs), "big")
    return check_bytes32("r", r) + (word & (_HIGH_BIT - 1)).to_bytes(32, "big") + bytes([27 + (word >> 255)])


def checked_address(value: str) -> str:
    """``value`` as a checksummed address; LedgerInputError if it is none."""
    try:
        return to_checksum_address(value)
    except (TypeError, ValueError) as exc:
        raise LedgerInputError(f"contributor: {value!r} is not an address") from exc
