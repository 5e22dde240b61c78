"""Screening under the one-step delay (issue 44, docs/DILOCOX.md section 13, "Screening of a time-bounded
run"): which honest contributions and which attacks each screening rule excludes, in the simulation.

What runs: ``training.simulate`` (the node's algorithm in one process: one-step delay, "rebase",
``overlap_steps = 0``, compression on) with the heterogeneous bench's settings (``tiny``, batch 8, inner lr
3e-3, outer lr 0.7, momentum 0.5), three replicas held at fixed inner-step counts (``--runs``: the counts a
time budget fitted; no clock), every contribution aggregated (screening is measured, never applied). At every
round, on the round's screening batch (its first 16 windows, the default ``screen_batch_size``, and its first
``--windows``), the per-window losses (``training.screening.ModelLoss.windows``) of the global weights and of
each honest contribution and of attacks built from it applied alone (``theta - a d``) and against itself
(``theta + a d``): a sign flip and a 4x scaling of the longest and of the shortest contribution, noise of the
median honest norm and of the longest one's. The losses are taken at ``theta^{t-1}``, the weights a round is
applied to, and (16 windows) at ``theta^{t-2}``, the global weights the round's inner steps began from (the
candidate of section 13's former "Open"). Then each rule, by ``training.screening.judge`` itself, on a round
of the three honest contributions (honest exclusions) and on a round of the three and one attack (that
attack's exclusion): version 1 (``one_sided``), version 2 (``two_sided``) at ``theta^{t-1}`` and at
``theta^{t-2}``, version 3 (``paired``), and versions 2 and 3 on ``--windows`` windows. The simulation hooks
``training.simulate``'s step rule and screening (module attributes), nothing else.

    python bench/bench_screening_delay.py          # writes bench/results/screening_delay.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_corpus, default_out, write_result  # noqa: E402

#: rule -> (diloco.screen_rule, the losses it reads: windows, and "_start" at theta^{t-2}).
RULES = {
    "version_1": ("one_sided", "16"),
    "version_2": ("two_sided", "16"),
    "version_2_start": ("two_sided", "16_start"),
    "version_3": ("paired", "16"),
    "version_2_wide": ("two_sided", "wide"),
    "version_3_wide": ("paired", "wide"),
}


def run(counts: list[int], rounds: int, data: str, windows: int) -> list[dict]:
    import torch

    import training.simulate as sim
    import training.simulate_diloco as loop  # the DiLoCo loop, whose names the probe replaces
    from training.config import DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig
    from training.config_compression import CompressionConfig
    from training.data import load_corpus
    from training.screening import model_loss_fn, screening_batch, slope_error, window_mean

    state = {"calls": -1}

    def takes(cfg, step, elapsed):  # replicas train one after the other, each from step 0
        if step == 0:
            state["calls"] += 1
        return step < counts[state["calls"] % len(counts)]

    model = ModelConfig(preset="tiny")
    training = TrainingConfig(seed=0, batch_size=8, inner_lr=3e-3, warmup_steps=20, lr_schedule="constant")
    diloco = DilocoConfig(inner_steps=max(counts), round_budget_s=1000.0, min_inner_steps=4,
                          num_replicas=len(counts), one_step_delay=True, overlap_steps=0, outer_lr=0.7,
                          outer_momentum=0.5)
    corpus = load_corpus(data, training.eval_fraction, model.block_size)
    rows: list[dict] = []
    held: dict = {}

    def norm(d):
        return math.sqrt(sum(float((v.double() ** 2).sum()) for v in d.values()))

    def screen(_loss_fn, weights, decoded, cfg, _declared):
        t = len(rows)
        # Row b of a screening batch does not depend on the
        # batch's size: the first 16 windows are the default batch.
        x, y = screening_batch(corpus, 0, t, windows, model.block_size)
        wide = model_loss_fn(model, x, y)
        narrow = model_loss_fn(model, x[:16], y[:16])
        a = torch.tensor(cfg.outer_lr, dtype=torch.float32)
        norms = [norm(d) for d in decoded]
        noise = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(t * 1000 + i))
                 for i, (k, v) in enumerate(decoded[0].items())}
        variants = {f"honest{i}": (d, counts[i]) for i, d in enumerate(decoded)}
        for i in (0, len(decoded) - 1):
            variants[f"flip{i}"] = ({k: -v for k, v in decoded[i].items()}, counts[i])
            variants[f"x4_{i}"] = ({k: 4 * v for k, v in decoded[i].items()}, counts[i])
        median = sorted(norms)[(len(norms) - 1) // 2]
        variants["noise_median"] = ({k: v * (median / norm(noise)) for k, v in noise.items()},
                                    sorted(counts)[1])
        variants["noise_longest"] = ({k: v * (norms[0] / norm(noise)) for k, v in noise.items()}, counts[0])
        # theta^{t-1} (these weights) and theta^{t-2} (the weights of the call before: the global weights when
        # this round's inner steps began; round 0 has no delay,
        # and round 1 began from the initial weights, round 0's).
        start = held.get("previous", weights)
        held["previous"] = weights
        points = {"wide": (wide, weights), "16": (narrow, weights), "16_start": (narrow, start)}
        row: dict = {"round": t, "L_b": {}, "variants": {}}
        base = {key: fn.windows(point) for key, (fn, point) in points.items()}
        row["L_b"] = {key: window_mean(values) for key, values in base.items()}
        for name, (d, k) in variants.items():
            entry: dict = {"declared": k}
            for key, (fn, point) in points.items():
                alone = fn.windows({n: point[n] - d[n] * a for n in point})
                against = fn.windows({n: point[n] + d[n] * a for n in point})
                entry[key] = {"alone": window_mean(alone), "against": window_mean(against),
                              "error": slope_error(alone, against)}
            row["variants"][name] = entry
        rows.append(row)
        print(t, {n: (round(v["16"]["against"] - v["16"]["alone"], 3), round(v["16"]["error"], 3),
                      round(v["16_start"]["against"] - v["16_start"]["alone"], 3))
                      for n, v in row["variants"].items()},
              flush=True)
        return []

    loop.takes_another_step = takes
    loop.screen_contributions = screen
    loop.screening_exclusions = lambda reports: {}
    torch.set_num_threads(1)
    sim.simulate("diloco_x", corpus, model, training, diloco, CompressionConfig(), PipelineConfig(), rounds)
    return rows


def verdicts(rows: list[dict]) -> dict:
    """Excluded per rule and kind, rounds 1 on (round 0 starts from the initial weights, no delay yet): honest
    ones in a round of the honest three, each attack in a round of the honest three and it."""
    from training.config import DilocoConfig
    from training.screening import judge

    base = DilocoConfig(inner_steps=800, round_budget_s=40.0, min_inner_steps=4, num_replicas=4,
                        one_step_delay=True, overlap_steps=0, outer_lr=0.7, outer_momentum=0.5)
    counts: dict = {}
    honest_out: list = []
    for row in rows[1:]:
        v = row["variants"]
        honest = [n for n in v if n.startswith("honest")]
        attacks = [n for n in v if n not in honest]
        out: dict[str, dict[str, bool]] = {n: {} for n in v}
        for rule, (screen_rule, key) in RULES.items():
            cfg = dataclasses.replace(base, screen_rule=screen_rule)
            for names in [honest] + [honest + [attack] for attack in attacks]:
                after = {i: v[n][key]["alone"] for i, n in enumerate(names)}
                against = {i: v[n][key]["against"] for i, n in enumerate(names)}
                errors = {i: v[n][key]["error"] for i, n in enumerate(names)}
                reports = judge(row["L_b"][key], after, len(names), cfg, against if screen_rule != "one_sided"
                                else None,
                                errors if screen_rule == "paired" else None)
                judged = names if names is honest else names[-1:]
                for n in judged:
                    out[n][rule] = reports[names.index(n)].excluded
        for n in v:
            kind = "honest" if n in honest else n.split("_")[0].rstrip("0123456789")
            entry = counts.setdefault(kind, {"n": 0, **{r: 0 for r in RULES}})
            entry["n"] += 1
            for rule in RULES:
                entry[rule] += out[n][rule]
            if kind == "honest" and any(out[n].values()):
                honest_out.append({"round": row["round"], "contribution": n, "declared": v[n]["declared"],
                                   **{f"slope_{key}": v[n][key]["against"] - v[n][key]["alone"]
                                      for key in ("16", "16_start", "wide")},
                                   **{f"error_{key}": v[n][key]["error"] for key in ("16", "wide")},
                                   **out[n]})
    return {"excluded": counts, "honest_excluded": honest_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="the training text (default: tinyshakespeare as 'dlx-node data fetch "
                             "tinyshakespeare' keeps it, fetched if missing)")
    parser.add_argument("--runs", nargs="+", default=["179,80,35:14", "400,80,20:10"],
                        help="COUNTS:ROUNDS per simulated run (the replicas' fixed step counts)")
    parser.add_argument("--windows", type=int, default=64,
                        help="the wide screening batch (its first 16: the default)")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    args.data = args.data or default_corpus()
    load_at_start = list(os.getloadavg())
    runs = []
    for spec in args.runs:
        counts_text, rounds = spec.split(":")
        counts = [int(c) for c in counts_text.split(",")]
        rows = run(counts, int(rounds), args.data, args.windows)
        runs.append({"counts": counts, "rounds": int(rounds), "rows": rows, **verdicts(rows)})
    total = verdicts([{}] + [r for run_ in runs for r in run_["rows"][1:]]) if runs else {}
    result = {
        "what": "screening rules under the one-step delay in the simulation (bench/bench_screening_delay.py)",
        "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs,
        "total": total["excluded"]}
    path = write_result(args.out, result, load_at_start)
    for kind, entry in total["excluded"].items():
        print(kind, entry)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
