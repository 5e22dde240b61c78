"""Gas of the binding of listed contributions to members (issue 62; docs/FRAUD_PROOF.md, "The binding"), on
a real anvil, at 4, 16 and 17 contributions (raw, one 64 x 64 stage; 17 is the most a raw run may list:
createRun's bound), each run created with ``maxContributions`` the count and the round listing all of them
(bench/fraud_proof_setup.py's :func:`aggregated`).

For each count: ``chunk_gas``, the chunk proof (``proveWrongAggregation``) of a round with one element
changed, and ``scale_gas``, the norm proof of a clipped contribution committed with scale 1.0, in a version-3
run: what a proof cost before the binding and costs after it (a wrong round is found before the binding is
read, so these should not move); and ``binding_gas``, the proof (``proveWrongNorm`` of the scales, which are
right) of a round whose last listed contribution is signed by an account that holds no seat: every listed
signature is recovered and every signer's seat read (the worst case; only with the binding). Figures go to
``bench/results/binding_gas.json`` (the tree before the binding, commit 871cb8c, measured the first two:
docs/FRAUD_PROOF.md "The binding").

    nice -n 10 python bench/bench_binding_gas.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, write_result  # noqa: E402
from ledger.anvil import AnvilProcess  # noqa: E402
from ledger.chain import connect_rpc  # noqa: E402
from bench.fraud_proof_setup import aggregated, blobs_of  # noqa: E402
from tests.fraud_fixtures import DILOCO, changed, commit, with_scale  # noqa: E402
from tests.ledger_fixtures import deploy  # noqa: E402

SHAPES = {"a.weight": (64, 64)}
STAKE = 10**18


def measure(url: str, count: int) -> dict:
    normed = dataclasses.replace(DILOCO, commitments="normed")
    round_ = aggregated(SHAPES, blobs_of(SHAPES, "raw", {}, count), normed)
    values = {"max_contributions": count, "max_rank": 1}
    row = {"contributions": count}
    chunk = 5
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_,
                       changed(round_.honest, chunk, 7), stake=STAKE, values=values)
    row["chunk_gas"] = committed.prover().prove_wrong_aggregation(committed.proof(chunk))["gasUsed"]
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_,
                       with_scale(round_.honest, 3, 0x3FF0000000000000), stake=STAKE, values=values)
    row["scale_gas"] = committed.prover().prove_wrong_norm(committed.scale_proof())["gasUsed"]
    outsider = count + 1  # commit() makes accounts 1 .. count members: count + 1 is none
    signers = (*range(1, count), outsider)
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, round_.honest,
                       stake=STAKE, contributors=signers, values=values)
    prover = committed.prover()
    row["binding_gas"] = prover.prove_wrong_norm(committed.scale_proof())["gasUsed"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(__file__))
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 16, 17])
    args = parser.parse_args()
    anvil = AnvilProcess()
    url = anvil.start()
    rows = []
    try:
        for count in args.counts:
            row = measure(url, count)
            print(row, flush=True)
            rows.append(row)
    finally:
        anvil.stop()
    write_result(args.out, {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
