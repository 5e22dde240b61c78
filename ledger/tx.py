"""Sending transactions robustly and decoding reverts, identically on anvil and py-evm.

* Every transaction is preflighted with ``eth_estimateGas``: a revert is decoded there into the matching
  :class:`ledger.errors.ContractRevert` subclass before anything is signed. The transaction then carries an
  explicit gas limit (estimate x margin), explicit EIP-1559 fees and the account's pending nonce, read under a
  lock (one sender per account: the nonce is never guessed locally, so a chain that lost blocks on restart
  cannot leave a nonce gap).
* Calls are retried with exponential backoff while the RPC endpoint is unreachable
  (:func:`ledger.chain.call_with_retries`), then :class:`ChainUnavailable` is raised.
* A mined transaction that reverted anyway (the state changed between estimate and inclusion) is replayed
  with ``eth_call`` on the state after its block to decode the error.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from eth_abi import encode
from eth_utils.exceptions import ValidationError as EthValidationError
from web3 import Web3
from web3.exceptions import TransactionNotFound, Web3RPCError

import contracts
from ledger.chain import DEFAULT_RETRY, RetryPolicy, call_with_retries
from ledger.fees import DEFAULT_FEES, FeePolicy, market_fees
from ledger.reverts import decode_revert, ledger_error_of
from ledger.errors import (
    AccountError,
    ContractRevert,
    FeeCapTooLow,
    LedgerError,
    RpcRejected,
    TransactionDropped,
    TransactionTimeout,
    UnknownRevert,
)

logger = logging.getLogger(__name__)

def _already_sent(exc: BaseException) -> bool:
    # The node holds or has mined a transaction with this nonce: ours after a retried send, or another
    # sender's. anvil/geth say "already known"/"nonce too low"; py-evm "Invalid transaction nonce: Expected".
    text = str(exc).lower()
    return isinstance(exc, (Web3RPCError, ValueError, EthValidationError)) and (
        "already known" in text or "nonce too low" in text or "invalid transaction nonce" in text
    )


@dataclass
class _Pending:
    """One nonce's transaction as sent so far: every signed version (replacements), newest last."""

    request: dict
    gas: int
    nonce: int
    fees: dict
    signed: list = field(default_factory=list)

    def hashes(self) -> list[bytes]:
        return [s.hash for s in self.signed]


class _NonceTaken(Exception):
    """The node refused a transaction because its nonce is already used by another one."""


