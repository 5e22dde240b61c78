"""Benchmark: the gap to centralized training by method, inner optimizer and model size (issue 46).

Each run is ``case:mode:variant``: a model and budget (``CASES``), a training mode of
training/simulate.py (``ddp``, ``diloco``: synchronous DiLoCo, ``diloco_x``: DiLoCoX with the
node's defaults) and a setting (``VARIANTS``: the inner optimizer, the outer step, the delay
correction, the replica count). Every run of a case uses the same seeds, tokens and inner-lr
schedule. Results accumulate in ONE JSON (bench/results/convergence.json): a run given again
replaces its row, other rows are kept, so a loaded machine can measure the plan in pieces
(``--fresh`` starts over; ``--merge`` adds the rows of pieces run in parallel into other files).
The plot (bench/results/convergence.svg: the gap against the size) is drawn from the same JSON
by scripts/results_convergence.py. The table takes, per case and mode, the best variant measured, and
the gap against the best DDP of the case (AdamW or Muon: the strongest centralized baseline
measured). Bytes: what a replica sends, against a float32 ring AllReduce of every step.

    nice python bench/bench_convergence.py --runs llama-s:ddp:adamw,llama-s:ddp:muon ...

The Llama sizes keep tokens per parameter about fixed (1.4 to 1.5: ``llama-xs`` 0.13M parameters,
``llama-s`` 0.28M, ``llama-m`` 0.56M, ``llama-l`` 1.05M) by scaling the per-replica batch with the
size, so that every size runs the same 30 rounds of H = 50 (the exchange pattern is the same; only
the model and the tokens grow). ``gpt2-mini`` and ``llama-l`` are the default budget of each family
(1,536,000 tokens of tinyshakespeare, bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from results_convergence import svg  # noqa: E402

from bench.benchio import RESULTS, default_corpus, write_result  # noqa: E402
from bench.convergence_cases import CASES, INNER_STEPS, REPLICAS, ROUNDS, STAGES  # noqa: E402
from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.data import load_corpus  # noqa: E402
from training.model import count_params  # noqa: E402
from training.simulate import MODES, simulate  # noqa: E402
from training.simulate_records import set_clock  # noqa: E402

#: name -> {"training": {...}, "diloco": {...}, "replicas": M, "inner_steps": H}: what a variant changes from
#: the defaults (the inner optimizer always named, so that a change of the library's default changes no row).
VARIANTS = {
    "adamw": {"training": {"optimizer": "adamw"}},
    "muon": {"training": {"optimizer": "muon"}},
    "muon-lr2": {"training": {"optimizer": "muon", "muon_lr_scale": 2.0}},
    "muon-lr4": {"training": {"optimizer": "muon", "muon_lr_scale": 4.0}},
    "olr-other2": {"diloco": {"outer_lr_other_scale": 2.0}},
    "muon-olr-other2": {"training": {"optimizer": "muon"}, "diloco": {"outer_lr_other_scale": 2.0}},
    "eager": {"diloco": {"delay_correction": "eager"}},
    "muon-eager": {"training": {"optimizer": "muon"}, "diloco": {"delay_correction": "eager"}},
    # The scaling-law paper's smallest replica count (arXiv 2503.09799: M = 1 DiLoCo beats DDP at every
    # scale it measured): one replica with both replicas' batch, the same tokens.
    "m1": {"training": {"optimizer": "adamw"}, "replicas": 1},
    "muon-m1": {"training": {"optimizer": "muon"}, "replicas": 1},
    # The same paper's other axis, the synchronisation interval H at the same tokens (rounds = 1500 / H):
    # synchronous DiLoCo's bytes per token grow as H shrinks; DiLoCoX's "auto" budget is per round, 1000x
    # below an AllReduce of its H steps, so its bytes per token stay.
    "muon-h25": {"training": {"optimizer": "muon"}, "inner_steps": 25},
    "muon-h100": {"training": {"optimizer": "muon"}, "inner_steps": 100},
    # Outer Adam in place of Nesterov (FedAdam, arXiv 2003.00295: b1 0.9, b2 0.99, no bias correction). Its
    # step is about lr per element whatever the pseudo-gradient's size (Nesterov's, lr 1, is about 1.5 Delta:
    # a median |Delta| of 3e-3 to 1e-2 per round at llama-xs), hence outer lrs near 1e-2.
    "muon-oadam-3e-3": {"training": {"optimizer": "muon"},
                        "diloco": {"outer_optimizer": "adam", "outer_lr": 3e-3}},
    "muon-oadam-1e-2": {"training": {"optimizer": "muon"},
                        "diloco": {"outer_optimizer": "adam", "outer_lr": 1e-2}},
    "muon-oadam-3e-2": {"training": {"optimizer": "muon"},
                        "diloco": {"outer_optimizer": "adam", "outer_lr": 3e-2}},
    "muon-oadam-1e-1": {"training": {"optimizer": "muon"},
                        "diloco": {"outer_optimizer": "adam", "outer_lr": 1e-1}},
    # FedAdam's tuned eps (its tau, arXiv 2003.00295, about 1e-3): where sqrt(v) is below it the step is about
    # lr / eps * m, a momentum step, so small (and coarsely
    # coded) elements are no longer moved by about lr each.
    "muon-oadam-1e-2-eps1e-3": {"training": {"optimizer": "muon"},
                                "diloco": {"outer_optimizer": "adam", "outer_lr": 1e-2,
                                           "outer_adam_eps": 1e-3}},
    "muon-oadam-3e-2-eps1e-3": {"training": {"optimizer": "muon"},
                                "diloco": {"outer_optimizer": "adam", "outer_lr": 3e-2,
                                           "outer_adam_eps": 1e-3}},
    "muon-oadam-1e-1-eps1e-3": {"training": {"optimizer": "muon"},
                                "diloco": {"outer_optimizer": "adam", "outer_lr": 1e-1,
                                           "outer_adam_eps": 1e-3}},
}
# The Nesterov outer step retuned for Muon inner steps (docs/DILOCOX.md section 14): the defaults (outer lr
# 1.0, momentum 0.5: ``muon``) were tuned with AdamW inner steps (section 9), and MuLoCo (arXiv 2505.23725)
# tunes the outer step per inner optimizer. ``muon-olr<lr>-om<momentum>``: the grid spans section 9's
# neighbours (lr 0.7 and 1.3) and DiLoCo's 0.7 / 0.9 (arXiv 2311.08105); its steady-state step is lr / (1 -
# momentum) pseudo-gradients (2 at the defaults, 7 at DiLoCo's), so the grid runs from 0.7 to 16.
VARIANTS.update({
    f"muon-olr{lr}-om{momentum}": {"training": {"optimizer": "muon"},
                                   "diloco": {"outer_lr": lr, "outer_momentum": momentum}}
    for lr in (0.5, 0.7, 1.0, 1.3, 1.6) for momentum in (0.3, 0.5, 0.7, 0.9) if (lr, momentum) != (1.0, 0.5)
})
# The inner learning rate (issue 46: never varied before). A replica steps on its own batch, half of DDP's
# global one, at the same inner lr, so its steps are noisier and its best lr may not be DDP's; a fair
# comparison tunes each mode's. ``-ilr<s>`` multiplies ``training.inner_lr`` (3e-3), hence both parts of Muon
# (``muon_lr_scale`` scales only the Muon-stepped matrices), with the same warmup and cosine schedule; on the
# default outer step (DDP and DiLoCoX) and on synchronous DiLoCo's best (1.0 / 0.7).
INNER_LR = TrainingConfig().inner_lr
for base in ("muon", "muon-olr1.0-om0.7"):
    VARIANTS.update({
        f"{base}-ilr{scale}": {**VARIANTS[base],
                               "training": {**VARIANTS[base]["training"], "inner_lr": INNER_LR * scale}}
        for scale in (0.5, 0.7, 1.4, 2)
    })
#: Seed noise: the same setting at another ``training.seed`` (the initial weights and every replica's
#: batches). A ``-seed<n>`` row is never a method's best in the table (a lucky seed is no method);
#: :func:`seed_spread` sets it beside the seed-0 row.
SEEDS = (1, 2)
for base in ("muon", "muon-olr1.0-om0.7"):
    VARIANTS.update({
        f"{base}-seed{seed}": {**VARIANTS[base], "training": {**VARIANTS[base]["training"], "seed": seed}}
        for seed in SEEDS
    })


def seed_of(variant: str) -> int:
    """The seed a variant runs at (0 unless it is a ``-seed<n>`` variant)."""
    return VARIANTS.get(variant, {}).get("training", {}).get("seed", 0)


#: The plan: every case, every mode, with each inner optimizer (what the table is for); the JSON names what of
#: it was not run.
PLAN = [f"{case}:{mode}:{variant}" for case in CASES for mode in MODES for variant in ("adamw", "muon")]


def run_one(case: str, mode: str, variant: str, corpus, data: str) -> dict:
    """One simulation of ``case`` in ``mode`` with ``variant``: its row of the JSON."""
    fields, batch, family = CASES[case]
    change = VARIANTS[variant]
    replicas = change.get("replicas", REPLICAS)
    inner_steps = change.get("inner_steps", INNER_STEPS)
    rounds = ROUNDS * INNER_STEPS // inner_steps  # the same inner steps, hence tokens, at every H
    model_cfg = ModelConfig(**fields)
    training_cfg = TrainingConfig(data_path=data, batch_size=batch * REPLICAS // replicas, eval_batches=16,
                                  **change.get("training", {}))
    diloco_cfg = DilocoConfig(inner_steps=inner_steps, num_replicas=replicas, screening=False,
                              **change.get("diloco", {}))
    started, cpu = time.perf_counter(), time.process_time()
    load = list(os.getloadavg())
    result = simulate(mode, corpus, model_cfg, training_cfg, diloco_cfg, CompressionConfig(),
                      PipelineConfig(num_stages=STAGES), rounds,
                      eval_every=max(1, 10 * INNER_STEPS // inner_steps))
    return {
        "case": case, "mode": mode, "variant": variant, "family": family,
        "num_params": count_params(model_cfg), "tokens": result.tokens_per_replica * replicas,
        "tokens_per_param": result.tokens_per_replica * replicas
        / count_params(model_cfg), "replicas": replicas, "inner_steps": inner_steps, "rounds": rounds,
        "batch_per_replica": training_cfg.batch_size,
        "held_out_loss": result.final_eval_loss, "bytes_per_token": result.bytes_per_token,
        "codec_outer_share": result.codec_outer_share, "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu, "load_average_start": load,
        "load_average_end": list(os.getloadavg()),
        "curve": [(r.outer_round, r.eval_loss) for r in result.rounds if r.eval_loss is not None],
        "settings": {"model": dataclasses.asdict(model_cfg), "training": change.get("training", {}),
                     "diloco": {**change.get("diloco", {}), "inner_steps": inner_steps}},
    }


def table(runs: list[dict]) -> list[dict]:
    """Per case and mode, the best variant measured, its gap to the case's best DDP and its bytes ratio.

    The best of a DiLoCo mode is taken over its ``REPLICAS``-replica variants: one replica (``m1``) exchanges
    with nobody, so it is listed among the variants but is not that mode's result."""
    rows = []
    for case in CASES:
        of_case = [r for r in runs if r["case"] == case]
        ddp = [r for r in of_case if r["mode"] == "ddp" and seed_of(r["variant"]) == 0]
        if not ddp:
            continue
        base = min(ddp, key=lambda r: r["held_out_loss"])
        for mode in MODES:
            measured = [r for r in of_case if r["mode"] == mode]
            candidates = [r for r in measured if (mode == "ddp" or r.get("replicas", REPLICAS) == REPLICAS)
                          and seed_of(r["variant"]) == 0]
            if not candidates:
                continue
            best = min(candidates, key=lambda r: r["held_out_loss"])
            optimizer = "muon" if best["variant"].startswith("muon") else "adamw"
            same = next((r for r in ddp if r["variant"] == optimizer), None)
            rows.append({
                "case": case, "family": best["family"], "num_params": best["num_params"],
                "tokens": best["tokens"], "mode": mode, "best_variant": best["variant"],
                "held_out_loss": best["held_out_loss"],
                "gap_vs_ddp": best["held_out_loss"] / base["held_out_loss"] - 1,
                "fewer_bytes_than_ddp": base["bytes_per_token"] / best["bytes_per_token"],
                "ddp_variant": base["variant"],
                # Against DDP with the same inner optimizer (None when that DDP was not run).
                "gap_vs_same_optimizer_ddp": None if same is None
                    else best["held_out_loss"] / same["held_out_loss"] - 1,
                "variants": {r["variant"]: r["held_out_loss"] for r in measured},
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="", help="comma-separated case:mode:variant")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="other JSONs of this script (pieces measured in parallel) whose rows join --out")
    parser.add_argument("--data", default=None, help="corpus (default: tinyshakespeare)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fresh", action="store_true", help="drop the rows already in --out")
    parser.add_argument("--out", default=str(RESULTS / "convergence.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    set_clock(time.process_time)
    wanted = [tuple(item.split(":")) for item in args.runs.split(",") if item]
    for case, mode, variant in wanted:
        if case not in CASES or mode not in MODES or variant not in VARIANTS:
            raise SystemExit(f"--runs {case}:{mode}:{variant}: cases {list(CASES)}, modes {list(MODES)}, "
                             f"variants {list(VARIANTS)}")
    data = args.data or default_corpus()
    path = Path(args.out)
    previous = json.loads(path.read_text()) if path.exists() and not args.fresh else {}
    runs = {(r["case"], r["mode"], r["variant"]): r for r in previous.get("runs", [])}
    pieces = list(previous.get("pieces", []))  # the command, machine and load of each piece merged in
    for other in args.merge:
        piece = json.loads(Path(other).read_text())
        runs.update({(r["case"], r["mode"], r["variant"]): r for r in piece["runs"]})
        pieces.append(piece.get("recorded"))
    start_load = list(os.getloadavg())

    def save() -> None:
        ordered = sorted(runs.values(), key=lambda r: (list(CASES).index(r["case"]), MODES.index(r["mode"]),
                                                       r["variant"]))
        done = {f"{r['case']}:{r['mode']}:{r['variant']}" for r in ordered}
        result = {"rounds": ROUNDS, "inner_steps": INNER_STEPS, "replicas": REPLICAS, "stages": STAGES,
                  "data": Path(data).parent.name, "table": table(ordered),
                  "not_run": [item for item in PLAN if item not in done], "pieces": pieces, "runs": ordered}
        write_result(path, result, start_load)
        path.with_suffix(".svg").write_text(svg(result))

    if args.merge:
        save()
    for case, mode, variant in wanted:
        block = CASES[case][0].get("block_size") or ModelConfig(**CASES[case][0]).block_size
        corpus = load_corpus(REPO / data, TrainingConfig().eval_fraction, block)
        row = run_one(case, mode, variant, corpus, str(REPO / data))
        runs[(case, mode, variant)] = row
        print(f"{case} {mode} {variant}: held-out {row['held_out_loss']:.4f} ({row['num_params']:,} params, "
              f"{row['tokens']:,} tokens, {row['cpu_seconds']:.0f} cpu s, load "
              f"{row['load_average_start'][0]:.1f})",
              flush=True)
        save()
    for row in table(list(runs.values())):
        print(f"{row['case']:<10} {row['mode']:<9} {row['best_variant']:<16} {row['held_out_loss']:.4f} "
              f"{100 * row['gap_vs_ddp']:+6.2f}% {row['fewer_bytes_than_ddp']:7.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
