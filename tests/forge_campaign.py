"""forge's invariant campaign over the contracts (contracts/forge): run it, read what it reports.

The suite (contracts/forge/test/TrustInvariants.t.sol, TrustHandler.sol) checks docs/TRUST.md's G1-G7 after
every call of its actors; forge is the npm ``@foundry-rs/forge`` pinned in contracts/package.json and
compiles with the project's solcjs through ``contracts/forge/solc``. Used by tests/test_forge_invariants.py,
bench/fuzz_forge.py and scripts/forge_mutations.py (which points ``root`` at a mutated copy).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORGE = REPO / "contracts" / "node_modules" / ".bin" / "forge"
FORGE_ROOT = REPO / "contracts" / "forge"
INVARIANT = "invariant_trust_model"
_VERDICT = re.compile(r"^\[(PASS|FAIL.*)\]", re.MULTILINE)  # "[FAIL: G3: an honest member was slashed]"
_COUNTS = re.compile(r"(invariant_\w+)\(\) \(runs: (\d+), calls: (\d+), reverts: (\d+)\)")


@dataclass
class Campaign:
    passed: bool
    runs: int
    calls: int
    reverts: int
    seconds: float
    failure: str  # forge's reason ("G3: an honest member was slashed"), "" when it passed
    output: str


def forge_available() -> bool:
    return FORGE.exists()


def run_campaign(runs: int, depth: int, seed: int, *, root: Path = FORGE_ROOT, timeout: float = 3600,
                 match: str = INVARIANT) -> Campaign:
    """``forge test`` on the invariant ``match`` with ``runs`` sequences of ``depth`` calls from ``seed``."""
    env = {**os.environ, "FOUNDRY_INVARIANT_RUNS": str(runs), "FOUNDRY_INVARIANT_DEPTH": str(depth),
           "FOUNDRY_FUZZ_SEED": hex(seed), "NO_COLOR": "1"}
    start = time.monotonic()
    done = subprocess.run([str(FORGE), "test", "--match-test", match], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    verdict, counts = _VERDICT.search(output), _COUNTS.search(output)
    if verdict is None or counts is None:
        raise RuntimeError(f"forge reported no invariant result (exit {done.returncode}):\n{output[-4000:]}")
    _, run_count, calls, reverts = counts.groups()
    failure = "" if verdict[1] == "PASS" else verdict[1].removeprefix("FAIL").strip(": ")
    return Campaign(verdict[1] == "PASS" and done.returncode == 0, int(run_count), int(calls), int(reverts),
                    seconds, failure, output)
