"""The forge invariant campaign at length (issue 63): contracts/forge's handlers against G1-G7, in the EVM.

Runs ``--jobs`` forge campaigns side by side (each ``--runs / --jobs`` sequences of ``--depth`` calls, seeds
``--seed``, ``--seed + 1``, ...), every invariant checked after every call, and writes
``bench/results/forge_invariants.json``: the runs, depth and seed of each campaign, its calls and verdict,
calls per second over the whole, and the time 1,000,000 calls would take at that rate (exit 1 on a
violation).

    nice -n 10 python bench/fuzz_forge.py --runs 4000 --depth 250 --jobs 16   # 1,000,000 calls
    nice -n 10 python bench/fuzz_forge.py --runs 40 --depth 500                # a shared 2-core machine
    python bench/fuzz_forge.py --merge chunk_*.json --commit REV  # campaigns run apart (each its own --out)
    python bench/fuzz_forge.py --stale   # which of the sources the recorded campaign ran on changed since

Each result records the sha256 of every source the campaign compiled from (contracts/src and the campaign's
own handlers and invariants: ``sources``), so a result made on older contracts shows it (``--stale``).

"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import RESULTS, write_result  # noqa: E402
from bench.forgesources import digest, one_tree, sources, stale  # noqa: E402
from tests.forge_campaign import FORGE, FORGE_ROOT, run_campaign  # noqa: E402

TARGET_CALLS = 1_000_000
# What the trust campaign compiles and runs: the contracts, and its handlers and invariants (its test files).
CAMPAIGN_TESTS = ("TrustInvariants.t.sol", "TrustHandler.sol", "TrustGame.sol", "TrustBase.sol", "Vm.sol")
INVARIANTS = ["G1 every committed record is honest",
              "G1 who counts (tenure, counters; at most maxSeats seats, a leave frees one)",
              "G2 a live honest member is never ejectable",
              "G3 no honest member slashed, no honest round overturned (a hashed run takes no challenge)",
              "G4 an honest leaver's whole stake back when due; no stake leaves early",
              "G5 finality and disputes by the disputer only",
              "G6 exact solvency (to the wei, proof funds included)",
              "G7 right rounds never proven wrong (a contributor that left before the commit, withdrew "
              "or rejoined unbinds nothing); every wrong round overturned whatever a squatter or the "
              "coalition's own proof does; the slash burned whole; whoever proved it paid min(the run's "
              "proof fund, half the slash) from the fund"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="sequences in all (split over the jobs)")
    parser.add_argument("--depth", type=int, default=500, help="calls per sequence")
    parser.add_argument("--seed", type=lambda v: int(v, 0), default=0xD1C0)
    parser.add_argument("--jobs", type=int, default=1, help="forge processes side by side")
    parser.add_argument("--out", default=str(RESULTS / "forge_invariants.json"))
    parser.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                        help="write one result from these results of campaigns run apart (nothing is run)")
    parser.add_argument("--commit", default="", help="with --merge: the commit the campaigns ran on")
    parser.add_argument("--stale", action="store_true",
                        help="list the sources that changed since the campaign of --out ran (exit 1 if any)")
    args = parser.parse_args()
    if args.stale:
        return stale(args.out, CAMPAIGN_TESTS)
    if args.merge:
        return merge(args.merge, args.out, args.commit)
    load = list(os.getloadavg())
    ran_on = sources(CAMPAIGN_TESTS)
    subprocess.run([str(FORGE), "build"], cwd=FORGE_ROOT, check=True, capture_output=True, timeout=1800)
    shares = [args.runs // args.jobs + (1 if i < args.runs % args.jobs else 0) for i in range(args.jobs)]
    start = time.monotonic()
    with ThreadPoolExecutor(args.jobs) as pool:
        campaigns = list(pool.map(lambda i: (args.seed + i, run_campaign(shares[i], args.depth, args.seed + i,
                                                                           timeout=24 * 3600)),
                                  [i for i in range(args.jobs) if shares[i]]))
    seconds = time.monotonic() - start
    calls = sum(c.calls for _, c in campaigns)
    rate = calls / seconds
    version = subprocess.run([str(FORGE), "--version"], capture_output=True, text=True, check=False).stdout
    result = {
        "forge": version.splitlines()[0] if version else "",
        "depth": args.depth, "runs": sum(c.runs for _, c in campaigns), "jobs": args.jobs,
        "campaigns": [{"seed": hex(seed), "runs": c.runs, "depth": args.depth, "calls": c.calls,
                       "reverts": c.reverts, "seconds": round(c.seconds, 1), "passed": c.passed,
                       "failure": c.failure} for seed, c in campaigns],
        "calls": calls, "violations": sum(1 for _, c in campaigns if not c.passed),
        "seconds": round(seconds, 1), "calls_per_second": round(rate, 1),
        "target_calls": TARGET_CALLS,
        "projected_seconds_for_target": round(TARGET_CALLS / rate) if calls < TARGET_CALLS else None,
        "invariants": INVARIANTS,
        "sources_digest": digest(ran_on), "sources": ran_on,
    }
    print(f"{calls:,} calls in {seconds:.0f} s ({rate:.1f} calls/s), {result['violations']} violation(s)")
    write_result(args.out, result, load)
    return 1 if result["violations"] else 0


def merge(paths: list[str], out: str, commit: str) -> int:
    """One result from the results of campaigns run apart (e.g. in sequence, a chunk at a time): every
    campaign kept with its seed, runs, depth, calls and seconds; the rate: calls over their summed seconds."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    ran_on = one_tree(parts)
    campaigns = [c for part in parts for c in part["campaigns"]]
    calls = sum(c["calls"] for c in campaigns)
    seconds = sum(c["seconds"] for c in campaigns)
    result = {
        "forge": parts[0]["forge"], "depth": sorted({c["depth"] for c in campaigns}),
        "runs": sum(c["runs"] for c in campaigns), "merged_from": len(parts), "campaigns_ran_on": commit,
        "campaigns": campaigns, "calls": calls,
        "violations": sum(1 for c in campaigns if not c["passed"]),
        "campaign_seconds": round(seconds, 1),
        "calls_per_second": round(calls / seconds, 1) if seconds else 0,
        "target_calls": TARGET_CALLS,
        # one process's campaign seconds for the target at the chunks' rate (side by side: less wall)
        "projected_seconds_for_target": (round(TARGET_CALLS * seconds / calls)
                                         if 0 < calls < TARGET_CALLS else None),
        "invariants": INVARIANTS,
    }
    if ran_on:
        result["sources_digest"], result["sources"] = digest(ran_on), ran_on
    print(f"{calls:,} calls in {len(campaigns)} campaigns, {result['violations']} violation(s)")
    write_result(out, result)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
