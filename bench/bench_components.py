"""A node's own work per round, component by component, in CPU seconds: fitted at three sizes, checked at a
fourth (issue 75's calibrated model; docs/SCALE.md).

    nice -n 5 python bench/bench_components.py [--fit llama-tiny,llama-mini,llama-20m] \\
        [--check llama-mini-64,llama-124m] [--repeats 3]

bench/bench_scale_system.py measures the whole system at a size, but its figures are wall-clock shares of a
loaded 2-core machine running 4 nodes and a chain: a fit to them predicts the load as much as the model (its
check missed by up to 88%). This script measures each component of one node's round alone, in a fresh
child process per size and stage (``torch`` on one thread), as the CPU seconds of that thread
(``time.thread_time``, the minimum of ``--repeats``): what a node would pay on an idle core of this CPU.
The shapes are the system runs' (vocabulary 32,000, sequences of 128 tokens, batches of 2, 2 stages; a node
holds one stage, so each figure is the mean over the two stages):

- ``inner_step``: one forward, backward and AdamW step of the stage (stage 0's backward from a random
  output gradient, as the pipeline hands it down; stage 1's from the loss);
- ``encode``: the contribution of the stage (``StageEngine.encode_contribution``, the default codec and
  budget);
- ``apply``: decoding and aggregating two replicas' contributions and the outer Nesterov step
  (``StageEngine.apply_round``);
- ``weights_hash``: the stage's weights root (``StageEngine.weights_hash``);
- ``peak_rss``: the child's peak resident set once all of the above ran (bytes).

Each quantity is fitted as ``a + sum(b_i x_i)`` (least squares) over the ``--fit`` sizes, the ``x_i``
being :data:`X_OF`'s (the parameters the node holds; for the inner step those of its matrices; for the
codec also a cubic term), and predicted for the ``--check``
size, which is not fitted: the relative error is reported as it comes out (goal: within 20%). Writes
bench/results/components.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, least_cpu_seconds, peak_rss_bytes, write_result  # noqa: E402

VOCAB, SEQ, BATCH, STAGES = 32000, 128, 2, 2
QUANTITIES = ("inner_step", "encode", "apply", "weights_hash", "peak_rss")
#: What each quantity is fitted against: the inner step's FLOPs grow with the matrices' parameters (the
#: token embedding is a lookup); the codec's (encode, and the apply's decode) with every parameter
#: (quantization, residual) and with sum(numel x min(rows, columns)) over the matrices (the Gram matrix and
#: its eigendecomposition of the low-rank factorization: cubic in the width); the rest with every
#: parameter the node holds.
X_OF = {"inner_step": ("matmul_parameters",), "encode": ("parameters", "gram_flops"),
        "apply": ("parameters", "gram_flops")}
#: Sizes that are a preset with other settings (bench/bench_scale_system.py's ``--set``).
VARIANTS = {"llama-mini-64": ("llama-mini", {"n_embd": 64})}
GOAL = 0.20


def measure_stage(preset: str, stage: int, repeats: int) -> dict:
    """Every component of one stage of ``preset``, in this process."""
    import torch

    from training.compression import encode_contribution
    from training.config import DilocoConfig, ModelConfig, TrainingConfig
    from training.config_compression import CompressionConfig
    from training.model import lm_loss
    from training.pipeline import make_inner_optimizer
    from training.stage_engine import StageEngine
    from training.stages import StageModule, split_stages

    torch.set_num_threads(1)
    base, settings = VARIANTS.get(preset, (preset, {}))
    cfg = ModelConfig(preset=base, vocab_size=VOCAB, block_size=SEQ, **settings)
    module = StageModule(cfg, split_stages(cfg.n_layer, STAGES)[stage], seed=0)
    params = dict(module.named_parameters())
    optimizer = make_inner_optimizer(module, TrainingConfig(batch_size=BATCH))
    compression = CompressionConfig()
    engine = StageEngine(stage, params, DilocoConfig(num_replicas=2), compression)
    generator = torch.Generator().manual_seed(stage)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    hidden = torch.randn(BATCH, SEQ, cfg.n_embd, generator=generator)

    def inner_step() -> None:
        if stage == 0:
            out = module(tokens)
            out.backward(torch.ones_like(out) * 1e-3)
        else:
            lm_loss(module(hidden), tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    inner = least_cpu_seconds(inner_step, repeats, time.thread_time)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    other_tensors = {name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()}
    other = encode_contribution(other_tensors, compression, stage_index=stage, outer_round=0)[0]
    del other_tensors
    own: list[bytes] = []
    # Once each: the encoder keeps a memo, and an apply moves the outer state.
    encode = least_cpu_seconds(lambda: own.append(engine.encode_contribution(0)[0]), 1, time.thread_time)
    apply = least_cpu_seconds(lambda: engine.apply_round(0, [own[0], other]), 1, time.thread_time)
    weights_hash = least_cpu_seconds(engine.weights_hash, repeats, time.thread_time)
    matmul = sum(p.numel() for name, p in params.items() if p.dim() == 2 and "embed_tokens" not in name)
    gram = sum(p.numel() * min(p.shape) for p in params.values() if p.dim() == 2)
    return {"parameters": sum(p.numel() for p in params.values()), "matmul_parameters": matmul,
            "gram_flops": gram,
            "inner_step": inner, "encode": encode,
            "apply": apply, "weights_hash": weights_hash, "peak_rss": peak_rss_bytes()}


def measure_size(preset: str, repeats: int) -> dict:
    """Both stages of ``preset``, each in a fresh child (its own peak RSS); the node's mean."""
    stages = []
    for stage in range(STAGES):
        done = subprocess.run([sys.executable, __file__, "--child", preset, str(stage), str(repeats)],
                              capture_output=True, text=True, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            raise SystemExit(f"{preset} stage {stage}: child failed\n{done.stderr[-2000:]}")
        stages.append(json.loads(done.stdout.strip().splitlines()[-1]))
    node = {key: sum(s[key] for s in stages) / STAGES
            for key in ("parameters", "matmul_parameters", "gram_flops", *QUANTITIES)}
    return {"stages": stages, "node": node}


def xs_of(quantity: str) -> tuple[str, ...]:
    return X_OF.get(quantity, ("parameters",))


def fit(nodes: list[dict], quantity: str) -> dict:
    """Least squares ``q = a + sum(b_i x_i)`` over ``nodes`` (exact with as many sizes as terms)."""
    import numpy as np

    names = xs_of(quantity)
    design = np.array([[1.0, *(node[x] for x in names)] for node in nodes])
    target = np.array([node[quantity] for node in nodes])
    solution = np.linalg.lstsq(design, target, rcond=None)[0]
    return {"intercept": float(solution[0]), "slopes": dict(zip(names, map(float, solution[1:]))),
            "points": len(nodes)}


def predict(model: dict, node: dict) -> float:
    return model["intercept"] + sum(slope * node[x] for x, slope in model["slopes"].items())


def check(models: dict, node: dict) -> dict:
    out = {}
    for quantity, model in models.items():
        predicted, measured = predict(model, node), node[quantity]
        out[quantity] = {"predicted": predicted, "measured": measured,
                         "error": (predicted - measured) / measured if measured else None}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", default="llama-tiny,llama-mini,llama-20m")
    parser.add_argument("--check", default="llama-mini-64,llama-124m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    load = list(os.getloadavg())
    fit_sizes, check_sizes = args.fit.split(","), args.check.split(",")
    measured = {}
    for preset in [*fit_sizes, *check_sizes]:
        measured[preset] = measure_size(preset, args.repeats)
        print(preset, json.dumps(measured[preset]["node"]), flush=True)
    models = {q: fit([measured[p]["node"] for p in fit_sizes], q) for q in QUANTITIES}
    checks = {p: check(models, measured[p]["node"]) for p in check_sizes}
    worst = max(abs(c["error"]) for by in checks.values() for c in by.values() if c["error"] is not None)
    for preset, by in checks.items():
        for quantity, c in by.items():
            print(f"{preset:14s} {quantity:13s} predicted {c['predicted']:.4g} measured {c['measured']:.4g} "
                  f"error {c['error']:+.1%}")
    result = {"benchmark": "components", "shapes": {"vocab_size": VOCAB, "block_size": SEQ,
                                                     "batch_size": BATCH, "stages": STAGES},
              "fit_sizes": fit_sizes, "check_sizes": check_sizes, "repeats": args.repeats,
              "measured": measured, "model": models, "check": checks, "worst_error": worst,
              "goal": GOAL, "met": worst <= GOAL}
    print(f"worst error {worst:.1%} (goal {GOAL:.0%}): {'met' if worst <= GOAL else 'NOT met'}")
    write_result(args.out, result, load)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(measure_stage(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
        sys.exit(0)
    sys.exit(main())
