"""Renderer of docs/RESULTS.md for the method-by-size table (bench/bench_convergence.py, issue 46) and its
plot (bench/results/convergence.svg, drawn from the same JSON). Numbers come only from the JSON."""

from __future__ import annotations

import math
import re

from results_sections import diloco, num, pct, table

MODE_NAMES = {"ddp": "DDP", "diloco": "sync DiLoCo", "diloco_x": "DiLoCoX"}
SIZE_CASES = ("llama-xs", "llama-s", "llama-m", "llama-l")
#: Issue 46's goals at the default budget: the gap to the best DDP (and, for DiLoCoX, the bytes ratio).
GOAL_GAP = {"diloco": 0.01, "diloco_x": 0.02}
GOAL_BYTES = {"diloco_x": 1000.0}
#: ... and at the largest size measured of a family, both modes within this.
GOAL_LARGEST = 0.01


def goal_text(row: dict) -> str:
    """The row's goal and by how much it is missed (points of gap; the bytes ratio for DiLoCoX)."""
    mode = row["mode"]
    if mode not in GOAL_GAP:
        return "-"
    goal, over = GOAL_GAP[mode], row["gap_vs_ddp"] - GOAL_GAP[mode]
    text = f"<= {100 * goal:+.0f}%: " + (f"missed by {100 * over:.2f} points" if over > 0 else "met")
    if mode in GOAL_BYTES:
        bytes_goal = GOAL_BYTES[mode]
        text += f"; >= {bytes_goal:.0f}x: " + ("met" if row["fewer_bytes_than_ddp"] >= bytes_goal
                                               else "missed")
    return text


def largest_goal(r: dict) -> str:
    """Per family, the largest case measured and how far each DiLoCo mode is from the 1% goal there."""
    parts = []
    for family in sorted({row["family"] for row in r["table"]}):
        rows = [row for row in r["table"] if row["family"] == family]
        largest = max(row["num_params"] for row in rows)
        for row in rows:
            if row["num_params"] == largest and row["mode"] in GOAL_GAP:
                over = row["gap_vs_ddp"] - GOAL_LARGEST
                parts.append(
                    f"{family} `{row['case']}` {MODE_NAMES[row['mode']]} {pct(row['gap_vs_ddp'], 2)} ("
                    + (f"missed by {100 * over:.2f} points" if over > 0 else "met") + ")")
    if not parts:
        return ""
    return f"At the largest size measured of each family, goal <= {100 * GOAL_LARGEST:+.0f}%: " + "; ".join(
        parts) + "."


def convergence(r: dict) -> list[str]:
    """The method-by-size table: per case and mode the best variant measured, its gap and bytes, every
    variant."""
    rows = []
    for row in r["table"]:
        variants = ", ".join(f"{name} {loss:.4f}" for name, loss in sorted(row["variants"].items(),
                                                                           key=lambda kv: kv[1]))
        rows.append([row["case"], f"{row['num_params']:,}", f"{row['tokens']:,}", MODE_NAMES[row["mode"]],
                     row["best_variant"], num(row["held_out_loss"]),
                     "(baseline)" if row["mode"] == "ddp" else pct(row["gap_vs_ddp"], 2),
                     "-" if row["mode"] == "ddp" else pct(row.get("gap_vs_same_optimizer_ddp"), 2),
                     "1x" if row["mode"] == "ddp" else f"{row['fewer_bytes_than_ddp']:.0f}x", goal_text(row),
                     variants])
    lines = [
        f"{r['replicas']} replicas x {r['stages']} stages, H = {r['inner_steps']} x {r['rounds']} rounds of "
        "tinyshakespeare (bytes), seed 0 (other seeds below, where run); each method's best variant "
        "measured, the gap against the best DDP of the same case (AdamW or Muon). `llama-xs/s/m/l` keep 1.4 "
        "to 1.5 tokens per parameter (the batch grows with the size); `gpt2-mini` and `llama-l` are each "
        "family's default budget (1,536,000 tokens).", ""]
    lines += table(["case", "parameters", "tokens", "method", "best variant", "held-out", "gap vs best DDP",
                    "vs DDP, same inner optimizer",
                    "fewer bytes than fp32 AllReduce", "goal (issue 46)",
                    "every variant measured (held-out)"], rows)
    lines += [trend(r), ""] + ([fit_text(r), ""] if fit_text(r) else [])
    lines += [largest_goal(r), ""] if largest_goal(r) else []
    lines += decomposition(r)
    lines += seed_spread(r)
    lines += ["![gap to the best DDP against model size](../bench/results/convergence.svg)", ""]
    pieces = [piece for piece in r.get("pieces", []) if piece]
    if pieces:
        lines += [
            "Measured in pieces (each row also records the load average at its start and end): "
            + "; ".join(
                f"`{piece['command'].replace(' --data $DLX_DATA_DIR/tinyshakespeare/input.txt', '')}` "
                f"({piece.get('date', '?')}, load {piece['load_average']['start'][0]:.1f} at start)"
                for piece in pieces
            )
            + ".",
            "",
        ]
    missing = r.get("not_run")
    if missing:
        lines += ["Not run (the machine's time): " + ", ".join(f"`{item}`" for item in missing) + ".", ""]
    return lines


