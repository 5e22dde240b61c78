"""docs/RESULTS.md's section of bench/bench_step_compile.py: a real model's inner step as a step program."""

from __future__ import annotations

from results_sections import table


def step_compile(r: dict) -> list[str]:
    """bench/bench_step_compile.py: the first inner step of each model compiled to a program (issue 78)."""
    rows, bounds = [], []
    for preset, m in r["models"].items():
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(m["ops_per_kind"].items(), key=lambda kv: -kv[1]))
        rows.append([preset, f"{m['parameters']:,}", m["state_tensors"], f"{m['ops']:,}",
                     m["ops_not_on_chain"], f"{m['elements']:,}", m["depth"],
                     f"{m['tables']} ({m['table_elements']:,})",
                     "yes" if m["end_state_bits_equal"] and m["loss_bits_equal"] else "NO", kinds])
        for h, halvings in m["halvings"].items():
            moves = m["moves_estimate"][h]
            bounds.append([preset, h, f"{m['k_on_chain']:,}", halvings["on_chain_k"], moves["on_chain_k"],
                           f"{m['k_any']:,}", halvings["any_k"], moves["any_k"]])
    lines = [f"The first reproducible inner step (kernel version {r['kernel_version']}, AdamW with the clip, "
             f"{r['batch_rows']} rows of the block size) compiled to a program of element-level ops "
             "(training/step_compile.py) and run with `run_op` from the step's start: its end state and "
             "loss against a trainer that took the same step untraced. Ops not on chain: kinds >= 16 "
             "(layouts, batched products, the mask's select, max, one-hot, cast, scatter, the embedding's "
             "backward, concatenation, the clip's float64 norm and factor).", ""]
    lines += table(["model", "parameters", "state tensors", "ops", "not on chain", "output elements",
                    "depth", "tables (elements)", "end bits =", "ops per kind"], rows)
    lines += ["The bisection's halvings `ceil(log2 H) + ceil(log2 ops) + ceil(log2 k)` (k: the widest "
              "on-chain product or tree sum, and the widest inner game of any op, the clip's norm and the "
              "embedding's backward included), and the moves estimated as two a halving plus "
              f"{r['moves_constant']} (the toy's measured game).", ""]
    lines += table(["model", "H", "k on chain", "halvings", "moves (est.)", "k any op", "halvings",
                    "moves (est.)"], bounds)
    return lines
