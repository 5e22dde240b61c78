"""Traffic per node as the number of replicas grows: measured in real local runs, then modelled.

    python bench/bench_scale.py [--replicas 2,4,8] [--rounds 4] [--inner-steps 4]

Each point is a real local run (anvil, one-node clusters of the ``tiny`` model,
2 stages chained in each node, spot checks off so that only the exchange is
measured). For every node it reads what the node's libp2p host counted
(``status.json``: application bytes sent and received over blobs, gossip and
sync) and reports the mean per node and per round, the round time, and the
mean contribution envelope size. The model extends the measurement: today every
holder of a stage fetches every other replica's contribution of it, so a node
receives about ``(R - 1) x C`` bytes per round (``C``: one replica's
contribution envelopes, all stages) and serves as much; gossip adds messages
per peer. Writes bench/results/scale.json.

Local runs are limited to anvil's 9 funded dev accounts (``MAX_NODES``), so 16
nodes are not measured here (issue 16).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node.commands.launcher import LocalRun  # noqa: E402


def one_run(workdir: Path, replicas: int, args) -> dict:
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"rounds={args.rounds}", "round_timeout=120", "join_timeout=120", "checkpoint_every=1000",
                "spot_checks=0"]
    run = LocalRun(workdir, replicas=replicas, stages=2, split=False, settings=settings)
    run.setup()
    started = time.monotonic()
    try:
        run.start()
        codes = [slot.process.wait(timeout=args.timeout) for slot in run.nodes]
        wall = time.monotonic() - started
        commits = run.client().history(run.run_id).commits
    finally:
        run.stop()
    nodes = []
    for slot in run.nodes:
        status = json.loads((slot.data_dir / "status.json").read_text())
        envelopes = list((slot.data_dir / "archive").rglob("*.env"))
        nodes.append({"exit": codes[run.nodes.index(slot)], "bytes_sent": status.get("bytes_sent", 0),
                      "bytes_received": status.get("bytes_received", 0),
                      "envelope_bytes": sum(p.stat().st_size for p in envelopes), "envelopes": len(envelopes)})
    rounds = len(commits)
    per_node_round = lambda key: sum(n[key] for n in nodes) / len(nodes) / max(rounds, 1)  # noqa: E731
    envelope_mean = (sum(n["envelope_bytes"] for n in nodes) / max(sum(n["envelopes"] for n in nodes), 1))
    return {
        "replicas": replicas, "rounds_committed": rounds, "exits": [n["exit"] for n in nodes],
        "wall_seconds": wall, "seconds_per_round": wall / max(rounds, 1),
        "sent_per_node_round": per_node_round("bytes_sent"),
        "received_per_node_round": per_node_round("bytes_received"),
        "contribution_envelope_bytes": envelope_mean,
        "replica_contribution_bytes": envelope_mean * 2,  # one envelope per stage, 2 stages
        "nodes": nodes,
    }


def model(points: list[dict], sizes: list[int]) -> list[dict]:
    """Per-node traffic per round for R replicas: (R - 1) contributions in, as many out, plus the
    per-peer gossip overhead fitted from the measured points (least squares on R - 1)."""
    xs = [p["replicas"] - 1 for p in points]
    ys = [p["received_per_node_round"] for p in points]
    c = sum(p["replica_contribution_bytes"] for p in points) / len(points)
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / max(sum((x - mean_x) ** 2 for x in xs), 1e-9))
    intercept = mean_y - slope * mean_x
    return [{"replicas": r, "contribution_bytes_in": (r - 1) * c,
             "fitted_received_per_node_round": intercept + slope * (r - 1)} for r in sizes]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--workdir", default="/tmp/dlx-bench-scale")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    args = parser.parse_args()
    points = []
    for replicas in [int(r) for r in args.replicas.split(",")]:
        point = one_run(Path(args.workdir) / f"r{replicas}", replicas, args)
        points.append(point)
        print(f"{replicas:>3} replicas: {point['rounds_committed']} rounds, {point['seconds_per_round']:.1f} s/round, "
              f"per node and round {point['sent_per_node_round'] / 1e3:.1f} kB sent, "
              f"{point['received_per_node_round'] / 1e3:.1f} kB received "
              f"(one replica's contribution {point['replica_contribution_bytes'] / 1e3:.1f} kB)", flush=True)
    modelled = model(points, [16, 64, 256, 1024])
    for m in modelled:
        print(f"{m['replicas']:>5} replicas (model): {m['fitted_received_per_node_round'] / 1e6:.2f} MB received "
              f"per node and round")
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    result = {"args": vars(args), "load_at_end": load, "measured": points, "model": modelled}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
