"""Benchmark: what ``training.compile`` gives a replica's inner steps on this CPU (issue 42).

    PYTHONPATH=. .venv/bin/python bench/bench_compile_cpu.py     # bench/results/compile_cpu.json

For each preset (``--presets``, default tiny and mini) one replica (every stage in this process,
``LocalReplicaTrainer``) trains on the CPU in float32, eager and with ``training.compile = true``, on the
run's own data (``training.data.round_batches`` of a generated corpus): the first step's seconds (a compiled
trainer compiles its forward and backward there), then tokens/s over ``--steps`` timed steps after
``--warmup`` untimed ones (and per second of this process's CPU time, which a loaded machine moves less),
and whether eager and compiled losses agree to 1e-3 (they are not bit-equal:
another platform). The GPU's figures come from bench/bench_gpu.py (``--compile``) on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import write_result  # noqa: E402
from training.config import ModelConfig, TrainingConfig  # noqa: E402
from training.data import generated_corpus, round_batches  # noqa: E402
from training.fingerprint import fingerprint  # noqa: E402
from training.pipeline import LocalReplicaTrainer  # noqa: E402


def measure(preset: str, compile: bool, args: argparse.Namespace) -> dict:
    model = ModelConfig(preset=preset)
    training = TrainingConfig(batch_size=args.batch, device="cpu", compile=compile, warmup_steps=0)
    corpus = generated_corpus(seed=0,
                              n_bytes=max(200_000, 4 * args.batch * model.block_size * (args.steps + 1)))
    steps = 1 + args.warmup + args.steps
    batches = round_batches(corpus, training.seed, 0, 0, steps, args.batch, model.block_size)
    trainer = LocalReplicaTrainer(model, training)
    started, cpu_started = time.perf_counter(), time.process_time()
    losses = [trainer.train_step(*batches[0])]
    first_seconds, first_cpu = time.perf_counter() - started, time.process_time() - cpu_started
    for x, y in batches[1:1 + args.warmup]:
        losses.append(trainer.train_step(x, y))
    started, cpu_started = time.perf_counter(), time.process_time()
    for x, y in batches[1 + args.warmup:]:
        losses.append(trainer.train_step(x, y))
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = args.steps * args.batch * model.block_size
    row = {"preset": preset, "compiled": compile, "batch": args.batch, "seq_len": model.block_size,
           "first_step_seconds": first_seconds, "first_step_cpu_seconds": first_cpu,
           "timed_steps": args.steps, "seconds": seconds, "cpu_seconds": cpu_seconds,
           "tokens_per_second": tokens / seconds, "tokens_per_cpu_second": tokens / cpu_seconds,
           "losses": losses}
    print(f"{preset} {'compiled' if compile else 'eager   '}: first step {first_seconds:.1f} s "
          f"({first_cpu:.1f} s of CPU), {row['tokens_per_second']:,.0f} tokens/s, "
          f"{row['tokens_per_cpu_second']:,.0f} tokens per CPU second", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,mini")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "compile_cpu.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = list(os.getloadavg())
    rows = []
    for preset in args.presets.split(","):
        eager, compiled = measure(preset, False, args), measure(preset, True, args)
        largest = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
        rows += [eager, compiled]
        print(f"{preset}: compiled/eager tokens/s "
              f"x{compiled['tokens_per_second'] / eager['tokens_per_second']:.2f} (per CPU second "
              f"x{compiled['tokens_per_cpu_second'] / eager['tokens_per_cpu_second']:.2f}), largest loss "
              f"difference {largest:.2e}", flush=True)
        compiled["speedup"] = compiled["tokens_per_second"] / eager["tokens_per_second"]
        compiled["cpu_speedup"] = compiled["tokens_per_cpu_second"] / eager["tokens_per_cpu_second"]
        compiled["largest_loss_difference"] = largest
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "platform": fingerprint(torch.device("cpu"), "fp32", compiled=True).document(), "rows": rows}
    write_result(args.out, result, load)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
