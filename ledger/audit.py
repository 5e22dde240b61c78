"""Auditor checks over a run's on-chain record; an auditor needs only an RPC URL and the two addresses.

* :func:`check_hash_chain` replays every RoundCommitted event from the genesis head and compares each step
  with the head the event carries and the final result with the contract's ``headOf(runId)``.
* :func:`verify_binding` checks a registration's ed25519 signature over
  :func:`ledger.client.binding_message` (the contract cannot: the EVM has no ed25519 precompile).
* :func:`verify_bytecode` compares the code deployed at an address with the committed build artifact,
  masking the immutables (values written into the code at deployment, e.g. the ledger's registry address).
* :func:`audit_run` runs them all on one run and returns an :class:`AuditReport`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from web3 import Web3

import contracts
from ledger.client import LedgerClient, binding_message
from ledger.errors import AuditError
from ledger.hashchain import genesis_head, next_head
from ledger.records import Registration, RunHistory

logger = logging.getLogger(__name__)


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


def check_hash_chain(history: RunHistory, chain_id: int, ledger_address: str) -> list[str]:
    """Replay ``history``'s commits through the hash chain; return the problems found (empty if sound)."""
    problems = []
    run = history.run
    head = genesis_head(chain_id, ledger_address, run.run_id, run.config_hash)
    if head != run.genesis_head:
        problems.append(f"run {run.run_id}: genesis head {run.genesis_head.hex()} != recomputed {head.hex()}")
    previous_round = None
    for record in history.commits:
        commit = record.commit
        if previous_round is not None and commit.round <= previous_round:
            problems.append(f"run {run.run_id}: round {commit.round} committed after round {previous_round}")
        previous_round = commit.round
        head = next_head(head, commit, record.committer)
        if head != record.head_hash:
            problems.append(
                f"run {run.run_id} round {commit.round}: event head {record.head_hash.hex()} != recomputed {head.hex()}"
            )
            head = record.head_hash  # resynchronise so one bad link is reported once
    if head != history.head_hash:
        problems.append(
            f"run {run.run_id}: contract head {history.head_hash.hex()} != replayed head {head.hex()}"
        )
    return problems


def verify_bytecode(w3: Web3, address: str, artifact: dict) -> None:
    """Check that the code at ``address`` is ``artifact``'s deployed bytecode, immutables masked.

    Raises:
        AuditError: No code at the address, a different length, or differing bytes outside the immutables.
    """
    deployed = bytes(w3.eth.get_code(Web3.to_checksum_address(address)))
    expected = bytes.fromhex(artifact["deployedBytecode"].removeprefix("0x"))
    name = artifact.get("contractName", "contract")
    if not deployed:
        raise AuditError(f"no code at {address}: {name} is not deployed there")
    if len(deployed) != len(expected):
        raise AuditError(
            f"code at {address} is {len(deployed)} bytes, {name}'s artifact {len(expected)} bytes"
        )
    masked = bytearray(deployed)
    for references in artifact.get("immutableReferences", {}).values():
        for reference in references:
            start, length = reference["start"], reference["length"]
            masked[start : start + length] = expected[start : start + length]
    if bytes(masked) != expected:
        first = next(i for i, (a, b) in enumerate(zip(masked, expected)) if a != b)
        raise AuditError(
            f"code at {address} differs from {name}'s committed artifact (first at byte {first})"
        )


@dataclass
class AuditReport:
    """The outcome of :func:`audit_run`."""

    run_id: int
    commits_checked: int
    problems: list[str] = field(default_factory=list)
    invalid_registrations: list[Registration] = field(default_factory=list)
    disputed_rounds: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found (invalid registrations of accounts that never committed are not problems)."""
        return not self.problems


def audit_run(client: LedgerClient, run_id: int, check_code: bool = True) -> AuditReport:
    """Audit run ``run_id``: contract code, hash chain, binding signatures, and who committed.

    Every commit must come from an account whose registration was valid (correct binding signature) and in
    force at the commit's block.
    """
    chain_id = client.chain_id
    history = client.history(run_id)
    report = AuditReport(run_id=run_id, commits_checked=len(history.commits))
    if check_code:
        for name, address in (
            ("NodeRegistry", client.registry_address),
            ("TrainingLedger", client.ledger_address),
        ):
            try:
                verify_bytecode(client.w3, address, contracts.artifact(name))
            except AuditError as exc:
                report.problems.append(str(exc))
    report.problems += check_hash_chain(history, chain_id, client.ledger_address)

    valid_by_account: dict[str, list[Registration]] = {}
    for registration in history.registrations:
        if verify_binding(registration, chain_id, client.registry_address):
            valid_by_account.setdefault(registration.account, []).append(registration)
        else:
            report.invalid_registrations.append(registration)
    for record in history.commits:
        in_force = any(
            r.block_number <= record.block_number
            and (r.unregistered_block is None or r.unregistered_block > record.block_number)
            for r in valid_by_account.get(record.committer, [])
        )
        if not in_force:
            report.problems.append(
                f"run {run_id} round {record.commit.round}: committed by {record.committer}, which had no valid "
                f"registration (verified binding signature) at block {record.block_number}"
            )
    report.disputed_rounds = sorted({dispute.round for dispute in history.disputes})
    if report.problems:
        logger.warning("audit of run %d found %d problem(s)", run_id, len(report.problems))
    return report
