"""Benchmark: the gap to DDP split by cause (issue 66): the one-step delay and the compression, each alone.

Cells (``CELLS``), each a mode of training/simulate.py with one part of DiLoCoX switched off:

* ``ddp``: centralized data-parallel training, the baseline of every gap;
* ``sync``: synchronous DiLoCo (no delay, the raw codec: DiLoCo's own share of the gap);
* ``delay``: DiLoCoX with the raw codec (the one-step delay only, at the node's defaults: "rebase", overlap
  "auto");
* ``compression``: DiLoCoX without the delay (the compression only: the byte budget "auto", 1000x);
* ``both``: DiLoCoX as the node runs it;
* method cells (``both-<method>``, ``delay-<method>``): DiLoCoX or the delay only with one setting changed
  (``METHODS``), measured against ``both`` / ``delay`` at the same seeds and tokens.

Every cell runs the same model, tokens, seeds and inner-lr schedule (``--optimizer``, Muon by default), and
every gap is taken against DDP at the same seed (a seed sets the initial weights and every replica's batches).
Rows accumulate in ONE JSON (bench/results/convergence_ablation.json), keyed by case, rounds, cell, seed and
inner optimizer, so a loaded machine can measure the plan in pieces, several runs side by side (each adds its
rows to the file under a lock; ``--fresh`` starts over). The summary gives per cell the
mean over the seeds run, the spread (max - min) and the gap against DDP; the split: ``delay - sync``,
``compression - sync``, and what ``both`` adds beyond the two (their interaction).

    nice python bench/bench_convergence_ablation.py --case gpt2-mini --rounds 10 --seeds 0,1

The case's tokens are ``rounds * H * batch * block * M``; ``--rounds 10`` is a third of bench_convergence.py's
budget (30 rounds), with the cosine inner-lr schedule compressed to the shorter run.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import RESULTS, default_corpus, write_result  # noqa: E402
from bench.convergence_cases import CASES, INNER_STEPS, REPLICAS, STAGES  # noqa: E402
from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.data import load_corpus  # noqa: E402
from training.model import count_params  # noqa: E402
from training.simulate import simulate  # noqa: E402
from training.simulate_records import set_clock  # noqa: E402

#: cell -> (simulation mode, DilocoConfig changes, CompressionConfig changes)
CELLS = {
    "ddp": ("ddp", {}, {}),
    "sync": ("diloco", {}, {}),
    "delay": ("diloco_x", {}, {"enabled": False}),
    "compression": ("diloco_x", {"one_step_delay": False}, {}),
    "both": ("diloco_x", {}, {}),
}
#: method -> (DilocoConfig changes, CompressionConfig changes): tried against the delay and the compression.
METHODS = {
    "eager": ({"delay_correction": "eager"}, {}),
    "lookahead": ({"delay_correction": "lookahead"}, {}),
    "om0.3": ({"outer_momentum": 0.3}, {}),
    # No error feedback (the existing switch): the control for leaky error feedback's decay.
    "noef": ({}, {"error_feedback": False}),
    # Leaky error feedback (compression.error_feedback_decay; SparseLoCo, arXiv 2508.15706).
    **{f"efd{beta}": ({}, {"error_feedback_decay": beta}) for beta in (0.5, 0.8, 0.9)},
    # A higher rank at the same bytes: the allocator may pick rank 64 (2-bit factors) where 32 capped it.
    "rank64": ({}, {"max_rank": 64}),
    # The encoder: "v2" selects every round; "v3" warm-starts the factors from last round's (PowerSGD).
    "v2": ({}, {"encoder": "v2"}),
    "v3": ({}, {"encoder": "v3"}),
    # Low-bit scales clipped to the smallest squared error (compression.quant_scale = "mse"), with and
    # without error feedback.
    "qmse": ({}, {"quant_scale": "mse"}),
    "qmse-noef": ({}, {"quant_scale": "mse", "error_feedback": False}),
    "v2-qmse": ({}, {"encoder": "v2", "quant_scale": "mse"}),
    "v2-qmse-noef": ({}, {"encoder": "v2", "quant_scale": "mse", "error_feedback": False}),
    # Rank 64 with clipped 2-bit factors: a higher rank at the bytes rank 32 at 4 bits costs.
    "rank64-qmse": ({}, {"max_rank": 64, "quant_scale": "mse"}),
}
for _base in ("both", "delay", "compression"):
    _mode, _diloco, _compression = CELLS[_base]
    CELLS.update({f"{_base}-{name}": (_mode, {**_diloco, **diloco}, {**_compression, **compression})
                  for name, (diloco, compression) in METHODS.items()})
#: method -> TrainingConfig changes, tried against the synchronous cell and the compression cell (issue 78):
#: ``fresh``, a new inner optimizer every round (``training.inner_state = "fresh"``), which a run under the
#: step prover's plain end rule needs (docs/FRAUD_PROOF.md "The claim's end").
TRAINING_METHODS = {"fresh": {"inner_state": "fresh"}}
#: cell -> its TrainingConfig changes (the cells not named here change none).
CELL_TRAINING = {}
for _base in ("sync", "compression"):
    for _name, _change in TRAINING_METHODS.items():
        CELLS[f"{_base}-{_name}"] = CELLS[_base]
        CELL_TRAINING[f"{_base}-{_name}"] = _change
#: The order the plan runs in (the split first, at every seed, then the methods).
SPLIT = ("ddp", "sync", "delay", "compression", "both")


def run_cell(case: str, cell: str, seed: int, rounds: int, optimizer: str, corpus, data: str) -> dict:
    """One simulation: its row of the JSON."""
    fields, batch, family = CASES[case]
    mode, diloco_change, compression_change = CELLS[cell]
    model_cfg = ModelConfig(**fields)
    training_change = CELL_TRAINING.get(cell, {})
    training_cfg = TrainingConfig(data_path=data, batch_size=batch, eval_batches=16, seed=seed,
                                  optimizer=optimizer, **training_change)
    diloco_cfg = DilocoConfig(inner_steps=INNER_STEPS, num_replicas=REPLICAS, screening=False,
                              **diloco_change)
    compression_cfg = CompressionConfig(**compression_change)
    started, cpu = time.perf_counter(), time.process_time()
    load = list(os.getloadavg())
    result = simulate(mode, corpus, model_cfg, training_cfg, diloco_cfg, compression_cfg,
                      PipelineConfig(num_stages=STAGES), rounds, eval_every=5)
    return {
        "case": case, "cell": cell, "seed": seed, "rounds": rounds, "mode": mode, "family": family,
        "optimizer": optimizer, "num_params": count_params(model_cfg),
        "tokens": result.tokens_per_replica * REPLICAS, "inner_steps": INNER_STEPS, "replicas": REPLICAS,
        "batch_per_replica": batch, "held_out_loss": result.final_eval_loss,
        "bytes_per_token": result.bytes_per_token, "wall_seconds": time.perf_counter() - started,
        # The codec's cost (encode and decode, with the outer step) against the inner steps' (process CPU
        # time under set_clock): what an encoder that selects every round costs beside one that selects
        # every 4th.
        "codec_seconds": sum(r.codec_seconds for r in result.rounds),
        "outer_seconds": sum(r.outer_seconds for r in result.rounds),
        "train_seconds": sum(r.train_seconds for r in result.rounds),
        "codec_outer_share": result.codec_outer_share,
        "cpu_seconds": time.process_time() - cpu, "load_average_start": load,
        "load_average_end": list(os.getloadavg()),
        "curve": [(r.outer_round, r.eval_loss) for r in result.rounds if r.eval_loss is not None],
        "settings": {"diloco": diloco_change, "compression": compression_change,
                     **({"training": training_change} if training_change else {})},
    }


OPTIMIZERS = ("muon", "adamw")


def optimizer_of(row: dict) -> str:
    """A row's or summary's inner optimizer; rows written before it was part of the key ran Muon."""
    return row.get("optimizer", "muon")


def _group(s: dict) -> tuple[str, int, str]:
    return s["case"], s["rounds"], optimizer_of(s)


def row_key(row: dict) -> tuple[str, int, str, int, str]:
    return row["case"], row["rounds"], row["cell"], row["seed"], optimizer_of(row)


def summarize(rows: list[dict]) -> list[dict]:
    """Per case, rounds and cell: the seeds run, mean loss, its spread, the gap against DDP at each seed."""
    out = []
    groups = sorted({(r["case"], r["rounds"], optimizer_of(r)) for r in rows},
                    key=lambda g: (list(CASES).index(g[0]), g[1], OPTIMIZERS.index(g[2])))
    for case, rounds, optimizer in groups:
        of = [r for r in rows if r["case"] == case and r["rounds"] == rounds and optimizer_of(r) == optimizer]
        ddp = {r["seed"]: r for r in of if r["cell"] == "ddp"}
        for cell in CELLS:
            runs = sorted((r for r in of if r["cell"] == cell), key=lambda r: r["seed"])
            if not runs:
                continue
            losses = [r["held_out_loss"] for r in runs]
            gaps = [r["held_out_loss"] / ddp[r["seed"]]["held_out_loss"] - 1
                    for r in runs if r["seed"] in ddp]
            out.append({
                "case": case, "rounds": rounds, "optimizer": optimizer, "cell": cell,
                "tokens": runs[0]["tokens"],
                "num_params": runs[0]["num_params"], "seeds": [r["seed"] for r in runs], "losses": losses,
                "mean_loss": statistics.fmean(losses), "spread": max(losses) - min(losses),
                "gap_seeds": [r["seed"] for r in runs if r["seed"] in ddp],
                "gaps_vs_ddp": gaps, "mean_gap_vs_ddp": statistics.fmean(gaps) if gaps else None,
                "gap_spread": (max(gaps) - min(gaps)) if gaps else None,
                "seeds_from_convergence": [r["seed"] for r in runs if r.get("source")],
                "fewer_bytes_than_ddp": (ddp[runs[0]["seed"]]["bytes_per_token"] / runs[0]["bytes_per_token"]
                                         if runs[0]["seed"] in ddp else None),
            })
    return out


def split(summary: list[dict]) -> list[dict]:
    """Per case and rounds, each cause's cost in the mean gap (points of the gap against DDP), over the seeds
    every cell of the split ran (a cell run at more seeds is not averaged over other ones)."""
    out = []
    for group in dict.fromkeys(_group(s) for s in summary):
        case, rounds, optimizer = group
        cells = {s["cell"]: dict(zip(s["gap_seeds"], s["gaps_vs_ddp"])) for s in summary
                 if _group(s) == group and s["mean_gap_vs_ddp"] is not None}
        if not all(c in cells for c in SPLIT[1:]):
            continue
        seeds = sorted(set.intersection(*(set(cells[c]) for c in SPLIT[1:])))
        if not seeds:
            continue
        gap = {c: statistics.fmean(cells[c][seed] for seed in seeds) for c in SPLIT[1:]}
        out.append({
            "case": case, "rounds": rounds, "optimizer": optimizer, "seeds": seeds, "diloco_own": gap["sync"],
            "delay": gap["delay"] - gap["sync"],
            "compression": gap["compression"] - gap["sync"],
            "interaction": gap["both"] - gap["delay"] - gap["compression"] + gap["sync"],
            "diloco_x": gap["both"],
        })
    return out


def methods(summary: list[dict]) -> list[dict]:
    """Per case and rounds, each method cell against its base cell (``both-<m>`` against ``both``, ...) at the
    seeds both ran: the gain in points of the gap against DDP per seed (positive: the method is closer to
    DDP), its mean, and whether it wins beyond the seed spread: a gain at every seed, and a mean gain above
    the larger of the two cells' gap spreads (the rule a method is kept by, issue 66)."""
    out = []
    for s in summary:
        base_name, _, method = s["cell"].partition("-")
        if not method or s["mean_gap_vs_ddp"] is None:
            continue
        base = next((b for b in summary if _group(b) == _group(s)
                     and b["cell"] == base_name and b["mean_gap_vs_ddp"] is not None), None)
        if base is None:
            continue
        gap = dict(zip(s["gap_seeds"], s["gaps_vs_ddp"]))
        base_gap = dict(zip(base["gap_seeds"], base["gaps_vs_ddp"]))
        seeds = [seed for seed in s["gap_seeds"] if seed in base_gap]
        if not seeds:
            continue
        gains = [base_gap[seed] - gap[seed] for seed in seeds]
        spread = max(s["gap_spread"] or 0.0, base["gap_spread"] or 0.0)
        mean = statistics.fmean(gains)
        out.append({"case": s["case"], "rounds": s["rounds"], "optimizer": _group(s)[2], "cell": s["cell"],
                    "base": base_name,
                    "method": method, "seeds": seeds, "gains": gains, "mean_gain": mean, "spread": spread,
                    "wins_beyond_spread": len(seeds) >= 2 and min(gains) > 0 and mean > spread})
    return out


