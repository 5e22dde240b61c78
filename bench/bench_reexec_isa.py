"""Benchmark: re-execution across CPU instruction sets and thread counts, and the platform rule (issue 42).

Claimants train a short simulated run (training/reexec_sim.py) in a subprocess under one
``ATEN_CPU_CAPABILITY`` on 1 thread: honest replicas and small cheats (a 1% perturbation of the
update, other data, half the inner steps). Every contribution is then re-executed
(``training.reexec.verify_contribution``) in subprocesses under each capability this CPU has and on 1
and 2 threads. Per model preset: the honest distance between capabilities and thread counts, the cheats'
smallest distance, and what each rule makes of them:

* ``old_tolerance``: the cross-platform rule before issue 42's (relative L2 distance <= the float32
  tolerance 1e-2 passes);
* ``rule``: issue 42's platform rule (training.fingerprint.compare_rerun): a claim of this CPU model is
  rerun under the claimant's own kernels and thread count (emulated), bit-exact demanded; a claim of a
  platform the verifier cannot emulate (another CPU model, a GPU) gets the three zones, passed up to
  ``TOLERANCE_PASS_BOUND``, mismatch beyond ``CROSS_PLATFORM_TOLERANCE``, undecided between: every rerun
  on other kernels or threads is counted as such a claim.

    PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py --presets llama-tiny,llama-mini
    PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py --resummarize  # the stored rows, today's rule
    PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py --presets llama-mini --add  # keep the other ones
    PYTHONPATH=. .venv/bin/python bench/bench_reexec_isa.py --presets llama-tiny --add \
        --arm-python /opt/arm-venv/bin/python --rerun-threads 1  # and ARM (scripts/setup-arm-emulation.sh)

With ``--arm-python`` an aarch64 Python with torch (on x86, scripts/setup-arm-emulation.sh's qemu-user
wrapper) trains and reruns too, under each of ``--arm-capabilities`` (torch's aarch64 kernels: ``default``,
NEON; ``sve256``): every claimant, x86 or ARM, is rerun on every platform; the preset's rows are stored as
``PRESET x86+aarch64``. An ARM platform's rows name it ``aarch64:CAPABILITY`` (torch calls both x86's and
ARM's baseline ``DEFAULT``).

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

CAPABILITY_NAMES = ("default", "avx2", "avx512")
ROLES = ("honest", "honest", "perturbed_1pct", "perturbed_1pct", "other_data", "half_steps")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="llama-tiny,llama-mini", help="comma-separated model presets")
    parser.add_argument("--preset", default="tiny", help=argparse.SUPPRESS)  # a child's
    parser.add_argument("--resummarize", action="store_true",
                        help="recompute the summaries of --out's stored rows under today's rule, run nothing")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--out", default=default_out(__file__))
    parser.add_argument("--add", action="store_true",
                        help="keep the presets --out holds that this invocation does not measure (each "
                             "preset records its own rounds, H and when it was measured)")
    parser.add_argument("--arm-python", default="",
                        help="an aarch64 python with torch (scripts/setup-arm-emulation.sh): claim "
                             "and rerun on ARM too")
    parser.add_argument("--arm-capabilities", default="default,sve256",
                        help="the ATEN_CPU_CAPABILITY values the ARM side runs under (with --arm-python)")
    parser.add_argument("--rerun-threads", default="1,2",
                        help="the thread counts every contribution is rerun on")
    parser.add_argument("--role", choices=("claim", "rerun"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    return [f"model.preset={args.preset}", "pipeline.num_stages=2", f"diloco.num_replicas={len(ROLES)}",
            f"diloco.inner_steps={args.inner_steps}", "training.batch_size=8", "training.warmup_steps=5",
            "compression.min_compress_numel=512",
            # training/reexec_sim.py's claims bind no applied hash: with an overlap (H >= 10 gives 1 step)
            # every rerun of a round > 0 would be "other_result",
            # so the bench runs DiLoCoX's plain one-step delay
            "diloco.overlap_steps=0"]


def kernels_label() -> str:
    """torch's CPU capability in this process, prefixed by the machine where that is not x86-64 (torch names
    both x86's and ARM's baseline kernels ``DEFAULT``); x86 labels stay as the stored rows have them."""
    import platform

    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability if platform.machine() in ("x86_64", "AMD64") else f"{platform.machine()}:{capability}"


def claim(args: argparse.Namespace) -> None:
    """Child: train the run under this process's capability on 1 thread; pickle what a verifier finds."""
    import torch

    from node.config import load_config
    from training.data import corpus_from_config
    from training.reexec_sim import (
        HalfStepsReplica,
        OtherDataReplica,
        PerturbedReplica,
        SimConfig,
        SimReplica,
        run_with_states,
    )

    torch.set_num_threads(1)
    cfg = load_config(None, overrides(args))
    sim = SimConfig(corpus_from_config(cfg.training, cfg.model), cfg.model, cfg.training, cfg.diloco,
                    cfg.compression, cfg.pipeline.num_stages, rounds=args.rounds)
    kinds = {"honest": SimReplica, "perturbed_1pct": PerturbedReplica, "other_data": OtherDataReplica,
             "half_steps": HalfStepsReplica}
    records = run_with_states([kinds[role](index, sim) for index, role in enumerate(ROLES)], sim)
    Path(args.file).write_bytes(pickle.dumps({
        "capability": kernels_label(),
        "records": [{"round": r.outer_round, "contributions": r.contributions, "claims": r.claims,
                     "states": {i: [p.to_bytes() for p in s.stages] for i, s in r.states.items()}}
                    for r in records],
    }))


