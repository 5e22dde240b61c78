"""Benchmark: GPU contributors (issue 32). One command per mode, one current JSON each.

    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py             # on a CUDA GPU: bench/results/gpu.json
    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py --smoke     # any device, tiny sizes: checks the plumbing
    PYTHONPATH=. .venv/bin/python bench/bench_gpu.py --calibrate # bench/results/gpu_calibration.json
                                                                 # (bench/gpu_calibration.py)

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
:data:`training.fingerprint.CROSS_PLATFORM_TOLERANCE` rests on: honest distances between
a contribution and its rerun (training.reexec.contribution_distance, the spot check's
metric) in float32 and bf16, several seeds: the rerun on the claimant's platform (must be
0), on another thread count, on every other device present (CPU <-> GPU), and in the
other precision; and the distance of the smallest cheat re-execution must catch (the
1% perturbation, training.reexec_sim.PerturbedReplica) rerun across platforms.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform as host_platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from training.codec_wire import decode_contribution  # noqa: E402
from training.config import (  # noqa: E402
    DilocoConfig,
    ModelConfig,
    TrainingConfig,
)
from training.config_compression import CompressionConfig  # noqa: E402
from training.data import generated_corpus, round_batches  # noqa: E402
from training.fingerprint import fingerprint  # noqa: E402
from training.model import count_params  # noqa: E402
from training.pipeline import LocalReplicaTrainer  # noqa: E402
from training.platform import resolve_device  # noqa: E402
from training.reexec import data_commitment, round_meta  # noqa: E402
from training.replica_capture import capture_trainer_part, start_state_bytes  # noqa: E402
from training.stage_engine import StageEngine  # noqa: E402

#: Dense bf16 peak (TFLOP/s, no sparsity) by a substring of
#: torch.cuda.get_device_name(); --peak-tflops overrides.
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
        "device": torch.cuda.get_device_name(0) if cuda
            else f"cpu ({fingerprint(torch.device('cpu'), 'fp32').device_name})",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": _git_commit(),
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


from bench.gpu_calibration import calibrate, summarize_calibration  # noqa: E402

# ----------------------------------------------------------------------------- (a) throughput


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token: 6 N + 12 L T C (PaLM appendix B; nanoGPT's estimate_mfu), N every
    parameter."""
    return 6.0 * count_params(model) + 12.0 * model.n_layer * model.block_size * model.n_embd


def peak_tflops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops > 0:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(model: ModelConfig, device: str, precision: str, args: argparse.Namespace, *,
               compile_model: bool = False, batch: int | None = None, fused_adamw: bool = False) -> dict:
    """tokens/s (and MFU against the bf16 peak) of one replica, every stage in this process, on random ids.

    ``fused_adamw``: torch's one-kernel AdamW (``fused=True``) in place of the engine's (measured, not used by
    the node: its arithmetic differs from the default's)."""
    args = argparse.Namespace(**{**vars(args), "batch": batch or args.batch})
    training = TrainingConfig(batch_size=args.batch, device=device, precision=precision, warmup_steps=0,
                              compile=compile_model)  # the node's setting (training/compiled.py)
    trainer = LocalReplicaTrainer(model, training, num_stages=1)
    if fused_adamw:
        trainer.optimizers = [torch.optim.AdamW(o.param_groups, lr=training.inner_lr,
                                                betas=(training.beta1, training.beta2), fused=True)
                              for o in trainer.optimizers]
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, model.vocab_size, (args.batch, model.block_size), generator=generator),
                torch.randint(0, model.vocab_size, (args.batch, model.block_size), generator=generator))
               for _ in range(2)]
    started = time.perf_counter()
    for step in range(args.warmup):
        trainer.train_step(*batches[step % 2])
    _sync(trainer.device)
    warmup_seconds = time.perf_counter() - started
    started = time.perf_counter()
    losses = [trainer.train_step(*batches[step % 2]) for step in range(args.steps)]
    _sync(trainer.device)
    seconds = time.perf_counter() - started
    tokens = args.steps * args.batch * model.block_size
    tokens_per_second = tokens / seconds
    peak = peak_tflops(args, trainer.device)
    achieved = flops_per_token(model) * tokens_per_second / 1e12
    result = {"precision": precision, "compiled": compile_model, "fused_adamw": fused_adamw,
              "batch": args.batch, "seq_len": model.block_size, "steps": args.steps,
              "warmup_steps": args.warmup, "warmup_seconds": warmup_seconds, "seconds": seconds,
              "tokens_per_second": tokens_per_second, "achieved_tflops": achieved, "peak_tflops": peak,
              "mfu": achieved / peak if peak else None, "last_loss": losses[-1],
              "max_memory_gib": (torch.cuda.max_memory_allocated(trainer.device) / 2**30
                                 if trainer.device.type == "cuda" else None)}
    mfu = "n/a (no peak known)" if result["mfu"] is None else f"{result['mfu']:.1%}"
    print(f"(a) {precision}{' compiled' if compile_model else ''}{' fused AdamW' if fused_adamw else ''} "
          f"batch {args.batch}: {tokens_per_second:,.0f} tokens/s, "
          f"{achieved:.3g} TFLOP/s, MFU {mfu}", flush=True)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


