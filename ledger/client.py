"""Typed client of the NodeRegistry and TrainingLedger contracts.

``LedgerClient`` takes and returns bytes, ints and the dataclasses of :mod:`ledger.records`; it knows
nothing of torch or libp2p. Writes go through :class:`ledger.tx.TransactionSender` (explicit gas, pending
nonce, retries with backoff, reverts decoded into :mod:`ledger.errors` classes on both backends). Writes are
idempotent where the protocol needs it: re-committing a round that is already on chain with an identical
record returns the original transaction instead of failing, and a different record raises
:class:`CommitConflict`. Records and verdicts are signed with :mod:`ledger.attest` (EIP-712).
Reads of the event logs (registrations, runs, a run's history) are :class:`ledger.history.EventReads`'s.
Creating, joining and leaving runs are :class:`ledger.runs.RunCalls`'s; disputes, equivocation proofs and
accusations :class:`ledger.disputes.DisputeCalls`'s, fraud proofs :class:`ledger.proofs.ProofCalls`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from eth_utils import to_checksum_address
from web3 import Web3

import contracts
from ledger.attest import (
    order_signatures,
    pack_signatures,
    record_digest,
    record_struct_hash,
    sign_record,
    sign_verdict,
)
from ledger.binding import binding_message
from ledger.chain import DEFAULT_RETRY, RetryPolicy
from ledger.contribution_binding import ContributionClaim, sign_contribution
from ledger.config import fee_policy
from ledger.errors import (
    AccountError,
    CommitConflict,
    DeploymentMismatch,
    LedgerError,
    LedgerInputError,
    LedgerRoundNotNext,
    LedgerStaleHead,
    TransactionTimeout,
)
from ledger.disputes import DisputeCalls
from ledger.events import EventDecoder, topic_address
from ledger.history import EventReads
from ledger.proofs import ProofCalls
from ledger.records import UINT64_MAX, RoundRecord, Verdict, check_bytes32, check_uint
from ledger.runs import RunCalls
from ledger.tx import DEFAULT_FEES, FeePolicy, TransactionSender

logger = logging.getLogger(__name__)

class LedgerClient(EventReads, RunCalls, DisputeCalls, ProofCalls):
    """Client of one deployment (a NodeRegistry and its TrainingLedger) acting as ``account``.

    Args:
        w3: Connected Web3 (see :mod:`ledger.chain`).
        account: The node's local signer (see :mod:`ledger.account`), or None for a read-only client
            (auditors, status): reads work, transactions raise AccountError.
        registry_address: The NodeRegistry.
        ledger_address: The TrainingLedger.
        retry: Backoff policy while the RPC endpoint is down.
        receipt_timeout: Seconds to wait for each transaction to be mined.
        from_block: First block to scan for events (the deployment block; 0 scans from genesis).
        log_page_blocks: Blocks per ``eth_getLogs`` request.
        fees: EIP-1559 fee cap, tip, replacement of stuck transactions, confirmations (:class:`FeePolicy`).
    """

    def __init__(
        self,
        w3: Web3,
        account: Any,
        registry_address: str,
        ledger_address: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        receipt_timeout: float = 60.0,
        from_block: int = 0,
        log_page_blocks: int = 10_000,
        fees: FeePolicy = DEFAULT_FEES,
    ):
        if log_page_blocks < 1:
            raise LedgerInputError(f"log_page_blocks={log_page_blocks}: must be >= 1")
        self.w3 = w3
        self.account = account
        self.from_block = from_block
        self.log_page_blocks = log_page_blocks
        self.sender = TransactionSender(w3, account, retry=retry, receipt_timeout=receipt_timeout, fees=fees)
        registry_abi = contracts.artifact("NodeRegistry")["abi"]
        ledger_abi = contracts.artifact("TrainingLedger")["abi"]
        self.registry_contract = w3.eth.contract(address=to_checksum_address(registry_address),
                                                 abi=registry_abi)
        self.ledger_contract = w3.eth.contract(address=to_checksum_address(ledger_address), abi=ledger_abi)
        self.registry_events = EventDecoder(registry_abi)
        self.ledger_events = EventDecoder(ledger_abi)

    @classmethod
    def from_config(cls, w3: Web3, account: Any, config: Any) -> LedgerClient:
        """A client for the deployment and settings of a :class:`ledger.config.LedgerConfig`."""
        if not (config.registry_address and config.ledger_address):
            raise LedgerInputError("ledger.registry_address and ledger.ledger_address must both be set")
        retry = RetryPolicy(total_seconds=config.retry_seconds)
        return cls(
            w3,
            account,
            config.registry_address,
            config.ledger_address,
            retry=retry,
            receipt_timeout=config.receipt_timeout,
            from_block=config.from_block,
            log_page_blocks=config.log_page_blocks,
            fees=fee_policy(config),
        )

    # Deployment ----------------------------------------------------------------------------------------
    @staticmethod
    def deploy(
        w3: Web3,
        account: Any,
        min_stake: int = 0,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        fees: FeePolicy = DEFAULT_FEES,
        receipt_timeout: float = 60.0,
        libraries: dict | None = None,
    ) -> tuple[str, str]:
        """Deploy the libraries (``contracts.LIBRARIES``), a NodeRegistry (with ``min_stake`` wei) and a
        TrainingLedger bound to it, linked to the libraries (its constructor creates the AggregationProver).

        Args:
            libraries: If given, filled with each library's name -> address.

        Returns:
            (registry_address, ledger_address), checksummed.
        """
        check_uint("min_stake", min_stake, 2**256 - 1)
        sender = TransactionSender(w3, account, retry=retry, fees=fees, receipt_timeout=receipt_timeout)
        linked: dict[str, str] = {}
        for name in contracts.LIBRARIES:  # each linked to those before it (StepProverMath: Float64Functions)
            linked[name] = sender.deploy(contracts.artifact(name), libraries=linked)
        registry = sender.deploy(contracts.artifact("NodeRegistry"), (min_stake,))
        ledger = sender.deploy(contracts.artifact("TrainingLedger"), (registry,), libraries=linked)
        logger.info("deployed NodeRegistry at %s and TrainingLedger at %s (libraries: %s)", registry, ledger,
                    ", ".join(f"{name} {address}" for name, address in linked.items()))
        if libraries is not None:
            libraries.update(linked)
        return registry, ledger

    # Identity ------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The client's Ethereum account address (the zero address for a read-only client)."""
        return self.sender.address

    @property
    def registry_address(self) -> str:
        """The NodeRegistry's address."""
        return self.registry_contract.address

    @property
    def ledger_address(self) -> str:
        """The TrainingLedger's address."""
        return self.ledger_contract.address

    @property
    def chain_id(self) -> int:
        """The connected chain's id."""
        return self.sender.chain_id

    def my_binding_message(self) -> bytes:
        """:func:`binding_message` for this client's chain, registry and account."""
        return binding_message(self.chain_id, self.registry_address, self.address)

    def check_deployment(self) -> None:
        """Check that both addresses hold contracts and that the ledger trusts this registry.

        Raises:
            DeploymentMismatch: Missing code, or the ledger is bound to another registry.
        """
        for name, address in (
            ("NodeRegistry", self.registry_address),
            ("TrainingLedger", self.ledger_address),
        ):
            code = self.sender.rpc(lambda address=address: self.w3.eth.get_code(address), "eth_getCode")
            if not code:
                raise DeploymentMismatch(f"no {name} at {address} on chain {self.chain_id}: no code there")
        trusted = self.sender.call(self.ledger_contract, "registry")
        if trusted != self.registry_address:
            raise DeploymentMismatch(
                f"TrainingLedger {self.ledger_address} trusts registry {trusted}, not {self.registry_address}"
            )

    def estimate(self, contract: str, name: str, args: tuple = (), value: int = 0) -> tuple[int, dict]:
        """(gas limit, EIP-1559 fees) of sending ``name(*args)`` to ``contract`` ("registry" or "ledger") now.

        The preflight of :meth:`ledger.tx.TransactionSender.send`: a revert is raised here, decoded. What the
        transaction would cost at most is ``gas x fees["maxFeePerGas"] + value``.
        """
        target = {"registry": self.registry_contract, "ledger": self.ledger_contract}[contract]
        data = target.encode_abi(name, args=list(args))
        return self.sender.estimate({"to": target.address, "value": value, "data": data}, name)

    def balance(self, address: str | None = None) -> int:
        """The wei ``address`` (default: this account) holds."""
        address = to_checksum_address(address or self.address)
        return self.sender.rpc(lambda: self.w3.eth.get_balance(address), "eth_getBalance")

    # Registry ------------------------------------------------------------------------------------------
    def register(self, pubkey: bytes, signature: bytes, stake: int | None = None) -> str:
        """Register this account with node key ``pubkey`` and its binding ``signature``; return the tx hash.

        Idempotent: if the account is already registered with ``pubkey``, returns the original transaction.

        Args:
            pubkey: Raw 32-byte ed25519 public key.
            signature: 64-byte ed25519 signature over :meth:`my_binding_message`.
            stake: Wei to deposit; None sends the registry's minimum stake.
        """
        pubkey = check_bytes32("pubkey", pubkey)
        if self.key_of(self.address) == pubkey:
            logger.info("account %s already registered with this key", self.address)
            return self.first_tx(
                self.registry_contract,
                self.registry_events,
                "NodeRegistered",
                [topic_address(self.address), "0x" + pubkey.hex()],
                last=True,
            )
        if stake is None:
            stake = self.min_stake()
        receipt = self.sender.transact(
            self.registry_contract, "register", (pubkey, bytes(signature)), "register", stake
        )
        return receipt["transactionHash"].to_0x_hex()

    def unregister(self) -> str:
        """Leave the registry (the stake is returned); return the tx hash."""
        return self.sender.transact(self.registry_contract, "unregister", (), "unregister")[
            "transactionHash"
        ].to_0x_hex()

    def is_registered(self, address: str | None = None) -> bool:
        """Whether ``address`` (default: this account) is a registered node."""
        return self.sender.call(
            self.registry_contract, "isRegistered", (to_checksum_address(address or self.address),)
        )

    def key_of(self, address: str) -> bytes | None:
        """The node key bound to ``address``, or None."""
        key = self.sender.call(self.registry_contract, "keyOf", (to_checksum_address(address),))
        return None if key == bytes(32) else bytes(key)

    def account_of(self, pubkey: bytes) -> str | None:
        """The account bound to node key ``pubkey``, or None."""
        account = self.sender.call(self.registry_contract, "accountOf", (check_bytes32("pubkey", pubkey),))
        return None if int(account, 16) == 0 else account

    def min_stake(self) -> int:
        """The registry's minimum stake in wei."""
        return self.sender.call(self.registry_contract, "minStake")

    def node_count(self) -> int:
        """The number of registered nodes."""
        return self.sender.call(self.registry_contract, "nodeCount")

    # Signing -------------------------------------------------------------------------------------------
    def sign_record(self, record: RoundRecord) -> bytes:
        """This account's 65-byte EIP-712 signature over ``record`` for this chain and ledger."""
        if self.account is None:
            raise AccountError("this ledger client is read-only (no account): cannot sign")
        return sign_record(self.account, record, self.chain_id, self.ledger_address)

    def sign_verdict(self, verdict: Verdict) -> bytes:
        """This account's 65-byte EIP-712 signature over ``verdict`` for this chain and ledger."""
        if self.account is None:
            raise AccountError("this ledger client is read-only (no account): cannot sign")
        return sign_verdict(self.account, verdict, self.chain_id, self.ledger_address)

    def sign_contribution(self, claim: ContributionClaim) -> bytes:
        """This account's 65-byte EIP-712 signature of a contribution it sends (issue 62: the binding a
        version-3 round's factors carry; ledger/contribution_binding.py)."""
        if self.account is None:
            raise AccountError("this ledger client is read-only (no account): cannot sign")
        return sign_contribution(self.account, claim, self.chain_id, self.ledger_address)

    def record_digest(self, record: RoundRecord) -> bytes:
        """The EIP-712 digest members sign for ``record`` on this chain and ledger."""
        return record_digest(record, self.chain_id, self.ledger_address)

    # Rounds --------------------------------------------------------------------------------------------
    def commit_round(self, record: RoundRecord, signatures: Iterable[bytes], attempts: int = 3) -> str:
        """Commit one outer round with members' signatures; return the hash of the transaction that committed
        it.

        The signatures (65 bytes each, any order) are sorted by signer address as the contract requires; the
        contract checks that at least ``quorum`` distinct current members signed. The caller must itself be a
        current member.

        Idempotent: if the round is already on chain with an identical record (submitted by any member, e.g.
        this one before an outage), that commit's transaction hash is returned and nothing is sent.

        Raises:
            CommitConflict: The round is already committed with a different record.
            LedgerRoundNotNext: Another round than the next is named (and this one was never committed).
            LedgerStaleHead: ``record.prev_head`` is not the run's head.
            LedgerNotMember, LedgerSignerNotMember, LedgerQuorumNotMet, LedgerSignersNotAscending,
            LedgerInvalidSignature, LedgerRoundBeyondMax, LedgerUnknownRun, LedgerZeroHash: contract rules.
            ChainUnavailable, TransactionTimeout: the chain could not be reached / did not mine in time.
        """
        if not isinstance(record, RoundRecord):
            raise LedgerInputError(f"commit_round needs a RoundRecord, got {type(record).__name__}")
        signatures = [bytes(signature) for signature in signatures]
        packed = pack_signatures(order_signatures(self.record_digest(record), signatures))
        what = f"commitRound(run {record.run_id}, round {record.round})"
        for attempt in range(1, attempts + 1):
            already = self._committed_tx(record, what)
            if already is not None:
                return already
            try:
                receipt = self.sender.transact(self.ledger_contract, "commitRound", (record.fields(), packed),
                                               what)
            except (LedgerRoundNotNext, LedgerStaleHead):
                # Another member's commit of this very round may have been mined between our check and ours.
                if self.record_hash_of(record.run_id, record.round) is not None and attempt < attempts:
                    continue
                raise
            except TransactionTimeout:
                if attempt == attempts:
                    raise
                logger.warning(
                    "%s: not mined in time (attempt %d/%d): checking the chain again", what, attempt, attempts
                )
                continue
            return receipt["transactionHash"].to_0x_hex()
        raise AssertionError("unreachable")

    def _committed_tx(self, record: RoundRecord, what: str) -> str | None:
        """The tx that committed ``record``'s round if it holds ``record``; CommitConflict if another
        record."""
        on_chain = self.record_hash_of(record.run_id, record.round)
        if on_chain is None:
            return None
        committed = self.commit_record(record.run_id, record.round)
        if on_chain != record_struct_hash(record):
            existing = committed.commit if committed is not None else None
            raise CommitConflict(
                f"{what}: already committed with a different record: on chain {existing}, attempted {record}",
                on_chain=existing,
                attempted=record,
            )
        logger.info("%s: already committed with an identical record", what)
        if committed is None:
            raise LedgerError(f"{what}: committed on chain but no RoundCommitted event found")
        return committed.tx_hash

    def record_hash_of(self, run_id: int, round: int) -> bytes | None:
        """The EIP-712 struct hash of the record committed for ``round`` of ``run_id``, or None."""
        check_uint("round", round, UINT64_MAX)
        stored = bytes(self.sender.call(self.ledger_contract, "recordHashOf", (run_id, round)))
        return None if stored == bytes(32) else stored

    def commit_of(self, run_id: int, round: int) -> RoundRecord | None:
        """The record committed for ``round`` of ``run_id`` (from its RoundCommitted event), or None."""
        committed = self.commit_record(run_id, round)
        return committed.commit if committed is not None else None

    def last_round(self, run_id: int) -> int | None:
        """The last committed round of ``run_id``, or None if none is committed."""
        count = self.run_struct(run_id)["commitCount"]
        return count - 1 if count > 0 else None

    def commit_count(self, run_id: int) -> int:
        """How many rounds of ``run_id`` are committed (also the number of the next round)."""
        return self.run_struct(run_id)["commitCount"]

    def head_of(self, run_id: int) -> bytes:
        """The current head of ``run_id``'s hash chain (see :mod:`ledger.hashchain`): the next
        ``prev_head``."""
        return bytes(self.sender.call(self.ledger_contract, "headOf", (run_id,)))

    def checkpoint_of(self, run_id: int, round: int) -> bytes | None:
        """The checkpoint content hash committed with ``round`` of ``run_id``, or None."""
        content_hash = bytes(self.sender.call(self.ledger_contract, "checkpointOf", (run_id, round)))
        return None if content_hash == bytes(32) else content_hash

    # Shared with the mixins ----------------------------------------------------------------------------
    def transact_ledger(self, name: str, args: tuple, what: str, value: int = 0) -> str:
        """Send ``name(*args)`` to the TrainingLedger; return the transaction hash (0x hex) once final."""
        receipt = self.sender.transact(self.ledger_contract, name, args, what, value)
        return receipt["transactionHash"].to_0x_hex()
