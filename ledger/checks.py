"""The chain checks of an audit: functions over a run's on-chain record that return one result per item.

An auditor needs only an RPC URL and the two addresses. :meth:`ledger.client.LedgerClient.history` reads
the record; these functions judge it and never raise on a finding (what to do with a failed item is the
caller's: :mod:`node.tools.audit` composes them with the evidence and replay checks).

* :func:`check_hash_chain` -- the genesis head, one link per RoundCommitted event (consecutive rounds below
  ``max_rounds``, ``prev_head``), the contract's head.
* :func:`check_registrations` -- a registration's ed25519 signature over its binding message
  (:func:`ledger.binding.verify_binding`; the contract cannot check it: the EVM has no ed25519 precompile).
* :func:`check_attesters` -- each commit's attesters are at least the run's quorum at that commit,
  ``max(k, ceil(quorum_bps x members in force))``, distinct members in force at it, rebuilt from the
  membership events alone (:meth:`ledger.records.Membership.in_force`).
* :func:`check_members` / :func:`bound_account` -- a member's node key, or a contribution's signing key, was
  bound by a registration with a valid binding in force (:meth:`ledger.records.Registration.in_force`).
* :func:`check_contracts` -- the code deployed at both addresses and at the ledger's prover is the committed
  build artifact, immutables masked (:func:`ledger.bytecode.bytecode_problem`), and so is every library they
  link; and the ledger trusts the registry.
* :func:`check_chain_record` runs them all on one run. Only the registrations the run uses (those in force
  when one of its members joined, whose key the seat copied) are items; a bogus registration of anyone else
  on the shared registry is a note, never a failure of this run.

Only :func:`check_contracts` reads the chain (through :func:`ledger.bytecode.verify_bytecode`); the others
are pure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import contracts
from ledger.binding import verify_binding
from ledger.bytecode import verify_bytecode
from ledger.errors import LedgerError
from ledger.hashchain import genesis_head, next_head
from ledger.eventrecords import DisputeRecord, EquivocationRecord, RunHistory, SlashRecord
from ledger.records import Membership, Registration

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemResult:
    """One checked item: its name, whether it matches the chain, and why not."""

    name: str
    ok: bool
    reason: str = ""

    @classmethod
    def of(cls, name: str, problems: list[str]) -> ItemResult:
        """The item's result from its problems (none: ok)."""
        return cls(name, not problems, "; ".join(problems))

    def line(self) -> str:
        return self.name if self.ok else f"{self.name}: {self.reason}"


# ---------------------------------------------------------------------- contracts

def check_contracts(client: Any) -> list[ItemResult]:
    """The contracts' bytecode against the committed artifacts (the registry, the ledger and the prover it
    created, with their linked libraries), and that the ledger trusts the registry."""
    results = []
    deployed = [("NodeRegistry", client.registry_address), ("TrainingLedger", client.ledger_address)]
    for name, address in deployed:
        try:
            verify_bytecode(client.w3, address, contracts.artifact(name))
            results.append(ItemResult(f"bytecode {name} {address}", True))
        except LedgerError as exc:
            results.append(ItemResult(f"bytecode {name} {address}", False, str(exc)))
    if all(item.ok for item in results):
        try:
            address = client.prover_address
            verify_bytecode(client.w3, address, contracts.artifact("AggregationProver"))
            results.append(ItemResult(f"bytecode AggregationProver {address}", True))
        except LedgerError as exc:
            results.append(ItemResult("bytecode AggregationProver", False, str(exc)))
    try:
        client.check_deployment()
        results.append(ItemResult("ledger trusts registry", True))
    except LedgerError as exc:
        results.append(ItemResult("ledger trusts registry", False, str(exc)))
    return results


# ---------------------------------------------------------------------- the hash chain
@dataclass(frozen=True)
class HashChainResult:
    """The hash chain of one run replayed: the genesis head, each commit's link (chain order), the head."""

    genesis: ItemResult
    links: list[ItemResult]
    head: ItemResult

    @property
    def ok(self) -> bool:
        return all(item.ok for item in (self.genesis, *self.links, self.head))

    @property
    def problems(self) -> list[str]:
        """One line per failed item (a link's names its round)."""
        items = [self.genesis, *self.links, self.head]
        return [item.line() for item in items if not item.ok]


