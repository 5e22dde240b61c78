"""The elementwise functions' final step on chain, measured (issue 78, docs/FRAUD_PROOF.md "Elementwise
functions"): the gas of StepProver's ``openOutput`` on a UNARY or UNARY_SLOPE op at each function's most
expensive input found.

Per op (kind, function code): the gas of ``Float64Functions.unary`` (an ``eth_estimateGas`` of a direct call)
at each candidate input (``ledger.stepfunctions.EDGE_INPUTS`` and ``--random`` more: uniformly random
bits and values of the usual range); the costliest one is put in a one-element op on anvil's StepProver, an
honest claim of it is challenged (the defender's ``openOutput`` is the final move, which recomputes the
function and decides) and so is a claim one ulp off (proven). Every move's gas is held to the 10M bound.

    python bench/bench_step_unary.py [--random 300] [--out bench/results/step_unary.json]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import contracts  # noqa: E402
from bench.benchio import default_out, write_result  # noqa: E402
from ledger import stepfunctions as sf  # noqa: E402
from ledger.anvil import AnvilProcess  # noqa: E402
from ledger.chain import connect_rpc  # noqa: E402
from ledger.stepproof import UNARY, Defender, Operation, StepProverClient, const_leaf, deploy  # noqa: E402
from ledger.stepproof import play  # noqa: E402

BOND = 10**15
MOVE_BOUND = 10_000_000


def candidates(count: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    random_bits = rng.integers(0, 2**32, count // 2, dtype=np.uint64).astype(np.uint32)
    usual = (rng.standard_normal(count - count // 2) * 10.0 ** rng.integers(-4, 3, count - count // 2))
    usual_bits = usual.astype(np.float32).view(np.uint32)
    edges = np.array(sf.EDGE_INPUTS, dtype=np.uint32)
    return [int(b) for b in np.concatenate([edges, random_bits, usual_bits])]


def one_element(kind: int, code: int, x: int, out: int) -> Operation:
    return Operation(kind, 1, code, 1, [const_leaf(x)], [], [const_leaf(out)], 1, 0)


def measure(w3, client: StepProverClient, library, kind: int, code: int, count: int) -> dict:
    costs = {x: library.functions.unary(kind, code, x).estimate_gas()
             for x in candidates(count, code + 100 * kind)}
    worst = max(costs, key=lambda x: (costs[x], x))
    defender, challenger = w3.eth.accounts[1], w3.eth.accounts[2]
    out = sf.unary_bits(kind, code, worst)
    honest = one_element(kind, code, worst, out)
    start = len(client.gas_log)
    upheld, moves = play(client, client.claim(honest, defender), Defender(honest, defender), challenger, 0,
                         lambda *_: False)
    final_gas = client.gas_log[-1][1]
    cheat = one_element(kind, code, worst, out + 1 if out & 0x7FFFFFFF != 0x7F800000 else out - 1)
    cheat_claim = client.claim(cheat, defender)
    cheat_won, _ = play(client, cheat_claim, Defender(cheat, defender), challenger, 0, lambda *_: False)
    return {"kind": "UNARY" if kind == UNARY else "UNARY_SLOPE", "code": code, "function": sf.NAMES[code],
            "inputs_tried": len(costs), "worst_input_bits": f"0x{worst:08x}",
            "worst_input": float(np.uint32(worst).view(np.float32)), "function_gas_worst": costs[worst],
            "function_gas_median": int(np.median(list(costs.values()))), "final_move_gas": final_gas,
            "honest_upheld": bool(upheld), "honest_moves": moves,
            "one_ulp_cheat_proven": bool(not cheat_won and client.wrong(cheat_claim)),
            "max_gas_any_move": max(gas for _, gas, _ in client.gas_log[start:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(__file__))
    parser.add_argument("--random", type=int, default=300, help="random candidate inputs per op")
    args = parser.parse_args()
    load = list(os.getloadavg())
    anvil = AnvilProcess()
    url = anvil.start()
    try:
        w3 = connect_rpc(url, timeout=120.0)
        client = StepProverClient(w3, deploy(w3, BOND, 20, "0x" + "00" * 20))
        artifact = contracts.artifact("Float64Functions")
        tx = w3.eth.contract(abi=artifact["abi"], bytecode=artifact["bytecode"]).constructor().transact(
            {"from": w3.eth.accounts[0]})
        library = w3.eth.contract(address=w3.eth.wait_for_transaction_receipt(tx)["contractAddress"],
                                  abi=artifact["abi"])
        rows = []
        for kind, code in sf.OPS:
            row = measure(w3, client, library, kind, code, args.random)
            print(row, flush=True)
            rows.append(row)
    finally:
        anvil.stop()
    worst = max(row["max_gas_any_move"] for row in rows)
    write_result(args.out, {"rows": rows, "max_gas_any_move": worst, "move_bound": MOVE_BOUND,
                            "within_bound": worst <= MOVE_BOUND,
                            "all_upheld_and_proven": all(r["honest_upheld"] and r["one_ulp_cheat_proven"]
                                                         for r in rows)}, load)
    return 0 if worst <= MOVE_BOUND else 1


if __name__ == "__main__":
    raise SystemExit(main())