# ---------------------------------------------------------------------------- (b) the node's share of a round


def round_share(model: ModelConfig, device: str, args: argparse.Namespace) -> dict:
    """One round of H inner steps in bf16, then each host-side part the node adds, timed (module
    docstring)."""
    training = TrainingConfig(batch_size=args.batch, device=device, precision="bf16", warmup_steps=0)
    diloco = DilocoConfig(inner_steps=args.inner_steps, num_replicas=2)
    compression = CompressionConfig()
    corpus = generated_corpus(seed=0, n_bytes=max(200_000, 4 * args.batch * model.block_size))
    trainer = LocalReplicaTrainer(model, training, num_stages=1)
    engines = [StageEngine(spec.index, dict(module.named_parameters()), diloco, compression)
               for spec, module in zip(trainer.specs, trainer.stage_modules)]
    batches = round_batches(corpus, training.seed, 0, 0, args.inner_steps, args.batch, model.block_size)
    trainer.train_step(*batches[0])  # warm the kernels; the round below starts from here
    _sync(trainer.device)

    # What the live node does each round (node/live/worker/contributor.py), timed part by part. On the
    # training thread (blocking): the copies of the start state's weights and optimizer state, the data
    # commitment, and the encode's first part (the weights to the host). On the node's other lanes,
    # overlapping the next round's training: the start state's serialisation and hash, the encode, the decode
    # of every contribution received, the outer step.
    blocking, lanes = {}, {}
    started = time.perf_counter()
    meta = round_meta(0, 0, model, diloco, run_rounds=0, num_stages=1)
    trainer_parts = [capture_trainer_part(m, o) for m, o in zip(trainer.stage_modules, trainer.optimizers)]
    blocking["start_state_copy"] = time.perf_counter() - started

    started = time.perf_counter()
    data_commitment(corpus, training, model, diloco, 0, 0)
    blocking["data_commitment"] = time.perf_counter() - started

    started = time.perf_counter()
    state_bytes = [start_state_bytes(meta, engine, part) for engine, part in zip(engines, trainer_parts)]
    state_hashes = [hashlib.sha256(data).digest() for data in state_bytes]
    lanes["start_state_serialise"] = time.perf_counter() - started
    # The pinned asynchronous copy is the plain copy, bit for bit.
    plain = [{f"param/{n}": p.detach().cpu().to(torch.float32) for n, p in m.named_parameters()}
             for m in trainer.stage_modules]
    copy_matches = all(torch.equal(part[name], value) for part, plain_part in zip(trainer_parts, plain)
                       for name, value in plain_part.items())
    del state_bytes

    started = time.perf_counter()
    for x, y in batches:
        trainer.train_step(x, y)
    _sync(trainer.device)
    train_seconds = time.perf_counter() - started

    started = time.perf_counter()
    for engine in engines:
        engine.prepare_encode(0)  # the part on the training thread: the weights to the host
    blocking["prepare_encode"] = time.perf_counter() - started
    started = time.perf_counter()
    payloads = [engine.encode_contribution(0)[0] for engine in engines]
    lanes["encode"] = time.perf_counter() - started

    started = time.perf_counter()
    for engine, payload in zip(engines, payloads):  # what a holder does with each other replica's bytes
        decode_contribution(payload, engine.shapes, stage_index=engine.stage_index, outer_round=0)
    lanes["exchange_decode"] = time.perf_counter() - started

    started = time.perf_counter()
    # M = 2: this contribution and (the same bytes as) another's
    for engine, payload in zip(engines, payloads):
        engine.finish_round(0, [payload, payload])
        engine.weights_hash()
    lanes["outer_step"] = time.perf_counter() - started

    blocking_seconds, lane_seconds = sum(blocking.values()), sum(lanes.values())
    tokens = args.inner_steps * args.batch * model.block_size
    result = {"inner_steps": args.inner_steps, "batch": args.batch, "tokens": tokens,
              "train_seconds": train_seconds, "tokens_per_second": tokens / train_seconds,
              "blocking": blocking, "lanes": lanes, "blocking_seconds": blocking_seconds,
              "lane_seconds": lane_seconds,
              # the goal's figure: what the node takes from the training thread
              "node_share": blocking_seconds / (train_seconds + blocking_seconds),
              "serial_share": (blocking_seconds + lane_seconds)
                  / (train_seconds + blocking_seconds + lane_seconds),
              "lanes_fit_in_round": lane_seconds <= train_seconds, "pinned_copy_matches": copy_matches,
              "payload_bytes": sum(len(p) for p in payloads), "state_stages": len(state_hashes),
              "note": "blocking: on the training thread; lanes: overlap the next round's training in a live "
                      "node (serial_share: as if nothing overlapped); parts timed one after another"}
    print(f"(b) round of H={args.inner_steps}: train {train_seconds:.2f}s, blocking {blocking_seconds:.2f}s "
          f"({result['node_share']:.1%} of the round), lanes {lane_seconds:.2f}s "
          f"({'fit' if result['lanes_fit_in_round'] else 'do NOT fit'} in the round; serial "
          f"{result['serial_share']:.1%}); " + ", ".join(f"{k} {v:.2f}s"
                                                         for k, v in {**blocking, **lanes}.items())
          + f"; pinned copy matches: {copy_matches}", flush=True)
    return result