#: bench_convergence.py's mode -> this bench's cell, for its ``muon`` variant (the same settings: Muon inner
#: steps, seed 0, the node's defaults otherwise; only the held-out evaluation's cadence differs, which does
#: not touch training).
CONVERGENCE_CELLS = {"ddp": "ddp", "diloco": "sync", "diloco_x": "both"}


def from_convergence(runs: list[dict], case: str) -> list[dict]:
    """bench/results/convergence.json's full-budget ``muon`` rows of ``case`` (seed 0) as rows of this
    bench (``--from-convergence``), each naming its ``source``: the same settings as this bench's ``ddp``,
    ``sync`` and ``both`` cells at 30 rounds, so the full budget's split needs only the other cells and
    seeds run here. Not the same bits: rerun on today's code the ``gpt2-mini`` rows differ (DDP in the
    sixth digit, DiLoCoX by 0.08%; docs/DILOCOX.md section 14), so a cell run here replaces its row."""
    out = []
    for run in runs:
        if run["case"] != case or run["variant"] != "muon" or run["mode"] not in CONVERGENCE_CELLS:
            continue
        if "inner_steps" not in run or "rounds" not in run:
            raise SystemExit(f"convergence row {case}/{run['mode']} names no H or rounds (recorded before "
                             "bench_convergence.py wrote them): rerun it here instead")
        if run["inner_steps"] != INNER_STEPS or run["replicas"] != REPLICAS:
            raise SystemExit(f"convergence row {case}/{run['mode']}: H {run['inner_steps']}, M "
                             f"{run['replicas']}, not this bench's {INNER_STEPS} and {REPLICAS}")
        out.append({**{k: run[k] for k in ("case", "rounds", "mode", "family", "num_params", "tokens",
                                           "held_out_loss", "bytes_per_token", "wall_seconds",
                                           "cpu_seconds", "load_average_start", "load_average_end",
                                           "curve")},
                    "cell": CONVERGENCE_CELLS[run["mode"]], "seed": 0, "optimizer": "muon",
                    "inner_steps": run["inner_steps"], "replicas": run["replicas"],
                    "batch_per_replica": run["batch_per_replica"],
                    "settings": {"diloco": {}, "compression": {}},
                    "source": "bench/results/convergence.json"})
    return out


