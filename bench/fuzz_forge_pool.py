"""The reward pool's forge invariant campaign (issue 77): contracts/forge/test/PoolHandler.sol's actors
against R1-R5 (PoolInvariants.t.sol), every invariant checked after every call, for a bounded number of calls.

Runs ``--runs`` sequences of ``--depth`` calls from ``--seed`` in one forge process and writes
``bench/results/forge_pool_invariants.json``: the calls (each actor's too), reverts, seconds and verdict
(exit 1 on a violation), and the tally of what the calls did, summed over the sequences
(PoolInvariants.t.sol's ``afterInvariant`` writes one line a sequence to the file POOL_TALLY names): claims
paid and refused by kind, and the sequences in which a round was overturned.

    nice -n 10 python bench/fuzz_forge_pool.py --runs 400 --depth 250    # 100,000 calls
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import RESULTS, write_result  # noqa: E402
from tests.forge_campaign import FORGE, FORGE_ROOT, run_campaign  # noqa: E402

POOL_INVARIANT = "invariant_pool_books"
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
    parser.add_argument("--runs", type=int, default=400, help="sequences")
    parser.add_argument("--depth", type=int, default=250, help="calls per sequence")
    parser.add_argument("--seed", type=lambda v: int(v, 0), default=0x9001)
    parser.add_argument("--out", default=str(RESULTS / "forge_pool_invariants.json"))
    args = parser.parse_args()
    load = list(os.getloadavg())
    subprocess.run([str(FORGE), "build"], cwd=FORGE_ROOT, check=True, capture_output=True, timeout=1800)
    tally_file = FORGE_ROOT / "cache" / "pool-tally.txt"
    tally_file.unlink(missing_ok=True)
    os.environ["POOL_TALLY"] = "cache/pool-tally.txt"  # forge's root is the working directory
    campaign = run_campaign(args.runs, args.depth, args.seed, timeout=6 * 3600, match=POOL_INVARIANT)
    tally = _tally(tally_file)
    version = subprocess.run([str(FORGE), "--version"], capture_output=True, text=True, check=False).stdout
    result = {
        "forge": version.splitlines()[0] if version else "",
        "seed": hex(args.seed), "runs": campaign.runs, "depth": args.depth, "calls": campaign.calls,
        "reverts": campaign.reverts, "seconds": round(campaign.seconds, 1),
        "calls_per_second": round(campaign.calls / campaign.seconds, 1) if campaign.seconds else 0.0,
        "passed": campaign.passed, "failure": campaign.failure,
        "violations": 0 if campaign.passed else 1,
        # forge's per-selector table: each actor's calls
        "calls_by_actor": {name: int(calls) for name, calls, _ in _CALLS.findall(campaign.output)},
        "invariants": INVARIANTS,
        "tally": tally,
    }
    print(f"{campaign.calls:,} calls in {campaign.seconds:.0f} s, "
          f"{'no violation' if campaign.passed else 'VIOLATION: ' + campaign.failure}")
    write_result(args.out, result, load)
    return 0 if campaign.passed else 1


def _tally(path: Path) -> dict[str, int]:
    """The sum of afterInvariant's lines (:data:`TALLY`); ``sequences`` is how many lines there were."""
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    sums = [sum(int(line[i]) for line in lines) for i in range(len(TALLY))]
    return {"sequences": len(lines), **dict(zip(TALLY, sums, strict=True))}


if __name__ == "__main__":
    sys.exit(main())