# ---------------------------------------------------------------------------- (c) a run that commits on chain


def chain_run(args: argparse.Namespace, device: str) -> dict:
    """2 replicas (one node process each, every stage in it) on this machine's device, a local chain."""
    import tempfile

    from node.commands.demosummary import summarize
    from node.commands.launcher import LocalRun

    settings = [f"model.preset={args.chain_preset}", f"rounds={args.chain_rounds}",
                f"diloco.inner_steps={args.chain_inner_steps}", f"training.device={device}",
                "training.precision=bf16", "round_timeout=600", f"training.batch_size={args.chain_batch}"]
    workdir = Path(tempfile.mkdtemp(prefix="dlx-gpu-run-"))
    run = LocalRun(workdir, replicas=2, stages=1, split=False, settings=settings)
    started = time.perf_counter()
    try:
        run.setup()
        run.start()
        ok = run.wait(args.chain_timeout)
        seconds = time.perf_counter() - started
        summary = summarize(run)
    finally:
        run.stop()
    rounds = summary["rounds"]
    result = {"settings": settings, "ok": ok, "seconds": seconds, "rounds_committed": len(rounds),
              "rounds_expected": args.chain_rounds, "weights_roots": [r["weights_root"] for r in rounds],
              "eval_loss": [r["eval_loss"] for r in rounds], "disputes": summary["disputes"],
              "workdir": str(workdir)}
    print(
        f"(c) 2 replicas on {device}: {len(rounds)}/{args.chain_rounds} rounds committed in {seconds:.0f}s, "
        f"exit ok={ok}", flush=True)
    return result