def decomposition(r: dict) -> list[str]:
    """Where the gap comes from, per case and inner optimizer measured in all three modes: synchronous DiLoCo
    against DDP with the same inner optimizer (DiLoCo's own share: the outer loop, H local steps, M replicas),
    DiLoCoX against synchronous DiLoCo (the one-step delay and the compression), and DiLoCoX against that DDP
    (their sum, compounded)."""
    runs = {(row["case"], row["mode"], row["variant"]): row["held_out_loss"] for row in r["runs"]}
    rows = []
    for case in dict.fromkeys(row["case"] for row in r["runs"]):
        for variant in ("adamw", "muon"):
            ddp, sync, x = (runs.get((case, mode, variant)) for mode in ("ddp", "diloco", "diloco_x"))
            if None in (ddp, sync, x):
                continue
            rows.append([case, variant, num(ddp), num(sync), num(x), pct(sync / ddp - 1, 2),
                         pct(x / sync - 1, 2), pct(x / ddp - 1, 2)])
    if not rows:
        return []
    return ["Where the gap comes from (each inner optimizer against DDP with the same one; rows where all "
            "three modes ran):", ""] + table(["case", "inner optimizer", "DDP", "sync DiLoCo", "DiLoCoX",
                                  "sync DiLoCo vs DDP (DiLoCo's own)",
                                              "DiLoCoX vs sync DiLoCo (delay + compression)",
                                  "DiLoCoX vs DDP"], rows)


def seed_spread(r: dict) -> list[str]:
    """Seed noise: per case, each mode's setting that was also run at other seeds (its ``-seed<n>`` rows), the
    gaps at each seed against DDP at the same seed, and how far they move between seeds ("-" where a run is
    missing)."""
    runs = {(row["case"], row["mode"], row["variant"]): row["held_out_loss"] for row in r["runs"]}
    bases: dict[tuple[str, str], str] = {}
    seeds: dict[str, set[int]] = {}
    for case, mode, variant in runs:
        match = re.fullmatch(r"(.+)-seed(\d+)", variant)
        if match and (case, mode, match[1]) in runs:
            bases.setdefault((case, mode), match[1])
            seeds.setdefault(case, {0}).add(int(match[2]))
    rows, spreads = [], []
    for case, found in seeds.items():
        names = {mode: bases.get((case, mode)) for mode in ("ddp", "diloco", "diloco_x")}
        if names["ddp"] is None:
            continue
        gaps: dict[str, list[float]] = {"diloco": [], "diloco_x": []}
        for seed in sorted(found):
            losses = {mode: runs.get((case, mode, name if seed == 0 else f"{name}-seed{seed}"))
                      for mode, name in names.items() if name is not None}
            if losses["ddp"] is None:
                continue
            row = [case, str(seed), num(losses["ddp"])]
            cells = []
            for mode in gaps:
                loss = losses.get(mode)
                row.append("-" if loss is None else num(loss))
                cells.append("-" if loss is None else pct(loss / losses["ddp"] - 1, 2))
                if loss is not None:
                    gaps[mode].append(loss / losses["ddp"] - 1)
            rows.append(row + cells)
        moved = [f"{MODE_NAMES[mode]} `{names[mode]}` " + _range(values) for mode, values in gaps.items()
                 if len(values) > 1]
        if moved:
            spreads.append(f"`{case}` (against DDP `{names['ddp']}`): " + ", ".join(moved))
    if not spreads:
        return []
    return (["Seed noise (the same settings at other `training.seed`s: initial weights and batches; each gap "
             "against DDP at the same seed; `-seed<n>` rows are never a method's best above):", ""]
            + table(["case", "seed", "DDP", "sync DiLoCo", "DiLoCoX", "sync DiLoCo vs DDP", "DiLoCoX vs DDP"],
                    rows)
            + ["Gap across seeds: " + "; ".join(spreads) + ".", ""])