def check_budget(rows: dict, case: str, rounds: int, optimizer: str, tokens: int | None = None) -> None:
    """Refuse to add a row to a (case, rounds, optimizer) group whose rows, with ``tokens``, ran another
    token budget (a changed batch in ``CASES``): the key is (case, rounds, cell, seed, optimizer), and every
    gap of the group is taken against the group's DDP, so such rows would mix."""
    group = [r for r in rows.values() if _group(r) == (case, rounds, optimizer)]
    budgets = sorted({r["tokens"] for r in group} - {tokens}) if tokens is not None else []
    if budgets:
        raise SystemExit(f"{case} at {rounds} rounds already holds rows of {budgets} tokens, not {tokens}: "
                         "give another --out")


def read_rows(path: Path) -> dict:
    """The rows in ``path`` by ``row_key`` (none if it does not exist)."""
    previous = json.loads(path.read_text()) if path.exists() else {}
    return {row_key(r): r for r in previous.get("rows", [])}


def save(path: Path, new_rows: list[dict], data: str, start_load: list[float]) -> dict:
    # ``data``: the corpus's name (its directory: "tinyshakespeare").
    """Add ``new_rows`` to the rows in ``path`` as it is now, under an exclusive lock, and rewrite it with
    its summary: runs of this bench started side by side (other cases, seeds or cells) into one ``--out``
    each keep every row the others wrote meanwhile. A row replaces the one of the same key. Returns the
    rows written."""
    lock = path.with_name(path.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        rows = read_rows(path)
        for row in new_rows:
            check_budget(rows, row["case"], row["rounds"], optimizer_of(row), row["tokens"])
            rows[row_key(row)] = row
        ordered = sorted(rows.values(), key=lambda r: (r["case"], r["rounds"],
                                                      OPTIMIZERS.index(optimizer_of(r)),
                                                      list(CELLS).index(r["cell"]), r["seed"]))
        summary = summarize(ordered)
        write_result(path, {"inner_steps": INNER_STEPS, "replicas": REPLICAS, "stages": STAGES,
                            "data": data,
                            "summary": summary, "split": split(summary), "methods": methods(summary),
                            "rows": ordered}, start_load)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="gpt2-mini", choices=list(CASES))
    parser.add_argument("--rounds", type=int, default=10, help="outer rounds of H = 50 (30: the full budget)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--cells", default=",".join(SPLIT), help=f"any of {list(CELLS)}")
    parser.add_argument("--optimizer", default="muon", choices=["adamw", "muon"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="drop the rows already in --out")
    parser.add_argument("--from-convergence", action="store_true",
                        help="first add bench/results/convergence.json's seed-0 muon ddp, sync DiLoCo and "
                             "DiLoCoX rows of --case (30 rounds) where --out has none")
    parser.add_argument("--out", default=str(RESULTS / "convergence_ablation.json"))
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="run nothing: add the rows of these results of this bench (runs that wrote "
                             "elsewhere) to --out, each replacing the row of its key, and exit")
    args = parser.parse_args()
    if args.merge:
        merged = [row for other in args.merge for row in read_rows(Path(other)).values()]
        names = {json.loads(Path(other).read_text()).get("data") for other in args.merge}
        if len(names) != 1:
            raise SystemExit(f"--merge: the files name other corpora ({sorted(map(str, names))})")
        save(Path(args.out), merged, names.pop(), list(os.getloadavg()))
        print(f"{len(merged)} rows of {len(args.merge)} files added to {args.out}")
        return 0
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    set_clock(time.process_time)
    cells = [c for c in args.cells.split(",") if c]
    unknown = [c for c in cells if c not in CELLS]
    if unknown:
        raise SystemExit(f"--cells {unknown}: must be among {list(CELLS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    data = default_corpus()
    path = Path(args.out)
    if args.fresh and path.exists():
        path.unlink()
    rows = read_rows(path)
    start_load = list(os.getloadavg())
    fields = CASES[args.case][0]
    block = fields.get("block_size") or ModelConfig(**fields).block_size
    corpus = load_corpus(REPO / data, TrainingConfig().eval_fraction, block)
    imported = []
    if args.from_convergence:
        convergence = json.loads((RESULTS / "convergence.json").read_text())["runs"]
        for row in from_convergence(convergence, args.case):
            check_budget(rows, row["case"], row["rounds"], row["optimizer"], row["tokens"])
            if row_key(row) not in rows:
                imported.append(row)
    check_budget(rows, args.case, args.rounds, args.optimizer)
    if imported:
        rows = save(path, imported, Path(data).parent.name, start_load)
    for seed in seeds:  # every cell at one seed before the next seed: a cut-short plan still splits the gap
        for cell in cells:
            row = run_cell(args.case, cell, seed, args.rounds, args.optimizer, corpus, str(REPO / data))
            print(f"{args.case} r{args.rounds} {args.optimizer} {cell} seed {seed}: held-out "
                  f"{row['held_out_loss']:.4f} ({row['tokens']:,} tokens, {row['cpu_seconds']:.0f} cpu s)",
                  flush=True)
            rows = save(path, [row], Path(data).parent.name, start_load)
    for s in summarize(list(rows.values())):
        gap = "" if s["mean_gap_vs_ddp"] is None else f"{100 * s['mean_gap_vs_ddp']:+6.2f}%"
        print(f"{s['case']:<10} r{s['rounds']:<3} {s['cell']:<22} seeds {s['seeds']} "
              f"mean {s['mean_loss']:.4f} spread {s['spread']:.4f} gap {gap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
