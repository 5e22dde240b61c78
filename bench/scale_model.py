"""A calibrated model of a large run: per-component costs measured at three sizes, checked at a fourth,
extrapolated to llama-1b, 7B and a 107B layout (issue 75; docs/SCALE.md).

    python bench/scale_model.py [--system bench/results/scale_system.json]
        [--fit llama-tiny-bytes,llama-mini-bytes,llama-20m-bytes]
        [--check llama-mini-64-bytes,llama-60m,llama-124m]
        [--out bench/results/scale_model.json]

Reads the runs of bench/bench_scale_system.py (one entry per model size). For every measured quantity q and
size it takes the node's figure (mean over the run's nodes) and fits ``q = a + b x`` by least squares over
the ``--fit`` sizes, ``x`` being the parameters a node holds (its stage: half the model in the 2 x 2 runs)
or, for the inner step, the model's parameters (its FLOPs at a fixed batch). The fit is checked against the
``--check`` size, not fitted to it: each quantity's predicted and measured figure and the relative error
are reported as they come out. The predictions for the large layouts use a refit on every size measured
with the fit's code (runs not marked ``"fit": false`` in scale_system.json). Bytes come from the nodes'
counts (bench/scale_bytes.py): a check's start state by the round it is of, the exchange per parameter held.

What is extrapolated, and from what:

- inner steps: not from this CPU. A GPU's step is ``6 N T / (GPUs x peak x MFU)`` with the MFU measured on
  an H200 for llama-124m (bench/results/gpu.json, 39.6%) and the A800's dense bf16 peak (312 TFLOPS); the
  pipeline's bubble is left out (it lowers throughput, so the figure is a bound).
- the node's own work per round (hashing and commitments, codec, start state, outer step, archive writes,
  spot checks, chain, exchange's CPU), as thread-seconds per parameter held on this CPU: the node runs it on
  its host CPU today, in one process, so these figures are what a GPU node would pay unless that work
  moves to the GPU or to more cores.
- bytes per round per node: the exchange's measured bytes per parameter held (contributions, checkpoint
  shards, gossip), at the measured replica count (the contributions' share grows with ``M - 1`` in the full
  exchange), and the spot checks' start states at the layout's rate, each a later round's whole replica
  state at its measured bytes per parameter.
- host RAM and disk per node: bytes per parameter held, measured (all state in host memory on the CPU).
- gas: a commit's gas at the run's quorum from bench/results/ledger.json (commitRound by quorum: linear in
  k); the fraud proof's worst gas is the contract's own bound for the layout (node/provergas.py:
  challenges of a game of ``ceil(log2(chunks))`` steps over 64-element chunks, one expiry, the commitment and
  the proof's bound at ``max_contributions = M``, ``max_rank = 64``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import RESULTS, write_result  # noqa: E402
from bench.scale_bytes import (  # noqa: E402
    bytes_per_check, bytes_sent, fit_start_state, linear, spot_check_bytes,
)

A800_BF16_PEAK = 312e12
#: The MFU measured for llama-124m in bf16 on an H200, the node's compiled trainer (bench/results/gpu.json).
GPU_MFU = 0.396
#: The MFU measured for llama-1b (1.1 B, TinyLlama's shape) in bf16 on an H200, eager, batch 8 x 2048 tokens:
#: 39,981 tokens/s, 308 TFLOP/s (`SCALE=1 ONLY_SCALE=1 bash bench/gpu_checks.sh`, 2026-11-29, its first 140 s;
#: the log's line "(a) bf16 batch 8: 39,981 tokens/s, 308 TFLOP/s, MFU 31.2%"). The model's rounds are also
#: given at it: the 1.1 B step not compiled and at a small batch, a floor under GPU_MFU's best setting.
GPU_MFU_1B_EAGER = 0.312
#: The components of the sampling profile (node/live/costprofile.py) that are the node's own work.
NODE_WORK = (
    "hashing",
    "codec",
    "start_state",
    "outer_step",
    "archive",
    "spot_checks",
    "chain",
    "exchange",
    "rng",
    "other",
)

#: The node's default ``spot_checks`` (node/config.py): expected re-executions of each contribution.
DEFAULT_SPOT_CHECKS = 0.06
#: The benches' ``--spot-checks``: every contribution re-executed once on average.
BENCH_SPOT_CHECKS = 1.0

#: The large layouts: (label, parameters, replicas M, stages S, GPUs per node, tokens per inner step per
#: replica, H, link bits/s). 107B: the DiLoCoX paper's 20 nodes of 8 A800 on 1 Gbps (arXiv 2506.21263's
#: abstract and issue 75), laid out as M x S nodes of one stage each; H and the tokens per step are ours
#: (the abstract gives neither).
LAYOUTS = (
    {
        "label": "llama-1b",
        "d_model": 2048,
        "parameters": 1_100_048_384,
        "replicas": 2,
        "stages": 2,
        "gpus_per_node": 1,
        "tokens_per_step": 262_144,
        "inner_steps": 100,
        "link_bps": 1e9,
    },
    {
        "label": "7B",
        "d_model": 4096,
        "parameters": 6_738_415_616,
        "replicas": 4,
        "stages": 2,
        "gpus_per_node": 8,
        "tokens_per_step": 1_048_576,
        "inner_steps": 100,
        "link_bps": 1e9,
    },
    {
        "label": "107B (2 x 10)",
        "d_model": 8192,
        "parameters": 107_000_000_000,
        "replicas": 2,
        "stages": 10,
        "gpus_per_node": 8,
        "tokens_per_step": 2_097_152,
        "inner_steps": 100,
        "link_bps": 1e9,
    },
    {
        "label": "107B (4 x 5)",
        "d_model": 8192,
        "parameters": 107_000_000_000,
        "replicas": 4,
        "stages": 5,
        "gpus_per_node": 8,
        "tokens_per_step": 2_097_152,
        "inner_steps": 100,
        "link_bps": 1e9,
    },
)
#: What the DiLoCoX paper reports (its abstract: arXiv 2506.21263); nothing beyond the abstract is cited.
PAPER = {
    "model": "a modified Qwen1.5-107B",
    "network": "1 Gbps",
    "hardware": "20 nodes x 8 A800 (160 GPUs)",
    "speedup_over_allreduce": 357,
    "source": "arXiv 2506.21263, abstract",
}


# ------------------------------------------------------------------------------------------------ measured


def measured(run: dict) -> dict:
    """The quantities of one bench_scale_system run, per node (means over its nodes)."""
    nodes = run["nodes"]
    args = run["args"]
    total = run["parameters"]["total"]
    stages = 2

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    steps = args["inner_steps"]
    replicas = len(nodes) // stages
    periods = mean(n.get("periods") for n in nodes)
    checks = sum((n.get("spot_checks") or {}).get("spot_checks", 0) for n in nodes)
    # checks per replica per round as run, and what each node served for them: each check fetches the whole
    # replica's start state, one stage's part from each of its nodes
    rate = checks / (replicas * periods) if periods else None
    sent = mean(n.get("bytes_sent_per_round") for n in nodes)
    key = "spot_check_state_bytes_per_round"
    fetched = [n[key] for n in nodes if key in n]
    # The start states the checks fetched, as the nodes counted them (nodes since 2026-11-30; runs before the
    # count have no split). Every check fetches what some node of the run serves, so the mean a node fetched
    # is the mean it served; one check fetches the whole replica's start state, a stage's part from each node.
    spot_bytes = sum(fetched) / len(fetched) if len(fetched) == len(nodes) else None
    # bytes per check over the checks that fetched them, both counted at the fetch (nodes since 03:15 that
    # day: a status written while a check ran counted its bytes, not yet the check)
    fetches = [n.get("spot_check_state_fetches_per_round") for n in nodes]
    counted = spot_bytes is not None and None not in fetches and sum(fetches) > 0
    per_check = sum(fetched) / sum(fetches) if counted else None
    # The exchange: what a node receives besides the start states its checks fetched (the other replica's
    # contribution to its stage, checkpoint shards, gossip). The least over the nodes: a fetch still running
    # when the run stopped (a last round's check) was received in part and not counted, and only adds.
    received = [n.get("bytes_received_per_round") for n in nodes]
    exchange = (min(r - f for r, f in zip(received, fetched))
                if spot_bytes is not None and None not in received else None)
    inner = mean(n.get("training_thread", {}).get("inner_s_per_round") for n in nodes)
    out = {
        "parameters": total,
        "stages": stages,
        "per_node": total / stages,
        "inner_steps": steps,
        "tokens_per_step": args["batch_size"] * run["parameters"]["block_size"],
        "inner_s_per_step": None if inner is None else inner / steps,
        "wall_s_per_round": mean(n.get("training_thread", {}).get("wall_s_per_round") for n in nodes),
        "bytes_sent_per_round": sent,
        "spot_check_rate": rate,
        "spot_check_fetch_rate": sum(fetches) / replicas if counted else None,
        "spot_check_bytes_per_round": spot_bytes,
        "spot_check_bytes_per_check": per_check,
        # per node: the checks that fetched a start state, and the bytes they fetched, over the run
        "spot_check_fetches": [round(f * args["rounds"]) for f in fetches] if counted else None,
        "spot_check_state_bytes": [b * args["rounds"] for b in fetched] if counted else None,
        "rounds": args["rounds"],
        "start_state_bytes_per_param": None if per_check is None else per_check / total,
        "exchange_bytes_per_round": exchange,
        "peak_rss_bytes": mean(n.get("peak_rss_bytes") for n in nodes),
        "disk_bytes_per_round": mean(
            n["disk"]["total_bytes"] / args["rounds"] for n in nodes if n.get("disk")
        ),
        # less the spot checks' working files: the claimants' start states a verifier holds for the next
        # round's chain check, one or two of the replica's whole state by when the node stopped
        "disk_held_bytes_per_round": mean(
            (n["disk"]["total_bytes"] - n["disk"].get("parts", {}).get("spotchecks", 0)) / args["rounds"]
            for n in nodes if n.get("disk")
        ),
        "complete": bool(run.get("audit", {}).get("exit") == 0),
        "load_end": ((run.get("recorded") or {}).get("load_average") or {}).get("end"),
    }
    if out["wall_s_per_round"] is not None and inner is not None:
        out["thread_other_s_per_round"] = out["wall_s_per_round"] - inner
    summary = run.get("summary") or {}
    out["process_cpu_s_per_round"] = summary.get("process_cpu_s_per_round")
    inner_cpu = summary.get("inner_cpu_s_per_round")
    out["inner_cpu_s_per_step"] = None if inner_cpu is None else inner_cpu / steps
    by_component = summary.get("cpu_s_per_round_by_component") or {}
    for k in NODE_WORK:  # CPU seconds: the process's, split by the sampling profile's shares
        out[f"{k}_s_per_round"] = by_component.get(k)
    spot_s = out.get("spot_checks_s_per_round")
    out["spot_checks_s_per_rate"] = spot_s / rate if spot_s is not None and rate else None
    if args.get("partial"):  # a run that broke off: only its inner steps and its memory until then count
        out = {k: v for k, v in out.items() if k in PARTIAL_KEEPS or not isinstance(v, (int, float))}
        out["complete"] = False
    return out


#: What a run that broke off still measured (bench_scale_system.py --partial).
PARTIAL_KEEPS = ("parameters", "per_node", "inner_steps", "tokens_per_step", "inner_s_per_step",
                 "inner_cpu_s_per_step", "peak_rss_bytes")

QUANTITIES = {  # quantity: the x it is fitted against
    "inner_s_per_step": "parameters",
    "inner_cpu_s_per_step": "parameters",
    "process_cpu_s_per_round": "per_node",
    "exchange_bytes_per_round": "per_node",
    "spot_checks_s_per_rate": "per_node",
    "peak_rss_bytes": "per_node",
    "disk_bytes_per_round": "per_node",
    "disk_held_bytes_per_round": "per_node",
    **{f"{k}_s_per_round": "per_node" for k in NODE_WORK},
}


def fit(points: list[dict], quantity: str) -> dict | None:
    """Least squares ``q = a + b x`` over the points that have the quantity (at least two)."""
    xs = [p[QUANTITIES[quantity]] for p in points if p.get(quantity) is not None]
    ys = [p[quantity] for p in points if p.get(quantity) is not None]
    if len(xs) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    a = my - b * mx
    return {"intercept": a, "slope": b, "x": QUANTITIES[quantity], "points": len(xs)}


def predict(model: dict, quantity: str, point: dict) -> float | None:
    if quantity in DERIVED:
        return DERIVED[quantity](model, point)
    return linear(model, quantity, point)


#: Quantities predicted from the fitted ones, not fitted themselves.
DERIVED = {"spot_check_bytes_per_round": spot_check_bytes, "bytes_sent_per_round": bytes_sent,
           "spot_check_bytes_per_check": bytes_per_check}


def check(model: dict, point: dict) -> dict:
    """Each quantity's prediction at ``point`` beside what was measured there."""
    rows = {}
    for quantity in (*QUANTITIES, *DERIVED):
        actual, guess = point.get(quantity), predict(model, quantity, point)
        if actual is None or guess is None:
            continue
        rows[quantity] = {
            "predicted": guess,
            "measured": actual,
            "error": (guess - actual) / actual if actual else None,
        }
    return rows