def _range(gaps: list[float]) -> str:
    """``low to high (mean m, spread s points)`` of gaps."""
    return (f"{pct(min(gaps), 2)} to {pct(max(gaps), 2)} (mean {pct(sum(gaps) / len(gaps), 2)}, spread "
            f"{100 * (max(gaps) - min(gaps)):.2f} points)")


def gaps_by_size(r: dict) -> dict[str, list[tuple[int, float]]]:
    """mode -> [(parameters, gap)] over the Llama sizes measured, smallest first."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in r["table"]:
        if row["case"] in SIZE_CASES and row["mode"] != "ddp":
            out.setdefault(row["mode"], []).append((row["num_params"], row["gap_vs_ddp"]))
    return {mode: sorted(points) for mode, points in out.items()}


#: The gap the issue asks the trend to reach (DiLoCoX within 2% of the strongest DDP).
TREND_GOAL = 0.02


def muon_gaps_by_size(r: dict) -> dict[str, list[tuple[int, float]]]:
    """mode -> [(parameters, gap)] of the one setting run at every Llama size (``muon``: Muon inner steps,
    the default outer step) against Muon DDP of the same size: the same method at every size."""
    runs = {(row["case"], row["mode"], row["variant"]): row for row in r["runs"]}
    out: dict[str, list[tuple[int, float]]] = {}
    for case in SIZE_CASES:
        ddp = runs.get((case, "ddp", "muon"))
        for mode in ("diloco", "diloco_x"):
            row = runs.get((case, mode, "muon"))
            if ddp is not None and row is not None:
                out.setdefault(mode, []).append(
                    (row["num_params"], row["held_out_loss"] / ddp["held_out_loss"] - 1))
    return out


def fit_trend(points: list[tuple[int, float]], goal: float = TREND_GOAL) -> dict | None:
    """Least squares ``gap = a + b log10(parameters)``: the slope per decade, its standard error (from the
    residuals, ``n - 2`` degrees of freedom; None with two points) and the size where the fit reaches
    ``goal`` (None where the slope is not negative: the fit never gets there growing the model)."""
    if len(points) < 2:
        return None
    xs, ys = [math.log10(p) for p, _ in points], [g for _, g in points]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    intercept = my - slope * mx
    residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    slope_se = math.sqrt(residual / (n - 2) / sxx) if n > 2 else None
    reach = None if slope >= 0 else 10 ** ((goal - intercept) / slope)
    # The most favourable slope the data allow (two standard errors lower, through the same mean point).
    low = None if slope_se is None else slope - 2 * slope_se
    reach_low = None if low is None or low >= 0 else 10 ** (mx + (goal - my) / low)
    return {"intercept": intercept, "slope": slope, "slope_se": slope_se, "reaches_goal_at": reach, "n": n,
            "reaches_goal_at_slope_minus_2se": reach_low}


def fit_words(mode: str, points: list[tuple[int, float]]) -> str | None:
    """One mode's fitted trend with size in words: its gap at the smallest size, the slope per decade and its
    standard error, and where it reaches the mode's goal (``GOAL_GAP``); None with fewer than two points."""
    goal = GOAL_GAP[mode]
    fit = fit_trend(points, goal)
    if fit is None:
        return None
    se = "" if fit["slope_se"] is None else f" +- {100 * fit['slope_se']:.2f}"
    text = (f"{MODE_NAMES[mode]} {pct(fit['intercept'] + fit['slope'] * math.log10(points[0][0]), 2)} at "
            f"{points[0][0] / 1e6:.2f}M, slope {100 * fit['slope']:+.2f}{se} points per 10x parameters "
            f"({fit['n']} sizes)")
    if fit["reaches_goal_at"] is not None:
        text += f", reaching {pct(goal, 0)} at about {fit['reaches_goal_at'] / 1e6:.2g}M parameters"
    else:
        text += f": the fit does not fall toward {pct(goal, 0)} with size"
    if fit["slope_se"] is not None and abs(fit["slope"]) < 2 * fit["slope_se"]:
        text += " (the slope is within two standard errors of zero: no trend resolved)"
    if fit["reaches_goal_at_slope_minus_2se"] is not None:
        text += (f"; at the slope two standard errors lower it would reach {pct(goal, 0)} at about "
                 f"{fit['reaches_goal_at_slope_minus_2se'] / 1e6:.2g}M")
    elif fit["slope_se"] is not None:
        text += f"; even two standard errors lower the slope does not fall toward {pct(goal, 0)}"
    return text


