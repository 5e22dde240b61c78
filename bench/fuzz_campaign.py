"""Bad input at scale: a mutation fuzzer over every decoder a peer, a file or the chain reaches (issue 15,
item 5).

Each target of ``tests/fuzz_targets.py`` is one decoder as the node calls it on untrusted bytes,
with its defined error set. The campaign feeds each target inputs made from its valid seeds
(random bytes, byte mutations: bit flips, boundary bytes, truncations, insertions, splices; and
structured ones: valid msgpack/JSON/TOML with values of the wrong type, size or range, envelopes
re-signed around a mutated payload), in-process, and counts the outcome of every input: success,
each defined error class, or **unexpected** (any other exception). It also times every input
and, for one input in ``--memory-every``, traces the memory the decoder allocated (tracemalloc).

It prints a table and writes ``bench/results/fuzz.json``; it exits 1 if any input raised an
unexpected exception, took longer than ``--max-seconds``, or allocated more than
``--max-alloc-mib`` (one input per distinct crash site is saved under ``--crash-dir``), and 2 if
fewer than ``--inputs`` inputs ran. ``--seconds`` gives every target the same time instead of
the same number of inputs (the fast decoders then take most of the inputs).

    nice -n 10 python bench/fuzz_campaign.py --inputs 1000000
    nice -n 10 python bench/fuzz_campaign.py --inputs 1000000 --seconds 1500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fuzz_targets import random_input, targets  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def run_target(target, count: int, seed: int, max_seconds: float, max_alloc: int, memory_every: int,
               crash_dir: Path, time_box: float = 0.0) -> dict:
    """Feed ``target`` ``count`` inputs, or (``time_box`` > 0) as many as fit in ``time_box`` seconds."""
    rng = random.Random(f"{seed}:{target.name}")
    outcomes: Counter[str] = Counter()
    unexpected: list[dict] = []
    seen_unexpected: set[str] = set()
    slow: list[dict] = []
    heavy: list[dict] = []
    slowest = 0.0
    peak_alloc = 0
    peak_ratio = 0.0
    started = time.perf_counter()
    index = 0
    while (index < count) if not time_box else (index % 64 or time.perf_counter() - started < time_box):
        index += 1
        data = random_input(rng, target)
        traced = memory_every and index % memory_every == 1
        if traced:
            tracemalloc.start()
        t0 = time.perf_counter()
        try:
            target.decode(data)
            outcomes["ok"] += 1
        except target.errors as exc:
            outcomes[type(exc).__name__] += 1
        except Exception as exc:  # noqa: BLE001 - counting exactly these is the point
            outcomes["UNEXPECTED"] += 1
            where = _raised_at(exc)
            if where not in seen_unexpected and len(unexpected) < 20:  # one example per distinct crash site
                seen_unexpected.add(where)
                unexpected.append({"error": f"{type(exc).__name__}: {str(exc)[:200]}", "at": where,
                                   "size": len(data),
                                   "file": _save(crash_dir, target.name, "crash", len(unexpected), data)})
        elapsed = time.perf_counter() - t0
        if traced:
            _current, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            peak_alloc = max(peak_alloc, peak)
            if len(data) >= 4096:  # below that, fixed costs (tracebacks, imports' caches) dominate the ratio
                peak_ratio = max(peak_ratio, peak / len(data))
            if peak > max_alloc and len(heavy) < 10:
                heavy.append({"alloc_bytes": peak, "size": len(data),
                              "file": _save(crash_dir, target.name, "alloc", len(heavy), data)})
        slowest = max(slowest, elapsed)
        if elapsed > max_seconds and len(slow) < 10:
            slow.append({"seconds": round(elapsed, 3), "size": len(data),
                         "file": _save(crash_dir, target.name, "slow", len(slow), data)})
    wall = time.perf_counter() - started
    return {
        "inputs": index,
        "seconds": round(wall, 2),
        "inputs_per_second": round(index / wall, 1),
        "outcomes": dict(sorted(outcomes.items())),
        "unexpected": unexpected,
        "slowest_input_s": round(slowest, 4),
        "over_time_bound": slow,
        "traced_peak_alloc_bytes": peak_alloc,
        "traced_peak_alloc_per_input_byte_4k_plus": round(peak_ratio, 1),
        "over_alloc_bound": heavy,
        "defined_errors": [e.__name__ for e in target.errors],
    }


def _raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the project's own code that the exception passed."""
    frame, where = exc.__traceback__, "?"
    while frame is not None:
        path = frame.tb_frame.f_code.co_filename
        if str(ROOT) in path and "/tests/" not in path and "/bench/" not in path:
            where = f"{os.path.relpath(path, ROOT)}:{frame.tb_lineno}"
        frame = frame.tb_next
    return f"{type(exc).__name__} at {where}"


