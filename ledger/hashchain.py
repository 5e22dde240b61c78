"""The TrainingLedger's running hash chain over a run's records, recomputed off-chain.

Mirrors the contract exactly (keccak256 over ``abi.encode``; see contracts/src/TrainingLedger.sol)::

    head_0 = keccak256(abi.encode(uint256 chainid, address ledger, uint256 runId, bytes32 configHash))
    head_n = keccak256(abi.encode(bytes32 head_{n-1}, bytes32 hashStruct(record_n)))

``hashStruct`` is the record's EIP-712 struct hash (:func:`ledger.attest.record_struct_hash`), the value the
members signed (through the digest); the record itself names ``prevHead == head_{n-1}``, so a signed record
only ever fits one place in the chain. An auditor who replays every RoundCommitted event of a run must
arrive at the contract's ``headOf(runId)``; any missing, reordered or altered commit changes the head.
"""

from __future__ import annotations

from eth_abi import encode
from eth_utils import keccak

from ledger.attest import record_struct_hash
from ledger.records import RoundRecord

_GENESIS_TYPES = ["uint256", "address", "uint256", "bytes32"]


def genesis_head(chain_id: int, ledger_address: str, run_id: int, config_hash: bytes) -> bytes:
    """The head of run ``run_id``'s chain before any commit."""
    return keccak(encode(_GENESIS_TYPES, [chain_id, ledger_address, run_id, config_hash]))


def next_head(previous: bytes, record: RoundRecord) -> bytes:
    """The head after ``record`` is committed on top of ``previous``."""
    return keccak(encode(["bytes32", "bytes32"], [previous, record_struct_hash(record)]))
