"""Benchmark: centralized training (DDP) vs synchronous DiLoCo vs DiLoCoX on tinyshakespeare.

Same model, same seeds, same tokens, same inner-lr schedule for the three modes
(see training/simulate.py). Prints a table (with nanoGPT's reference for the
same token budget) and writes bench/results/diloco.json (``--out`` elsewhere; the
one current result, history in git), including each mode's loss-vs-bytes curve. Goals of issue 14: DDP <= 1.80
held-out at 1,536,000 tokens; DiLoCoX within 2% of it with >= 1000x fewer bytes
than fp32 ring AllReduce; synchronous DiLoCo within 1%.

The defaults are the measured best settings and the node's defaults (docs/DILOCOX.md
section 9; the overlap and the byte budget in their "auto" form, resolved values in the JSON):

    .venv/bin/python bench/bench_diloco.py --cpu-clock    # 1,536,000 tokens: H=50 x 30 rounds, M=2, S=2

Ablations and other settings go elsewhere with ``--out /tmp/x.json``; bench/diloco_ablations.py
collects such runs into its table. The default encoder is the node's
(training.config.DEFAULT_ENCODER, v4 since issue 29); runs before issue 29 in git history used
v1 or v2 (``--encoder`` reproduces them).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import RESULTS, default_corpus, write_result  # noqa: E402
from training.config import (  # noqa: E402
    DEFAULT_ENCODER,
    DELAY_CORRECTIONS,
    INNER_OPTIMIZERS,
    OUTER_DECAYS,
    DilocoConfig,
    EncoderVersion,
    ModelConfig,
    PipelineConfig,
    TrainingConfig,
)
from bench.convergence_cases import CASES  # noqa: E402
from training.config_compression import CompressionConfig, QuantScale  # noqa: E402
from training.data import corpus_from_config, load_corpus  # noqa: E402
from training.model import count_params  # noqa: E402
from training.sharded_corpus import is_dataset  # noqa: E402
from training.simulate import MODES, simulate  # noqa: E402
from training.simulate_records import set_clock  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

# nanoGPT's CPU "baby" configuration on tinyshakespeare (same model shape as `mini`, same
# 1,536,000 training tokens; its README): held-out loss on its own val split.
NANOGPT_BABY_VAL = 1.886


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="corpus, relative to the repository root (default: tinyshakespeare as "
                             "'dlx-node data fetch tinyshakespeare' keeps it, fetched if missing)")
    parser.add_argument("--preset", default="mini", help="a model preset, e.g. mini or llama-20m")
    parser.add_argument("--case", default=None, choices=list(CASES),
                        help="a model case of the convergence benchmarks (bench/convergence_cases.py: "
                             "its preset, shape and per-replica batch, in place of --preset and "
                             "--batch-size): the model bench_convergence_ablation.py trains, e.g. llama-l")
    parser.add_argument("--family", default=None, choices=["gpt2", "llama"],
                        help="check the preset's family (llama presets are llama-*)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="model.tokenizer: bytes, or a tokenizers JSON file (a prepared dataset's "
                             "tokenizer.json: dlx-node data prepare --train-tokenizer)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="model.vocab_size (default: the preset's)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=50, help="H")
    parser.add_argument("--rounds", type=int, default=30, help="outer rounds; tokens = rounds*H*batch*block")
    parser.add_argument("--batch-size", type=int, default=8, help="per replica")
    parser.add_argument("--optimizer", default=TrainingConfig.optimizer, choices=list(INNER_OPTIMIZERS),
                        help="training.optimizer, the inner optimizer of every mode (muon: docs/DILOCOX.md "
                             "section 14; bench/bench_convergence.py compares them)")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--lr-schedule", default="cosine", choices=["cosine", "constant"])
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--beta2", type=float, default=0.99)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--outer-lr", type=float, default=1.0, help="synchronous DiLoCo")
    parser.add_argument("--outer-momentum", type=float, default=0.5, help="synchronous DiLoCo")
    parser.add_argument("--x-outer-lr", type=float, default=None, help="DiLoCoX (default: --outer-lr)")
    parser.add_argument("--x-outer-momentum", type=float, default=None,
                        help="DiLoCoX (default: --outer-momentum)")
    parser.add_argument("--outer-warmup-rounds", type=int, default=0,
                        help="both DiLoCo modes: linear warmup of the outer lr over this many rounds")
    parser.add_argument("--outer-decay", default="constant", choices=list(OUTER_DECAYS),
                        help="both DiLoCo modes: decay of the outer lr (to --outer-min-lr-ratio) and "
                             "momentum (to --outer-final-momentum) over the run's rounds")
    parser.add_argument("--outer-min-lr-ratio", type=float, default=1.0)
    parser.add_argument("--outer-final-momentum", default="auto", help="auto: no momentum decay")
    parser.add_argument("--outer-decay-rounds", type=int, default=0, help="decay horizon (0: --rounds)")
    parser.add_argument("--error-budget", type=float, default=0.4)
    parser.add_argument("--bits", default="2,4,8")
    parser.add_argument("--max-rank", type=int, default=32)
    parser.add_argument("--min-compress-numel", type=int, default=4096)
    parser.add_argument("--no-delay", action="store_true", help="DiLoCoX without the one-step delay")
    parser.add_argument("--delay-correction", default="rebase", choices=list(DELAY_CORRECTIONS))
    parser.add_argument("--bandwidth-budget", default="auto",
                        help="DiLoCoX: bytes per stage contribution per round (0: code to --error-budget; "
                             "auto: --target-reduction times fewer bytes than AllReduce, the node's default)")
    parser.add_argument("--target-reduction", type=float, default=1000.0,
                        help="DiLoCoX with --bandwidth-budget auto: fewer bytes than fp32 ring AllReduce")
    parser.add_argument("--encoder", default=DEFAULT_ENCODER.value, choices=[v.value for v in EncoderVersion],
                        help="compression.encoder: which encoder picks the bytes (same wire format; default: "
                             "the node's, v4 = v2's selection every 4th round and re-allocations from its "
                             "estimates with v2's factorization between; v3 = v2's selection every 4th round "
                             "and warm-started power iterations between; docs/DILOCOX.md sections 3 and 9)")
    parser.add_argument("--no-error-feedback", action="store_true")
    parser.add_argument("--quant-scale", default=QuantScale.MAX.value, choices=[q.value for q in QuantScale],
                        help="compression.quant_scale: each low-bit column's scale, its largest magnitude "
                             "(max) or the clip with the smallest squared error (mse; docs/DILOCOX.md "
                             "section 14)")
    parser.add_argument("--overlap-steps", default="auto",
                        help="DiLoCoX: inner steps the exchange overlaps before it is applied (0: the whole "
                             "round; auto: H // 10, the node's default)")
    parser.add_argument("--no-compression", action="store_true",
                        help="DiLoCoX with the raw codec (delay only)")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=5, help="rounds between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time the phases in process CPU seconds (a shared machine's load then does not "
                             "distort the codec's share; meaningful with --threads 1)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None,
                        help="where to write the result (default: the one current result, overwritten: "
                             "bench/results/diloco.json, or with --case bench/results/diloco_goal.json: "
                             "issue 66's goals side by side)")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(RESULTS / ("diloco.json" if args.case is None else "diloco_goal.json"))
    if args.case is not None:
        fields, args.batch_size, args.family = CASES[args.case]
        args.preset = fields["preset"]
        args.model_fields = {k: v for k, v in fields.items() if k != "preset"}
    else:
        args.model_fields = {}
    if args.data is None:
        args.data = default_corpus()
    return args


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    if args.cpu_clock:
        set_clock(time.process_time)
    model_fields = {"tokenizer": args.tokenizer, **args.model_fields}
    if args.vocab_size is not None:
        model_fields["vocab_size"] = args.vocab_size
    model_cfg = ModelConfig(preset=args.preset, **model_fields)
    if args.family is not None and model_cfg.family != args.family:
        raise SystemExit(f"--family {args.family}: preset {args.preset} is of the {model_cfg.family} family")
    training_cfg = TrainingConfig(
        data_path=str(REPO / args.data), seed=args.seed, batch_size=args.batch_size, inner_lr=args.inner_lr,
        eval_batches=args.eval_batches, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio, beta2=args.beta2, weight_decay=args.weight_decay,
        optimizer=args.optimizer,
    )
    diloco_cfg = DilocoConfig(
        inner_steps=args.inner_steps, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
        outer_warmup_rounds=args.outer_warmup_rounds, outer_decay=args.outer_decay,
        outer_decay_rounds=args.outer_decay_rounds or args.rounds, outer_min_lr_ratio=args.outer_min_lr_ratio,
        outer_final_momentum=args.outer_final_momentum,
        one_step_delay=not args.no_delay, num_replicas=args.replicas, delay_correction=args.delay_correction,
        # The node screens contributions only where one node holds every stage (node/live/worker/replica.py);
        # the simulation holds the whole model and would screen split runs too, dropping honest
        # contributions the node keeps. Measure what the node runs.
        screening=args.stages == 1,
    )
    compression_cfg = CompressionConfig(
        error_budget=args.error_budget, bit_choices=[int(b) for b in args.bits.split(",")],
        max_rank=args.max_rank, min_compress_numel=args.min_compress_numel,
        bandwidth_budget=args.bandwidth_budget, target_reduction=args.target_reduction,
        error_feedback=not args.no_error_feedback, quant_scale=args.quant_scale,
        enabled=not args.no_compression, encoder=args.encoder,
    )
    x_diloco_cfg = dataclasses.replace(
        diloco_cfg,
        outer_lr=args.outer_lr if args.x_outer_lr is None else args.x_outer_lr,
        outer_momentum=args.outer_momentum if args.x_outer_momentum is None else args.x_outer_momentum,
        overlap_steps=args.overlap_steps,
    )
    pipeline_cfg = PipelineConfig(num_stages=args.stages)
    # What "auto" resolves to, recorded beside the results (the node resolves it the same way).
    resolved = {
        "overlap_steps": x_diloco_cfg.overlap,
        "bandwidth_budget_per_stage": [
            compression_cfg.stage_bandwidth_budget(
                sum(math.prod(shape) for shape in stage_param_shapes(model_cfg, spec).values()),
                args.inner_steps, args.replicas)
            for spec in split_stages(model_cfg.n_layer, args.stages)
        ],
    }
    print(f"DiLoCoX: overlap {resolved['overlap_steps']} steps, bandwidth budget per stage "
          f"{resolved['bandwidth_budget_per_stage']} bytes", flush=True)
    if model_cfg.byte_level and not is_dataset(REPO / args.data):
        corpus = load_corpus(REPO / args.data, training_cfg.eval_fraction, model_cfg.block_size)
    else:  # a prepared dataset or a text file in a BPE vocabulary: read as a node reads it
        corpus = corpus_from_config(training_cfg, model_cfg)

    load = {"start": list(os.getloadavg())}  # the machine's load average (1, 5, 15 min) at start and end
    results = {}
    for mode in args.modes.split(","):
        started = time.perf_counter()
        result = simulate(
            mode, corpus, model_cfg, training_cfg, x_diloco_cfg if mode == "diloco_x" else diloco_cfg,
            compression_cfg, pipeline_cfg, args.rounds,
            eval_every=args.eval_every,
        )
        results[mode] = (result, time.perf_counter() - started)
        print(f"{mode}: done in {results[mode][1]:.0f} s, held-out loss {result.final_eval_loss:.4f}",
              flush=True)

    print()
    print(f"model {args.case or args.preset} ({count_params(model_cfg):,} params), M={args.replicas}, "
          f"S={args.stages}, "
          f"H={args.inner_steps}, rounds={args.rounds}, batch {args.batch_size}x{model_cfg.block_size}, "
          f"tokens {args.replicas * next(iter(results.values()))[0].tokens_per_replica:,} in all")
    header = (f"{'mode':<10} {'held-out':>9} {'vs ddp':>8} {'bytes/token':>12} {'fewer bytes':>12} "
              f"{'ratio/round (min..max)':>23} {'codec+outer':>12}")
    print(header)
    print("-" * len(header))
    tokens_in_all = args.rounds * args.inner_steps * args.batch_size * args.replicas * model_cfg.block_size
    if args.preset == "mini" and tokens_in_all == 1_536_000:
        print(f"{'nanoGPT':<10} {NANOGPT_BABY_VAL:>9.4f}   (baby config, its own val split, same tokens)")
    baseline = results.get("ddp", (None,))[0]
    summary = {}
    for mode, (result, seconds) in results.items():
        ratios = [r.compression_ratio for r in result.rounds]
        fewer = baseline.bytes_per_token / result.bytes_per_token if baseline else None
        loss_gap = (result.final_eval_loss / baseline.final_eval_loss - 1) if baseline else None
        ratio_text = f"{min(ratios):.1f}..{max(ratios):.1f}" if mode != "ddp" else "-"
        print(
            f"{mode:<10} {result.final_eval_loss:>9.4f} {(f'{100 * loss_gap:+.2f}%' if baseline else '-'):>8}"
            f" {result.bytes_per_token:>12.2f} {(f'{fewer:.0f}x' if fewer else '-'):>12} {ratio_text:>23} "
            f"{100 * result.codec_outer_share:>11.2f}%"
        )
        tokens_per_round = result.tokens_per_replica // result.outer_rounds
        cumulative, curve = 0.0, []
        for record in result.rounds:
            cumulative += record.bytes_sent_per_replica
            if record.eval_loss is not None:
                curve.append({"round": record.outer_round,
                              "tokens": tokens_per_round * (record.outer_round + 1) * result.num_replicas,
                              "bytes_per_replica": cumulative, "held_out_loss": record.eval_loss})
        summary[mode] = {
            "held_out_loss": result.final_eval_loss,
            "bytes_per_token": result.bytes_per_token,
            "bytes_per_replica": result.bytes_per_replica,
            "fewer_bytes_than_ddp": fewer,
            "loss_vs_ddp": loss_gap,
            "compression_ratio_per_round": ratios,
            "codec_outer_share": result.codec_outer_share,
            "wall_seconds": seconds,
            "curve": curve,
        }
    targets = {}
    # issue 14's goal: bytes of tinyshakespeare
    if baseline and args.preset == "mini" and model_cfg.byte_level:
        targets["ddp_le_1.80"] = baseline.final_eval_loss <= 1.80
    if baseline and "diloco" in results:
        targets["diloco_within_1pct"] = summary["diloco"]["loss_vs_ddp"] <= 0.01
    if baseline and "diloco_x" in results:
        x = summary["diloco_x"]
        targets.update({
            "diloco_x_fewer_bytes_ge_1000x": x["fewer_bytes_than_ddp"] >= 1000,
            "diloco_x_within_2pct": x["loss_vs_ddp"] <= 0.02,
        })
        print()
        print(f"DiLoCoX vs ddp: {x['fewer_bytes_than_ddp']:.0f}x fewer bytes/token, held-out loss "
              f"{100 * x['loss_vs_ddp']:+.2f}%, codec+outer "
              f"{100 * x['codec_outer_share']:.2f}% of round time")
    if targets:
        print("targets:", ", ".join(f"{k}={'PASS' if v else 'FAIL'}" for k, v in targets.items()))

    out = {
        "args": vars(args),
        "resolved": resolved,
        "platform": {"python": platform.python_version(), "torch": torch.__version__,
                     "machine": platform.machine(), "cpus": os.cpu_count(), "threads": args.threads},
        "num_params": count_params(model_cfg),
        "summary": summary,
        "nanogpt_baby_val": NANOGPT_BABY_VAL,
        "targets": targets,
        "runs": {mode: result.to_dict() for mode, (result, _) in results.items()},
    }
    path = write_result(args.out, out, load["start"])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