class TransactionSender:
    """Signs and sends an account's transactions; one instance per account and process.

    Args:
        w3: Connected Web3.
        account: A local signer (``eth_account`` LocalAccount), or None for a read-only sender.
        retry: Backoff policy while the RPC endpoint is down.
        receipt_timeout: Seconds to wait for a transaction to be mined (and as long again for its
            confirmations).
        gas_margin: Gas limit = estimate x margin + 10k, bounding the limit yet tolerating small state drift.
        fees: Fee cap, tip, replacement and confirmations (:class:`FeePolicy`).
    """

    def __init__(
        self,
        w3: Web3,
        account: Any,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        receipt_timeout: float = 60.0,
        gas_margin: float = 1.25,
        fees: FeePolicy = DEFAULT_FEES,
    ):
        self.w3 = w3
        self.account = account
        self.retry = retry
        self.receipt_timeout = receipt_timeout
        self.gas_margin = gas_margin
        self.fees = fees
        self._lock = threading.Lock()
        self._chain_id: int | None = None

    @property
    def address(self) -> str:
        """The sending account's address (the zero address for a read-only sender)."""
        return self.account.address if self.account is not None else "0x" + "00" * 20

    def _call_options(self) -> dict:
        # A read-only sender leaves "from" out: py-evm checks a sender's balance even for eth_call.
        return {"from": self.account.address} if self.account is not None else {}

    @property
    def chain_id(self) -> int:
        """The connected chain's id (read once)."""
        if self._chain_id is None:
            self._chain_id = self.rpc(lambda: self.w3.eth.chain_id, "eth_chainId")
        return self._chain_id

    def rpc(self, call, what: str):
        """Run an RPC ``call`` with retries; map the failures to :mod:`ledger.errors` classes.

        Reverts become ContractRevert subclasses, an empty answer from a contract call DeploymentMismatch,
        and a request the node refuses (insufficient funds, malformed transaction) RpcRejected.
        """
        try:
            return call_with_retries(call, self.retry, what)
        except Exception as exc:  # noqa: BLE001 - every failure mapped to a ledger error (or re-raised as is)
            raise ledger_error_of(exc, what) from exc

    def call(self, contract, name: str, args: tuple = (), what: str = "", block: int | str = "latest"):
        """``eth_call`` the view ``name(*args)`` of the web3 ``contract``."""
        function = contract.get_function_by_name(name)(*args)
        return self.rpc(lambda: function.call(self._call_options(), block_identifier=block), what or name)

    def transact(self, contract, name: str, args: tuple = (), what: str = "", value: int = 0) -> dict:
        """Send ``name(*args)`` of the web3 ``contract`` as a transaction; return its receipt once final.

        Raises:
            ContractRevert: (a subclass) the call reverts, in the preflight or once mined.
            ChainUnavailable: the RPC stayed unreachable for the retry policy's duration.
            TransactionTimeout: sent but not mined within ``receipt_timeout`` (FeeCapTooLow: the base
                fee stayed above the cap; TransactionDropped: a reorg dropped it and its nonce was reused).
        """
        data = contract.encode_abi(name, args=list(args))
        return self.send({"to": contract.address, "value": value, "data": data}, what or name)

    def deploy(self, artifact: dict, args: tuple = (), what: str = "", libraries: dict | None = None) -> str:
        """Deploy the contract of a build ``artifact`` with constructor ``args``, linked to ``libraries``
        (name -> address of each library its code calls, ``contracts.link``); return its address."""
        constructor = next((item for item in artifact["abi"] if item["type"] == "constructor"), None)
        types = [item["type"] for item in constructor["inputs"]] if constructor else []
        data = contracts.link(artifact, libraries or {}) + encode(types, list(args)).hex()
        receipt = self.send({"value": 0, "data": data}, what or f"deploy {artifact['contractName']}")
        return receipt["contractAddress"]

    def estimate(self, request: dict, what: str) -> tuple[int, dict]:
        """(gas limit, EIP-1559 fees) a transaction ``request`` (to/value/data) would be sent with now;
        the preflight: a revert is raised here, decoded. What ``send`` would spend at most is
        ``gas x maxFeePerGas + value``."""
        request = {"from": self.address, **request}
        return self._gas_limit(request, what), self._market_fees(what)

    def send(self, request: dict, what: str) -> dict:
        """Preflight, sign and send the transaction ``request`` (to/value/data); return the receipt once
        final.

        The nonce is the account's pending nonce on the chain (never a local counter, so a restart or a
        chain that lost blocks leaves no gap). An unmined transaction is replaced every
        ``fees.replace_after`` seconds with higher fees; one that an earlier life (or another process) of
        the account left stuck below the market ahead of ours is cancelled the same way. A mined one is
        final after ``fees.confirmations`` blocks; a reorg that drops it before makes it be sent again.

        Raises:
            ContractRevert: (a subclass) the call reverts, in the preflight or once mined.
            ChainUnavailable: the RPC stayed unreachable for the retry policy's duration.
            TransactionTimeout: not mined within ``receipt_timeout`` (see :meth:`transact`).
        """
        if self.account is None:
            raise AccountError(
                f"{what}: this ledger client is read-only (no account): cannot send transactions"
            )
        with self._lock:
            address = self.account.address
            request = {"from": address, **request}
            gas = self._gas_limit(request, what)
            fees = self._market_fees(what)
            pending = self._sign_and_send(request, gas, fees, what)
            receipt = self._wait_for_receipt(pending, what)
            receipt = self._wait_for_confirmations(pending, receipt, what)
        if receipt["status"] != 1:
            raise self._explain_failure(request, receipt, what)
        logger.debug("%s: mined in block %d, gas %d", what, receipt["blockNumber"], receipt["gasUsed"])
        return receipt

    def send_all(self, requests: list[tuple[dict, str]]) -> list[dict | Exception]:
        """Send independent transactions ``requests`` ((to/value/data, what) each) at once: each preflighted,
        all signed with consecutive pending nonces and broadcast before any receipt is awaited, so that on a
        chain with timed blocks they share blocks (a player of several clocked games at once: no move waits
        for another's block). Each one's receipt once final, or the LedgerError that stopped it (a preflight
        revert: not sent; a mined revert, decoded), in order; :meth:`send`'s replacement and confirmations."""
        if self.account is None:
            raise AccountError("this ledger client is read-only (no account): cannot send transactions")
        results: list[dict | Exception | None] = [None] * len(requests)
        with self._lock:
            fees = self._market_fees("transactions sent together")
            sent = []
            for index, (request, what) in enumerate(requests):
                request = {"from": self.account.address, **request}
                try:
                    sent.append((index, request, what,
                                 self._sign_and_send(request, self._gas_limit(request, what), fees, what)))
                except LedgerError as exc:
                    results[index] = exc
            for index, request, what, pending in sent:
                try:
                    receipt = self._wait_for_receipt(pending, what)
                    receipt = self._wait_for_confirmations(pending, receipt, what)
                    results[index] = receipt if receipt["status"] == 1 else self._explain_failure(
                        request, receipt, what)
                except LedgerError as exc:
                    results[index] = exc
        return results

    def _market_fees(self, what: str, floor: dict | None = None) -> dict:
        """:func:`ledger.fees.market_fees` at the chain's base fee and tip now."""
        base_fee = self.rpc(lambda: self.w3.eth.get_block("latest")["baseFeePerGas"], "eth_getBlockByNumber")
        priority = self.fees.priority_fee
        if priority is None:
            priority = self.rpc(lambda: self.w3.eth.max_priority_fee, "eth_maxPriorityFeePerGas")
        return market_fees(self.fees, base_fee, priority, what, floor)

    def _sign_and_send(self, request: dict, gas: int, fees: dict, what: str, attempts: int = 3) -> _Pending:
        """Sign with the pending nonce and send; return what the node now holds for that nonce.

        A "nonce too low"/"already known" answer means either the node already has this very transaction
        (a send retried after a dropped connection) or another sender using the same account took the nonce;
        in the second case the transaction is signed again with a fresh nonce.
        """
        address = request["from"]
        for _ in range(attempts):
            pending = _Pending(request, gas, self._pending_nonce(address), fees)
            try:
                self._broadcast(pending, fees, what)
                return pending
            except _NonceTaken:
                logger.warning(
                    "%s: nonce %d was taken by another sender of %s: re-signing", what, pending.nonce, address
                )
        raise RpcRejected(
            f"{what}: nonce kept being taken by another sender of {address} ({attempts} attempts)"
        )

    def _broadcast(self, pending: _Pending, fees: dict, what: str) -> None:
        """Sign ``pending``'s transaction with ``fees`` and send it; raise _NonceTaken if its nonce is
        used."""
        unsigned = {key: value for key, value in pending.request.items() if key != "from"}
        transaction = {**unsigned, **fees, "gas": pending.gas, "nonce": pending.nonce,
                       "chainId": self.chain_id}
        signed = self.account.sign_transaction(transaction)
        self._send_signed(signed, what)
        pending.signed.append(signed)
        pending.fees = fees

    def _send_signed(self, signed, what: str) -> None:
        try:
            call_with_retries(lambda: self._send_raw(signed.raw_transaction), self.retry, f"{what}: send")
        except Exception as exc:  # noqa: BLE001 - classified: only "already sent" is handled, the rest re-raised
            if not _already_sent(exc):
                raise ledger_error_of(exc, f"{what}: send") from exc
            if not self._node_has(signed.hash):
                raise _NonceTaken() from exc
            logger.info("%s: node already had transaction %s", what, signed.hash.to_0x_hex())

    def _receipt_of(self, pending: _Pending, what: str) -> dict | None:
        """The receipt of whichever version of ``pending`` is mined (None: none is, as far as the node
        knows)."""
        for tx_hash in reversed(pending.hashes()):
            try:
                return call_with_retries(
                    lambda tx_hash=tx_hash: self.w3.eth.get_transaction_receipt(tx_hash), self.retry,
                    f"{what}: receipt")
            except TransactionNotFound:
                continue
        return None

    def _replace(self, pending: _Pending, what: str) -> None:
        """Raise an unmined transaction's fees (same nonce); first cancel a stuck one of the account ahead of
        it."""
        address = pending.request["from"]
        mined = self.rpc(lambda: self.w3.eth.get_transaction_count(address, "latest"),
                         "eth_getTransactionCount")
        if mined < pending.nonce:
            self._cancel_stuck(address, mined, what)
            return
        if mined > pending.nonce:
            return  # some version was mined meanwhile: the receipt shows on the next poll
        fees = self._market_fees(what, floor=pending.fees)
        if fees["maxFeePerGas"] <= pending.fees["maxFeePerGas"]:
            logger.warning("%s: not mined and the fee cap is reached (%g gwei): waiting", what,
                           pending.fees["maxFeePerGas"] / 1e9)
            return
        logger.warning("%s: not mined after %.0fs: replacing it (nonce %d) with maxFeePerGas %g gwei", what,
                       self.fees.replace_after, pending.nonce, fees["maxFeePerGas"] / 1e9)
        try:
            self._broadcast(pending, fees, what)
        except _NonceTaken:
            pass  # mined meanwhile (an older version, or dropped and replaced): the polls tell
        except RpcRejected as exc:
            logger.warning("%s: replacement refused (%s): waiting", what, exc)

    def _cancel_stuck(self, address: str, nonce: int, what: str) -> None:
        """Replace the account's unmined transaction at ``nonce`` (left by an earlier life: its fees are
        unknown here) by a transfer of nothing to itself at twice the market's fees, doubled while refused."""
        fees = self._market_fees(what)
        for _ in range(4):
            cancel = _Pending({"from": address, "to": address, "value": 0}, 21_000, nonce, fees)
            logger.warning("%s: nonce %d of %s is held by an unmined transaction ahead of ours: cancelling "
                           "it with maxFeePerGas %g gwei", what, nonce, address, fees["maxFeePerGas"] / 1e9)
            try:
                self._broadcast(cancel, {**fees, "maxFeePerGas": 2 * fees["maxFeePerGas"],
                                         "maxPriorityFeePerGas": 2 * fees["maxPriorityFeePerGas"]}, what)
                return
            except _NonceTaken:
                return  # it was mined meanwhile
            except RpcRejected as exc:
                if "underpriced" not in str(exc).lower():
                    logger.warning("%s: cancelling nonce %d refused: %s", what, nonce, exc)
                    return
                fees = self._market_fees(what,
                                         floor={k: 2 * v for k, v in cancel.fees.items() if k != "type"})

    def _pending_nonce(self, address: str) -> int:
        return self.rpc(
            lambda: self.w3.eth.get_transaction_count(address, "pending"), "eth_getTransactionCount"
        )

    def _send_raw(self, raw_transaction: bytes) -> None:
        self.w3.eth.send_raw_transaction(raw_transaction)

    def _node_has(self, tx_hash: bytes) -> bool:
        try:
            self.rpc(lambda: self.w3.eth.get_transaction(tx_hash), "eth_getTransactionByHash")
        except TransactionNotFound:
            return False
        return True

    def _gas_limit(self, request: dict, what: str) -> int:
        # The preflight: a revert surfaces here, decoded, before anything is signed.
        estimate = self.rpc(lambda: self.w3.eth.estimate_gas(request), what)
        return int(estimate * self.gas_margin) + 10_000

    def _wait_for_receipt(self, pending: _Pending, what: str) -> dict:
        """Poll until a version of ``pending`` is mined, replacing it every ``fees.replace_after`` seconds."""
        deadline = time.monotonic() + self.receipt_timeout
        next_replace = time.monotonic() + self.fees.replace_after
        delay = 0.05
        while True:
            receipt = self._receipt_of(pending, what)
            if receipt is not None:
                return receipt
            now = time.monotonic()
            if now >= deadline:
                base_fee = self.rpc(lambda: self.w3.eth.get_block("latest")["baseFeePerGas"],
                                    "eth_getBlockByNumber")
                if self.fees.max_fee_cap and base_fee >= self.fees.max_fee_cap:
                    raise FeeCapTooLow(f"{what}: not mined within {self.receipt_timeout:.0f}s: the base fee "
                                       f"({base_fee / 1e9:g} gwei) rose above the fee cap "
                                       f"({self.fees.max_fee_cap / 1e9:g} gwei, ledger.max_fee_gwei)")
                raise TransactionTimeout(
                    f"{what}: transaction {pending.hashes()[-1].hex()} not mined within "
                    f"{self.receipt_timeout:.0f}s"
                )
            if now >= next_replace:
                next_replace = now + self.fees.replace_after
                self._replace(pending, what)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _wait_for_confirmations(self, pending: _Pending, receipt: dict, what: str) -> dict:
        """Wait until ``receipt``'s block has ``fees.confirmations - 1`` blocks on top of it on the canonical
        chain; a reorg that drops the transaction meanwhile makes it be broadcast again (the same signed
        bytes: one nonce, so it can never be mined twice) and waited for from the start."""
        needed = self.fees.confirmations
        if needed <= 1:
            return receipt
        deadline = time.monotonic() + self.receipt_timeout * 2
        while True:
            head = self.rpc(lambda: self.w3.eth.block_number, "eth_blockNumber")
            current = self._receipt_of(pending, what)
            if current is None:
                logger.warning("%s: block %d holding it left the chain (reorg): sending it again", what,
                               receipt["blockNumber"])
                try:
                    self._send_signed(pending.signed[-1], what)
                except _NonceTaken:
                    raise TransactionDropped(
                        f"{what}: dropped by a reorg and its nonce {pending.nonce} was "
                        "taken by another transaction: check the chain and send it anew"
                    ) from None
                receipt = self._wait_for_receipt(pending, what)
                continue
            if current["blockHash"] != receipt["blockHash"]:
                logger.warning("%s: moved from block %d to block %d by a reorg", what, receipt["blockNumber"],
                               current["blockNumber"])
            receipt = current
            if head - receipt["blockNumber"] + 1 >= needed:
                return receipt
            if time.monotonic() >= deadline:
                raise TransactionTimeout(f"{what}: mined in block {receipt['blockNumber']} but not {needed} "
                                         f"blocks deep within {2 * self.receipt_timeout:.0f}s "
                                         "(the chain stalled?)")
            time.sleep(0.5)

    def _explain_failure(self, request: dict, receipt: dict, what: str) -> ContractRevert:
        block = receipt["blockNumber"]
        where = f"{what} (tx {receipt['transactionHash'].to_0x_hex()}, block {block})"
        try:
            # Replayed on the state after its block: whatever made it fail (typically another transaction
            # earlier in the same block) is in that state.
            self.w3.eth.call(request, block_identifier=block)
        except Exception as exc:  # noqa: BLE001 - any failure of the replay: a revert decoded, else reported
            revert = decode_revert(exc, where)
            if revert is not None:
                return revert
        return UnknownRevert(f"{where}: mined but reverted (gas used {receipt['gasUsed']})")