def check_hash_chain(history: RunHistory, chain_id: int, ledger_address: str) -> HashChainResult:
    """Replay ``history``'s commits from the genesis head: each event's head, and the contract's at the end.

    Each link also checks what the contract enforced: rounds are consecutive from 0 and below the run's
    ``max_rounds`` (when set), and each record names the previous head as its ``prev_head``. After a wrong
    link the replay resynchronises on the event's head, so one bad link is reported once.
    """
    run = history.run
    head = genesis_head(chain_id, ledger_address, run.run_id, run.config_hash)
    genesis = ItemResult.of(
        "genesis head",
        [] if head == run.genesis_head else [f"event {run.genesis_head.hex()} != recomputed {head.hex()}"],
    )
    links = []
    for expected_round, record in enumerate(history.commits):
        commit = record.commit
        problems = []
        if commit.round != expected_round:
            problems.append(f"round {commit.round} committed where round {expected_round} was next")
        if run.max_rounds and commit.round >= run.max_rounds:
            problems.append(f"round {commit.round} is beyond the run's max_rounds {run.max_rounds}")
        if commit.prev_head != head:
            problems.append(f"record's prev_head {commit.prev_head.hex()} != previous head {head.hex()}")
        head = next_head(head, commit)
        if head != record.head_hash:
            problems.append(f"event head {record.head_hash.hex()} != recomputed {head.hex()}")
            head = record.head_hash
        links.append(ItemResult.of(f"hash chain link round {commit.round}", problems))
    final = ItemResult.of(
        "hash chain head",
        []
        if head == history.head_hash
        else [f"contract headOf {history.head_hash.hex()} != replayed {head.hex()}"],
    )
    return HashChainResult(genesis, links, final)


# ---------------------------------------------------------------------- members and attesters
def check_attesters(history: RunHistory) -> list[ItemResult]:
    """One result per commit: distinct attesters, ascending, each a member in force at the commit, at least
    the run's quorum of them counted. The quorum at a commit is ``max(k, ceil(quorum_bps x counted
    members))``, as the contract computed it from its count of counted members (founders, and joiners credited
    past their tenure: MemberCounted events, which a commit's own credits emit before its RoundCommitted).

    The chain verified the signatures; this re-checks, from the membership events alone, that the signers it
    accepted were members when the commit was mined (and that the submitter was one).
    """
    results = []
    for record in history.commits:
        in_force = {m.account for m in history.members_at(record.position)}
        counted = {m.account for m in history.counted_at(record.position)}
        quorum = history.run.quorum_for(len(counted))
        attesters = list(record.attesters)
        problems = []
        counted_attesters = len(set(attesters) & counted)
        if counted_attesters < quorum:
            problems.append(
                f"{counted_attesters} counted attesters, the run's quorum is {quorum}"
                + (f" (k {history.run.quorum}, {history.run.quorum_bps} bps of "
                   f"{len(counted)} counted members)"
                   if quorum != history.run.quorum else "")
            )
        if [int(a, 16) for a in attesters] != sorted({int(a, 16) for a in attesters}):
            problems.append("attesters are not strictly ascending")
        outsiders = [a for a in attesters if a not in in_force]
        if outsiders:
            problems.append(f"not members at block {record.block_number}: {', '.join(outsiders)}")
        if record.submitter not in in_force:
            problems.append(f"submitter {record.submitter} was not a member at block {record.block_number}")
        results.append(ItemResult.of(f"attesters of round {record.commit.round}", problems))
    return results


def check_members(history: RunHistory, valid: dict[str, list[Registration]]) -> list[ItemResult]:
    """One result per membership: the node key the ledger copied was bound to the account by a registration
    with a valid binding signature, in force when it joined."""
    results = []
    for membership in history.memberships:
        block = membership.joined[0]
        bound = any(
            r.pubkey == membership.node_key and r.in_force(block) for r in valid.get(membership.account, [])
        )
        name = f"member {membership.account} (joined block {block})"
        results.append(
            ItemResult(name, True)
            if bound
            else ItemResult(
                name,
                False,
                f"node key {membership.node_key.hex()[:16]} had no registration with a valid binding "
                f"signature for {membership.account} at block {block}",
            )
        )
    return results


