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

from bench.benchio import default_out, write_result  # noqa: E402
from ledger.anvil import AnvilProcess  # noqa: E402
from ledger.chain import connect_rpc  # noqa: E402
from ledger.runparams import (PROOF_MAX_CALLDATA, PROOF_MAX_GAS, most_contributions,  # noqa: E402
                              proof_cost)
from tests.fraud_fixtures import aggregated_round, changed, commit, contribution, with_scale  # noqa: E402
from tests.ledger_fixtures import deploy  # noqa: E402

SHAPES = {"a.weight": (96, 96)}  # chunk 1: elements 64..127, rows 0 and 1 of P
CASES = (("raw", {}, 0), ("quant", {"bits": 8}, 0), ("lowrank", {"bits": 8, "rank": 8}, 8),
         ("lowrank", {"bits": 8, "rank": 64}, 64))
STAKE = 10**18
CHUNK = 1
# float64 1 + 2^-52: float32(float64(d) * s) == d for every float32 d (the change is far below half a float32
# ulp), so the weights stay the honest ones while the contract takes the clip's product for every element
NEXT_AFTER_ONE = 0x3FF0000000000001


def measure(url: str, codec: str, options: dict, rank: int, count: int) -> dict:
    blobs = [contribution(SHAPES, codec, 300 + i, scale=1e-3, **options)  # alike: the rule clips none
             for i in range(count)]
    round_ = aggregated_round(SHAPES, blobs)
    wrong = round_.honest
    for j in range(count):  # every scale a clip that changes no value: the float64 product in every piece
        wrong = with_scale(wrong, j, NEXT_AFTER_ONE)
    wrong = changed(wrong, CHUNK, 63)
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, wrong, stake=STAKE,
                       values={"max_contributions": count, "max_rank": max(rank, 1)})
    receipt = committed.prover().prove_wrong_aggregation(committed.proof(CHUNK))
    sent = committed.deployment.w3.eth.get_transaction(receipt["transactionHash"])
    gas_bound, bytes_bound = proof_cost(count, max(rank, 1))
    row = {"codec": codec, **options, "contributions": count, "gas": receipt["gasUsed"],
           "calldata_bytes": len(sent["input"]), "gas_bound": gas_bound, "calldata_bound": bytes_bound}
    row["bound_holds"] = row["gas"] <= gas_bound and row["calldata_bytes"] <= bytes_bound
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,4")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    anvil = AnvilProcess()
    url = anvil.start()
    started = time.monotonic()
    rows = []
    try:
        for codec, options, rank in CASES:
            for count in counts:
                rows.append(measure(url, codec, options, rank, count))
                print(rows[-1], flush=True)
    finally:
        anvil.stop()
    slopes = {}
    for codec, options, _rank in CASES:
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
