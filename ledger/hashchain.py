"""The TrainingLedger's running hash chain over a run's commits, recomputed off-chain.

Mirrors the contract exactly (keccak256 over ``abi.encode``; see contracts/src/TrainingLedger.sol)::

    head_0 = keccak256(abi.encode(uint256 chainid, address ledger, uint256 runId, bytes32 configHash))
    head_n = keccak256(abi.encode(bytes32 head_{n-1}, uint256 runId, uint64 round, bytes32 weightsRoot,
                                  bytes32 contributionsRoot, uint64 trainLossMicro, uint64 evalLossMicro,
                                  uint64 tokens, uint32 numContributors, address committer))

An auditor who replays every RoundCommitted event of a run must arrive at the contract's ``headOf(runId)``;
any missing, reordered or altered commit changes the head.
"""

from __future__ import annotations

from eth_abi import encode
from eth_utils import keccak

from ledger.records import RoundCommit

_GENESIS_TYPES = ["uint256", "address", "uint256", "bytes32"]
_LINK_TYPES = [
    "bytes32",
    "uint256",
    "uint64",
    "bytes32",
    "bytes32",
    "uint64",
    "uint64",
    "uint64",
    "uint32",
    "address",
]


def genesis_head(chain_id: int, ledger_address: str, run_id: int, config_hash: bytes) -> bytes:
    """The head of run ``run_id``'s chain before any commit."""
    return keccak(encode(_GENESIS_TYPES, [chain_id, ledger_address, run_id, config_hash]))


def next_head(previous: bytes, commit: RoundCommit, committer: str) -> bytes:
    """The head after ``committer`` commits ``commit`` on top of ``previous``."""
    return keccak(
        encode(
            _LINK_TYPES,
            [previous, *commit.fields(), committer],
        )
    )
