#!/usr/bin/env python3
"""Mutation check of the reward pool's invariants (issue 77): seed a real bug into a copy of
contracts/src/RewardPool.sol and show that the pool's stateful fuzzer (tests/reward_machine.py, P1..P6)
catches it, naming the property that failed. docs/REWARDS.md ("Mutations the pool's invariants catch") lists
them.

Each mutation edits one line of a copy of contracts/ in a temporary directory, builds it there (node
contracts/build.js), and runs the machine on py-evm against the copy's artifacts, derandomized (the same
examples every time) and without shrinking (the first failure ends the run). The unmutated contract must pass
the same run first.

    python scripts/pool_mutations.py                     # all, 12 examples x 30 steps each
    python scripts/pool_mutations.py --only claim-twice  # one (names below)
    python scripts/pool_mutations.py --machine trust --examples 6 --steps 60  # the trust fuzzer's R1-R5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    old: str  # must occur exactly once in RewardPool.sol
    new: str
    expect: str  # the property meant to catch it
    bug: str
    trust: str = ""  # the trust fuzzer's invariant meant to catch it (tests/trust_pool.py R1-R5), if any


MUTATIONS = (
    Mutation("claim-twice",
             "if (_claimed[key]) revert RewardAlreadyClaimed(runId, round, stage, msg.sender);",
             "", "P4", "a share can be claimed again", "R3"),
    Mutation("open-unfinal",
             "if (!_ledger.isFinal(runId, next)) revert RewardRoundNotFinal(runId, next);", "",
             "P3", "a round opens (and pays) before it is final, or overturned", "R2"),
    Mutation("pay-convicted",
             "if (member.status == TrainingLedger.MemberStatus.Slashed) "
             "revert RewardConvicted(runId, msg.sender);",
             "", "P5", "a convicted member is paid", "R2"),
    Mutation("reserve-nothing", "pool.free -= amount;", "", "P1",
             "a round opens without reserving its budget", "R1"),
    Mutation("paid-unrecorded", "budget.paid += uint128(amount);", "", "P2",
             "a claim is not counted against its round's budget (credits can exceed the pool)", "R1"),
    Mutation("credit-asked", "received = held - before;", "received = amount;", "P1",
             "a token funding is credited as the amount asked, not what arrived (a fee-on-transfer token)",
             "R4"),
    Mutation("no-lock", "if (_locked) revert RewardReentered();", "", "P6",
             "no re-entrancy lock: the token's calls into the pool from inside a transfer go through", "R5"),
    Mutation("share-of-listed",
             "uint256 slots = count > params.contributionSlots ? count : params.contributionSlots;",
             "uint256 slots = count;", "P5",
             "a contribution's share is the stage's budget over those listed (dropping others raises it)",
             "R2"),
)

#: What the child process runs: the machine against the artifacts of ``sys.argv[1]``.
CHILD = """
import sys
from pathlib import Path
import contracts
contracts.ARTIFACT_DIR = Path(sys.argv[1])
from hypothesis import HealthCheck, Phase, settings
from tests.reward_machine import RewardMachine
RewardMachine.TestCase.settings = settings(
    max_examples=int(sys.argv[2]), stateful_step_count=int(sys.argv[3]), deadline=None,
    suppress_health_check=list(HealthCheck), derandomize=True, database=None,
    phases=[Phase.explicit, Phase.generate])
RewardMachine.TestCase().runTest()
"""

#: The trust fuzzer (tests/trust_machine.py with its pool actors, tests/trust_pool.py R1-R5) instead.
CHILD_TRUST = """
import logging
import sys
from pathlib import Path
import contracts
contracts.ARTIFACT_DIR = Path(sys.argv[1])
logging.basicConfig(level=logging.CRITICAL)
from hypothesis import HealthCheck, Phase, settings
from tests.trust_machine import TrustMachine, _weigh
# the pool's moves weighted up: a short run of the whole machine otherwise draws few claims that pay, and a
# bug no claim exercises is not caught. The steered moves (tests/trust_pool.py): a member's own claim once
# final (pays), a claim of the newest round at once (refused: not final), a coalition attester convicted
# (equivocation) claiming (refused); then the drawn claims, the captured run's and the token's re-entry
_weigh(TrustMachine, {"member_claims_once_final": 10, "member_claims_at_once": 3,
                      "coalition_attester_equivocates_and_claims": 3, "member_claims": 3,
                      "coalition_claims_its_captured_round": 2, "token_reenters": 10})
