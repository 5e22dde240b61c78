"""Compiled dlx-node contracts, loaded from the committed artifacts.

The Solidity sources live in ``contracts/src``; ``node contracts/build.js`` compiles them with the pinned
solc (``contracts/package.json``) into ``contracts/artifacts/<Name>.json`` and CI checks with
``node contracts/build.js --check`` that a rebuild gives the same bytes. Python reads only the artifacts, so
running a node needs no Node.js.

TrainingLedger and AggregationProver keep their concerns in linked libraries (``LIBRARIES``, docs/LEDGER.md),
StepProver its pure pieces (``STEP_LIBRARIES``):
a deployment deploys each library first and writes its address into the bytecode that calls it
(:func:`link`), as the artifact's ``linkReferences`` place it.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CONTRACTS_DIR = Path(__file__).resolve().parent
ARTIFACT_DIR = CONTRACTS_DIR / "artifacts"
SOURCE_DIR = CONTRACTS_DIR / "src"
BUILD_INPUT = CONTRACTS_DIR / "build" / "input.json"
NAMES = (
    "NodeRegistry", "TrainingLedger", "LedgerMembership", "LedgerDisputes", "LedgerAccusations",
    "AggregationProver", "ProverChunks", "ProverNorms", "ProverAvailability", "ProverBinding",
    "StepProver", "StepProverMath", "StepProverBinding", "Float64Functions", "Float32Harness", "NormHarness",
    "AnswerRelay",
    "RewardPool",
    "ReentrantClaimer", "QuirkyToken",
)
#: StepProver's linked libraries (ledger.stepproof.deploy deploys them first for a StepProver of its own).
STEP_LIBRARIES = ("StepProverMath", "StepProverBinding")
#: The library StepProverMath links (the elementwise functions' soft-float: deployed before it, linked into
#: its code; the one library that links another).
MATH_LIBRARIES = ("Float64Functions",)
#: The linked libraries, in deployment order: TrainingLedger's, then AggregationProver's, then StepProver's
#: (the ledger's constructor creates the prover, whose constructor creates the ledger's StepProver, so the
#: ledger's creation code links all three sets), StepProverMath's own first (each is linked to the ones before
#: it: :func:`link` with the addresses so far).
LIBRARIES = (
    "LedgerMembership", "LedgerDisputes", "LedgerAccusations",
    "ProverChunks", "ProverNorms", "ProverAvailability", "ProverBinding", *MATH_LIBRARIES, *STEP_LIBRARIES,
)
#: EIP-170: the most bytes of code a contract may deploy (build.js fails past 90% of it).
CODE_SIZE_LIMIT = 24_576


@cache
def _load(name: str) -> str:
    if name not in NAMES:
        raise KeyError(f"unknown contract {name!r}: expected one of {list(NAMES)}")
    return (ARTIFACT_DIR / f"{name}.json").read_text(encoding="utf-8")


def artifact(name: str) -> dict:
    """The committed build artifact of contract ``name`` (a fresh dict each call).

    Keys: ``contractName``, ``sourceName``, ``compiler``, ``settings``, ``abi``, ``bytecode`` and
    ``deployedBytecode`` (0x-prefixed hex), ``immutableReferences`` (AST id -> list of ``{start, length}``
    byte ranges in the deployed code), ``linkReferences`` and ``deployedLinkReferences`` (source -> library
    -> list of ``{start, length}`` byte ranges holding the library's address in ``bytecode`` and
    ``deployedBytecode``: :func:`link`), ``methodIdentifiers``, ``metadata``.
    """
    return json.loads(_load(name))


def linked_libraries(artifact: dict, deployed: bool = False) -> dict[str, list[dict]]:
    """The libraries ``artifact``'s creation code (``deployed``: its deployed code) links: name -> byte
    ranges."""
    references = artifact.get("deployedLinkReferences" if deployed else "linkReferences", {})
    return {name: ranges for libraries in references.values() for name, ranges in libraries.items()}


def link(artifact: dict, addresses: dict[str, str], deployed: bool = False) -> str:
    """``artifact``'s ``bytecode`` (``deployed``: ``deployedBytecode``), 0x-prefixed hex, with the address of
    each library it links (``addresses``: library name -> address) written over the library's placeholder.

    Raises:
        KeyError: A library the code links has no address in ``addresses``.
    """
    code = list(artifact["deployedBytecode" if deployed else "bytecode"])
    for name, ranges in linked_libraries(artifact, deployed).items():
        if name not in addresses:
            raise KeyError(f"{artifact['contractName']} links library {name}: no address given for it")
        address = addresses[name].lower().removeprefix("0x")
        if len(address) != 40:
            raise KeyError(f"library {name}: {addresses[name]!r} is not a 20-byte address")
        for reference in ranges:
            start = 2 + 2 * reference["start"]
            code[start : start + 2 * reference["length"]] = address
    return "".join(code)
