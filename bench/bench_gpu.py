"""Benchmark: GPU contributors (issue 32). One command per mode, one current JSON each.

    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py               # on a CUDA GPU: bench/results/gpu.json
    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py --smoke       # any device, tiny sizes: checks the plumbing
    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py --calibrate   # bench/results/gpu_calibration.json

The GPU run (refused without CUDA; ``--smoke`` runs the same code with tiny sizes
on whatever device there is and writes ``--out``, by default bench/results/gpu_smoke.json):

(a) throughput: tokens/s and MFU of one replica of ``llama-124m`` (all stages in one
    process) training in bf16 (and fp32, and bf16 with ``torch.compile``) on synthetic
    token ids; MFU = model FLOPs per token (6 N + 12 L T C: PaLM appendix B) x tokens/s
    over the GPU's dense bf16 peak;
(b) the node's share of a round: one real round of H inner steps, then what the node
    adds to it on the host: capturing and hashing the start state, the data commitment,
    the codec (prepare + encode), the exchange's bytes through the wire decoder of every
    contribution, and the outer step (aggregate + apply + weights hash);
(c) a 2-replica run on the one GPU (``dlx-node demo``'s local chain and node processes,
    ``training.device = "cuda"``, ``training.precision = "bf16"``) that must commit every
    round on chain.

The calibration (``--calibrate``; any machine, more with a GPU) measures what
:data:`training.platform.CROSS_PLATFORM_TOLERANCE` rests on: honest distances between
a contribution and its rerun (training.reexec.contribution_distance, the spot check's
metric) in float32 and bf16, several seeds: the rerun on the claimant's platform (must be
0), on another thread count, on every other device present (CPU <-> GPU), and in the
other precision; and the distance of the smallest cheat re-execution must catch (the
1% perturbation, training.reexec_sim.PerturbedReplica) rerun across platforms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform as host_platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.config import (  # noqa: E402
    PRECISIONS,
    CompressionConfig,
    DilocoConfig,
    ModelConfig,
    TrainingConfig,
)
from training.data import corpus_from_config  # noqa: E402
from training.platform import CROSS_PLATFORM_TOLERANCE, fingerprint, resolve_device  # noqa: E402
from training.reexec import contribution_distance, reexecute  # noqa: E402
from training.reexec_sim import PerturbedReplica, SimConfig, SimReplica, run_with_states  # noqa: E402
from training.replica_state import ReplicaStartState  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

#: Dense bf16 peak (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name(); --peak-tflops overrides.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0,
                    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0}


def environment(command: list[str]) -> dict:
    """What the JSON records about where it ran."""
    cuda = torch.cuda.is_available()
    return {
        "command": " ".join(shlex.quote(part) for part in command),
        "python": host_platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({fingerprint(torch.device('cpu'), 'fp32').device_name})",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


# ----------------------------------------------------------------------------- calibration


def _with_precision(state: ReplicaStartState, precision: str) -> ReplicaStartState:
    """The same start state, as if the claimant had trained in ``precision`` (the rerun follows the state)."""
    return ReplicaStartState(tuple(
        dataclasses.replace(part, meta=dataclasses.replace(
            part.meta, platform=dataclasses.replace(part.meta.platform, precision=precision)))
        for part in state.stages))


def _rerun_distance(record, replica, previous, sim: SimConfig, *, device: str, threads: int,
                    precision: str | None = None) -> tuple[float, float]:
    """(largest stage distance, seconds) of rerunning ``replica``'s round of ``record``."""
    state = record.states[replica]
    if precision is not None:
        state = _with_precision(state, precision)
    training = dataclasses.replace(sim.training, device=device)
    started = time.perf_counter()
    rerun = reexecute(state, sim.corpus, sim.model, training, sim.diloco, sim.compression,
                      previous_contributions=previous, threads=threads)
    specs = split_stages(sim.model.n_layer, sim.num_stages)
    distance = max(
        contribution_distance(claim.payload, rerun.payloads[claim.stage_index],
                              stage_param_shapes(sim.model, specs[claim.stage_index]),
                              stage_index=claim.stage_index, outer_round=record.outer_round)
        for claim in record.claims[replica])
    return distance, time.perf_counter() - started