TrustMachine.TestCase.settings = settings(
    max_examples=int(sys.argv[2]), stateful_step_count=int(sys.argv[3]), deadline=None,
    suppress_health_check=list(HealthCheck), derandomize=True, database=None,
    phases=[Phase.explicit, Phase.generate])
TrustMachine.TestCase().runTest()
"""


def built_copy(workdir: Path, mutation: Mutation | None) -> Path:
    """A copy of contracts/ with ``mutation`` applied to RewardPool.sol, built; its artifacts directory."""
    root = workdir / "contracts"
    skipped = shutil.ignore_patterns("node_modules", "forge", "artifacts", "__pycache__")
    shutil.copytree(REPO / "contracts", root, ignore=skipped)
    (root / "artifacts").mkdir()
    (root / "node_modules").symlink_to((REPO / "contracts" / "node_modules").resolve())
    if mutation is not None:
        path = root / "src" / "RewardPool.sol"
        text = path.read_text()
        if text.count(mutation.old) != 1:
            raise SystemExit(f"mutation {mutation.name}: {mutation.old!r} occurs {text.count(mutation.old)} "
                             "times in RewardPool.sol (the contract changed: update the mutation)")
        path.write_text(text.replace(mutation.old, mutation.new))
    subprocess.run(["node", str(root / "build.js")], check=True, capture_output=True, timeout=900)
    return root / "artifacts"


def check(mutation: Mutation | None, examples: int, steps: int, machine: str = "pool") -> dict:
    start = time.monotonic()
    child = CHILD_TRUST if machine == "trust" else CHILD
    with tempfile.TemporaryDirectory(prefix="pool-mutation-") as tmp:
        artifacts = built_copy(Path(tmp), mutation)
        run = subprocess.run([sys.executable, "-c", child, str(artifacts), str(examples), str(steps)],
                             cwd=REPO, capture_output=True, text=True, timeout=3600,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    output = run.stdout + run.stderr
    caught_by = sorted(set(re.findall(r"AssertionError: ([PR]\d)", output)))
    last = [line for line in output.splitlines() if "Error" in line][-1:] if run.returncode else []
    return {"mutation": mutation.name if mutation else "none",
            "bug": mutation.bug if mutation else "(the contract as it is)",
            "expected": (mutation.trust if machine == "trust" else mutation.expect) if mutation else None,
            "caught": run.returncode != 0,
            "caught_by": caught_by, "failure": last[0].strip()[:300] if last else "",
            "seconds": round(time.monotonic() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS])
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--machine", choices=("pool", "trust"), default="pool",
                        help="the pool's own machine (P1-P6) or the trust fuzzer with its pool actors "
                             "(R1-R5)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    results = [] if args.no_baseline else [check(None, args.examples, args.steps, args.machine)]
    for result in results:
        print(json.dumps(result), flush=True)
    for mutation in chosen:
        results.append(check(mutation, args.examples, args.steps, args.machine))
        print(json.dumps(results[-1]), flush=True)
    baseline_ok = args.no_baseline or not results[0]["caught"]
    missed = [r["mutation"] for r in results if r["mutation"] != "none" and not r["caught"]]
    print(f"baseline {'passed' if baseline_ok else 'FAILED'}; {len(chosen) - len(missed)} of {len(chosen)} "
          f"mutations caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    return 0 if baseline_ok and not missed else 1


if __name__ == "__main__":
    raise SystemExit(main())
