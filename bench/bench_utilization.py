"""Compute utilization of real nodes under a rate-limited link, with and without the one-step delay (issue
16).

    python bench/bench_utilization.py [--rounds 5] [--inner-steps 100] [--batch-size 8] [--rate B/s]
        [--concurrent]

Every point is a real local run (anvil, 2 one-node clusters, each node holding
both stages chained, ``torch_threads=1``, spot checks off so that no rerun
competes for the cores). Each node logs one record per *period*, from the end of
one round's training to the end of the next one's (``timing.jsonl``,
node/live/state/roundclock.py); compute utilization is time in inner steps / wall
time of the period. Steps:

1. calibrate: a run without the delay and without a cap gives one round's
   compute (inner seconds), the bytes a node downloads per round (the other
   replica's contribution envelopes) and the exchange's fixed latency (gossip,
   the close, its settle time) with no cap;
2. the cap: ``p2p.rate_limit_bps`` such that the exchange (latency + bytes / rate)
   takes ``--target`` (0.9) of one round's compute;
3. at that cap: a run without the delay and one with DiLoCoX's one-step delay over
   the whole round (``diloco.overlap_steps=0``); optionally (``--with-auto``) the
   default partial overlap (``overlap_steps="auto"``, H // 10 steps);
4. the paper's ratio (``--paper-ratio``, module constant PAPER below): a run with
   the delay at the cap that makes the exchange that fraction of the compute.

The steady-state figures leave out the first two periods (the first has no
start; with the delay, the second holds no exchange yet). Writes
bench/results/utilization.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node.commands.launcher import LocalRun  # noqa: E402

STEADY_FROM = 2  # first steady period (see module docstring)


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def one_run(workdir: Path, name: str, args, extra: list[str]) -> dict:
    """One local run of 2 replicas; per node its periods and finished rounds, and the summary."""
    settings = [f"model.preset={args.preset}", f"diloco.inner_steps={args.inner_steps}",
                f"training.batch_size={args.batch_size}", f"rounds={args.rounds}", "round_timeout=300",
                "join_timeout=120", "checkpoint_every=1000", "spot_checks=0", "torch_threads=1", *extra]
    if (workdir / name).exists():  # a fresh chain reuses run id 1: an old state.json would refuse to re-sign
        shutil.rmtree(workdir / name)
    run = LocalRun(workdir / name, replicas=2, stages=2, split=False, settings=settings)
    run.setup()
    load_start = loadavg()
    started = time.monotonic()
    try:
        run.start()
        ok = run.wait(args.timeout)
        wall = time.monotonic() - started
    finally:
        run.stop()
    nodes = []
    for slot in run.nodes:
        records = []
        path = slot.data_dir / "timing.jsonl"
        if path.exists():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        envelopes = sorted((slot.data_dir / "archive").rglob("*.env"))
        status = slot.status()
        nodes.append({"name": slot.name, "exit": slot.process.returncode if slot.process else None,
                      "periods": [r for r in records if r["kind"] == "period"],
                      "finishes": [r for r in records if r["kind"] == "finish"],
                      "bytes_received": status.get("bytes_received", 0),
                      "bytes_sent": status.get("bytes_sent", 0),
                      "envelope_bytes_mean": (sum(p.stat().st_size for p in envelopes) / len(envelopes)
                                              if envelopes else 0), "envelopes": len(envelopes)})
    point = {"name": name, "settings": settings, "all_exited_0": ok, "wall_seconds": round(wall, 1),
             "load_start": load_start, "load_end": loadavg(), "nodes": nodes}
    point["summary"] = summarize(nodes)
    return point


def summarize(nodes: list[dict]) -> dict:
    """Steady-state means over both nodes: utilization = sum inner / sum wall over the periods."""
    steady = [p for n in nodes for p in n["periods"] if p["round"] >= STEADY_FROM and p["wall_s"]]
    finishes = [f for n in nodes for f in n["finishes"] if f["round"] >= STEADY_FROM - 1]
    exchanges = [f["exchange_s"] for f in finishes if f.get("exchange_s") is not None]
    mean = lambda key: statistics.fmean(p[key] for p in steady) if steady else None  # noqa: E731
    per_node = {}
    for n in nodes:
        own = [p for p in n["periods"] if p["round"] >= STEADY_FROM and p["wall_s"]]
        per_node[n["name"]] = (round(sum(p["inner_s"] for p in own) / sum(p["wall_s"] for p in own), 4)
                               if own else None)
    inner = mean("inner_s")
    summary = {
        "steady_periods": len(steady),
        "utilization": (round(sum(p["inner_s"] for p in steady) / sum(p["wall_s"] for p in steady), 4)
                        if steady else None),
        "utilization_min_period": round(min(p["utilization"] for p in steady), 4) if steady else None,
        "utilization_per_node": per_node,
        "inner_s_mean": inner, "wall_s_mean": mean("wall_s"),
        "exchange_s_median": statistics.median(exchanges) if exchanges else None,
        "exchange_over_inner": (statistics.median(exchanges) / inner) if exchanges and inner else None,
        "bytes_received_per_round": statistics.fmean(
            n["bytes_received"] / max(len(n["finishes"]), 1) for n in nodes),
        "envelope_bytes_mean": statistics.fmean(n["envelope_bytes_mean"] for n in nodes),
    }
    if steady:
        for phase in ("start_state", "eval", "encode", "close_wait", "fetch_wait", "aggregate",
                      "finish_other", "other", "lane_start_state", "lane_eval", "lane_encode"):
            summary[f"{phase}_s_mean"] = statistics.fmean(p.get(f"{phase}_s", 0.0) for p in steady)
        own = ("start_state", "eval", "encode", "aggregate", "finish_other", "other")
        wall = sum(p["wall_s"] for p in steady)
        summary["own_work_share"] = sum(p.get(f"{k}_s", 0.0) for p in steady for k in own) / wall
        summary["network_wait_share"] = sum(p.get("close_wait_s", 0.0) + p.get("fetch_wait_s", 0.0)
                                            for p in steady) / wall
    return summary


#: DiLoCoX's setting (arXiv 2506.21263, abstract): what the ratio below rests on.
PAPER = {
    "source": "arXiv 2506.21263 (DiLoCoX), abstract: a 107B model pre-trained over a 1 Gbps network, "
              "357x speedup over vanilla AllReduce",
    "params": 107e9, "link_bytes_per_s": 1e9 / 8, "speedup_over_allreduce": 357.0,
}


def paper_ratio(params: int, bytes_per_round: float, inner_steps: int) -> dict:
    """The paper setting's exchange time / compute time per round, with our measured compression.

    AllReduce moves one full gradient per step over the link (2 (M-1)/M x 4 bytes per parameter
    in float32, = 4 N at M = 2: the accounting of CompressionConfig.stage_bandwidth_budget), so
    a step costs ``T_c + T_ar``. If DiLoCoX's 357x is compute-bound (the overlap hides its
    exchange), ``(T_c + T_ar) / T_c = 357``: ``T_ar / T_c = 356`` (a lower bound otherwise).
    A DiLoCoX round is H steps of compute and one contribution of ``4 N / rho`` bytes
    (``rho``: float32 bytes / contribution bytes per round, measured here), so::

        exchange / compute = (4 N / rho / B) / (H T_c) = (T_ar / T_c) / (H rho) = 356 / (H rho)

    independent of N and B. With a bfloat16 AllReduce baseline ``T_ar`` is half of the float32
    figure, so the same 357x means twice the ratio.
    """
    rho = 4 * params / bytes_per_round
    ar_over_compute = PAPER["speedup_over_allreduce"] - 1
    fp32 = ar_over_compute / (inner_steps * rho)
    return {**PAPER, "allreduce_over_compute_per_step": ar_over_compute, "our_round_ratio_vs_float32": rho,
            "our_reduction_vs_allreduce_of_H_steps": inner_steps * rho, "inner_steps": inner_steps,
            "ratio_with_our_compression": fp32, "ratio_if_allreduce_was_bf16": 2 * fp32,
            "paper_link_seconds_per_round_with_our_compression": 4 * PAPER["params"] / rho
                / PAPER["link_bytes_per_s"],
            "ratio_with_their_compression": None,
            "why_not_theirs": "the paper's H, compression ratio and step time were not in the sources "
                              "reachable from this machine (search returned only its abstract); with them: "
                              "356 / (H_paper * rho_paper)"}


def model_params(preset: str) -> int:
    from training.config import ModelConfig
    from training.model import init_state_dict

    return sum(t.numel() for t in init_state_dict(ModelConfig(preset=preset), 0).values())


def cap_for(bytes_per_round: float, latency: float, inner: float, fraction: float) -> float:
    """bytes/s so that latency + bytes / rate = fraction * inner (at least half of it left to the bytes)."""
    transfer = max(fraction * inner - latency, 0.5 * fraction * inner)
    return bytes_per_round / transfer


def report(point: dict) -> None:
    s = point["summary"]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    print(f"{point['name']:>14}: utilization {fmt(s['utilization'], '.1%')} (min period "
          f"{fmt(s['utilization_min_period'], '.1%')}), inner {fmt(s['inner_s_mean'], '.2f')} s, wall "
          f"{fmt(s['wall_s_mean'], '.2f')} s, exchange {fmt(s['exchange_s_median'], '.2f')} s "
          f"({fmt(s['exchange_over_inner'], '.0%')} of compute), load {point['load_start']} "
          f"-> {point['load_end']}",
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=100)
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.9,
                        help="exchange time / compute time to calibrate to")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="skip the calibration: use this cap (bytes/s)")
    parser.add_argument("--burst", type=float, default=16384.0,
                        help="the cap's bucket (p2p.rate_limit_burst, bytes): the default 2 MiB bucket would "
                             "let a whole round of mini's contributions (~0.35 MB) through at once")
    parser.add_argument("--paper-ratio", type=float, default=None,
                        help="exchange / compute of the paper's setting (default: computed, see PAPER)")
    parser.add_argument("--with-auto", action="store_true", help="also run the default partial overlap")
    parser.add_argument("--concurrent", action="store_true",
                        help="run the capped points at the same time (a loaded machine: "
                             "the same load for all)")
    parser.add_argument("--points", default="calibrate,nodelay,delay,paper")
    parser.add_argument("--timeout", type=float, default=2400)
    parser.add_argument("--workdir", default="/tmp/dlx-bench-util")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "utilization.json"))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    points = args.points.split(",")
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update({"args": vars(args), "load_at_start": loadavg(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())})
    runs = result.setdefault("runs", {})

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))

    # A capped transfer sends a whole chunk (up to ~1 MiB) after the bucket allows it: at a few kB/s
    # that is longer than the default 15 s stall timeout, which would abandon every stream.
    patient = ["p2p.blob_stall_timeout=3600", "p2p.transfer_timeout=3600"]
    delay_full = ["diloco.one_step_delay=true", "diloco.overlap_steps=0"]
    no_delay = ["diloco.one_step_delay=false"]
    if "calibrate" in points:
        runs["calibrate"] = one_run(workdir, "calibrate", args, no_delay)
        report(runs["calibrate"])
        save()
    rate = args.rate
    if not rate:
        s = runs["calibrate"]["summary"]
        bytes_per_round = s["envelope_bytes_mean"] * 2  # one envelope per stage from the one other replica
        rate = cap_for(bytes_per_round, s["exchange_s_median"] or 0.0, s["inner_s_mean"], args.target)
        result["calibration"] = {"bytes_per_round": bytes_per_round,
                                 "uncapped_exchange_s": s["exchange_s_median"], "inner_s": s["inner_s_mean"],
                                 "target": args.target, "rate_limit_bps": rate}
        print(f"cap: {rate:.0f} bytes/s ({bytes_per_round:.0f} bytes per round, uncapped exchange "
              f"{s['exchange_s_median']:.2f} s, compute {s['inner_s_mean']:.2f} s)", flush=True)
    result["rate_limit_bps"] = rate
    burst = [f"p2p.rate_limit_burst={args.burst:.0f}"]
    capped = [f"p2p.rate_limit_bps={rate:.0f}", *burst, *patient]
    todo: dict[str, list[str]] = {}
    if "nodelay" in points:
        todo["nodelay"] = no_delay + capped
    if "delay" in points:
        todo["delay"] = delay_full + capped
    if args.with_auto:
        todo["delay_auto_overlap"] = ["diloco.one_step_delay=true", *capped]
    if "paper" in points:
        ratio = args.paper_ratio
        if "calibrate" in runs:  # the arithmetic, from the calibration run's own H and bytes
            cal = runs["calibrate"]
            cal_h = int(next(x for x in cal["settings"] if x.startswith("diloco.inner_steps=")).split("=")[1])
            result["paper"] = paper_ratio(model_params(args.preset),
                                          cal["summary"]["envelope_bytes_mean"] * 2, cal_h)
            if ratio is None:
                ratio = result["paper"]["ratio_with_our_compression"]
        if ratio is None:
            print("no paper ratio (give --paper-ratio, or calibrate at the same H); skipping the paper point")
        else:
            # The cap gives bytes / rate = target * compute; the paper's ratio is link time only, so
            # bytes / paper_rate = ratio * compute, on top of which comes this machine's fixed latency.
            paper_rate = rate * args.target / ratio
            result["paper_point"] = {"ratio": ratio, "rate_limit_bps": paper_rate}
            print(f"paper point: exchange / compute {ratio:.3f}, cap {paper_rate:.0f} bytes/s", flush=True)
            todo["paper"] = delay_full + [f"p2p.rate_limit_bps={paper_rate:.0f}", *burst, *patient]
    if args.concurrent:
        with ThreadPoolExecutor(max_workers=len(todo) or 1) as pool:
            futures = {name: pool.submit(one_run, workdir, name, args, extra) for name, extra in todo.items()}
            for name, future in futures.items():
                runs[name] = future.result()
                runs[name]["concurrent_with"] = [n for n in todo if n != name]
                report(runs[name])
    else:
        for name, extra in todo.items():
            runs[name] = one_run(workdir, name, args, extra)
            report(runs[name])
            save()
    result["load_at_end"] = loadavg()
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
