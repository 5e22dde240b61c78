"""Typed client of the NodeRegistry and TrainingLedger contracts.

``LedgerClient`` takes and returns bytes, ints and the dataclasses of :mod:`ledger.records`; it knows
nothing of torch or libp2p. Writes go through :class:`ledger.tx.TransactionSender` (explicit gas, pending
nonce, retries with backoff, reverts decoded into :mod:`ledger.errors` classes on both backends). Writes are
idempotent where the protocol needs it: re-committing a round that is already on chain with identical data
returns the original transaction instead of failing, and different data raises :class:`CommitConflict`.
Reads of the event logs (registrations, runs, a run's history) are :class:`ledger.history.EventReads`'s.
"""

from __future__ import annotations

import logging
from typing import Any

from eth_utils import to_checksum_address
from web3 import Web3

import contracts
from ledger.chain import DEFAULT_RETRY, RetryPolicy
from ledger.errors import (
    CommitConflict,
    DeploymentMismatch,
    LedgerCheckpointExists,
    LedgerError,
    LedgerInputError,
    LedgerRoundNotIncreasing,
    TransactionTimeout,
)
from ledger.events import EventDecoder, topic_address, topic_uint
from ledger.history import EventReads
from ledger.records import UINT32_MAX, UINT64_MAX, RoundCommit, check_bytes32, check_uint
from ledger.tx import TransactionSender

logger = logging.getLogger(__name__)

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