def fit_text(r: dict) -> str:
    """The fitted trend of each DiLoCo mode with size, its uncertainty and where it reaches its goal (sync
    DiLoCo 1%, DiLoCoX 2%: ``GOAL_GAP``)."""
    parts = [text for mode, points in muon_gaps_by_size(r).items()
             if (text := fit_words(mode, points)) is not None]
    if not parts:
        return ""
    return ("Fitted trend (least squares of the gap on log10 parameters, the `muon` rows at every Llama size "
            "against Muon DDP of the same size, seed 0; the standard error from the fit's residuals): "
            + "; ".join(parts) + ".")


#: The ablation's cells that stand for a mode in its trend with size.
ABLATION_MODES = {"sync": "diloco", "both": "diloco_x"}


def ablation_trend(summary: list[dict]) -> list[str]:
    """Per number of rounds at which three or more Llama sizes ran ``ddp`` and a mode's cell, the mean gap
    (over the seeds run) against size and its fitted trend (``fit_words``): one sentence per rounds."""
    out = []
    for rounds in sorted({s["rounds"] for s in summary}):
        parts = []
        for cell, mode in ABLATION_MODES.items():
            points = sorted((s["num_params"], s["mean_gap_vs_ddp"]) for s in summary
                            if s["rounds"] == rounds and s["cell"] == cell and s["case"] in SIZE_CASES
                            and s.get("optimizer", "muon") == "muon" and s["mean_gap_vs_ddp"] is not None)
            if len(points) >= 3:
                steps = " -> ".join(f"{p / 1e6:.2f}M {pct(g, 2)}" for p, g in points)
                parts.append(f"{steps}; fit: {fit_words(mode, points)}")
        if parts:
            out.append(f"Gap with size at {rounds} rounds (Llama, mean over the seeds run; least squares on "
                       "log10 parameters): " + "; ".join(parts) + ".")
    return out


def trend(r: dict) -> str:
    """Whether the gap shrinks with size, in words, from the JSON."""
    parts = []
    for mode, points in gaps_by_size(r).items():
        if len(points) < 2:
            continue
        falling = all(b[1] < a[1] for a, b in zip(points, points[1:]))
        steps = " -> ".join(pct(gap, 2) for _, gap in points)
        parts.append(f"{MODE_NAMES[mode]} {steps} "
                     f"({'shrinks at every step' if falling else 'does not shrink at every step'})")
    if not parts:
        return "Fewer than two Llama sizes measured: no trend with size yet."
    return "Gap with size (Llama, smallest first): " + "; ".join(parts) + "."