def calibrate(args: argparse.Namespace) -> dict:
    """Honest and cheating rerun distances per precision (module docstring)."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    model = ModelConfig(preset=args.preset)
    rows = []
    for claimant_device in devices:
        for precision in PRECISIONS:
            for seed in range(args.seeds):
                training = TrainingConfig(seed=seed, batch_size=args.batch_size, warmup_steps=args.warmup_steps,
                                          device=claimant_device, precision=precision)
                corpus = corpus_from_config(training, model)
                sim = SimConfig(corpus, model, training, DilocoConfig(inner_steps=args.inner_steps, num_replicas=2),
                                CompressionConfig(), args.stages, args.rounds)
                torch.set_num_threads(1)  # claimants train on 1 thread; reruns on 1 (same) and 2 (other)
                started = time.perf_counter()
                records = run_with_states([SimReplica(0, sim), PerturbedReplica(1, sim)], sim)
                print(f"claimant {claimant_device} {precision} seed {seed}: {args.rounds} rounds in "
                      f"{time.perf_counter() - started:.0f}s", flush=True)
                for record in records:
                    previous = records[record.outer_round - 1].contributions if record.outer_round else None
                    reruns = [("same", claimant_device, 1, None), ("threads", claimant_device, 2, None)]
                    reruns += [("device", other, 1, None) for other in devices if other != claimant_device]
                    reruns.append(("precision", claimant_device, 1, "fp32" if precision == "bf16" else "bf16"))
                    for kind, device, threads, swapped in reruns:
                        for replica, role in ((0, "honest"), (1, "cheat")):
                            if role == "cheat" and kind in ("same", "precision"):
                                continue  # the cheat is judged across platforms (its worst case); "same" is exact
                            distance, seconds = _rerun_distance(record, replica, previous, sim, device=device,
                                                                threads=threads, precision=swapped)
                            rows.append({"claimant_device": claimant_device, "precision": precision, "seed": seed,
                                         "round": record.outer_round, "role": role, "rerun": kind,
                                         "rerun_device": device, "rerun_threads": threads,
                                         "rerun_precision": swapped or precision, "distance": distance,
                                         "seconds": seconds})
                            print(f"  round {record.outer_round} {role:<6} rerun {kind:<9} on {device} "
                                  f"{threads}t {swapped or precision}: {distance:.3g}", flush=True)
    summary = {}
    for precision in PRECISIONS:
        mine = [r for r in rows if r["precision"] == precision]

        def worst(role, kinds):
            values = [r["distance"] for r in mine if r["role"] == role and r["rerun"] in kinds]
            return max(values) if values else None

        cheats = [r["distance"] for r in mine if r["role"] == "cheat"]
        summary[precision] = {
            "same_platform_max": worst("honest", ("same",)),
            "other_threads_max": worst("honest", ("threads",)),
            "other_device_max": worst("honest", ("device",)),
            "other_precision_max": worst("honest", ("precision",)),
            "cheat_min": min(cheats) if cheats else None,
            "tolerance_in_force": CROSS_PLATFORM_TOLERANCE[precision],
        }
    return {"args": vars(args), "model_params": sum(math.prod(s) for s in _shapes(model)), "summary": summary,
            "rows": rows}


def _shapes(model: ModelConfig):
    for spec in split_stages(model.n_layer, 1):
        yield from stage_param_shapes(model, spec).values()


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny sizes on any device (CPU included)")
    mode.add_argument("--calibrate", action="store_true", help="rerun distances behind the cross-platform tolerance")
    parser.add_argument("--out", default="", help="the JSON to write (default: per mode, under bench/results/)")
    # calibration
    parser.add_argument("--preset", default="mini", help="calibration model (bench_reexec.py's)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=20)
    args = parser.parse_args(argv)
    for name in ("seeds", "rounds", "inner_steps", "stages", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = [sys.executable, *sys.argv] if argv is None else ["bench/bench_gpu.py", *argv]
    if args.calibrate:
        document = {"environment": environment(command), **calibrate(args)}
        write_json(Path(args.out or REPO / "bench/results/gpu_calibration.json"), document)
        print(json.dumps(document["summary"], indent=1))
        return 0
    raise SystemExit("not yet")


if __name__ == "__main__":
    sys.exit(main())
