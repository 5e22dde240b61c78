"""The table of DiLoCo/DiLoCoX ablations: bench/results/diloco_ablations.json, one row per (run, mode).

An ablation is one ``bench/bench_diloco.py --out /tmp/<name>.json ...`` run with other settings.
This script adds its rows to the table under a name (replacing that name's rows if it was there),
or removes a name's rows, and compares every row's held-out loss with the DDP row of the same
token budget and inner settings (``ddp_same_settings``, ``vs_ddp``) and with the best DDP row of
the same token budget whatever its settings (``ddp_best``, ``vs_ddp_best``: the strong baseline,
the fair reference for a run whose inner settings were tuned for DiLoCo). The per-round curves
stay in the run's own file; the table keeps what docs/RESULTS.md shows. History is in git.

    .venv/bin/python bench/bench_diloco.py --modes diloco_x --encoder v2 --out /tmp/v2.json
    .venv/bin/python bench/diloco_ablations.py --add codec_v2=/tmp/v2.json
    .venv/bin/python bench/diloco_ablations.py                  # recompute and print the table
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import RESULTS, write_result  # noqa: E402

TABLE = RESULTS / "diloco_ablations.json"

# The arguments that differ between ablations (the rest are the bench defaults).
KEYS = (
    "replicas", "inner_steps", "rounds", "batch_size", "inner_lr", "lr_schedule", "warmup_steps", "beta2",
    "weight_decay", "outer_lr", "outer_momentum", "x_outer_lr", "x_outer_momentum", "outer_warmup_rounds",
    "outer_decay", "outer_min_lr_ratio", "outer_final_momentum", "delay_correction", "no_delay",
    "error_budget", "bandwidth_budget", "target_reduction", "overlap_steps", "max_rank", "bits",
    "no_error_feedback", "encoder", "seed", "cpu_clock",
)


def _budget_key(settings: dict) -> tuple:
    """Runs whose DDP baselines are comparable: same steps, inner lr, schedule, warmup, beta2, decay."""
    return (settings["rounds"] * settings["inner_steps"], settings["inner_lr"], settings.get("lr_schedule")
            or "constant",
            settings.get("warmup_steps") or 0, settings.get("beta2") or 0.95, settings.get("weight_decay")
            or 0.0)


def _tokens(settings: dict) -> int:
    return settings["rounds"] * settings["inner_steps"] * settings["batch_size"] * (settings.get("replicas")
                                                                                    or 2)


def rows_of(name: str, run: dict) -> list[dict]:
    """The table's rows of one bench_diloco.py result (one per mode)."""
    if "summary" not in run or "args" not in run:
        raise SystemExit(f"{name}: not a bench_diloco.py result (no 'summary' or 'args')")
    settings = {k: run["args"].get(k) for k in KEYS}
    recorded = run.get("recorded", {})
    return [{
        "tag": name, "mode": mode, "settings": settings,
        "held_out_loss": summary["held_out_loss"],
        "fewer_bytes_than_ddp": summary.get("fewer_bytes_than_ddp"),
        "resolved": run.get("resolved"),
        "bytes_per_replica": summary["bytes_per_replica"],
        "codec_outer_share": summary["codec_outer_share"],
        "load": run.get("load") or recorded.get("load_average"),
        "date": recorded.get("date"),
    } for mode, summary in run["summary"].items()]


def compare(rows: list[dict]) -> None:
    """Fill every row's DDP references from the table's own DDP rows."""
    same: dict[tuple, float] = {}
    best: dict[int, float] = {}
    for row in rows:
        if row["mode"] == "ddp":
            same[_budget_key(row["settings"])] = row["held_out_loss"]
            tokens = _tokens(row["settings"])
            best[tokens] = min(best.get(tokens, float("inf")), row["held_out_loss"])
    for row in rows:
        reference = same.get(_budget_key(row["settings"]))
        strong = best.get(_tokens(row["settings"]))
        row["ddp_same_settings"] = reference
        row["vs_ddp"] = None if reference is None else row["held_out_loss"] / reference - 1
        row["ddp_best"] = strong
        row["vs_ddp_best"] = None if strong is None else row["held_out_loss"] / strong - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--add", action="append", default=[], metavar="NAME=PATH",
                        help="add (or replace) the rows of a bench_diloco.py result under NAME")
    parser.add_argument("--remove", action="append", default=[], metavar="NAME")
    parser.add_argument("--table", default=str(TABLE))
    args = parser.parse_args()
    table = Path(args.table)
    rows = json.loads(table.read_text())["rows"] if table.exists() else []
    for name in args.remove:
        rows = [row for row in rows if row["tag"] != name]
    for item in args.add:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--add {item!r}: expected NAME=PATH")
        run = json.loads(Path(path).read_text())
        rows = [row for row in rows if row["tag"] != name] + rows_of(name, run)
    compare(rows)
    if args.add or args.remove or not table.exists():
        write_result(table, {"rows": rows})
        print(f"wrote {table}")
    print(f"{'tag':<34} {'mode':<9} {'held-out':>9} {'ddp':>7} {'vs ddp':>8} {'best ddp':>8} {'vs best':>8}")
    for row in rows:
        gap = "-" if row["vs_ddp"] is None else f"{100 * row['vs_ddp']:+.2f}%"
        ref = "-" if row["ddp_same_settings"] is None else f"{row['ddp_same_settings']:.4f}"
        best_gap = "-" if row["vs_ddp_best"] is None else f"{100 * row['vs_ddp_best']:+.2f}%"
        best = "-" if row["ddp_best"] is None else f"{row['ddp_best']:.4f}"
        print(f"{row['tag']:<34} {row['mode']:<9} {row['held_out_loss']:>9.4f} {ref:>7} {gap:>8} "
              f"{best:>8} {best_gap:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