# ---------------------------------------------------------------------- registrations
def check_registrations(
    registrations: list[Registration], chain_id: int, registry_address: str
) -> tuple[list[ItemResult], dict[str, list[Registration]]]:
    """One result per registration (its binding signature), and the valid registrations by account."""
    results, valid = [], {}
    for registration in registrations:
        name = (
            f"registration {registration.account} key {registration.pubkey.hex()[:16]} "
            f"(block {registration.block_number})"
        )
        if verify_binding(registration, chain_id, registry_address):
            valid.setdefault(registration.account, []).append(registration)
            results.append(ItemResult(name, True))
        else:
            results.append(
                ItemResult(
                    name,
                    False,
                    "ed25519 binding signature does not verify: the key never "
                    "signed this account's binding message (forged registration)",
                )
            )
    return results, valid


def registration_used(registration: Registration, memberships: list[Membership]) -> bool:
    """Whether a run uses ``registration``: it was in force when a membership of its account joined (the seat
    copied the registry's key of the account at that block)."""
    return any(
        m.account == registration.account and registration.in_force(m.joined[0]) for m in memberships
    )


def bound_account(
    valid: dict[str, list[Registration]], pubkey: bytes, first_block: int, last_block: int
) -> str | None:
    """The account whose valid registration binds ``pubkey`` and was in force during the block range."""
    for account, registrations in valid.items():
        if any(r.pubkey == pubkey and r.in_force(first_block, last_block) for r in registrations):
            return account
    return None


# ---------------------------------------------------------------------- one run
@dataclass
class ChainChecks:
    """Every chain item of one run (:func:`check_chain_record`); ``links`` and ``attesters`` follow
    ``history.commits``, ``members`` follows ``history.memberships``."""

    run_id: int
    contracts: list[ItemResult] | None  # None: not checked (on request)
    hash_chain: HashChainResult
    registrations: list[ItemResult]  # the registrations the run uses (registration_used)
    members: list[ItemResult]
    attesters: list[ItemResult]
    valid: dict[str, list[Registration]] = field(default_factory=dict)  # valid registrations by account
    disputes: dict[int, list[DisputeRecord]] = field(default_factory=dict)  # by round
    equivocations: dict[int, list[EquivocationRecord]] = field(default_factory=dict)  # by round
    slashings: list[SlashRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # findings that do not concern this run's record

    @property
    def disputed_rounds(self) -> list[int]:
        """The rounds some member disputed, ascending."""
        return sorted(self.disputes)

    def items(self) -> list[ItemResult]:
        return [
            *(self.contracts or []),
            self.hash_chain.genesis,
            *self.registrations,
            *self.members,
            *self.hash_chain.links,
            *self.attesters,
            self.hash_chain.head,
        ]

    @property
    def problems(self) -> list[str]:
        return [item.line() for item in self.items() if not item.ok]

    @property
    def ok(self) -> bool:
        """Nothing contradicts the record (a forged registration the run uses does: a member's seat holds a
        key its account never proved control of). A forged registration of an account the run never seated is
        a note: anyone can write one to the shared registry, and it says nothing about this run. Disputes,
        equivocations and slashings are findings to report, not contradictions of the record."""
        return not self.problems


def check_chain_record(client: Any, history: RunHistory, check_code: bool = True) -> ChainChecks:
    """Every chain check of ``history`` (read with ``client``, a reader of the run's deployment)."""
    chain_id = client.chain_id
    results, valid = check_registrations(history.registrations, chain_id, client.registry_address)
    registrations, notes = [], []
    for registration, result in zip(history.registrations, results, strict=True):
        if registration_used(registration, history.memberships):
            registrations.append(result)
        elif not result.ok:
            notes.append(f"{result.name}, not used by run {history.run.run_id}: {result.reason}")
    disputes: dict[int, list[DisputeRecord]] = {}
    for dispute in history.disputes:
        disputes.setdefault(dispute.round, []).append(dispute)
    equivocations: dict[int, list[EquivocationRecord]] = {}
    for equivocation in history.equivocations:
        equivocations.setdefault(equivocation.round, []).append(equivocation)
    checks = ChainChecks(
        run_id=history.run.run_id,
        contracts=check_contracts(client) if check_code else None,
        hash_chain=check_hash_chain(history, chain_id, client.ledger_address),
        registrations=registrations,
        members=check_members(history, valid),
        attesters=check_attesters(history),
        valid=valid,
        disputes=disputes,
        equivocations=equivocations,
        slashings=list(history.slashings),
        notes=notes,
    )
    if checks.problems:
        logger.info("chain checks of run %d: %d problem(s)", history.run.run_id, len(checks.problems))
    return checks
