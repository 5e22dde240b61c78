"""Collect the DiLoCo/DiLoCoX ablation runs (bench/results/diloco_abl_*.json) into one table and JSON.

Each ablation is one ``bench/bench_diloco.py --tag abl_<name>`` run. Losses are
compared with the DDP run of the same token budget and the same inner settings
(``ddp_same_settings``, ``vs_ddp``) and with the best DDP run of the same token
budget whatever its settings (``ddp_best``, ``vs_ddp_best``: the strong baseline,
the fair reference for a run whose inner settings were tuned for DiLoCo).

    .venv/bin/python bench/diloco_ablations.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

# The arguments that differ between ablations (the rest are the bench defaults).
KEYS = (
    "inner_steps", "rounds", "batch_size", "inner_lr", "lr_schedule", "warmup_steps", "beta2", "weight_decay",
    "outer_lr", "outer_momentum", "x_outer_lr", "x_outer_momentum", "outer_warmup_rounds", "outer_decay",
    "outer_min_lr_ratio", "outer_final_momentum", "delay_correction", "no_delay",
    "error_budget", "bandwidth_budget", "target_reduction", "overlap_steps", "max_rank", "bits", "no_error_feedback",
)


def _tokens(a: dict) -> int:
    return a["rounds"] * a["inner_steps"] * a["batch_size"] * a.get("replicas", 2)


def load(tag: str) -> dict:
    return json.loads((RESULTS / f"diloco_{tag}.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="diloco_ablations.json")
    args = parser.parse_args()
    rows = []
    ddp_by_budget: dict[tuple, float] = {}
    ddp_best: dict[int, float] = {}  # tokens (per block) -> best DDP held-out loss
    runs = {path.stem.removeprefix("diloco_"): json.loads(path.read_text())
            for path in sorted(RESULTS.glob("diloco_*.json")) if path.name != Path(args.out).name}
    runs = {tag: run for tag, run in runs.items() if "summary" in run and "args" in run}
    for tag, run in runs.items():
        ddp = run["summary"].get("ddp")
        if ddp:
            a = run["args"]
            key = (a["rounds"] * a["inner_steps"], a["inner_lr"], a.get("lr_schedule", "constant"),
                   a.get("warmup_steps", 0), a.get("beta2", 0.95), a.get("weight_decay", 0.0))
            ddp_by_budget[key] = ddp["held_out_loss"]
            ddp_best[_tokens(a)] = min(ddp_best.get(_tokens(a), float("inf")), ddp["held_out_loss"])
    for tag, run in runs.items():
        if not tag.startswith(("abl_", "final", "bw_", "x4")):
            continue
        a = run["args"]
        key = (a["rounds"] * a["inner_steps"], a["inner_lr"], a.get("lr_schedule", "constant"),
               a.get("warmup_steps", 0), a.get("beta2", 0.95), a.get("weight_decay", 0.0))
        reference = ddp_by_budget.get(key)
        best = ddp_best.get(_tokens(a))
        for mode, summary in run["summary"].items():
            loss = summary["held_out_loss"]
            rows.append({
                "tag": tag, "mode": mode, "settings": {k: a.get(k) for k in KEYS},
                "held_out_loss": loss,
                "ddp_same_settings": reference,
                "vs_ddp": None if reference is None else loss / reference - 1,
                "ddp_best": best,
                "vs_ddp_best": None if best is None else loss / best - 1,
                "fewer_bytes_than_ddp": summary.get("fewer_bytes_than_ddp"),
                "resolved": run.get("resolved"),
                "bytes_per_replica": summary["bytes_per_replica"],
                "codec_outer_share": summary["codec_outer_share"],
            })
    (RESULTS / args.out).write_text(json.dumps({"rows": rows}, indent=1))
    print(f"{'tag':<34} {'mode':<9} {'held-out':>9} {'ddp':>7} {'vs ddp':>8} {'best ddp':>8} {'vs best':>8}")
    for row in rows:
        gap = "-" if row["vs_ddp"] is None else f"{100 * row['vs_ddp']:+.2f}%"
        ref = "-" if row["ddp_same_settings"] is None else f"{row['ddp_same_settings']:.4f}"
        best_gap = "-" if row["vs_ddp_best"] is None else f"{100 * row['vs_ddp_best']:+.2f}%"
        best = "-" if row["ddp_best"] is None else f"{row['ddp_best']:.4f}"
        print(f"{row['tag']:<34} {row['mode']:<9} {row['held_out_loss']:>9.4f} {ref:>7} {gap:>8} {best:>8} {best_gap:>8}")
    print(f"wrote {(RESULTS / args.out).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
