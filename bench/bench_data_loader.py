"""Benchmark: the prepared-dataset loader's resident memory and throughput (issue 31, "Scale of data").

Generates two token datasets of the given sizes on disk (random uint16 ids of an 8192-token vocabulary,
16 M-token shards; ``training.shards.ShardWriter``), then, in a fresh process per dataset (so each RSS is
that dataset's alone), does what a training node does with it:

1. opens it (``open_dataset``: every shard's size, header, sha256 and largest id checked);
2. builds a ``llama-20m`` replica (LocalReplicaTrainer: weights, AdamW) and trains ``--train-steps`` inner
   steps on the dataset's round batches (batch 8 x 256 tokens, the preset's context), timing each step:
   what the model consumes;
3. reads ``--rounds`` whole rounds of batches (H = 50 steps each, ``round_batches``: the offsets from
   (seed, replica, round, step, row), the windows by memory map), timing them: what the loader delivers;
4. records VmRSS (and its anonymous / file-backed parts) after each phase and the peak VmHWM.

The same loader loop is then run once more on the large dataset without releasing the pages it read
(``--keep-pages`` variant, loader only) to show what the release in ``ShardedTokens._release`` buys.
Writes ``bench/results/data_loader.json`` (the one current result; history is in git).

    PYTHONPATH=. .venv/bin/python bench/bench_data_loader.py                      # 10MB and 2GB, ~5 min
    PYTHONPATH=. .venv/bin/python bench/bench_data_loader.py --sizes 10MB,200MB --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VOCAB = 8192
SHARD_TOKENS = 1 << 24
PRESET = "llama-20m"
BATCH = 8
H = 50


def parse_size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def generate(directory: Path, size_bytes: int, seed: int = 0) -> dict:
    """A dataset of ``size_bytes`` of uint16 ids (random, below VOCAB)."""
    import numpy as np

    from training.shards import ShardWriter

    directory.mkdir(parents=True)
    tokens = size_bytes // 2
    rng = np.random.default_rng(seed)
    writer = ShardWriter(directory, VOCAB, SHARD_TOKENS)
    started = time.perf_counter()
    written = 0
    while written < tokens:
        count = min(SHARD_TOKENS, tokens - written)
        writer.append(rng.integers(0, VOCAB, count, dtype=np.uint16))
        written += count
    manifest = writer.finish("bytes" if VOCAB == 256 else "sha256:" + "0" * 64, tokens - tokens // 100)
    return {"tokens": manifest.num_tokens, "shards": len(manifest.shards), "bytes_on_disk": sum(
        p.stat().st_size for p in directory.iterdir()), "write_s": round(time.perf_counter() - started, 2)}


def memory() -> dict:
    """This process's resident memory (MiB) from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


def measure(directory: str, rounds: int, train_steps: int, release: bool) -> dict:
    """Phases 1-4 in this process (run as a child)."""
    import torch

    from training.config import ModelConfig, TrainingConfig
    from training.data import round_batches
    from training.pipeline import LocalReplicaTrainer
    from training.sharded_corpus import open_dataset

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    result = {"start": memory()}
    started = time.perf_counter()
    corpus = open_dataset(directory, release_pages=release)
    result["open_verify_s"] = round(time.perf_counter() - started, 2)
    result["after_open"] = memory()
    model_cfg = ModelConfig(preset=PRESET, vocab_size=VOCAB)
    block = model_cfg.block_size
    if train_steps:
        trainer = LocalReplicaTrainer(model_cfg, TrainingConfig(batch_size=BATCH), num_stages=1)
        batches = round_batches(corpus, 0, 0, 0, train_steps + 1, BATCH, block)
        trainer.train_step(*batches[0])  # warm-up (allocations, kernels)
        started = time.perf_counter()
        for x, y in batches[1:]:
            trainer.train_step(x, y)
        step_s = (time.perf_counter() - started) / train_steps
        result["train_step_s"] = round(step_s, 4)
        result["train_tokens_per_s"] = round(BATCH * block / step_s)
        result["after_training"] = memory()
    started = time.perf_counter()
    windows = 0
    for outer_round in range(rounds):
        for x, _ in round_batches(corpus, 0, outer_round % 4, outer_round, H, BATCH, block):
            windows += x.shape[0]
    elapsed = time.perf_counter() - started
    result["loader_batches_per_s"] = round(rounds * H / elapsed, 1)
    result["loader_tokens_per_s"] = round(windows * block / elapsed)
    result["loader_windows"] = windows
    result["after_loading"] = memory()
    return result


def run_child(directory: Path, rounds: int, train_steps: int, release: bool) -> dict:
    command = [sys.executable, __file__, "--child", str(directory), "--rounds", str(rounds), "--train-steps",
               str(train_steps)] + ([] if release else ["--keep-pages"])
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"measuring {directory} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10MB,2GB", help="dataset sizes (bytes of token ids on disk)")
    parser.add_argument("--rounds", type=int, default=40,
                        help="rounds of batches the loader reads (H = 50 each)")
    parser.add_argument("--train-steps", type=int, default=5, help="llama-20m inner steps timed")
    parser.add_argument("--workdir", default="", help="where to generate the datasets (default: a temp dir)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "data_loader.json"))
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # measure this dataset, print JSON
    parser.add_argument("--keep-pages", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.train_steps, release=not args.keep_pages)))
        return

    from training.config import ModelConfig
    from training.model import count_params

    work = Path(args.workdir or tempfile.mkdtemp(prefix="dlx-loader-bench-"))
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    out = {
        "what": ("prepared-dataset loader: resident memory per dataset size, batches delivered "
                 "vs llama-20m consumed"),
        "command": "PYTHONPATH=. python bench/bench_data_loader.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "model": {"preset": PRESET, "vocab_size": VOCAB, "params": count_params(ModelConfig(preset=PRESET,
                  vocab_size=VOCAB)), "batch_size": BATCH,
                  "block_size": ModelConfig(preset=PRESET).block_size},
        "rounds_read": args.rounds, "inner_steps": H, "datasets": {},
    }
    try:
        for size in sizes:
            directory = work / size
            info = generate(directory, parse_size(size))
            print(f"{size}: {info['tokens']:,} tokens in {info['shards']} shards "
                  f"({info['write_s']} s to write)",
                  flush=True)
            info.update(run_child(directory, args.rounds, args.train_steps, release=True))
            out["datasets"][size] = info
            print(json.dumps(info, indent=1), flush=True)
        largest = sizes[-1]
        out["without_page_release"] = {largest: run_child(work / largest, args.rounds, 0, release=False)}
        print("without page release:", json.dumps(out["without_page_release"], indent=1), flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    small, large = out["datasets"][sizes[0]], out["datasets"][sizes[-1]]
    out["summary"] = {
        "rss_after_loading_mib": {size: d["after_loading"]["VmRSS"] for size, d in out["datasets"].items()},
        "peak_rss_mib": {size: d["after_loading"]["VmHWM"] for size, d in out["datasets"].items()},
        "rss_difference_mib": round(large["after_loading"]["VmRSS"] - small["after_loading"]["VmRSS"], 1),
        "peak_difference_mib": round(large["after_loading"]["VmHWM"] - small["after_loading"]["VmHWM"], 1),
        "loader_over_training_speed": round(large["loader_tokens_per_s"] / large["train_tokens_per_s"], 1),
    }
    print(json.dumps(out["summary"], indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