# ------------------------------------------------------------------------------------------------ large runs


def commit_gas(ledger: dict, quorum: int) -> int:
    """commitRound's gas at quorum k, from the ledger bench's rows (linear in k through them)."""
    rows = {int(k): v["later"] for k, v in ledger["gas"]["commitRound_by_quorum"].items()}
    ks = sorted(rows)
    slope = (rows[ks[-1]] - rows[ks[0]]) / (ks[-1] - ks[0])
    return round(rows[ks[0]] + slope * (quorum - ks[0]))


def fraud_proof_gas(per_node: float, replicas: int) -> dict:
    from ledger.runparams import DEFAULT_MAX_RANK, game_steps_for
    from node.provergas import ProverCost, prover_gas
    from training.chunks import CHUNK_ELEMENTS

    chunks = math.ceil(per_node / CHUNK_ELEMENTS)
    steps = game_steps_for(chunks)
    cost = ProverCost(
        steps=steps, proof_gas=prover_gas(replicas, DEFAULT_MAX_RANK), price=1, quorum=1, stake=0, bond=0
    )
    return {"chunks": chunks, "game_steps": steps, "proof_gas": cost.proof_gas, "worst_gas": cost.gas}


def components_seconds(components: dict, per_node: float, d_model: int) -> dict[str, float]:
    """The node's own codec and weights-root CPU seconds per round on one core of this CPU, from
    bench/bench_components.py's fit (checked within 20% at a size it did not see): encode and apply grow with
    the parameters held and with sum(numel x min dimension) over the matrices, which for a transformer's
    matrices (every one at least ``d_model`` wide) is about the parameters held times ``d_model``."""
    x = {"parameters": per_node, "matmul_parameters": per_node, "gram_flops": per_node * d_model}
    out = {}
    for quantity in ("encode", "apply", "weights_hash"):
        fitted = components["model"][quantity]
        out[quantity] = fitted["intercept"] + sum(b * x[name] for name, b in fitted["slopes"].items())
    return out


