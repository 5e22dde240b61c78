"""A real model's first inner step as a step program: its size and the contribution game's bound (issue 78).

For each preset: the first reproducible inner step (kernel version 3, AdamW with the clip, batch 2 rows of
the block size) compiled to a program of element-level ops (training/step_compile.py), the program run with
``run_op`` from the step's start and its end compared bit for bit with a trainer that took the same step
untraced; then the count table (training/step_ops.py ``counts``): ops per kind, output elements, the trace
tree's depth, the ops whose kind no contract computes yet (kinds >= 16), the constant tables, the widest inner
game (``k``: an on-chain product's or tree sum's, and any op's), and the bisection's halvings
``ceil(log2 H) + ceil(log2 ops) + ceil(log2 k)`` for H inner steps, with the moves estimated as two a halving
plus the toy's measured constant (bench/bench_step_proof.py ``steps_level``: 27 moves for 12 halvings).
Writes bench/results/step_compile.json.

    .venv/bin/python bench/bench_step_compile.py                          # mini and llama-20m
    .venv/bin/python bench/bench_step_compile.py --models llama-tiny      # one
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.benchio import default_out, write_result  # noqa: E402
from training.exact_probe import trainer_for  # noqa: E402
from training.step_compile import compile_step  # noqa: E402
from training.step_ops import counts, run_program  # noqa: E402
from training.step_trace import state_tensors  # noqa: E402

BATCH = 2
STEPS = (20, 100, 500)
#: The toy's game (bench_step_proof.py steps_level): 27 moves for 7 + 3 + 2 halvings.
MOVES_CONSTANT = 3


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).numpy().tobytes()


def model_case(preset: str) -> dict:
    cfg, trainer = trainer_for(preset, "adamw", True, BATCH, 3)
    generator = torch.Generator().manual_seed(7)
    batch = torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=generator)
    began = time.perf_counter()
    compiled = compile_step(trainer, batch)
    compile_s = time.perf_counter() - began
    del trainer
    began = time.perf_counter()
    tensors = run_program(compiled.program, compiled.start, batch, keep_all=False)
    run_s = time.perf_counter() - began
    end = [tensors[q] for q in compiled.program.copies]
    loss_bits = _bits(tensors[compiled.program.loss])
    del tensors
    _, reference = trainer_for(preset, "adamw", True, BATCH, 3)
    loss = reference.train_step(batch[:, :-1], batch[:, 1:])
    same = all(_bits(t) == _bits(want) for t, (_, want) in zip(end, state_tensors(reference), strict=True))
    same_loss = loss_bits == _bits(torch.tensor([loss], dtype=torch.float32))
    table = {str(h): counts(compiled.program, h)["halvings"] for h in STEPS}
    out = counts(compiled.program, STEPS[1])
    out.pop("steps")
    out["halvings"] = table
    out["moves_estimate"] = {h: {k: 2 * v + MOVES_CONSTANT for k, v in halvings.items()}
                             for h, halvings in table.items()}
    out.update({"parameters": sum(p.numel() for p in reference.stage_modules[0].parameters()),
                "vocab_size": cfg.vocab_size, "block_size": cfg.block_size, "batch_rows": BATCH,
                "end_state_bits_equal": same, "loss_bits_equal": same_loss,
                "compile_seconds": round(compile_s, 1), "run_seconds": round(run_s, 1),
                "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mini", "llama-20m"])
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    load = list(os.getloadavg())
    result: dict = {"kernel_version": 3, "batch_rows": BATCH, "moves_constant": MOVES_CONSTANT, "models": {}}
    for preset in args.models:
        result["models"][preset] = model_case(preset)
        print(preset, result["models"][preset], flush=True)
    write_result(args.out, result, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
