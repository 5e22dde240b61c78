"""The reward pool's forge invariant campaign (issue 77): contracts/forge/test/PoolHandler.sol's actors
against R1-R5 (PoolInvariants.t.sol), every invariant checked after every call, for a bounded number of calls.

Runs ``--jobs`` forge processes side by side (``--runs / --jobs`` sequences of ``--depth`` calls each, seeds
``--seed``, ``--seed + 1``, ...) and writes ``bench/results/forge_pool_invariants.json``: each campaign's
seed, calls, seconds and verdict, their sums (calls, each actor's calls, reverts; exit 1 on a violation), and
the tally of what the calls did, summed over the sequences (PoolInvariants.t.sol's ``afterInvariant`` writes
one line a sequence to the file POOL_TALLY names, one file a process): claims paid and refused by kind, and
the sequences in which a round was overturned.

    nice -n 15 python bench/fuzz_forge_pool.py --runs 240 --depth 250 --jobs 2   # 60,000 calls
    python bench/fuzz_forge_pool.py --merge part_*.json --commit REV   # campaigns run apart (each its --out)
    python bench/fuzz_forge_pool.py --stale   # which sources changed since the recorded campaign ran

Each result records the sha256 of every source the campaign compiled from (contracts/src and the pool
campaign's test files: ``sources``), so a result made on older contracts shows it (``--stale``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import RESULTS, write_result  # noqa: E402
from bench.forgesources import digest, one_tree, sources, stale  # noqa: E402
from tests.forge_campaign import FORGE, FORGE_ROOT, Campaign, run_campaign  # noqa: E402

POOL_INVARIANT = "invariant_pool_books"
# What the pool campaign compiles beside contracts/src: its handler, rounds, invariants and their bases.
CAMPAIGN_TESTS = ("PoolInvariants.t.sol", "PoolHandler.sol", "PoolRounds.sol", "TrustBase.sol", "Vm.sol")
INVARIANTS = ["R1 credits within the pool (no round paid past its budget; free + open budgets = funded - "
              "claimed)",
              "R2 no credit for a convicted member, an account not listed (a copier, a forged signature), a "
              "round not final or overturned; each attestation and contribution the rule's share",
              "R3 a claim pays once", "R4 each pool's balance = funded (what arrived) - claimed",
              "R5 a re-entrant token's calls into its pool refused (RewardReentered)"]
#: PoolInvariants.t.sol afterInvariant's line, in order.
TALLY = ("attestations_paid", "contributions_paid", "contributions_refused", "forged_refused",
         "overturned_refused", "convicted_refused", "reentries_refused", "sequences_overturned")
_CALLS = re.compile(r"^\| PoolHandler \| (\w+)\s*\| (\d+)\s*\| (\d+)", re.MULTILINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=400, help="sequences in all (split over the jobs)")
    parser.add_argument("--depth", type=int, default=250, help="calls per sequence")
    parser.add_argument("--seed", type=lambda v: int(v, 0), default=0x9001)
    parser.add_argument("--jobs", type=int, default=1, help="forge processes side by side")
    parser.add_argument("--out", default=str(RESULTS / "forge_pool_invariants.json"))
    parser.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                        help="write one result from these results of campaigns run apart (nothing is run)")
    parser.add_argument("--commit", default="", help="with --merge: the commit the campaigns ran on")
    parser.add_argument("--stale", action="store_true",
                        help="list the sources that changed since the campaign of --out ran (exit 1 if any)")
    args = parser.parse_args()
    if args.stale:
        return stale(args.out, CAMPAIGN_TESTS)
    if args.merge:
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        result = {**summed([c for part in parts for c in part["campaigns"]]), "forge": parts[0]["forge"],
                  "merged_from": len(parts), "campaigns_ran_on": args.commit}
        ran_on = one_tree(parts)
        return report({**result, **({"sources_digest": digest(ran_on), "sources": ran_on} if ran_on else {})},
                      args.out, None)
    load = list(os.getloadavg())
    ran_on = sources(CAMPAIGN_TESTS)
    subprocess.run([str(FORGE), "build"], cwd=FORGE_ROOT, check=True, capture_output=True, timeout=1800)
    shares = [args.runs // args.jobs + (1 if i < args.runs % args.jobs else 0) for i in range(args.jobs)]
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        campaigns = list(pool.map(lambda i: one_campaign(shares[i], args.depth, args.seed + i, i),
                                  [i for i in range(args.jobs) if shares[i]]))
    version = subprocess.run([str(FORGE), "--version"], capture_output=True, text=True, check=False).stdout
    result = {**summed(campaigns), "forge": version.splitlines()[0] if version else "", "jobs": args.jobs,
              "wall_seconds": round(time.monotonic() - start, 1),
              "sources_digest": digest(ran_on), "sources": ran_on}
    return report(result, args.out, load)


def one_campaign(runs: int, depth: int, seed: int, job: int) -> dict:
    """One forge process's campaign, with its own tally file: its seed, counts, seconds, verdict, each
    actor's calls and the tally of what its calls did."""
    tally_file = FORGE_ROOT / "cache" / f"pool-tally-{job}.txt"
    tally_file.unlink(missing_ok=True)
    # forge's root is its working directory: the path is relative to contracts/forge (fs_permissions: cache/)
    campaign: Campaign = run_campaign(runs, depth, seed, timeout=12 * 3600, match=POOL_INVARIANT,
                                      env={"POOL_TALLY": f"cache/{tally_file.name}"})
    return {"seed": hex(seed), "runs": campaign.runs, "depth": depth, "calls": campaign.calls,
            "reverts": campaign.reverts, "seconds": round(campaign.seconds, 1), "passed": campaign.passed,
            "failure": campaign.failure,
            # forge's per-selector table: each actor's calls
            "calls_by_actor": {name: int(calls) for name, calls, _ in _CALLS.findall(campaign.output)},
            "tally": _tally(tally_file)}