class Measured(dict):
    """The throughput rows, the document written again (marked partial) as each lands: a lease's time limit
    that cuts the script short keeps what it measured."""

    def __init__(self, save) -> None:
        super().__init__()
        self.save = save

    def __setitem__(self, name: str, row: dict) -> None:
        super().__setitem__(name, row)
        self.save()


def perf(args: argparse.Namespace, save=lambda out: None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        model = ModelConfig(preset="llama-tiny", vocab_size=256)
    else:
        model = ModelConfig(preset=args.preset_gpu, vocab_size=args.vocab_size)
    out = {"smoke": args.smoke, "model": {"preset": model.preset, "vocab_size": model.vocab_size,
                                          "params": count_params(model),
                                          "flops_per_token": flops_per_token(model)},
           "training_device": device, "platform": fingerprint(resolve_device(device), "bf16").document()}
    out["throughput"] = Measured(lambda: save({**out, "partial": "cut short before its end"}))
    out["throughput"]["bf16"] = throughput(model, device, "bf16", args)
    if args.throughput_only:  # (a) in bf16 alone (and compiled): a lease's check at a larger size
        if args.compile:
            out["throughput"]["bf16_compiled"] = throughput(model, device, "bf16", args, compile_model=True)
        best = max(out["throughput"], key=lambda name: out["throughput"][name]["tokens_per_second"])
        out["goals"] = {"mfu_bf16": out["throughput"]["bf16"]["mfu"],
                        "mfu_best": out["throughput"][best]["mfu"], "mfu_best_setting": best}
        return out
    out["throughput"]["fp32"] = throughput(model, device, "fp32", args)
    if args.compile:
        out["throughput"]["bf16_compiled"] = throughput(model, device, "bf16", args, compile_model=True)
    out["throughput"]["bf16_fused_adamw"] = throughput(model, device, "bf16", args, fused_adamw=True)
    for batch in args.sweep_batches:
        out["throughput"][f"bf16_b{batch}"] = throughput(model, device, "bf16", args, batch=batch)
        if args.compile:
            out["throughput"][f"bf16_compiled_b{batch}"] = throughput(model, device, "bf16", args,
                                                                      batch=batch, compile_model=True)
    # Twice: the first round pays for the pinned host buffers the start state and encode copies land in (a
    # node pays it once); the second reuses them (torch's caching host allocator), as every later round does.
    out["round_share_first"] = round_share(model, device, args)
    out["round_share"] = round_share(model, device, args)
    if not args.skip_chain:
        out["chain_run"] = chain_run(args, device)
    best = max((name for name in out["throughput"] if name.startswith("bf16")),
               key=lambda name: out["throughput"][name]["tokens_per_second"])
    out["goals"] = {"mfu_bf16": out["throughput"]["bf16"]["mfu"], "mfu_best": out["throughput"][best]["mfu"],
                    "mfu_best_setting": best, "mfu_goal": 0.40,
                    "node_share": out["round_share"]["node_share"], "node_share_goal": 0.03}
    return out

# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny sizes on any device (CPU included)")
    mode.add_argument("--calibrate", action="store_true",
                      help="rerun distances behind the cross-platform tolerance")
    mode.add_argument("--resummarize", action="store_true",
                      help="recompute the calibration summary of --out (default gpu_calibration.json) from "
                           "its stored rows under today's rule; runs nothing")
    parser.add_argument("--out", default="",
                        help="the JSON to write (default: per mode, under bench/results/)")
    # the GPU run (--smoke: tiny sizes)
    parser.add_argument("--preset-gpu", default="llama-124m", help="model of the GPU run")
    parser.add_argument("--vocab-size", type=int, default=32000, help="the GPU run's vocabulary (random ids)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per inner step")
    parser.add_argument("--steps", type=int, default=30, help="timed inner steps of (a)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed inner steps before them")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure bf16 with torch.compile")
    parser.add_argument("--sweep-batches", default="",
                        help="comma-separated further batch sizes of (a) in bf16 (eager, and "
                             "compiled with --compile)")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="dense bf16 peak for MFU (0: by GPU name)")
    parser.add_argument("--throughput-only", action="store_true",
                        help="(a) in bf16 only (with --compile, compiled too): no fp32, (b) or (c)")
    parser.add_argument("--skip-chain", action="store_true", help="leave out (c), the run on a local chain")
    parser.add_argument("--chain-preset", default="llama-20m")
    parser.add_argument("--chain-rounds", type=int, default=3)
    parser.add_argument("--chain-inner-steps", type=int, default=50)
    parser.add_argument("--chain-batch", type=int, default=16)
    parser.add_argument("--chain-timeout", type=float, default=1800.0)
    # calibration
    parser.add_argument("--preset", default="mini", help="calibration model (bench_reexec.py's)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="H: of the calibration runs (default 20) or of (b)'s round "
                             "(default 100; smoke 4)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--min-compress-numel", type=int, default=CompressionConfig().min_compress_numel,
                        help="smaller tensors are only quantized (512 gives the tiny model "
                             "low-rank codings too)")
    args = parser.parse_args(argv)
    if args.inner_steps is None:
        args.inner_steps = 20 if args.calibrate else 4 if args.smoke else 100
    try:
        args.sweep_batches = [int(b) for b in args.sweep_batches.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--sweep-batches={args.sweep_batches!r}: comma-separated integers")
    if any(b < 1 for b in args.sweep_batches):
        parser.error(f"--sweep-batches={args.sweep_batches}: each must be >= 1")
    if args.smoke:  # tiny everything: the plumbing, on any device
        args.batch, args.steps, args.warmup, args.compile = 4, 3, 1, False
        args.chain_preset, args.chain_rounds, args.chain_inner_steps, args.chain_batch = "tiny", 2, 3, 4
    for name in ("seeds", "rounds", "inner_steps", "stages", "batch_size", "batch", "steps", "chain_rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = [sys.executable, *sys.argv] if argv is None else ["bench/bench_gpu.py", *argv]
    if args.resummarize:
        path = Path(args.out or REPO / "bench/results/gpu_calibration.json")
        stored = json.loads(path.read_text())
        document = {**stored, "summary": summarize_calibration(stored["rows"]),
                    "resummarized": ("summary recomputed from the stored rows under today's rule "
                                     f"({' '.join(command)})")}
        write_json(path, document)
        print(json.dumps(document["summary"], indent=1))
        return 0
    if args.calibrate:
        document = {"environment": environment(command), **calibrate(args)}
        write_json(Path(args.out or REPO / "bench/results/gpu_calibration.json"), document)
        print(json.dumps(document["summary"], indent=1))
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("bench/bench_gpu.py needs a CUDA GPU (torch.cuda.is_available() is false here; torch "
              f"{torch.__version__}). Run it on a GPU machine, or pass --smoke for tiny "
              "sizes on this device, "
              "or --calibrate for the rerun distances.", file=sys.stderr)
        return 2
    default = "bench/results/gpu_smoke.json" if args.smoke else "bench/results/gpu.json"
    path, environ = Path(args.out or REPO / default), environment(command)
    document = {"environment": environ, **perf(args, lambda partial: write_json(path, {"environment": environ,
                                                                                     **partial}))}
    write_json(path, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
