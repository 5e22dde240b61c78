"""Reverts, decoded identically on anvil and py-evm: a contract's custom error becomes the matching
:class:`ledger.errors.ContractRevert` subclass, ``Error(string)`` and ``Panic(uint256)`` a readable one.

anvil reports a revert's data in an RPC error; eth-tester raises ``TransactionFailed`` on py-evm with the data
in its message; :func:`decode_revert` takes either. Used by :mod:`ledger.tx` (preflight, mined reverts) and
the tests.
"""

from __future__ import annotations

import ast
from typing import Any

from eth_abi import decode
from eth_utils import keccak, to_checksum_address
from eth_utils.exceptions import ValidationError as EthValidationError
from web3.exceptions import BadFunctionCallOutput, ContractLogicError, TransactionNotFound, Web3RPCError

import contracts
from ledger import errors
from ledger.abidecode import ABI_DECODE_ERRORS
from ledger.errors import ContractRevert, DeploymentMismatch, LedgerError, RpcRejected, UnknownRevert

_ERROR_STRING = bytes.fromhex("08c379a0")  # Error(string)
_PANIC = bytes.fromhex("4e487b71")  # Panic(uint256)


def _error_table() -> dict[bytes, tuple[str, list[str], list[str]]]:
    table = {}
    for name in contracts.NAMES:
        for entry in contracts.artifact(name)["abi"]:
            if entry["type"] != "error":
                continue
            types = [item["type"] for item in entry["inputs"]]
            names = [item["name"] for item in entry["inputs"]]
            selector = keccak(text=f"{entry['name']}({','.join(types)})")[:4]
            table[selector] = (entry["name"], types, names)
    return table


#: 4-byte selector -> (error name, argument types, argument names) for every custom error of the contracts.
ERROR_SELECTORS = _error_table()


def _show(value: Any) -> str:
    return "0x" + value.hex() if isinstance(value, bytes) else str(value)


def revert_from_data(data: bytes, what: str) -> ContractRevert:
    """The ContractRevert subclass for raw revert ``data`` (selector + ABI-encoded arguments)."""
    selector = data[:4]
    if selector in ERROR_SELECTORS:
        name, types, names = ERROR_SELECTORS[selector]
        try:
            decoded = decode(types, data[4:])
            values = {
                key: to_checksum_address(value) if kind == "address" else value
                for key, kind, value in zip(names, types, decoded, strict=True)
            }
        except ABI_DECODE_ERRORS:  # malformed data from the node: report it undecoded
            return UnknownRevert(f"{what}: reverted with malformed {name} data 0x{data.hex()}", data=data)
        shown = ", ".join(f"{key}={_show(value)}" for key, value in values.items())
        return errors.REVERT_CLASSES[name](f"{what}: reverted with {name}({shown})", values=values, data=data)
    if selector == _ERROR_STRING:
        try:
            reason = decode(["string"], data[4:])[0]
        except ABI_DECODE_ERRORS:  # not an ABI string (or not UTF-8): show the bytes
            reason = f"0x{data.hex()}"
        return UnknownRevert(f"{what}: reverted: {reason}", values={"reason": reason}, data=data)
    if selector == _PANIC:
        code = int.from_bytes(data[4:36], "big") if len(data) >= 36 else -1
        return UnknownRevert(f"{what}: panicked with code {code:#x}", values={"code": code}, data=data)
    return UnknownRevert(f"{what}: reverted without a known error (data 0x{data.hex()})", data=data)


def _bytes_from_eth_tester(exc: BaseException) -> bytes | None:
    """Revert data from eth-tester's ``TransactionFailed`` chain (it nests the raw bytes, or their repr)."""
    seen = set()
    literal = None
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for arg in current.args:
            if isinstance(arg, bytes):
                return arg
            if isinstance(arg, BaseException) and arg.args and isinstance(arg.args[0], bytes):
                return arg.args[0]
            if isinstance(arg, str) and literal is None:
                text = arg.removeprefix("execution reverted: ")
                if text.startswith(("b'", 'b"')):
                    try:
                        literal = ast.literal_eval(text)
                    except (ValueError, SyntaxError):
                        pass
        current = current.__cause__ or current.__context__
    return literal


def decode_revert(exc: BaseException, what: str) -> ContractRevert | None:
    """Map a revert raised by either backend to a ContractRevert subclass; None if ``exc`` is no revert.

    web3 raises ``ContractCustomError``/``ContractLogicError`` (with ``.data``) against a JSON-RPC node such
    as anvil; eth-tester raises ``eth_tester.exceptions.TransactionFailed`` on py-evm.
    """
    if isinstance(exc, ContractLogicError):
        data = exc.data
        if isinstance(data, str) and data.startswith("0x"):
            return revert_from_data(bytes.fromhex(data[2:]), what)
        if isinstance(data, bytes):
            return revert_from_data(data, what)
        return UnknownRevert(f"{what}: reverted: {exc}")
    if type(exc).__name__ == "TransactionFailed" and type(exc).__module__.startswith("eth_tester"):
        data = _bytes_from_eth_tester(exc)
        if data is not None:
            return revert_from_data(data, what)
        return UnknownRevert(f"{what}: reverted: {exc}")
    return None


def ledger_error_of(exc: Exception, what: str) -> Exception:
    """The ledger error for a failed RPC request (``exc`` itself if it already is one or is unexpected)."""
    if isinstance(exc, (LedgerError, TransactionNotFound)):  # the latter is an answer, not a failure
        return exc
    revert = decode_revert(exc, what)
    if revert is not None:
        return revert
    if isinstance(exc, BadFunctionCallOutput):
        return DeploymentMismatch(f"{what}: the contract returned nothing: wrong address or chain? ({exc})")
    # py-evm refuses with eth_utils' ValidationError (e.g. "cannot afford txn gas"), anvil with an RPC error.
    if isinstance(exc, (Web3RPCError, EthValidationError)) or type(exc).__module__.startswith("eth_tester"):
        return RpcRejected(f"{what}: the chain node refused the request: {exc}")
    return exc
