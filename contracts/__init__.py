"""Compiled dlx-node contracts, loaded from the committed artifacts.

The Solidity sources live in ``contracts/src``; ``node contracts/build.js`` compiles them with the pinned
solc (``contracts/package.json``) into ``contracts/artifacts/<Name>.json`` and CI checks with
``node contracts/build.js --check`` that a rebuild gives the same bytes. Python reads only the artifacts, so
running a node needs no Node.js.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

CONTRACTS_DIR = Path(__file__).resolve().parent
ARTIFACT_DIR = CONTRACTS_DIR / "artifacts"
SOURCE_DIR = CONTRACTS_DIR / "src"
BUILD_INPUT = CONTRACTS_DIR / "build" / "input.json"
NAMES = ("NodeRegistry", "TrainingLedger", "AggregationProver", "Float32Harness", "NormHarness")


@cache
def _load(name: str) -> str:
    if name not in NAMES:
        raise KeyError(f"unknown contract {name!r}: expected one of {list(NAMES)}")
    return (ARTIFACT_DIR / f"{name}.json").read_text(encoding="utf-8")


def artifact(name: str) -> dict:
    """The committed build artifact of contract ``name`` (a fresh dict each call).

    Keys: ``contractName``, ``sourceName``, ``compiler``, ``settings``, ``abi``, ``bytecode`` and
    ``deployedBytecode`` (0x-prefixed hex), ``immutableReferences`` (AST id -> list of ``{start, length}``
    byte ranges in the deployed code), ``methodIdentifiers``, ``metadata``.
    """
    return json.loads(_load(name))
