"""forge's invariant campaign over the contracts (contracts/forge): run it, read what it reports.

The suite (contracts/forge/test/TrustInvariants.t.sol, TrustHandler.sol) checks docs/TRUST.md's G1-G7 after
every call of its actors; forge is the npm ``@foundry-rs/forge`` pinned in contracts/package.json and
compiles with the project's solcjs through ``contracts/forge/solc``. Used by tests/test_forge_invariants.py,
bench/fuzz_forge.py and scripts/forge_mutations.py (which points ``root`` at a mutated copy). The quick
campaign (``QUICK``) runs two focused invariants beside it: VerdictInvariants.t.sol, the coalition's verdicts
at close quarters (commits, joins, leaves, disputes and accusations sharing blocks), and GameInvariants.t.sol,
TrustGame's fraud-proof game moves alone (most sequences play a game to its proof).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORGE = REPO / "contracts" / "node_modules" / ".bin" / "forge"
FORGE_ROOT = REPO / "contracts" / "forge"
INVARIANT = "invariant_trust_model"
VERDICTS = "invariant_verdicts_need_the_quorum_in_force"
GAME = "invariant_every_wrong_round_overturned"
QUICK = f"{INVARIANT}|{VERDICTS}|{GAME}"  # --match-test of the quick campaign: one compilation
_VERDICT = re.compile(r"^\[(PASS|FAIL.*)\]")  # "[FAIL: G3: an honest member was slashed]"
_COUNTS = re.compile(r"(invariant_\w+)\(\) \(runs: (\d+), calls: (\d+), reverts: (\d+)\)")


@dataclass
class Campaign:
    passed: bool
    runs: int  # runs, calls and reverts: summed over the invariants run
    calls: int
    reverts: int
    seconds: float
    failure: str  # forge's reason ("G3: an honest member was slashed"), "" when it passed
    output: str
    invariants: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name: (runs, calls, reverts)
    failures: dict[str, str] = field(default_factory=dict)  # name: forge's reason, for each that failed


def forge_available() -> bool:
    return FORGE.exists()


def run_campaign(runs: int, depth: int, seed: int, *, root: Path = FORGE_ROOT, timeout: float = 3600,
                 match: str = INVARIANT, shrink: int | None = None,
                 env: dict[str, str] | None = None) -> Campaign:
    """``forge test`` on the invariants ``match`` (a regex: ``QUICK`` runs three) with ``runs`` sequences of
    ``depth`` calls each from ``seed``; ``shrink`` bounds forge's shrinking of a counterexample (0: none);
    ``env``: more environment for forge (the pool campaign's ``POOL_TALLY``)."""
    env = {**os.environ, **(env or {}), "FOUNDRY_INVARIANT_RUNS": str(runs),
           "FOUNDRY_INVARIANT_DEPTH": str(depth), "FOUNDRY_FUZZ_SEED": hex(seed), "NO_COLOR": "1"}
    if shrink is not None:
        env["FOUNDRY_INVARIANT_SHRINK_RUN_LIMIT"] = str(shrink)
    start = time.monotonic()
    done = subprocess.run([str(FORGE), "test", "--match-test", match], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    results = _results(output)
    if not results:
        raise RuntimeError(f"forge reported no invariant result (exit {done.returncode}):\n{output[-4000:]}")
    counts = {name: c for name, (_, c) in results.items()}
    failures = {name: verdict.removeprefix("FAIL").strip(": ")
                for name, (verdict, _) in results.items() if verdict != "PASS"}
    return Campaign(not failures and done.returncode == 0, sum(c[0] for c in counts.values()),
                    sum(c[1] for c in counts.values()), sum(c[2] for c in counts.values()), seconds,
                    next(iter(failures.values()), ""), output, counts, failures)


def _results(output: str) -> dict[str, tuple[str, tuple[int, int, int]]]:
    """Each invariant's verdict ("PASS", "FAIL: reason") and counts, in the order forge reports them: a pass
    on one line, a failure's counts after its counterexample (the summary's repeats are skipped)."""
    results: dict[str, tuple[str, tuple[int, int, int]]] = {}
    verdict = None
    for line in output.splitlines():
        found = _VERDICT.match(line)
        if found:
            verdict = found[1]
        counts = _COUNTS.search(line)
        if counts and verdict is not None:
            results.setdefault(counts[1], (verdict, (int(counts[2]), int(counts[3]), int(counts[4]))))
            verdict = None
    return results