def summed(campaigns: list[dict]) -> dict:
    """The campaigns kept whole, and their sums: calls, reverts, each actor's calls, the tally, the rate over
    their summed seconds (one process's calls a second), the violations (campaigns that failed)."""
    calls = sum(c["calls"] for c in campaigns)
    seconds = sum(c["seconds"] for c in campaigns)
    actors = sorted({name for c in campaigns for name in c["calls_by_actor"]})
    return {"depth": sorted({c["depth"] for c in campaigns}), "runs": sum(c["runs"] for c in campaigns),
            "calls": calls, "reverts": sum(c["reverts"] for c in campaigns),
            "campaign_seconds": round(seconds, 1),
            "calls_per_second": round(calls / seconds, 1) if seconds else 0.0,
            "violations": sum(1 for c in campaigns if not c["passed"]),
            "failures": [f"seed {c['seed']}: {c['failure']}" for c in campaigns if not c["passed"]],
            "calls_by_actor": {name: sum(c["calls_by_actor"].get(name, 0) for c in campaigns)
                               for name in actors},
            "invariants": INVARIANTS,
            "tally": {key: sum(c["tally"][key] for c in campaigns) for key in ("sequences", *TALLY)},
            "campaigns": campaigns}


def report(result: dict, out: str, load: list[float] | None) -> int:
    """Print the campaign's line, write its one current result; 1 on a violation."""
    print(f"{result['calls']:,} calls in {len(result['campaigns'])} campaign(s), "
          f"{result['campaign_seconds']:.0f} s of campaigns, {result['violations']} violation(s)"
          + "".join(f"\n  {failure}" for failure in result["failures"]))
    write_result(out, result, load)
    return 1 if result["violations"] else 0


def _tally(path: Path) -> dict[str, int]:
    """The sum of afterInvariant's lines (:data:`TALLY`); ``sequences`` is how many lines there were."""
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    sums = [sum(int(line[i]) for line in lines) for i in range(len(TALLY))]
    return {"sequences": len(lines), **dict(zip(TALLY, sums, strict=True))}


if __name__ == "__main__":
    sys.exit(main())
