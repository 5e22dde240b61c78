"""Benchmark: the reproducible mode's cost and its bits (issue 64, docs/REPRODUCIBLE.md).

Per (preset, inner optimizer): the seconds of one inner step (``LocalReplicaTrainer.train_step``, batch
``--batch``, random token ids) in the normal mode and with ``training.reproducible`` (kernel versions 1 and
2, ``training.reproducible_kernels``; keys ``reproducible_*`` and ``slowdown`` version 1's, ``*_v2``
version 2's), on ``--timing-threads`` threads, the modes' steps alternating, the median of ``--steps``
steps after one warm-up step, the tokens per second
and the slowdown, in wall-clock and in the process's CPU time (``*_cpu``); per encoder, the seconds of the
codec's encode of fixed inputs (3 rounds under a byte
budget, one to the error budget: ``training.exact_probe.codec_bytes``) in each mode.
Then, in children under ``ATEN_CPU_CAPABILITY`` default, avx2 and the machine's own, on 1 and 2 threads,
with and without ``MKL_CBWR=COMPATIBLE`` (Numba's target following the capability:
``training.exact_probe.NUMBA_TARGETS``): the sha256 of the weights after two inner steps (normal, and the
reproducible mode with each kernel version) and of the codec's payloads in each mode, and whether every
child gave the same bits.

    PYTHONPATH=. .venv/bin/python bench/bench_reproducible.py
    PYTHONPATH=. .venv/bin/python bench/bench_reproducible.py --cases tiny:adamw --steps 3 --no-grid
    PYTHONPATH=. .venv/bin/python bench/bench_reproducible.py --audit  # the demo audit (bench/repro_audit.py)
    PYTHONPATH=. .venv/bin/python bench/bench_reproducible.py --audit --audit-full --audit-cheats
        # the full-size demo's, and the 1% and one-ulp cheats at its settings (bench/repro_cheats.py)

writes bench/results/reproducible.json (``benchio.write_result``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_out, write_result  # noqa: E402
from training.exact_probe import ENCODERS, NATIVE, child_env, codec_bytes, fresh_steps, trainer_for  # noqa: E402

DEFAULT_CASES = "tiny:adamw,mini:adamw,llama-tiny:muon,llama-20m:adamw:2"
GRID = [(capability, threads, cbwr) for capability in (NATIVE, "default", "avx2") for threads in (1, 2)
        for cbwr in ("", "COMPATIBLE")]


def step_seconds(preset: str, optimizer: str, modes: list[tuple[bool, int]], batch: int,
                 steps: int) -> tuple[list[float], list[float]]:
    """Median seconds of one inner step in each mode ``(reproducible, kernel version)``, after a warm-up
    step of each: wall-clock, and the process's CPU time (on one thread, what a step costs without the
    other processes of a shared machine that delay it). The modes' steps alternate (one step of each in turn,
    the same batch), so a load that
    comes and goes on a shared machine weighs on every mode alike."""
    import torch

    trainers = [trainer_for(preset, optimizer, on, batch, kernels) for on, kernels in modes]
    model_cfg = trainers[0][0]
    generator = torch.Generator().manual_seed(0)
    times: list[list[float]] = [[] for _ in modes]
    cpu: list[list[float]] = [[] for _ in modes]
    for index in range(steps + 1):
        x, y = (torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.block_size), generator=generator)
                for _ in range(2))
        for (_, trainer), spent, used in zip(trainers, times, cpu):
            started, started_cpu = time.perf_counter(), time.process_time()
            trainer.train_step(x, y)
            if index:
                spent.append(time.perf_counter() - started)
                used.append(time.process_time() - started_cpu)
    return [statistics.median(spent) for spent in times], [statistics.median(used) for used in cpu]


def child_hashes(cases: list[tuple[str, str]], capability: str, threads: int, cbwr: str) -> dict:
    env = child_env(REPO, capability, threads, cbwr)
    spec = ",".join(f"{p}:{o}" for p, o in cases)
    done = subprocess.run([sys.executable, __file__, "--child", spec, "--threads", str(threads)], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=REPO, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_child(cases: list[tuple[str, str]], threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    modes = {"normal": (False, 1), "reproducible": (True, 1), "reproducible_v2": (True, 2)}
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": threads,
                      "hashes": {**{f"{p}:{o}:{mode}": fresh_steps(p, o, on, kernels=kernels)
                                    for p, o, *_ in cases for mode, (on, kernels) in modes.items()},
                                 **{f"codec:{encoder}:{mode}": codec_bytes(encoder, mode == "reproducible")
                                    for encoder in ENCODERS for mode in ("normal", "reproducible")}}}))


def write_audit(args: argparse.Namespace) -> None:
    """``--audit``: the demo audit's block replaces ``audit`` of ``--out`` (``audit_full`` with
    ``--audit-full``: the demo's own size), with its own ``recorded``; with ``--audit-cheats`` its ``cheats``
    (bench/repro_cheats.py) after the audits. ``--audit-cheats`` without ``--audit``: the cheats alone, on
    the demo ``--audit-workdir`` already holds, merged into the block as its ``cheats``. The file is read
    again just before it is written, so what another bench wrote meanwhile (the cost part) is kept."""
    from bench.benchio import recorded
    from bench.repro_audit import demo_defaults, run_audit_bench

    key = "audit_full" if args.audit_full else "audit"
    if args.audit_full:
        vars(args).update(demo_defaults())
    if args.audit:
        block = run_audit_bench(REPO, args)
        if args.audit_cheats:
            block["cheats"] = audit_cheats(args, Path(args.audit_workdir or block.pop("workdir")))
        block.pop("workdir", None)
        block["recorded"] = recorded(block["load_average"]["start"])
        merge_block(Path(args.out), key, block)
    else:
        if not args.audit_workdir:
            raise SystemExit("--audit-cheats without --audit: give the demo's --audit-workdir")
        load = list(os.getloadavg())
        cheats = audit_cheats(args, Path(args.audit_workdir))
        cheats["recorded"] = recorded(load)
        merge_block(Path(args.out), key, {"cheats": cheats}, update=True)


def audit_cheats(args: argparse.Namespace, workdir: Path) -> dict:
    """bench/repro_cheats.py on the demo of ``workdir``: trained under ``--audit-train``, rerun under each
    capability of ``--audit-under``."""
    from bench.repro_cheats import run_cheat_bench

    node_toml = workdir / "demo" / "r0" / "node.toml"
    if not node_toml.is_file():
        raise SystemExit(f"{node_toml}: no demo there (run --audit first)")
    step = args.audit_cheat_step if args.audit_cheat_step >= 0 else args.audit_inner_steps - 1
    return run_cheat_bench(REPO, node_toml, workdir, args.audit_train, args.audit_under.split(","), step,
                           args.audit_threads)


def merge_block(path: Path, key: str, block: dict, update: bool = False) -> None:
    """Write ``block`` as ``key`` of the JSON at ``path`` (``update``: into the block already there), the
    rest of the file as it is now."""
    from bench.benchio import scrub_paths

    result = json.loads(path.read_text()) if path.is_file() else {}
    result[key] = {**result.get(key, {}), **block} if update else block
    print(json.dumps(result[key], indent=1, default=str))
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(scrub_paths(json.dumps(result, indent=1, default=str)) + "\n")
    os.replace(temporary, path)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES,
                        help="comma-separated preset:optimizer[:versions], versions the kernel versions "
                             "(training.reproducible_kernels) timed, e.g. 12 (the default) or 2")
    parser.add_argument("--grid-cases", default="tiny:adamw,llama-tiny:muon",
                        help="the cases the children hash (two inner steps, batch 2)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timing-threads", type=int, default=1,
                        help="intra-op threads of the timings (1: steadier on a loaded machine)")
    parser.add_argument("--no-grid", action="store_true")
    parser.add_argument("--audit", action="store_true",
                        help="instead: a reproducible demo run trained under --audit-train and audited with "
                             "--reexecute all under each of --audit-under (bench/repro_audit.py), written "
                             "into --out's 'audit' block (the rest of the file kept)")
    parser.add_argument("--audit-full", action="store_true",
                        help="with --audit: the full-size demo (dlx-node demo's own preset, replicas, rounds "
                             "and inner steps, overriding --audit-preset and the others), into 'audit_full'")
    parser.add_argument("--audit-cheats", action="store_true",
                        help="the 1%% and the one-ulp cheat in one inner step, with the demo's settings, "
                             "trained under --audit-train and convicted under each of --audit-under "
                             "(bench/repro_cheats.py); alone: on the demo --audit-workdir holds")
    parser.add_argument("--audit-cheat-step", type=int, default=-1,
                        help="the cheats' inner step of round 0 (default: the round's last)")
    parser.add_argument("--audit-preset", default="tiny")
    parser.add_argument("--audit-replicas", type=int, default=2)
    parser.add_argument("--audit-rounds", type=int, default=3)
    parser.add_argument("--audit-inner-steps", type=int, default=8)
    parser.add_argument("--audit-threads", type=int, default=1)
    parser.add_argument("--audit-train", default="default", help="ATEN_CPU_CAPABILITY of the demo's training")
    parser.add_argument("--audit-under", default="default,native,avx2",
                        help="the audits' capabilities, the training one first (the same-platform time)")
    parser.add_argument("--audit-workdir", default="", help="keep the demo and audits here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    parse = lambda spec: [tuple(case.split(":")) for case in spec.split(",") if case]  # noqa: E731
    if args.child:
        run_child(parse(args.child), args.threads)
        return
    if args.audit or args.audit_cheats:
        write_audit(args)
        return
    load = list(os.getloadavg())
    import torch

    from training.config import ModelConfig

    torch.set_num_threads(args.timing_threads)
    timings = []
    for preset, optimizer, *versions in parse(args.cases):
        tokens = args.batch * ModelConfig(preset=preset).block_size
        kernels = [int(v) for v in (versions[0] if versions else "12")]
        (normal, *exacts), (normal_cpu, *exacts_cpu) = step_seconds(
            preset, optimizer, [(False, 1), *((True, v) for v in kernels)], args.batch, args.steps)
        row = {"preset": preset, "optimizer": optimizer, "batch": args.batch,
               "threads": torch.get_num_threads(), "normal_step_s": round(normal, 4),
               "normal_tokens_per_s": round(tokens / normal, 1), "normal_cpu_s": round(normal_cpu, 4)}
        for version, exact, exact_cpu in zip(kernels, exacts, exacts_cpu):
            tag = "reproducible" if version == 1 else f"reproducible_v{version}"  # version 1: the old keys
            suffix = "" if version == 1 else f"_v{version}"
            row.update({f"{tag}_step_s": round(exact, 4), f"{tag}_tokens_per_s": round(tokens / exact, 1),
                        f"slowdown{suffix}": round(exact / normal, 2), f"{tag}_cpu_s": round(exact_cpu, 4),
                        f"slowdown{suffix}_cpu": round(exact_cpu / normal_cpu, 2)})
        timings.append(row)
        print(timings[-1], flush=True)
    codec = []
    for encoder in ENCODERS:  # the codec's encode of training.exact_probe.codec_inputs: 3 rounds and 1
        seconds = {}
        for exact in (False, True):
            started = time.perf_counter()
            codec_bytes(encoder, exact)
            seconds[exact] = time.perf_counter() - started
        codec.append({"encoder": encoder, "normal_s": round(seconds[False], 3),
                      "reproducible_s": round(seconds[True], 3),
                      "slowdown": round(seconds[True] / seconds[False], 1)})
        print(codec[-1], flush=True)
    result = {"timings": timings, "codec": codec}
    if not args.no_grid:
        grid = []
        for capability, threads, cbwr in GRID:
            out = child_hashes(parse(args.grid_cases), capability, threads, cbwr)
            grid.append({"capability": out["capability"], "threads": threads, "mkl_cbwr": cbwr or None,
                         "hashes": out["hashes"]})
            print(grid[-1], flush=True)
        keys = grid[0]["hashes"]
        result["grid"] = grid
        result["identical_across_grid"] = {key: len({row["hashes"][key] for row in grid}) == 1
                                           for key in keys}
    print(json.dumps(result, indent=1))
    previous = Path(args.out)
    kept = json.loads(previous.read_text()) if previous.is_file() else {}
    # The blocks this run did not produce (the demo audit's, the grid's under --no-grid) stay as they were,
    # each with its own figures; "recorded" is this run's.
    write_result(args.out, {**{k: v for k, v in kept.items() if k not in result and k != "recorded"},
                            **result}, load)


if __name__ == "__main__":
    main(sys.argv[1:])
