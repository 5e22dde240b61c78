"""The Float32 soft-float against torch on millions of operands, on a real anvil (issue 43).

Every operation of contracts/src/Float32.sol runs through Float32Harness with ``eth_call`` in batches on an
anvil this script starts, and each result is compared with torch's on this CPU (numpy's for the norm rule's
float64 division and square root, exact Python for integers wider than 64 bits): bit for bit, NaN class only
for a NaN result (docs/SOFTFLOAT.md). Operand classes per operation (tests/float32_reference.py):
``random`` (uniform bit patterns: every exponent, NaNs, subnormals), ``biased`` (exponents near the edges,
mantissas near 0 and all ones, short mantissas), ``near`` (b = a moved a few units in the last place: ties
and cancellations; unary: the biased operands moved), ``ties`` (built to round at an exact tie or up into
the next binade), and ``edges`` (every pair of edge values, once). Then the gas of each operation on
``typical`` operands (normal values of weights' and updates' magnitudes, what the outer step sees) and on
the random classes, measured by the harness's gasleft() calls. Writes ``bench/results/float32_fuzz.json``;
exits 1 on any mismatch.

    nice -n 10 python bench/fuzz_float32.py --per-op 1000000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import RESULTS, write_result  # noqa: E402
from ledger.chain import connect_rpc
from ledger.anvil import AnvilProcess
from tests.float32_reference import (  # noqa: E402
    OPS,
    biased_bits,
    deploy_harness,
    edge_operands,
    harness_call,
    mismatches,
    near_bits,
    random_bits,
    reference,
    tie_operands,
)

CLASS_SHARES = {"random": 0.4, "biased": 0.4, "near": 0.1, "ties": 0.1}
CALL_GAS = 1_900_000_000
KEEP_MISMATCHES = 10


def class_operands(rng: np.random.Generator, op, kind: str, count: int) -> tuple:
    """``count`` operands ``(a, b)`` of class ``kind`` (module docstring)."""
    if kind == "ties":
        return tie_operands(rng, op, count)
    if kind == "random":
        a = random_bits(rng, op.width, count)
    else:
        a = biased_bits(rng, op.width, count)
    if op.width == 32:  # the integer conversions: no bit neighbours worth building beyond ties
        return a, None
    if kind == "near":
        if op.binary:
            return a, near_bits(rng, a)
        return near_bits(rng, a), None
    if not op.binary:
        return a, None
    return a, (random_bits if kind == "random" else biased_bits)(rng, op.width, count)


def typical_operands(rng: np.random.Generator, op, count: int) -> tuple:
    """Normal values of the magnitudes the outer step sees (2^-24 .. 2^2, either sign); integers as the
    decoder converts them: |M| < 2^53 (a low-rank product, ``fromInt``), |q| <= 32767 (a quantized value,
    ``fromInt32``)."""
    if op.width == 32:
        bound = 1 << 53 if op.name == "fromInt" else 32768
        return [int(v) for v in rng.integers(-bound + 1, bound, size=count)], None
    dtype = np.float32 if op.width == 4 else np.float64

    def draw():
        magnitude = np.ldexp(rng.uniform(1.0, 2.0, size=count), rng.integers(-24, 3, size=count))
        return (magnitude * rng.choice([-1.0, 1.0], size=count)).astype(dtype).view(np.uint32 if op.width == 4
                                                                                    else np.uint64)

    a = draw()
    if op.name == "sqrt64":
        a = np.abs(a.view(np.float64)).view(np.uint64)
    return a, (draw() if op.binary else None)


def fuzz_op(w3, address, op, total: int, batch: int, rng: np.random.Generator) -> dict:
    """``total`` operands of ``op`` in classes, then every edge pair: counts and the first mismatches."""
    counts, bad, found = {}, {}, []

    def run(kind: str, a, b) -> None:
        got = harness_call(w3, address, op, a, b, gas=CALL_GAS)
        wrong = mismatches(op, got, reference(op, a, b))
        counts[kind] = counts.get(kind, 0) + len(got)
        bad[kind] = bad.get(kind, 0) + int(wrong.size)
        for i in wrong[: KEEP_MISMATCHES - len(found)]:
            found.append({"class": kind, "a": hex(int(a[i])), "b": None if b is None else hex(int(b[i])),
                          "got": hex(int(got[i]))})

    for kind, share in CLASS_SHARES.items():
        remaining = int(total * share)
        while remaining > 0:
            size = min(batch, remaining)
            run(kind, *class_operands(rng, op, kind, size))
            remaining -= size
    a, b = edge_operands(op)
    run("edges", a, b)
    return {"operands": sum(counts.values()), "by_class": counts, "mismatches": sum(bad.values()),
            "mismatches_by_class": bad, "first_mismatches": found}


def gas_of(w3, address, op, rng: np.random.Generator, count: int) -> dict:
    """Gas per call of ``op``: on typical operands (median, max) and on the random and biased classes."""
    typical = harness_call(w3, address, op, *typical_operands(rng, op, count), gas=CALL_GAS, measure=True)
    spread = np.concatenate([
        harness_call(w3, address, op, *class_operands(rng, op, kind, count), gas=CALL_GAS, measure=True)
        for kind in ("random", "biased", "ties")
    ])
    return {"typical_median": int(np.median(typical)), "typical_max": int(typical.max()),
            "all_classes_mean": round(float(spread.mean()), 1), "max": int(max(spread.max(), typical.max()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-op", type=int, default=1_000_000,
                        help="operands per operation (before the edges)")
    parser.add_argument("--int-per-op", type=int, default=0,
                        help="operands for the integer conversions, whose reference is per-element Python "
                             "(0: as --per-op)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated operations")
    parser.add_argument("--batch", type=int, default=25_000, help="operands per eth_call")
    parser.add_argument("--gas-samples", type=int, default=2_000,
                        help="operands per class for the gas figures")
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--out", default=str(RESULTS / "float32_fuzz.json"))
    args = parser.parse_args()
    load = list(os.getloadavg())
    rng = np.random.default_rng(args.seed)
    names = [name for name in args.ops.split(",") if name]
    unknown = sorted(set(names) - set(OPS))
    if unknown:
        parser.error(f"unknown operations {unknown}; known: {', '.join(OPS)}")
    anvil = AnvilProcess(extra_args=("--disable-block-gas-limit",))
    anvil.start()
    results, started = {}, time.monotonic()
    try:
        w3 = connect_rpc(anvil.url, timeout=600.0)
        address = deploy_harness(w3)
        for name in names:
            op = OPS[name]
            total = args.int_per_op if op.width == 32 and args.int_per_op else args.per_op
            began = time.monotonic()
            entry = fuzz_op(w3, address, op, total, args.batch, rng)
            entry["seconds"] = round(time.monotonic() - began, 1)
            entry["gas"] = gas_of(w3, address, op, rng, args.gas_samples)
            results[name] = entry
            print(f"{name}: {entry['operands']:,} operands, {entry['mismatches']} mismatches, "
                  f"{entry['seconds']:.0f} s, gas {entry['gas']}", flush=True)
    finally:
        anvil.stop()
    total_mismatches = sum(entry["mismatches"] for entry in results.values())
    result = {
        "ops": results,
        "operands": sum(entry["operands"] for entry in results.values()),
        "mismatches": total_mismatches,
        "seconds": round(time.monotonic() - started, 1),
        "per_op": args.per_op,
        "int_per_op": args.int_per_op or args.per_op,
        "seed": args.seed,
        "backend": "anvil (eth_call, Float32Harness)",
        "reference": "torch CPU (float32 ops, float64 multiply, conversions); numpy float64 division and "
                     "sqrt (the norm rule's Python floats); exact Python integers",
        "gas_method": ("gasleft() around the library call minus gasleft() around an "
                       "identity call, per operand"),
        "classes": list(CLASS_SHARES) + ["edges"],
    }
    path = write_result(args.out, result, load)
    print(f"{result['operands']:,} operands, {total_mismatches} mismatches -> {path}")
    return 1 if total_mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
