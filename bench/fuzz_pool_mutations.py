#!/usr/bin/env python3
"""Mutation check of the reward pool's invariants (issue 77): seed a real bug into a copy of
contracts/src/RewardPool.sol and show that the pool's stateful fuzzer (tests/reward_machine.py, P1..P6), the
trust fuzzer with its pool actors (R1-R5) or the forge pool campaign (PoolInvariants.t.sol, R1-R5) catches
it, naming the property that failed. docs/REWARDS.md ("Mutations the pool's invariants catch") lists
them.

Each mutation edits one line of a copy of contracts/ in a temporary directory, builds it there (node
contracts/build.js), and runs the machine on py-evm against the copy's artifacts, derandomized (the same
examples every time) and without shrinking (the first failure ends the run). The unmutated contract must pass
the same run first.

    python bench/fuzz_pool_mutations.py                     # all, 12 examples x 30 steps each
    python bench/fuzz_pool_mutations.py --only claim-twice  # one (names below)
    python bench/fuzz_pool_mutations.py --machine trust --examples 3 --steps 30 --jobs 2   # trust fuzzer
    python bench/fuzz_pool_mutations.py --machine forge --examples 8 --steps 128 --jobs 2  # forge campaign

The trust fuzzer's and the forge campaign's checks each write one current result (``RESULTS``:
bench/results/pool_mutations.json, one entry a machine, docs/RESULTS.md); the pool machine's are
printed (docs/REWARDS.md has its table).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: Each machine's one current result (the pool machine's is printed only).
#: The one current result: each machine's latest run under ``machines[<machine>]`` (a run replaces its own).
RESULT = "bench/results/pool_mutations.json"
#: What a result was measured on (their sha256 in the JSON): the contract and the machines.
SOURCES = ("contracts/src/RewardPool.sol", "tests/reward_machine.py", "tests/trust_machine.py",
           "tests/trust_pool.py", "contracts/forge/test/PoolHandler.sol",
           "contracts/forge/test/PoolRounds.sol", "contracts/forge/test/PoolInvariants.t.sol")


@dataclass(frozen=True)
class Mutation:
    name: str
    old: str  # must occur exactly once in RewardPool.sol
    new: str
    expect: str  # the property meant to catch it
    bug: str
    trust: str = ""  # the trust fuzzer's and the forge campaign's invariant meant to catch it (R1-R5)
    source: str = "RewardPool.sol"  # under contracts/src (scripts/forge_mutations.mutated_tree reads it)


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

#: The forge campaign's seed (forge draws from it; the same calls every time).
FORGE_SEED = 0x5EED

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

#: The trust machine's moves weighted up for the mutation check (each listed w times among its ~40 rules,
#: every rule enabled: tests/trust_machine.every_rule_enabled): a short run of the whole machine otherwise
#: draws few claims that pay, and a bug no claim exercises is not caught. The steered moves
#: (tests/trust_pool.py): a member's own claim once final (pays), a claim of the newest round at once
#: (refused: not final), a coalition attester convicted (equivocation) claiming (refused); then the drawn
#: claims, the captured run's and the token's re-entry.
TRUST_WEIGHTS = {"member_claims_once_final": 10, "member_claims_at_once": 3,
                 "coalition_attester_equivocates_and_claims": 3, "member_claims": 3,
                 "coalition_claims_its_captured_round": 2, "token_reenters": 10}

#: The trust fuzzer (tests/trust_machine.py with its pool actors, tests/trust_pool.py R1-R5) instead, its
#: moves weighted by ``sys.argv[4]`` (JSON: :data:`TRUST_WEIGHTS`).
CHILD_TRUST = """
import json
import logging
import sys
from pathlib import Path
import contracts
contracts.ARTIFACT_DIR = Path(sys.argv[1])
logging.basicConfig(level=logging.CRITICAL)
from hypothesis import HealthCheck, Phase, settings
from tests.trust_machine import TrustMachine, _weigh
_weigh(TrustMachine, json.loads(sys.argv[4]))
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
    """One run of ``machine`` against RewardPool.sol with ``mutation`` (None: as it is): ``examples`` x
    ``steps`` (forge: sequences x calls); whether an invariant caught it, and which."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pool-mutation-") as tmp:
        if machine == "forge":
            caught_by, failure, failed = _forge(Path(tmp), mutation, examples, steps)
        else:
            caught_by, failure, failed = _python(Path(tmp), mutation, examples, steps, machine)
    # caught: the run failed on an invariant (P1-P6, R1-R5); a failure of anything else is a broken run
    broken = failed and not caught_by
    return {"mutation": mutation.name if mutation else "none",
            "bug": mutation.bug if mutation else "(the contract as it is)",
            "expected": (mutation.expect if machine == "pool" else mutation.trust) if mutation else None,
            "caught": failed and not broken, "broken": broken,
            "caught_by": caught_by, "failure": failure,
            "seconds": round(time.monotonic() - start, 1)}


def _python(tmp: Path, mutation: Mutation | None, examples: int, steps: int,
            machine: str) -> tuple[list[str], str, bool]:
    """The pool's or the trust machine on py-evm against a built copy: (properties failed, the last error
    line, whether the run failed)."""
    artifacts = built_copy(tmp, mutation)
    run = subprocess.run([sys.executable, "-c", CHILD_TRUST if machine == "trust" else CHILD, str(artifacts),
                          str(examples), str(steps), json.dumps(TRUST_WEIGHTS)],
                         cwd=REPO, capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "PYTHONPATH": str(REPO), "DLX_TRUST_STRICT_RULES": "1"})
    output = run.stdout + run.stderr
    last = [line for line in output.splitlines() if "Error" in line][-1:] if run.returncode else []
    caught_by = sorted(set(re.findall(r"AssertionError: ([PR]\d)", output)))
    return caught_by, last[0].strip()[:300] if last else "", run.returncode != 0


def _forge(tmp: Path, mutation: Mutation | None, runs: int, depth: int) -> tuple[list[str], str, bool]:
    """The forge pool campaign (PoolInvariants.t.sol, R1-R5) on a mutated copy of the forge tree, seed
    FORGE_SEED, no shrinking: (invariants failed, forge's reason, whether it failed)."""
    sys.path.insert(0, str(REPO))
    from scripts.forge_mutations import mutated_tree
    from tests.forge_campaign import FORGE_ROOT, run_campaign

    left_out = ("CalldataFuzz.t.sol", "MoneySymbolic.t.sol", "Game*.sol", "TrustGame*.sol",
                "TrustHandler.sol", "TrustInvariants.t.sol", "Verdict*.sol")
    root = mutated_tree(tmp, mutation, left_out)
    for built in ("out", "cache"):  # the tree's last build: forge recompiles only what the mutation changed
        if (FORGE_ROOT / built).is_dir():
            shutil.copytree(FORGE_ROOT / built, root / built, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("pool-tally*"))
    campaign = run_campaign(runs, depth, FORGE_SEED, root=root, timeout=3600, match="invariant_pool_books",
                            shrink=0)
    return sorted(set(re.findall(r"\b(R\d):", campaign.failure))), campaign.failure[:300], not campaign.passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[m.name for m in MUTATIONS])
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--machine", choices=("pool", "trust", "forge"), default="pool",
                        help="the pool's own machine (P1-P6), the trust fuzzer with its pool actors (R1-R5), "
                             "or the forge pool campaign (R1-R5: --examples sequences of --steps calls)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (each its own process)")
    parser.add_argument("--out", help="write the result here (default: the machine's one current result, "
                                      "RESULT, under machines.<machine>; the pool machine's: none)")
    args = parser.parse_args()
    if args.out is None and args.machine in ("trust", "forge"):
        args.out = str(REPO / RESULT)
    load = list(os.getloadavg())
    chosen = [None] * (not args.no_baseline) + [m for m in MUTATIONS if not args.only or m.name in args.only]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda m: shown(check(m, args.examples, args.steps, args.machine)), chosen))
    baseline_ok = args.no_baseline or not (results[0]["caught"] or results[0]["broken"])
    missed = [r["mutation"] for r in results if r["mutation"] != "none" and not r["caught"]]
    mutants = len(chosen) - (not args.no_baseline)
    print(f"baseline {'passed' if baseline_ok else 'FAILED'}; {mutants - len(missed)} of {mutants} "
          f"mutations caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
    if args.out:
        sys.path.insert(0, str(REPO))
        trust = args.machine == "trust"
        run = {
            "machine": args.machine, "examples": args.examples, "steps": args.steps, "derandomized": True,
            "weights": TRUST_WEIGHTS if trust else {},
            "funding_rounds": _trust_setting("FUNDING_ROUNDS") if trust else None,
            "spare_slots": _trust_setting("SPARE_SLOTS") if trust else None,
            "baseline": None if args.no_baseline else ("passed" if baseline_ok else "failed"),
            "mutants": mutants, "caught": mutants - len(missed), "missed": missed,
            "as_expected": sum(1 for r in results if r["expected"] and r["expected"] in r["caught_by"]),
            "forge_seed": hex(FORGE_SEED) if args.machine == "forge" else None,
            "jobs": args.jobs, "results": results,
            "sources": {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest() for name in SOURCES}}
        _write_machine(Path(args.out), args.machine, run, load)
    return 0 if baseline_ok and not missed else 1



def _write_machine(path: Path, machine: str, run: dict, load) -> None:
    """Put ``run`` (with its ``recorded`` block) under ``machines[machine]`` of the one result at ``path``."""
    from bench.benchio import recorded, write_result

    try:
        machines = json.loads(path.read_text()).get("machines", {})
    except (OSError, ValueError, AttributeError):
        machines = {}
    machines[machine] = {**run, "recorded": recorded(load)}
    write_result(path, {"machines": machines}, load)  # the file's provenance: this run's


def shown(result: dict) -> dict:
    print(json.dumps(result), flush=True)
    return result


def _trust_setting(name: str) -> int:
    """A constant of the trust machine's pools (tests/trust_pool.py: FUNDING_ROUNDS, the rounds they are
    funded for at set-up; SPARE_SLOTS, their contribution slots past the run's maxContributions); 0: none."""
    text = (REPO / "tests" / "trust_pool.py").read_text()
    found = re.search(rf"^{name} = (\d+)", text, re.MULTILINE)
    return int(found[1]) if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
