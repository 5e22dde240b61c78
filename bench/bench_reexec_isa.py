"""Benchmark: re-execution across CPU instruction sets and thread counts (issue 42).

Claimants train a short simulated run (training/reexec_sim.py) in a subprocess under one
``ATEN_CPU_CAPABILITY`` on 1 thread: honest replicas and small cheats (a 1% perturbation of the
update, other data, half the inner steps). Every contribution is then re-executed
(``training.reexec.verify_contribution``) in subprocesses under each capability and on 1 and 2
threads. The table: the honest distance between capabilities and thread counts, the cheats'
smallest distance, and how many cheats each rule lets through:

* ``tolerance``: today's cross-platform rule (relative L2 distance <= the float32 tolerance);
* ``same_kernels``: a rerun under the claimant's own capability and thread count, bit-exact demanded
  (what a verifier of another capability can do for a CPU claimant by starting its rerun with the
  claimant's ``ATEN_CPU_CAPABILITY``, where its CPU has that instruction set).

    PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py                 # tiny, 3 rounds, H=10

writes bench/results/reexec_isa.json (``benchio.write_result``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_out, write_result  # noqa: E402

CAPABILITIES = ("default", "avx2")
ROLES = ("honest", "honest", "perturbed_1pct", "perturbed_1pct", "other_data", "half_steps")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--out", default=default_out(__file__))
    parser.add_argument("--role", choices=("claim", "rerun"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    return [f"model.preset={args.preset}", "pipeline.num_stages=2", f"diloco.num_replicas={len(ROLES)}",
            f"diloco.inner_steps={args.inner_steps}", "training.batch_size=8", "training.warmup_steps=5",
            "compression.min_compress_numel=512"]


def claim(args: argparse.Namespace) -> None:
    """Child: train the run under this process's capability on 1 thread; pickle what a verifier finds."""
    import torch

    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec_sim import HalfStepsReplica, OtherDataReplica, PerturbedReplica, SimConfig, SimReplica, \
        run_with_states

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(args))
    sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                    cfg.compression, cfg.pipeline.num_stages, rounds=args.rounds)
    kinds = {"honest": SimReplica, "perturbed_1pct": PerturbedReplica, "other_data": OtherDataReplica,
             "half_steps": HalfStepsReplica}
    records = run_with_states([kinds[role](index, sim) for index, role in enumerate(ROLES)], sim)
    Path(args.file).write_bytes(pickle.dumps({
        "capability": torch.backends.cpu.get_cpu_capability(),
        "records": [{"round": r.outer_round, "contributions": r.contributions, "claims": r.claims,
                     "states": {i: [p.to_bytes() for p in s.stages] for i, s in r.states.items()}} for r in records],
    }))


def rerun(args: argparse.Namespace) -> None:
    """Child: re-execute every contribution of the pickled run here, on ``--threads`` threads; print JSON rows."""
    import torch

    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec import verify_contribution

    cfg = load_config(None, overrides(args))
    corpus = corpus_from_config(cfg.training, cfg.model)
    run = pickle.loads(Path(args.file).read_bytes())
    rows = []
    for index, record in enumerate(run["records"]):
        previous = run["records"][index - 1]["contributions"] if index > 0 else None
        for replica, parts in sorted(record["states"].items()):
            check = verify_contribution(parts, record["claims"][replica], corpus, cfg.model, cfg.training,
                                        cfg.diloco, cfg.compression, outer_round=record["round"], replica=replica,
                                        run_rounds=len(run["records"]), previous_contributions=previous,
                                        threads=args.threads)
            rows.append({"claimant": run["capability"], "rerun": torch.backends.cpu.get_cpu_capability(),
                         "threads": args.threads, "round": record["round"], "replica": replica,
                         "role": ROLES[replica], "verdict": check.verdict,
                         "distance": max(check.distances.values(), default=None), "seconds": check.reexec_seconds})
    print(json.dumps(rows))


def child(args: argparse.Namespace, role: str, capability: str, file: Path, threads: int = 1) -> str:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO)}
    command = [sys.executable, __file__, "--role", role, "--file", str(file), "--threads", str(threads),
               "--preset", args.preset, "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{role} under {capability}: {done.stderr[-2000:]}")
    return done.stdout


def summarize(rows: list[dict], tolerance: float) -> dict:
    """Honest distances by what differs; per cheat the smallest distance and how many each rule lets through.
    A check refused before any rerun (``data_mismatch``, ``state_mismatch``: no distance) is caught by both."""
    def honest(match) -> list[float]:
        return [r["distance"] for r in rows if r["role"] == "honest" and match(r) and r["distance"] is not None]

    def smallest(values) -> float | None:
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def passes_tolerance(r) -> bool:
        return r["verdict"] in ("exact", "within_tolerance") and r["distance"] is not None and r["distance"] <= tolerance

    cheats = [r for r in rows if r["role"] != "honest"]
    same = lambda r: r["claimant"] == r["rerun"] and r["threads"] == 1  # noqa: E731
    other = lambda r: r["claimant"] != r["rerun"]  # noqa: E731
    summary = {
        "honest_same_kernels_max": max(honest(same), default=None),
        "honest_other_threads_max": max(honest(lambda r: r["claimant"] == r["rerun"] and r["threads"] != 1),
                                        default=None),
        "honest_other_capability_max": max(honest(other), default=None),
        "honest_verdicts": sorted({r["verdict"] for r in rows if r["role"] == "honest"}),
        "cheats": {},
        "tolerance": tolerance,
    }
    for role in sorted({r["role"] for r in cheats}):
        mine = [r for r in cheats if r["role"] == role]
        summary["cheats"][role] = {
            "checks": len([r for r in mine if same(r)]),
            "min_distance_same_kernels": smallest(r["distance"] for r in mine if same(r)),
            "min_distance_other_capability": smallest(r["distance"] for r in mine if other(r)),
            # a cheat claiming another platform than the verifier's: judged by the tolerance
            "pass_tolerance_other_capability": sum(1 for r in mine if other(r) and passes_tolerance(r)),
            "reruns_other_capability": sum(1 for r in mine if other(r)),
            # the same cheat rerun under its own kernels: bit-exact demanded
            "pass_same_kernels": sum(1 for r in mine if same(r) and r["verdict"] == "exact"),
            "verdicts": sorted({r["verdict"] for r in mine}),
        }
    return summary


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.role == "claim":
        claim(args)
        return 0
    if args.role == "rerun":
        rerun(args)
        return 0
    from training.platform import CROSS_PLATFORM_TOLERANCE

    load = list(os.getloadavg())
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for claimed in CAPABILITIES:
            file = Path(tmp) / f"{claimed}.pkl"
            print(f"claimants under {claimed}", flush=True)
            child(args, "claim", claimed, file)
            for capability in CAPABILITIES:
                for threads in (1, 2):
                    print(f"  rerun under {capability}, {threads} threads", flush=True)
                    rows += json.loads(child(args, "rerun", capability, file, threads).strip().splitlines()[-1])
    (REPO / args.out).with_suffix(".rows.tmp").write_text(json.dumps(rows))  # kept if the summary fails
    summary = summarize(rows, CROSS_PLATFORM_TOLERANCE["fp32"])
    print(json.dumps(summary, indent=1))
    write_result(REPO / args.out, {"args": {k: v for k, v in vars(args).items() if k not in ("role", "file")},
                                   "roles": list(ROLES), "summary": summary, "rows": rows,
                                   "wall_seconds": time.perf_counter() - started}, load)
    (REPO / args.out).with_suffix(".rows.tmp").unlink()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