def rerun(args: argparse.Namespace) -> None:
    """Child: re-execute every contribution of the pickled run here, on ``--threads`` threads; print JSON
    rows."""
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
                                        cfg.diloco, cfg.compression, outer_round=record["round"],
                                        replica=replica, run_rounds=len(run["records"]),
                                        previous_contributions=previous, threads=args.threads)
            rows.append({"claimant": run["capability"], "rerun": kernels_label(),
                         "threads": args.threads, "round": record["round"], "replica": replica,
                         "role": ROLES[replica], "verdict": check.verdict,
                         "distance": max(check.distances.values(), default=None),
                         "seconds": check.reexec_seconds})
    print(json.dumps(rows))


def child(args: argparse.Namespace, role: str, capability: str, file: Path, threads: int = 1,
          python: str = sys.executable) -> str:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO)}
    command = [python, __file__, "--role", role, "--file", str(file), "--threads", str(threads),
               "--preset", args.preset, "--rounds", str(args.rounds), "--inner-steps", str(args.inner_steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{role} under {capability} ({python}): {done.stderr[-2000:]}")
    return done.stdout


def rule_verdict(row: dict) -> str:
    """What issue 42's rule makes of a rerun row. Same kernels and threads as the claimant's (the claimant's
    platform, or emulated): the row's own bit-exact verdict. Otherwise the claim is taken as one of a platform
    the verifier cannot emulate: the three zones of training.fingerprint.compare_rerun over its distance (a
    check refused before any rerun, data_mismatch or state_mismatch, keeps its verdict)."""
    from training.fingerprint import (
        CROSS_PLATFORM_TOLERANCE,
        MISMATCH,
        TOLERANCE_PASS_BOUND,
        UNDECIDED,
        WITHIN_TOLERANCE,
    )

    if row["distance"] is None or (row["claimant"] == row["rerun"] and row["threads"] == 1):
        return row["verdict"]
    if row["distance"] == 0.0:
        return "exact"
    if row["distance"] <= TOLERANCE_PASS_BOUND["fp32"]:
        return WITHIN_TOLERANCE
    return MISMATCH if row["distance"] > CROSS_PLATFORM_TOLERANCE["fp32"] else UNDECIDED


def summarize(rows: list[dict], old_tolerance: float = 1e-2) -> dict:
    """Honest distances by what differs; per cheat the smallest distance and what each rule makes of it.
    A check refused before any rerun (``data_mismatch``, ``state_mismatch``: no distance) is caught by all."""
    from training.fingerprint import CROSS_PLATFORM_TOLERANCE, TOLERANCE_PASS_BOUND

    def honest(match) -> list[float]:
        return [r["distance"] for r in rows if r["role"] == "honest" and match(r)
                and r["distance"] is not None]

    def smallest(values) -> float | None:
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def passes_old(r) -> bool:
        return r["distance"] is not None and r["distance"] <= old_tolerance

    def counted(mine: list[dict]) -> dict:
        verdicts = [rule_verdict(r) for r in mine]
        return {v: verdicts.count(v) for v in sorted(set(verdicts))}

    same = lambda r: r["claimant"] == r["rerun"] and r["threads"] == 1  # noqa: E731
    other = lambda r: r["claimant"] != r["rerun"]  # noqa: E731
    other_kernels = lambda r: not same(r)  # noqa: E731
    pairs = sorted({(r["claimant"], r["rerun"]) for r in rows if other(r)})
    summary = {
        "honest_same_kernels_max": max(honest(same), default=None),
        "honest_other_threads_max": max(honest(lambda r: r["claimant"] == r["rerun"] and r["threads"] != 1),
                                        default=None),
        "honest_other_capability_max": max(honest(other), default=None),
        "honest_by_capability_pair": {
            f"{a}->{b}": {"max": max(honest(lambda r, a=a, b=b: (r["claimant"], r["rerun"])
                                            == (a, b)), default=None),
                           "min": smallest(honest(lambda r, a=a, b=b: (r["claimant"],
                                                                        r["rerun"]) == (a, b)))}
            for a, b in pairs},
        "honest_verdicts": sorted({r["verdict"] for r in rows if r["role"] == "honest"}),
        # every honest rerun on other kernels or threads, judged as a claim of a platform nobody can emulate
        "honest_rule_other_kernels": counted([r for r in rows if r["role"] == "honest" and other_kernels(r)]),
        "cheats": {},
        "old_tolerance": old_tolerance,
        "pass_bound": TOLERANCE_PASS_BOUND["fp32"],
        "mismatch_bound": CROSS_PLATFORM_TOLERANCE["fp32"],
    }
    for role in sorted({r["role"] for r in rows if r["role"] != "honest"}):
        mine = [r for r in rows if r["role"] == role]
        summary["cheats"][role] = {
            "checks": len([r for r in mine if same(r)]),
            "min_distance_same_kernels": smallest(r["distance"] for r in mine if same(r)),
            "min_distance_other_capability": smallest(r["distance"] for r in mine if other(r)),
            # before issue 42's rule: a cheat claiming another platform than the verifier's, judged by 1e-2
            "pass_old_tolerance_other_kernels": sum(1 for r in mine if other_kernels(r) and passes_old(r)),
            "reruns_other_kernels": sum(1 for r in mine if other_kernels(r)),
            # the rule, claimant of this CPU model: rerun under its own kernels, bit-exact demanded
            "pass_emulated": sum(1 for r in mine if same(r) and r["verdict"] == "exact"),
            # the rule, claimant of a platform the verifier cannot emulate: the three zones
            "rule_other_kernels": counted([r for r in mine if other_kernels(r)]),
            "pass_rule_other_kernels": sum(1 for r in mine if other_kernels(r)
                                           and rule_verdict(r) in ("exact", "within_tolerance")),
        }
    return summary


def capabilities() -> list[str]:
    """The ATen capabilities this CPU has, lowest first."""
    from training.claimant_kernels import CPU_CAPABILITY_LEVELS, native_cpu_capability

    top = CPU_CAPABILITY_LEVELS[native_cpu_capability()]
    return [name for name in CAPABILITY_NAMES if CPU_CAPABILITY_LEVELS[name.upper()] <= top]


def platforms(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(python, ATEN_CPU_CAPABILITY) of every platform claimants train and reruns run on: this CPU's
    capabilities, then with ``--arm-python`` the ARM ones."""
    here = [(sys.executable, capability) for capability in capabilities()]
    arm = [c for c in args.arm_capabilities.split(",") if c] if args.arm_python else []
    return here + [(args.arm_python, capability) for capability in arm]


def measure(args: argparse.Namespace, preset: str) -> list[dict]:
    """Every rerun row of one preset (claimants under each platform, reruns under each x
    ``--rerun-threads``)."""
    args = argparse.Namespace(**{**vars(args), "preset": preset})
    rows: list[dict] = []
    every = platforms(args)
    with tempfile.TemporaryDirectory() as tmp:
        for index, (claim_python, claimed) in enumerate(every):
            file = Path(tmp) / f"{index}-{claimed}.pkl"
            print(f"{preset}: claimants under {claimed} ({claim_python})", flush=True)
            child(args, "claim", claimed, file, python=claim_python)
            for python, capability in every:
                for threads in [int(t) for t in args.rerun_threads.split(",")]:
                    print(f"  rerun under {capability} ({python}), {threads} threads", flush=True)
                    rows += json.loads(child(args, "rerun", capability, file, threads, python=python
                                             ).strip().splitlines()[-1])
    return rows


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.role == "claim":
        claim(args)
        return 0
    if args.role == "rerun":
        rerun(args)
        return 0
    out = REPO / args.out
    load = list(os.getloadavg())
    started = time.perf_counter()
    if args.resummarize:
        stored = json.loads(out.read_text())
        presets = {name: {**doc, "summary": summarize(doc["rows"])}
                       for name, doc in stored["presets"].items()}
        document = {**{k: v for k, v in stored.items() if k not in ("recorded",)}, "presets": presets}
        document["resummarized"] = "summaries recomputed from the stored rows under today's rule"
        write_result(out, document, stored.get("recorded", {}).get("load_at_start", load))
        print(json.dumps({name: doc["summary"] for name, doc in presets.items()}, indent=1))
        return 0
    presets = {}
    if args.add and out.exists():  # kept as measured: their own rounds, H and record
        stored = json.loads(out.read_text())
        for name, doc in stored["presets"].items():
            presets[name] = {"rounds": stored["args"]["rounds"], "inner_steps": stored["args"]["inner_steps"],
                             "recorded": stored.get("recorded"), **doc}
    for preset in [p for p in args.presets.split(",") if p]:
        preset_started = time.perf_counter()
        rows = measure(args, preset)
        name = f"{preset} x86+aarch64" if args.arm_python else preset
        presets[name] = {"rounds": args.rounds, "inner_steps": args.inner_steps, "summary": summarize(rows),
                         "rows": rows, "wall_seconds": time.perf_counter() - preset_started,
                         "platforms": sorted({r["claimant"] for r in rows}),
                         "rerun_threads": args.rerun_threads}
        print(json.dumps(presets[name]["summary"], indent=1), flush=True)
    write_result(out, {"args": {k: v for k, v in vars(args).items()
                                if k not in ("role", "file", "preset", "threads", "resummarize", "out", "add",
                                             "arm_python")},
                       "capabilities": capabilities(), "roles": list(ROLES), "presets": presets,
                       "wall_seconds": time.perf_counter() - started}, load)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