class LedgerClient(EventReads):
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
    ):
        if log_page_blocks < 1:
            raise LedgerInputError(f"log_page_blocks={log_page_blocks}: must be >= 1")
        self.w3 = w3
        self.account = account
        self.from_block = from_block
        self.log_page_blocks = log_page_blocks
        self._sender = TransactionSender(w3, account, retry=retry, receipt_timeout=receipt_timeout)
        registry_abi = contracts.artifact("NodeRegistry")["abi"]
        ledger_abi = contracts.artifact("TrainingLedger")["abi"]
        self._registry = w3.eth.contract(address=to_checksum_address(registry_address), abi=registry_abi)
        self._ledger = w3.eth.contract(address=to_checksum_address(ledger_address), abi=ledger_abi)
        self._registry_events = EventDecoder(registry_abi)
        self._ledger_events = EventDecoder(ledger_abi)

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
        )

    # Deployment ----------------------------------------------------------------------------------------
    @staticmethod
    def deploy(
        w3: Web3, account: Any, min_stake: int = 0, *, retry: RetryPolicy = DEFAULT_RETRY
    ) -> tuple[str, str]:
        """Deploy a NodeRegistry (with ``min_stake`` wei) and a TrainingLedger bound to it.

        Returns:
            (registry_address, ledger_address), checksummed.
        """
        check_uint("min_stake", min_stake, 2**256 - 1)
        sender = TransactionSender(w3, account, retry=retry)
        registry = sender.deploy(contracts.artifact("NodeRegistry"), (min_stake,))
        ledger = sender.deploy(contracts.artifact("TrainingLedger"), (registry,))
        logger.info("deployed NodeRegistry at %s and TrainingLedger at %s", registry, ledger)
        return registry, ledger

    # Identity ------------------------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """The client's Ethereum account address (the zero address for a read-only client)."""
        return self._sender.address

    @property
    def registry_address(self) -> str:
        """The NodeRegistry's address."""
        return self._registry.address

    @property
    def ledger_address(self) -> str:
        """The TrainingLedger's address."""
        return self._ledger.address

    @property
    def chain_id(self) -> int:
        """The connected chain's id."""
        return self._sender.chain_id

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
            code = self._sender.rpc(lambda address=address: self.w3.eth.get_code(address), "eth_getCode")
            if not code:
                raise DeploymentMismatch(f"no {name} at {address} on chain {self.chain_id}: no code there")
        trusted = self._sender.call(self._ledger, "registry")
        if trusted != self.registry_address:
            raise DeploymentMismatch(
                f"TrainingLedger {self.ledger_address} trusts registry {trusted}, not {self.registry_address}"
            )

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
            return self._first_tx(
                self._registry,
                self._registry_events,
                "NodeRegistered",
                [topic_address(self.address), "0x" + pubkey.hex()],
                last=True,
            )
        if stake is None:
            stake = self.min_stake()
        receipt = self._sender.transact(
            self._registry, "register", (pubkey, bytes(signature)), "register", stake
        )
        return receipt["transactionHash"].to_0x_hex()

    def unregister(self) -> str:
        """Leave the registry (the stake is returned); return the tx hash."""
        return self._sender.transact(self._registry, "unregister", (), "unregister")[
            "transactionHash"
        ].to_0x_hex()

    def is_registered(self, address: str | None = None) -> bool:
        """Whether ``address`` (default: this account) is a registered node."""
        return self._sender.call(
            self._registry, "isRegistered", (to_checksum_address(address or self.address),)
        )

    def key_of(self, address: str) -> bytes | None:
        """The node key bound to ``address``, or None."""
        key = self._sender.call(self._registry, "keyOf", (to_checksum_address(address),))
        return None if key == bytes(32) else bytes(key)

    def account_of(self, pubkey: bytes) -> str | None:
        """The account bound to node key ``pubkey``, or None."""
        account = self._sender.call(self._registry, "accountOf", (check_bytes32("pubkey", pubkey),))
        return None if int(account, 16) == 0 else account

    def min_stake(self) -> int:
        """The registry's minimum stake in wei."""
        return self._sender.call(self._registry, "minStake")

    def node_count(self) -> int:
        """The number of registered nodes."""
        return self._sender.call(self._registry, "nodeCount")

    # Runs ----------------------------------------------------------------------------------------------
    def create_run(self, config_hash: bytes, num_stages: int, inner_steps: int, config_uri: str = "") -> int:
        """Create a run; return its id.

        Args:
            config_hash: 32-byte hash of the run's full configuration (model, data, hyperparameters, stages, H).
            num_stages: Pipeline stages (>= 1).
            inner_steps: Inner steps H per outer round (>= 1).
            config_uri: Where the configuration can be fetched (emitted only).
        """
        config_hash = check_bytes32("config_hash", config_hash)
        check_uint("num_stages", num_stages, UINT32_MAX)
        check_uint("inner_steps", inner_steps, UINT32_MAX)
        receipt = self._sender.transact(
            self._ledger, "createRun", (config_hash, num_stages, inner_steps, config_uri), "createRun"
        )
        for log in receipt["logs"]:
            event = self._ledger_events.decode(log)
            if event is not None and event.name == "RunCreated":
                return event.args["runId"]
        raise LedgerError(
            f"createRun transaction {receipt['transactionHash'].to_0x_hex()} emitted no RunCreated"
        )

    def run_count(self) -> int:
        """The number of runs (the latest run id)."""
        return self._sender.call(self._ledger, "runCount")

    # Rounds --------------------------------------------------------------------------------------------
    def commit_round(self, commit: RoundCommit, attempts: int = 3) -> str:
        """Commit one outer round; return the hash of the transaction that committed it.

        Idempotent: if the round is already on chain with identical data (from any registered node, e.g.
        this one before an outage), that commit's transaction hash is returned and nothing is sent.

        Raises:
            CommitConflict: The round is already committed with different data.
            LedgerRoundNotIncreasing: A later round is already committed (and this one never was).
            LedgerNotRegistered, LedgerUnknownRun, LedgerZeroHash: contract rules.
            ChainUnavailable, TransactionTimeout: the chain could not be reached / did not mine in time.
        """
        if not isinstance(commit, RoundCommit):
            raise LedgerInputError(f"commit_round needs a RoundCommit, got {type(commit).__name__}")
        what = f"commitRound(run {commit.run_id}, round {commit.round})"
        for attempt in range(1, attempts + 1):
            existing = self.commit_of(commit.run_id, commit.round)
            if existing is not None:
                if existing != commit:
                    raise CommitConflict(
                        f"{what}: already committed with different data: on chain {existing}, attempted {commit}",
                        on_chain=existing,
                        attempted=commit,
                    )
                logger.info("%s: already committed with identical data", what)
                return self._first_tx(
                    self._ledger,
                    self._ledger_events,
                    "RoundCommitted",
                    [topic_uint(commit.run_id), topic_uint(commit.round)],
                )
            args = commit.fields()
            try:
                receipt = self._sender.transact(self._ledger, "commitRound", args, what)
            except LedgerRoundNotIncreasing:
                # Another node's commit of this very round may have been mined between our check and ours.
                if self.commit_of(commit.run_id, commit.round) is not None and attempt < attempts:
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

    def commit_of(self, run_id: int, round: int) -> RoundCommit | None:
        """The commit of ``round`` of ``run_id``, or None if that round was not committed."""
        check_uint("round", round, UINT64_MAX)
        stored = self._sender.call(self._ledger, "commitOf", (run_id, round))
        weights_root, contributions_root, train_loss, eval_loss, tokens, contributors, exists = stored
        if not exists:
            return None
        return RoundCommit(
            run_id,
            round,
            bytes(weights_root),
            bytes(contributions_root),
            train_loss,
            eval_loss,
            tokens,
            contributors,
        )

    def last_round(self, run_id: int) -> int | None:
        """The last committed round of ``run_id``, or None if none is committed."""
        run = self._run_struct(run_id)
        return run["lastRound"] if run["commitCount"] > 0 else None

    def commit_count(self, run_id: int) -> int:
        """How many rounds of ``run_id`` are committed."""
        return self._run_struct(run_id)["commitCount"]

    def head_of(self, run_id: int) -> bytes:
        """The current head of ``run_id``'s hash chain (see :mod:`ledger.hashchain`)."""
        return bytes(self._sender.call(self._ledger, "headOf", (run_id,)))

    # Checkpoints and disputes --------------------------------------------------------------------------
    def publish_checkpoint(self, run_id: int, round: int, content_hash: bytes, uri: str) -> str:
        """Publish the checkpoint of ``round``; return the tx hash.

        Idempotent: if the same content hash is already published for that round, returns its transaction.

        Raises:
            LedgerCheckpointExists: A different checkpoint is already published for the round.
            LedgerCheckpointAhead: ``round`` is after the last committed round.
        """
        content_hash = check_bytes32("content_hash", content_hash)
        check_uint("round", round, UINT64_MAX)
        what = f"publishCheckpoint(run {run_id}, round {round})"
        try:
            receipt = self._sender.transact(
                self._ledger, "publishCheckpoint", (run_id, round, content_hash, uri), what
            )
        except LedgerCheckpointExists as exc:
            if bytes(exc.values["contentHash"]) != content_hash:
                raise
            return self._first_tx(
                self._ledger,
                self._ledger_events,
                "CheckpointPublished",
                [topic_uint(run_id), topic_uint(round)],
            )
        return receipt["transactionHash"].to_0x_hex()

    def checkpoint_of(self, run_id: int, round: int) -> bytes | None:
        """The content hash published for ``round`` of ``run_id``, or None."""
        content_hash = bytes(self._sender.call(self._ledger, "checkpointOf", (run_id, round)))
        return None if content_hash == bytes(32) else content_hash

    def dispute(
        self, run_id: int, round: int, computed_weights_root: bytes, computed_contributions_root: bytes
    ) -> str:
        """Flag committed ``round`` of ``run_id`` with the roots this node computed instead; return the tx hash."""
        args = (
            run_id,
            round,
            check_bytes32("computed_weights_root", computed_weights_root),
            check_bytes32("computed_contributions_root", computed_contributions_root),
        )
        receipt = self._sender.transact(
            self._ledger, "dispute", args, f"dispute(run {run_id}, round {round})"
        )
        return receipt["transactionHash"].to_0x_hex()

    def dispute_count(self, run_id: int, round: int) -> int:
        """How many nodes disputed ``round`` of ``run_id``."""
        return self._sender.call(self._ledger, "disputeCount", (run_id, round))

    # Internals -----------------------------------------------------------------------------------------
    def _run_struct(self, run_id: int) -> dict:
        names = (
            "configHash",
            "headHash",
            "numStages",
            "innerSteps",
            "lastRound",
            "commitCount",
            "creator",
            "latestCheckpointRound",
            "checkpointCount",
        )
        return dict(zip(names, self._sender.call(self._ledger, "runOf", (run_id,)), strict=True))