def retained_multiple(retention: dict | None) -> float | None:
    """A node's disk under the default retention over its stage's float32 bytes, at most over the run, on a
    chain whose blocks go by on time (bench/bench_retention.py's ``ontime`` part; the node that keeps only
    the windows). The files without a name (O_TMPFILE spills) count where the run measured them."""
    part = (retention or {}).get("ontime") or {}
    keep_all = set(part.get("keep_all") or ())
    figures = [v.get("disk_with_unnamed_max_over_stage_bytes", v["disk_max_over_stage_bytes"])
               for name, v in (part.get("summary") or {}).items()
               if name not in keep_all and "disk_max_over_stage_bytes" in v]
    return max(figures) if figures else None


def on_gpu(run: dict) -> bool:
    """Whether a scale_system run's nodes trained on a GPU (``--set training.device=cuda...``)."""
    return any(setting.startswith("training.device=cuda") for setting in run["args"].get("set") or ())


def large(model: dict, layout: dict, ledger: dict, components: dict | None = None,
          retained: float | None = None) -> dict:
    n, m, s = layout["parameters"], layout["replicas"], layout["stages"]
    per_node = n / s
    point = {"parameters": n, "per_node": per_node, "stages": s}
    gpus = s * layout["gpus_per_node"]  # one replica
    step_s = 6 * n * layout["tokens_per_step"] / (gpus * A800_BF16_PEAK * GPU_MFU)
    compute_s = layout["inner_steps"] * step_s
    work = {k: max(0.0, predict(model, f"{k}_s_per_round", point) or 0.0) for k in NODE_WORK}
    # The benches check every contribution about once (--spot-checks 1); a run at the node's default rate
    # fetches and serves start states that much less often: the checks' CPU and bytes at the layout's rate.
    rate = layout.get("spot_checks", DEFAULT_SPOT_CHECKS)
    work["spot_checks"] = rate * max(0.0, predict(model, "spot_checks_s_per_rate", point) or 0.0)
    spot_bytes = spot_check_bytes(model, point, rate) or 0.0
    sent = bytes_sent(model, point, rate) or 0.0
    sent_every_check = bytes_sent(model, point, BENCH_SPOT_CHECKS) or 0.0
    link_s = sent * 8 / layout["link_bps"]
    # One-step delay: the exchange and the node's own work (on the host CPU) overlap the next round's inner
    # steps (on the GPUs); a round lasts the longer of the two.
    round_s = max(compute_s, sum(work.values()) + link_s)
    compute_s_1b_eager = compute_s * GPU_MFU / GPU_MFU_1B_EAGER
    members = m * s
    quorum = max(2, math.ceil(members / 2))
    tokens = m * layout["inner_steps"] * layout["tokens_per_step"]
    # Data-parallel AllReduce of bf16 gradients every step over the same links (ring: 2 (M-1)/M of them).
    allreduce_s = 2 * (m - 1) / m * 2 * per_node * 8 / layout["link_bps"]
    allreduce_tokens_s = m * layout["tokens_per_step"] / (step_s + allreduce_s)
    calibrated = components_seconds(components, per_node, layout["d_model"]) if components else None
    return {
        **layout,
        "components_s_per_round": calibrated,
        "per_node": per_node,
        "step_s": step_s,
        "compute_s_per_round": compute_s,
        "node_work_s_per_round": work,
        "node_work_s": sum(work.values()),
        "spot_checks": rate,
        "bytes_per_round": sent,
        "spot_check_bytes_per_round": spot_bytes,
        "bytes_per_round_at_bench_rate": sent_every_check,
        "link_s_per_round": link_s,
        "round_s": round_s,
        "compute_s_per_round_at_1b_eager_mfu": compute_s_1b_eager,
        "round_s_at_1b_eager_mfu": max(compute_s_1b_eager, sum(work.values()) + link_s),
        "tokens_per_s": tokens / round_s,
        "allreduce_tokens_per_s": allreduce_tokens_s,
        "speedup_over_allreduce": tokens / round_s / allreduce_tokens_s,
        "host_ram_bytes": predict(model, "peak_rss_bytes", point),
        "disk_bytes_per_round": predict(model, "disk_held_bytes_per_round", point),
        # a verifier holds a claimant's whole replica state (on disk) while it checks it and until the next
        # round's chain check: one or two at a time
        "spot_check_state_bytes": (model.get("start_state") or {}).get("later", 0.0) * n,
        # under the default retention disk does not grow with the rounds: the measured multiple of the stage
        "disk_bytes_per_node_retained": None if retained is None else retained * 4 * per_node,
        "quorum": quorum,
        "commit_gas": commit_gas(ledger, quorum),
        "fraud_proof": fraud_proof_gas(per_node, m),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default=str(RESULTS / "scale_system.json"))
    parser.add_argument("--ledger", default=str(RESULTS / "ledger.json"))
    parser.add_argument("--fit", default="llama-tiny-bytes,llama-mini-bytes,llama-20m-bytes")
    parser.add_argument("--check", default="llama-mini-64-bytes,llama-60m,llama-124m",
                        help="sizes the fit is checked at")
    parser.add_argument("--components", default=str(RESULTS / "components.json"),
                        help="bench/bench_components.py's fit (the codec's and weights root's CPU)")
    parser.add_argument("--retention", default=str(RESULTS / "retention.json"),
                        help="bench/bench_retention.py's result (the retained disk multiple)")
    parser.add_argument("--out", default=str(RESULTS / "scale_model.json"))
    args = parser.parse_args()
    runs = json.loads(Path(args.system).read_text())["runs"]
    ledger = json.loads(Path(args.ledger).read_text())
    components_path = Path(args.components)
    components = json.loads(components_path.read_text()) if components_path.exists() else None
    retention_path = Path(args.retention)
    retention = json.loads(retention_path.read_text()) if retention_path.exists() else None
    retained = retained_multiple(retention)
    # the fit is of the node's host-CPU work on this CPU machine: runs whose nodes trained on a GPU (another
    # machine's host CPU) are shown by the results page, not fitted
    points = {label: measured(run) for label, run in runs.items() if not on_gpu(run)}
    fitted = [points[label] for label in args.fit.split(",")]
    model = {q: f for q in QUANTITIES if (f := fit(fitted, q)) is not None}
    model["start_state"] = fit_start_state(fitted)
    checked = {size: check(model, points[size]) for size in args.check.split(",") if size in points}
    # the large layouts' refit: every size measured on this CPU with the code of today (runs marked
    # ``"fit": false`` were measured with code since changed, or before the nodes counted their bytes)
    current = [point for label, point in points.items() if runs[label].get("fit", True)]
    refit = {q: f for q in QUANTITIES if (f := fit(current, q)) is not None}
    refit["start_state"] = fit_start_state(current)
    result = {
        "benchmark": "scale_model",
        "fit_sizes": args.fit.split(","),
        "refit_sizes": [label for label, run in runs.items() if label in points and run.get("fit", True)],
        "check_sizes": args.check.split(","),
        "measured": points,
        "model": model,
        "check": checked,
        "refit": refit,
        "large": [large(refit, layout, ledger, components, retained) for layout in LAYOUTS],
        "retained_disk_multiple": retained,
        "paper": PAPER,
        "assumptions": {"a800_bf16_peak_flops": A800_BF16_PEAK, "gpu_mfu": GPU_MFU,
                        "gpu_mfu_1b_eager": GPU_MFU_1B_EAGER},
    }
    write_result(args.out, result)
    for size, rows in checked.items():
        for q, row in rows.items():
            error = "-" if row["error"] is None else f"{100 * row['error']:+.1f}%"
            print(f"{size:12s} {q:28s} predicted {row['predicted']:.4g} measured {row['measured']:.4g} "
                  f"{error}")
    for row in result["large"]:
        print(
            f"{row['label']:16s} round {row['round_s']:.0f} s (compute {row['compute_s_per_round']:.0f}, "
            f"node work {row['node_work_s']:.0f}, link {row['link_s_per_round']:.0f}), "
            f"{row['bytes_per_round'] / 1e9:.1f} GB/round, RAM {row['host_ram_bytes'] / 1e9:.0f} GB, "
            f"disk {row['disk_bytes_per_round'] / 1e9:.0f} GB/round (less the checks' files), "
            f"{(row['disk_bytes_per_node_retained'] or 0) / 1e9:.0f} GB retained, "
            f"commit {row['commit_gas']:,} gas, "
            f"fraud proof {row['fraud_proof']['worst_gas']:,} gas, "
            f"{row['speedup_over_allreduce']:.0f}x AllReduce"
        )
        calibrated = row["components_s_per_round"]
        if calibrated:
            print(f"{'':16s} calibrated on one core: encode {calibrated['encode']:.0f} s, apply "
                  f"{calibrated['apply']:.0f} s, weights root {calibrated['weights_hash']:.0f} s a round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