def _save(crash_dir: Path, name: str, kind: str, index: int, data: bytes) -> str:
    crash_dir.mkdir(parents=True, exist_ok=True)
    path = crash_dir / f"{name}-{kind}-{index}.bin"
    path.write_bytes(data)
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=1_000_000,
                        help="inputs in total: split evenly over the targets, or (with "
                             "--seconds) the minimum")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="time budget split evenly over the targets (fast decoders then get more inputs)")
    parser.add_argument("--only", default="", help="comma list of target names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=2.0, help="per-input time bound")
    parser.add_argument("--max-alloc-mib", type=float, default=64.0, help="per-input traced allocation bound")
    parser.add_argument("--memory-every", type=int, default=100, help="trace allocations of one input in N")
    parser.add_argument("--crash-dir", default="/tmp/dlx-fuzz-crashes",
                        help="where inputs that raised an unexpected exception are saved")
    parser.add_argument("--out", default=str(RESULTS / "fuzz.json"))
    args = parser.parse_args()

    chosen = [t for t in targets() if not args.only or t.name in args.only.split(",")]
    per_target = max(1, args.inputs // len(chosen))
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report: dict = {}
    failed = False
    started = time.perf_counter()
    print(f"{'target':26s} {'inputs':>9s} {'inputs/s':>9s} {'slowest':>8s} {'peakKiB':>8s}  outcomes",
          flush=True)
    for target in chosen:
        result = run_target(target, per_target, args.seed, args.max_seconds, int(args.max_alloc_mib * 2**20),
                            args.memory_every, Path(args.crash_dir), args.seconds / len(chosen))
        report[target.name] = result
        bad = result["unexpected"] or result["over_time_bound"] or result["over_alloc_bound"]
        failed = failed or bool(bad)
        outcomes = ", ".join(f"{k} {v}" for k, v in result["outcomes"].items())
        print(f"{target.name:26s} {result['inputs']:>9d} {result['inputs_per_second']:>9.0f} "
              f"{result['slowest_input_s']:>8.3f} "
              f"{result['traced_peak_alloc_bytes'] / 1024:>8.0f}  {outcomes}",
              flush=True)
        for item in result["unexpected"][:3] + result["over_time_bound"][:3] + result["over_alloc_bound"][:3]:
            print(f"    !! {item}", flush=True)
    wall = time.perf_counter() - started
    total = sum(r["inputs"] for r in report.values())
    summary = {
        "command": "python " + " ".join(sys.argv),
        "inputs": total,
        "input_target": args.inputs,
        "seconds": round(wall, 1),
        "inputs_per_second": round(total / wall, 1),
        "unexpected": sum(r["outcomes"].get("UNEXPECTED", 0) for r in report.values()),
        "over_time_bound": sum(len(r["over_time_bound"]) for r in report.values()),
        "over_alloc_bound": sum(len(r["over_alloc_bound"]) for r in report.values()),
        "max_seconds": args.max_seconds,
        "max_alloc_mib": args.max_alloc_mib,
        "memory_every": args.memory_every,
        "max_rss_growth_mib": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_start) / 1024,
                                    1),
        "loadavg": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "targets": report,
    }
    print(f"{total} inputs in {wall:.0f} s ({total / wall:.0f}/s); unexpected {summary['unexpected']}, "
          f"over the time bound {summary['over_time_bound']}, over the allocation bound "
          f"{summary['over_alloc_bound']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out}")
    if failed:
        return 1
    if total < args.inputs:
        print(f"only {total} inputs, fewer than --inputs {args.inputs}: give it more --seconds")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
