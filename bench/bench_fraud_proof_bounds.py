"""The constants of the contract's bound on a fraud proof's cost (issue 62; docs/FRAUD_PROOF.md, "Bounded
proofs"), measured on a real anvil.

``TrainingLedger.createRun`` refuses a fraud-provable run whose worst proof could need more than 10M gas or
128 KiB of calldata at its ``maxContributions`` and ``maxRank``, by ``LedgerCore.proofCost`` (mirrored by
``ledger.runparams.proof_cost``): ``base + M x (per_piece + rank x per_rank)``, gas and bytes alike. The worst
proof is the chunk proof (each listed contribution's piece decoded for 64 elements; the norm proofs read one
piece or only the factors: bench/results/fraud_proof.json). This script sends successful chunk proofs of the
worst kind (the chunk's last element changed, so all 64 are recomputed; every contribution's committed scale
1 + 2^-52, a clip that changes no value, so the float64 product is taken for each element; low-rank pieces
spanning two rows of P) for a few counts and codecs, and writes their gas and calldata next to the formula's
bound for each (``bound_holds``: the formula is above every measurement) to
``bench/results/fraud_proof_bounds.json``, with the per-piece slopes it measured. Short: a (96, 96) stage, at
most 4 contributions.

    nice -n 10 python bench/bench_fraud_proof_bounds.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fraud_proof_setup import aggregated, anvil_url, blobs_of, prove_chunk, rank_of, worst_case  # noqa: E402
from bench.benchio import default_out, write_result  # noqa: E402
from ledger.runparams import (PROOF_MAX_CALLDATA, PROOF_MAX_GAS, most_contributions,  # noqa: E402
                              proof_cost)

SHAPES = {"a.weight": (96, 96)}  # chunk 1: elements 64..127, rows 0 and 1 of P
CASES = (("raw", {}), ("quant", {"bits": 8}), ("lowrank", {"bits": 8, "rank": 8}),
         ("lowrank", {"bits": 8, "rank": 64}))
CHUNK = 1


def measure(url: str, codec: str, options: dict, count: int) -> dict:
    # alike: the rule clips none, so worst_case commits every scale as 1 + 2^-52
    round_ = aggregated(SHAPES, blobs_of(SHAPES, codec, options, count, seed=300, large_every=0))
    row = {"codec": codec, **options, "contributions": count,
           **prove_chunk(url, round_, worst_case(round_.honest, CHUNK), CHUNK,
                         {"max_contributions": count, "max_rank": rank_of(options)})}
    row["gas_bound"], row["calldata_bound"] = proof_cost(count, rank_of(options))
    row["bound_holds"] = (row["gas"] is not None and row["gas"] <= row["gas_bound"]
                          and row["calldata_bytes"] <= row["calldata_bound"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,4")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    started = time.monotonic()
    rows = []
    with anvil_url() as url:
        for codec, options in CASES:
            for count in counts:
                rows.append(measure(url, codec, options, count))
                print(rows[-1], flush=True)
    slopes = {}
    for codec, options in CASES:
        mine = [r for r in rows if r["codec"] == codec and r.get("rank") == options.get("rank")]
        low, high = min(mine, key=lambda r: r["contributions"]), max(mine, key=lambda r: r["contributions"])
        if high["contributions"] > low["contributions"]:
            span = high["contributions"] - low["contributions"]
            slopes[f"{codec}{options.get('rank', '')}"] = {
                "gas_per_piece": (high["gas"] - low["gas"]) // span,
                "bytes_per_piece": (high["calldata_bytes"] - low["calldata_bytes"]) // span}
    result = {"chunk_elements": 64, "shapes": {k: list(v) for k, v in SHAPES.items()}, "rows": rows,
              "slopes": slopes, "max_gas": PROOF_MAX_GAS, "max_calldata": PROOF_MAX_CALLDATA,
              "most_contributions": {str(rank): most_contributions(rank) for rank in (1, 8, 16, 32, 64)},
              "bound_holds": all(row["bound_holds"] for row in rows),
              "seconds": round(time.monotonic() - started, 1)}
    write_result(args.out, result)
    return 0 if result["bound_holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
