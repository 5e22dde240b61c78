"""Whether the code on chain is the committed build's: each contract's deployed bytecode against its artifact,
immutables, linked library addresses and a library's own address masked; every linked library checked the same
way (docs/AUDIT.md). Used by the audit (:func:`ledger.checks.check_contracts`) and ``dlx chain verify``."""

from __future__ import annotations

from web3 import Web3

import contracts
from ledger.errors import AuditError


def _expected_code(artifact: dict) -> bytes:
    """``artifact``'s deployed bytecode, each linked library's placeholder as zero bytes."""
    zeros = {name: "0x" + "00" * 20 for name in contracts.linked_libraries(artifact, deployed=True)}
    return bytes.fromhex(contracts.link(artifact, zeros, deployed=True).removeprefix("0x"))


def _is_library(code: bytes) -> bool:
    """Whether ``code`` (an artifact's) is a library's: PUSH20 <its own address, zero in the artifact>,
    ADDRESS, EQ, as solc starts every library with (a call other than a DELEGATECALL to a mutating function
    reverts)."""
    return code[:21] == b"\x73" + bytes(20) and code[21:23] == b"\x30\x14"


def bytecode_problem(deployed: bytes, artifact: dict, address: str) -> str | None:
    """Why ``deployed`` (the code at ``address``) is not ``artifact``'s deployed bytecode, or None.

    The immutables (values written into the code at deployment, e.g. the ledger's registry address), the
    linked libraries' addresses and a library's own address are masked: their bytes are taken from the
    artifact before comparing (:func:`linked_addresses` reads the libraries', :func:`verify_bytecode` checks
    their code). A library must hold its own address.
    """
    expected = _expected_code(artifact)
    name = artifact.get("contractName", "contract")
    if not deployed:
        return f"no code at {address}: {name} is not deployed there"
    if len(deployed) != len(expected):
        return f"code at {address} is {len(deployed)} bytes, {name}'s artifact {len(expected)} bytes"
    masked = bytearray(deployed)
    ranges = [reference for references in artifact.get("immutableReferences", {}).values()
              for reference in references]
    ranges += [reference for references in contracts.linked_libraries(artifact, deployed=True).values()
               for reference in references]
    if _is_library(expected):
        if deployed[1:21].hex() != address.lower().removeprefix("0x"):
            return f"code at {address} is {name}'s as deployed at 0x{deployed[1:21].hex()}, not there"
        ranges.append({"start": 1, "length": 20})
    for reference in ranges:
        start, length = reference["start"], reference["length"]
        masked[start : start + length] = expected[start : start + length]
    if bytes(masked) != expected:
        first = next(i for i, (a, b) in enumerate(zip(masked, expected)) if a != b)
        return f"code at {address} differs from {name}'s committed artifact (first at byte {first})"
    return None


def linked_addresses(deployed: bytes, artifact: dict) -> dict[str, str]:
    """The address of each library ``artifact``'s deployed code links, read from ``deployed`` (its code on
    chain, checked by :func:`bytecode_problem`); AuditError if one library's places hold different
    addresses."""
    addresses = {}
    for name, references in contracts.linked_libraries(artifact, deployed=True).items():
        found = {deployed[r["start"] : r["start"] + r["length"]] for r in references}
        if len(found) != 1:
            raise AuditError(f"{artifact['contractName']}'s code links {len(found)} different {name} "
                             "libraries")
        addresses[name] = Web3.to_checksum_address(found.pop())
    return addresses


def verify_bytecode(w3: Web3, address: str, artifact: dict) -> None:
    """Check that the code at ``address`` is ``artifact``'s deployed bytecode, immutables masked, and that
    every library it links holds its committed code (each checked the same way).

    Raises:
        AuditError: No code at the address, a different length, or differing bytes outside the immutables and
            library addresses, here or in a linked library.
    """
    deployed = bytes(w3.eth.get_code(Web3.to_checksum_address(address)))
    problem = bytecode_problem(deployed, artifact, address)
    if problem is not None:
        raise AuditError(problem)
    for name, library in linked_addresses(deployed, artifact).items():
        try:
            verify_bytecode(w3, library, contracts.artifact(name))
        except AuditError as exc:
            raise AuditError(f"{artifact['contractName']} at {address} links library {name}: {exc}") from None
