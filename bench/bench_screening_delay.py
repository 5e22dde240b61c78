"""Screening under the one-step delay (issue 44, docs/DILOCOX.md section 13, "Screening of a time-bounded run"):
which honest contributions and which attacks each screening rule excludes, in the simulation.

What runs: ``training.simulate`` (the node's algorithm in one process: one-step delay, "rebase", ``overlap_steps =
0``, compression on) with the heterogeneous bench's settings (``tiny``, batch 8, inner lr 3e-3, outer lr 0.7,
momentum 0.5), three replicas held at fixed inner-step counts (``--counts``: the count a time budget fitted; no
clock), every contribution aggregated (screening is measured, never applied). At every round the global weights
``theta^{t-1}`` and, on the round's screening batch, the loss of each honest contribution and of attacks built
from it applied alone (``theta - a d``) and against itself (``theta + a d``): a sign flip and a 4x scaling of
the longest and of the shortest contribution, noise of the median honest norm and of the longest one's. Then
each rule on those numbers: version 1 (``one_sided``, time-bounded: ``L > max(L_b, med) + tol``), version 2
(``two_sided``: slope and curvature, training/screening.py), version 2's excess form and the curvature per
declared step (both dropped). The simulation hooks ``training.simulate``'s step rule and screening (module
attributes), nothing else.

    python bench/bench_screening_delay.py          # writes bench/results/screening_delay.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_out, write_result  # noqa: E402


def run(counts: list[int], rounds: int, data: str) -> list[dict]:
    import torch

    import training.simulate as sim
    from training.config import CompressionConfig, DilocoConfig, ModelConfig, PipelineConfig, TrainingConfig
    from training.data import load_corpus
    from training.screening import _f32, model_loss_fn, screening_batch

    state = {"calls": -1}

    def takes(cfg, step, elapsed):  # replicas train one after the other, each from step 0
        if step == 0:
            state["calls"] += 1
        return step < counts[state["calls"] % len(counts)]

    model = ModelConfig(preset="tiny")
    training = TrainingConfig(seed=0, batch_size=8, inner_lr=3e-3, warmup_steps=20, lr_schedule="constant")
    diloco = DilocoConfig(inner_steps=max(counts), round_budget_s=1000.0, min_inner_steps=4, num_replicas=len(counts),
                          one_step_delay=True, overlap_steps=0, outer_lr=0.7, outer_momentum=0.5)
    corpus = load_corpus(data, training.eval_fraction, model.block_size)
    rows: list[dict] = []

    def norm(d):
        return math.sqrt(sum(float((v.double() ** 2).sum()) for v in d.values()))

    held: dict = {}  # the engines of replica 0 (their momentum), caught where the simulation reads its weights
    global_state = sim._global_state

    def catch(engines):
        held["engines"] = engines
        return global_state(engines)

    def screen(_loss_fn, weights, decoded, cfg, _declared, **_reference):
        t = len(rows)
        x, y = screening_batch(corpus, 0, t, cfg.screen_batch_size, model.block_size)
        loss = model_loss_fn(model, x, y)
        a = torch.tensor(cfg.outer_lr, dtype=torch.float32)
        norms = [norm(d) for d in decoded]
        noise = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(t * 1000 + i))
                 for i, (k, v) in enumerate(decoded[0].items())}
        variants = {f"honest{i}": (d, counts[i]) for i, d in enumerate(decoded)}
        for i in (0, len(decoded) - 1):
            variants[f"flip{i}"] = ({k: -v for k, v in decoded[i].items()}, counts[i])
            variants[f"x4_{i}"] = ({k: 4 * v for k, v in decoded[i].items()}, counts[i])
        median = sorted(norms)[(len(norms) - 1) // 2]
        variants["noise_median"] = ({k: v * (median / norm(noise)) for k, v in noise.items()}, sorted(counts)[1])
        variants["noise_longest"] = ({k: v * (norms[0] / norm(noise)) for k, v in noise.items()}, counts[0])
        momentum = {n: m for e in held["engines"] for n, m in e.momentum.items()}
        # The reference points: theta^{t-1} (versions 1 and 2), theta^{t-2} (the global weights the round's
        # inner steps began from: the weights of the call before), and theta^{t-1} + a m^{t-1} (its estimate
        # from the state the apply holds).
        points = {"": weights, "_start": held.get("previous", weights),
                  "_momentum": {n: weights[n] + a * momentum[n] for n in weights}}
        held["previous"] = weights
        row = {"round": t, "variants": {}}
        for suffix, point in points.items():
            row["L_b" + suffix] = _f32(loss(point))
        flat_m = torch.cat([momentum[n].double().flatten() for n in sorted(weights)])
        for name, (d, k) in variants.items():
            flat_d = torch.cat([d[n].double().flatten() for n in sorted(weights)])
            scale = float(flat_d.norm() * flat_m.norm())
            entry = {"declared": k, "direction": float(flat_d @ flat_m) / scale if scale > 0 else None}
            for suffix, point in points.items():
                entry["alone" + suffix] = _f32(loss({n: point[n] - d[n] * a for n in point}))
                entry["against" + suffix] = _f32(loss({n: point[n] + d[n] * a for n in point}))
            row["variants"][name] = entry
        rows.append(row)
        print(t, {n: (round(v["against"] - v["alone"], 3), round(v["against_start"] - v["alone_start"], 3),
                      round(v["against_momentum"] - v["alone_momentum"], 3)) for n, v in row["variants"].items()},
              flush=True)
        return []

    sim._global_state = catch
    sim.takes_another_step = takes
    sim.screen_contributions = screen
    sim.screening_exclusions = lambda reports: {}
    torch.set_num_threads(1)
    sim.simulate("diloco_x", corpus, model, training, diloco, CompressionConfig(), PipelineConfig(), rounds)
    return rows


RULES = ("version_1", "version_2", "version_3", "version_3_momentum", "version_2_excess", "curvature_per_step")


def _two_sided(v: dict, lb: float, honest: list[str], suffix: str) -> dict[str, bool]:
    """Version 2's rule on the losses at one reference point (``suffix``: "" theta^{t-1}, "_start" theta^{t-2},
    "_momentum" theta^{t-1} + a m^{t-1}): name -> excluded."""
    tol = 0.02 * lb
    slope = {n: v[n]["against" + suffix] - v[n]["alone" + suffix] for n in v}
    curv = {n: (v[n]["against" + suffix] + v[n]["alone" + suffix]) / 2 - lb for n in v}
    least = min(tol, _median([slope[n] for n in honest]) / 4)
    most = 4 * max(_median([curv[n] for n in honest]), 0) + tol
    return {n: not (slope[n] > least and curv[n] <= most) for n in v}


def _median(values):
    return sorted(values)[(len(values) - 1) // 2]


def verdicts(rows: list[dict]) -> dict:
    """Excluded per rule and kind, rounds 1 on (round 0 starts from the initial weights, no delay yet)."""
    counts: dict = {}
    honest_out: list = []
    for row in rows[1:]:
        lb, tol, v = row["L_b"], 0.02 * row["L_b"], row["variants"]
        honest = [n for n in v if n.startswith("honest")]
        slope = {n: v[n]["against"] - v[n]["alone"] for n in v}
        curv = {n: (v[n]["against"] + v[n]["alone"]) / 2 - lb for n in v}
        excess = {n: v[n]["alone"] - lb for n in v}
        per_step = {n: curv[n] / v[n]["declared"] for n in v}
        m_alone, m_slope = _median([v[n]["alone"] for n in honest]), _median([slope[n] for n in honest])
        m_excess, m_ps = (_median([c[n] for n in honest]) for c in (excess, per_step))
        least = min(tol, m_slope / 4)
        rule = {"version_2": _two_sided(v, lb, honest, ""),
                "version_3": _two_sided(v, row["L_b_start"], honest, "_start"),
                "version_3_momentum": _two_sided(v, row["L_b_momentum"], honest, "_momentum")}
        for n in v:
            kind = "honest" if n in honest else n.split("_")[0].rstrip("0123456789")
            out = {
                "version_1": not v[n]["alone"] <= max(lb, m_alone) + tol,
                **{name: excluded[n] for name, excluded in rule.items()},
                "version_2_excess": not (slope[n] > least and excess[n] <= 4 * max(m_excess, 0) + tol),
                "curvature_per_step": not (slope[n] > least and per_step[n] <= 4 * max(m_ps, 0) + tol / v[n]["declared"]),
            }
            entry = counts.setdefault(kind, {"n": 0, **{r: 0 for r in RULES}})
            entry["n"] += 1
            for name in RULES:
                entry[name] += out[name]
            if kind == "honest" and any(out.values()):
                honest_out.append({"round": row["round"], "contribution": n, "slope": slope[n], "curvature": curv[n],
                                   "excess": excess[n],
                                   "slope_start": v[n]["against_start"] - v[n]["alone_start"],
                                   "slope_momentum": v[n]["against_momentum"] - v[n]["alone_momentum"],
                                   **{r: out[r] for r in RULES}})
    return {"excluded": counts, "honest_excluded": honest_out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="/work/shared/data/tinyshakespeare/input.txt")
    parser.add_argument("--runs", nargs="+", default=["179,80,35:14", "400,80,20:10"],
                        help="COUNTS:ROUNDS per simulated run (the replicas' fixed step counts)")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    load_at_start = list(os.getloadavg())
    runs, rows_all = [], []
    for spec in args.runs:
        counts_text, rounds = spec.split(":")
        counts = [int(c) for c in counts_text.split(",")]
        rows = run(counts, int(rounds), args.data)
        runs.append({"counts": counts, "rounds": int(rounds), "rows": rows, **verdicts(rows)})
        rows_all.extend(rows)
    total = verdicts([{}] + [r for run_ in runs for r in run_["rows"][1:]]) if runs else {}
    result = {"what": "screening rules under the one-step delay in the simulation (bench/bench_screening_delay.py)",
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "runs": runs,
              "total": total["excluded"]}
    path = write_result(args.out, result, load_at_start)
    for kind, entry in total["excluded"].items():
        print(kind, entry)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