def svg(r: dict, width: int = 560, height: int = 300) -> str:
    """The gap of each DiLoCo mode against the parameter count (log scale) over the Llama sizes."""
    series = gaps_by_size(r)
    points = [p for pts in series.values() for p in pts] or [(1, 0.0)]
    left, right, top, bottom = 60, width - 130, 20, height - 40
    xs = [math.log10(p) for p, _ in points]
    x_low, x_high = min(xs) - 0.05, max(xs) + 0.05
    y_high = max(0.01, max(g for _, g in points)) * 1.15
    y_low = min(0.0, min(g for _, g in points))

    def x_of(params: int) -> float:
        return left + (math.log10(params) - x_low) / (x_high - x_low) * (right - left)

    def y_of(gap: float) -> float:
        return bottom - (gap - y_low) / (y_high - y_low) * (bottom - top)

    colours = {"diloco": "#1f77b4", "diloco_x": "#d62728"}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="black"/>',
        (f'<text x="{(left + right) / 2:.0f}" y="{height - 8}" '
         'text-anchor="middle">parameters (log scale)</text>'),
        f'<text x="14" y="{(top + bottom) / 2:.0f}" transform="rotate(-90 14 {(top + bottom) / 2:.0f})" '
        'text-anchor="middle">held-out loss vs best DDP</text>']
    for gap in (y_low, (y_low + y_high) / 2, y_high):
        parts.append(
            f'<text x="{left - 4}" y="{y_of(gap) + 4:.1f}" text-anchor="end">{100 * gap:+.1f}%</text>')
    for params, _ in points:
        parts.append(
            f'<text x="{x_of(params):.1f}" y="{bottom + 14}" text-anchor="middle">{params / 1e6:.2f}M</text>')
    for index, (mode, pts) in enumerate(sorted(series.items())):
        colour = colours.get(mode, "gray")
        path = " ".join(f"{x_of(p):.1f},{y_of(g):.1f}" for p, g in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts += [f'<circle cx="{x_of(p):.1f}" cy="{y_of(g):.1f}" r="3" fill="{colour}"/>' for p, g in pts]
        parts.append(
            f'<text x="{right + 10}" y="{top + 16 + 18 * index}" fill="{colour}">{MODE_NAMES[mode]}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


CELL_NAMES = {"ddp": "DDP", "sync": "sync DiLoCo", "delay": "+ one-step delay only (raw codec)",
              "compression": "+ compression only (no delay)", "both": "+ both (DiLoCoX)"}


def ablation_case(s: dict) -> str:
    """A case's name on the page, with its inner optimizer where it is not Muon (rows written before the
    optimizer was part of the bench's key ran Muon)."""
    optimizer = s.get("optimizer", "muon")
    names = {"muon": "", "adamw": " (AdamW)"}
    return s["case"] + names.get(optimizer, f" ({optimizer})")


def ablation(r: dict) -> list[str]:
    """bench/bench_convergence_ablation.py: per case and budget each cell's losses at every seed run, their
    mean and spread, the gap against DDP at the same seed; then the split by cause and the methods' rows."""
    rows = []
    for s in r["summary"]:
        name = CELL_NAMES.get(s["cell"], s["cell"])
        imported = s.get("seeds_from_convergence", [])
        rows.append([ablation_case(s), f"{s['tokens']:,}", name,
                     ", ".join(f"{seed}*" if seed in imported else str(seed) for seed in s["seeds"]),
                     ", ".join(num(loss) for loss in s["losses"]), num(s["mean_loss"]), num(s["spread"]),
                     "(baseline)" if s["cell"] == "ddp" else ", ".join(pct(g, 2) for g in s["gaps_vs_ddp"]),
                     "-" if s["cell"] == "ddp" else pct(s["mean_gap_vs_ddp"], 2),
                     "-" if s["cell"] == "ddp" or s["gap_spread"] is None else f"{100 * s['gap_spread']:.2f}",
                     "1x" if s["fewer_bytes_than_ddp"] is None or s["cell"] == "ddp"
                     else f"{s['fewer_bytes_than_ddp']:.0f}x"])
    lines = table(["case", "tokens", "cell", "seeds", "held-out per seed", "mean", "spread (max - min)",
                   "gap vs DDP, same seed", "mean gap", "gap spread (points)",
                   "fewer bytes than fp32 AllReduce"], rows)
    if any(s.get("seeds_from_convergence") for s in r["summary"]):
        lines += ["`*`: that seed's row is bench/bench_convergence.py's run of the same settings (its "
                  "`muon` variant in convergence.json, `--from-convergence`), not rerun here (a rerun on "
                  "today's code need not match it bit for bit).", ""]
    tokens = {(s["case"], s["rounds"]): s["tokens"] for s in r["summary"]}
    splits = [f"`{ablation_case(s)}` at {tokens[s['case'], s['rounds']]:,} tokens: DiLoCo's own "
              f"{pct(s['diloco_own'], 2)}, the one-step delay {pct(s['delay'], 2)}, the compression "
              f"{pct(s['compression'], 2)}, the two together beyond their sum {pct(s['interaction'], 2)} "
              f"(DiLoCoX {pct(s['diloco_x'], 2)}"
              + (f"; seeds {', '.join(map(str, s['seeds']))}" if s.get("seeds") else "") + ")"
              for s in r.get("split", [])]
    if splits:
        lines += ["The split by cause, in points of the mean gap against DDP (the delay: `delay - sync`; the "
                  "compression: `compression - sync`): " + "; ".join(splits) + ".", ""]
    for sentence in ablation_trend(r["summary"]):
        lines += [sentence, ""]
    methods = [[ablation_case(m), f"{tokens[m['case'], m['rounds']]:,}", f"`{m['cell']}`", f"`{m['base']}`",
                ", ".join(str(seed) for seed in m["seeds"]), ", ".join(f"{100 * g:+.2f}" for g in m["gains"]),
                f"{100 * m['mean_gain']:+.2f}", f"{100 * m['spread']:.2f}",
                "**yes**" if m["wins_beyond_spread"] else "no"] for m in r.get("methods", [])]
    if methods:
        lines += ["Each method against its base cell at the same seeds, in points of the gap against DDP "
                  "(positive: closer to DDP); it wins beyond the seed spread where it gains at every seed "
                  "and its mean gain exceeds the larger of the two cells' gap spreads (kept only where it "
                  "wins at both sizes):", ""]
        lines += table(["case", "tokens", "method cell", "against", "seeds", "gain per seed (points)",
                        "mean gain", "seed spread (points)", "wins beyond the spread"], methods)
    return lines


def diloco_goal(r: dict) -> list[str]:
    """bench/bench_diloco.py --case: issue 66's goals measured side by side in one run (DDP, synchronous
    DiLoCo and DiLoCoX on one model, tokens and seed), each goal met or missed by how many points."""
    a, s = r["args"], r["summary"]
    feedback = "off" if a.get("no_error_feedback") else "on"
    lines = [f"Case `{a.get('case') or a['preset']}`, inner optimizer {a.get('optimizer', 'adamw')}, seed "
             f"{a['seed']}; DiLoCoX's codec: encoder `{a['encoder']}`, low-bit scales "
             f"`{a.get('quant_scale', 'max')}`, error feedback {feedback}.", ""]
    lines += diloco(r, check_defaults=False)
    goals = []
    if "diloco_x" in s and "ddp" in s:
        x = s["diloco_x"]
        goals.append(_goal("DiLoCoX within 2% of DDP", x["loss_vs_ddp"], 0.02)
                     + f", at {x['fewer_bytes_than_ddp']:.0f}x fewer bytes (goal >= 1000x: "
                     + ("met" if x["fewer_bytes_than_ddp"] >= 1000 else "**missed**") + ")")
    if "diloco" in s and "ddp" in s:
        goals.append(_goal("synchronous DiLoCo within 1% of DDP", s["diloco"]["loss_vs_ddp"], 0.01))
    if goals:
        lines += ["Goals (issue 66, at the largest size): " + "; ".join(goals) + ".", ""]
    return lines


def _goal(name: str, gap: float, goal: float) -> str:
    verdict = "met" if gap <= goal else f"**missed by {100 * (gap - goal):.2f} points**"
    return f"{name}: {pct(gap, 2)}, {verdict}"
