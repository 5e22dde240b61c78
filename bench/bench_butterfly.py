"""Benchmark: per-node bytes and messages per round, today's all-to-all exchange vs the sliced one (issue 16).

An in-process simulation with the real protocol objects: real ed25519
identities and signed :mod:`p2p.envelope` envelopes around every contribution,
slice manifest and partial; real codec bytes (:mod:`training.butterfly`, the
stage codec under the run's "auto" bandwidth budget) of real pseudo-gradients
(K replicas x H real inner steps of the model from its initial weights). For
R replicas (4 .. 1024) only what one node sees is materialized: replica i's
pseudo-gradient is base ``i mod K`` times ``1 + 0.01 * noise_i`` (deterministic),
and a partial other than the node's own is coded from the K base replicas'
average (its size is set by its budget, not by R; the JSON says which figures
are materialized and which are modelled that way).

Per node = one replica's copy of one stage (the node holds one stage). Today:
the node fetches the R-1 other contribution envelopes of its stage and serves
its own to R-1 peers. Sliced (A = min(R, numel // min_slice_numel) slices):
the node sends each aggregator its signed slice manifest + slice message; as
aggregator of slice j it receives R-1 of those and serves its signed partial to
R-1 peers; it fetches the A-1 other partials. Gossip control messages
(announce, close) are the same in both schemes and not counted.

Also measured: the coding error of the sliced encoding against A (why
``min_slice_numel``), the replay of one real partial (bit-identical, seconds),
and a short convergence comparison on the tiny model (M replicas, no delay):
held-out loss with today's exchange vs the sliced exchange with re-encoded
partials. Writes bench/results/butterfly.json.

    # everything in one process (hours on a loaded machine):
    nice -n 19 .venv/bin/python bench/bench_butterfly.py

The committed results were taken as five processes in parallel, then merged (load 25-43):

    bench_butterfly.py --presets tiny --skip-convergence --out /tmp/s5b-tiny.json              # ~15 min
    bench_butterfly.py --presets mini --traffic-stages 0 --skip-convergence --out /tmp/s5b-mini.json # ~10 min
    bench_butterfly.py --presets= --conv-only 0|4|16 --out /tmp/s5b-convN.json                 # ~12 min each
    bench_butterfly.py --parts /tmp/s5b-tiny.json,/tmp/s5b-mini.json,/tmp/s5b-conv0.json,...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_corpus  # noqa: E402
from bench.butterfly_traffic import sliced_traffic, todays_traffic  # noqa: E402
from training.butterfly import (  # noqa: E402
    SlicedErrorFeedbackCompressor, aggregate_slice, assemble_partials, encode_slices,
)
from training.slice_plan import DEFAULT_MIN_SLICE_NUMEL, plan_slices  # noqa: E402
from training.compression import encode_contribution  # noqa: E402
from training.config import DilocoConfig, ModelConfig, TrainingConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.data import eval_batches, load_corpus, round_batches  # noqa: E402
from training.diloco import average_contributions  # noqa: E402
from training.model import count_params, init_state_dict  # noqa: E402
from training.pipeline import LocalReplicaTrainer  # noqa: E402
from training.schedule import inner_lr, set_lr, trainer_optimizers  # noqa: E402
from training.stage_engine import StageEngine  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

# ----------------------------------------------------------------------------- real pseudo-gradients


def real_pseudo_gradients(model_cfg, training_cfg, corpus, num_stages: int, replicas: int, steps: int):
    """``[per replica: [per stage: {name: start - end}]]`` after ``steps`` real AdamW steps from the initial
    weights."""
    initial = init_state_dict(model_cfg, training_cfg.seed)
    out = []
    for replica in range(replicas):
        trainer = LocalReplicaTrainer(model_cfg, training_cfg, num_stages, state_dict=initial)
        before = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in trainer.stage_modules]
        for x, y in round_batches(corpus, training_cfg.seed, replica, 0, steps, training_cfg.batch_size,
                                  model_cfg.block_size):
            trainer.train_step(x, y)
        out.append([
            {n: torch.sub(before[s][n], p.detach()) for n, p in m.named_parameters()}
            for s, m in enumerate(trainer.stage_modules)
        ])
    return out


def slicing_error(pseudo_gradient, shapes, cfg, budget, counts, min_slice_numel):
    """Relative error and bytes of the sliced encoding of one real pseudo-gradient, per requested A."""
    norm = math.sqrt(sum(float(torch.sum(v.double() ** 2)) for v in pseudo_gradient.values()))
    rows = []
    for count in counts:
        plan = plan_slices(shapes, count, min_slice_numel=min_slice_numel)
        row = {"requested": count, "slices": plan.num_slices, "budget": budget}
        for label, guided in (("guided", True), ("proportional", False)):
            blobs, decoded, _ = encode_slices(pseudo_gradient, plan, cfg, budget, stage_index=0,
                                              outer_round=0, guided=guided)
            error = math.sqrt(sum(float(torch.sum((pseudo_gradient[n] - decoded[n]).double() ** 2))
                                  for n in shapes))
            row[label] = {"bytes": sum(map(len, blobs)), "rel_error": error / norm}
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- convergence


def convergence(scheme: str, corpus, model_cfg, training_cfg, replicas: int, num_stages: int, steps: int,
                rounds: int, compression_cfg, norm_clip: float, min_slice_numel: int, eval_every: int,
                num_slices: int = 0):
    """Synchronous DiLoCoX (no delay) with today's exchange or the sliced one; held-out loss per round."""
    diloco_cfg = DilocoConfig(inner_steps=steps, num_replicas=replicas, one_step_delay=False,
                              norm_clip=norm_clip)
    initial = init_state_dict(model_cfg, training_cfg.seed)
    trainers = [LocalReplicaTrainer(model_cfg, training_cfg, num_stages, state_dict=initial)
                for _ in range(replicas)]
    engines = [[StageEngine(spec.index, dict(m.named_parameters()), diloco_cfg, compression_cfg)
                for spec, m in zip(t.specs, t.stage_modules)] for t in trainers]
    plans = []
    if scheme == "sliced":
        for stage, engine in enumerate(engines[0]):
            plans.append(plan_slices(engine.shapes, num_slices or replicas, min_slice_numel=min_slice_numel))
        for row in engines:
            for stage, engine in enumerate(row):
                engine.compressor = SlicedErrorFeedbackCompressor(
                    engine.shapes, compression_cfg, plans[stage],
                    bandwidth_budget=engine.compressor.bandwidth_budget)
                # The assembled Delta reaches the engine as one raw contribution (its average is itself, bit
                # for bit), so the engine's outer step and bookkeeping run unchanged.
                engine.compression_cfg = dataclasses.replace(compression_cfg, enabled=False)
    evaluator = LocalReplicaTrainer(model_cfg, training_cfg, num_stages, state_dict=initial)
    held_out = eval_batches(corpus, training_cfg.eval_batches, training_cfg.batch_size, model_cfg.block_size)
    raw_cfg = CompressionConfig(enabled=False)
    records = []
    for outer_round in range(rounds):
        for replica, trainer in enumerate(trainers):
            optimizers = trainer_optimizers(trainer)
            batches = round_batches(corpus, training_cfg.seed, replica, outer_round, steps,
                                    training_cfg.batch_size, model_cfg.block_size)
            for step, (x, y) in enumerate(batches):
                set_lr(optimizers, inner_lr(training_cfg, outer_round * steps + step, rounds * steps))
                trainer.train_step(x, y)
        blobs = [[engine.encode_contribution(outer_round)[0] for engine in row] for row in engines]
        partial_errors, partial_bytes = [], 0
        contribution_bytes = sum(len(blob) for row in blobs for blob in row) / replicas
        for stage in range(num_stages):
            contributions = [blobs[replica][stage] for replica in range(replicas)]
            if scheme == "sliced":
                plan = plans[stage]
                budget = engines[0][stage].compressor.bandwidth_budget
                slices = [engines[r][stage].compressor.last_slices for r in range(replicas)]
                results = [aggregate_slice([s[j] for s in slices], plan, j, compression_cfg, budget,
                                           norm_clip=norm_clip, stage_index=stage, outer_round=outer_round)
                           for j in range(plan.num_slices)]
                delta = assemble_partials([r.partial for r in results], plan, stage_index=stage,
                                          outer_round=outer_round)
                exact = average_contributions([engines[r][stage].compressor.last_decoded
                                               for r in range(replicas)])
                num = sum(float(torch.sum((delta[n] - exact[n]).double() ** 2)) for n in delta)
                den = sum(float(torch.sum(exact[n].double() ** 2)) for n in delta)
                partial_errors.append(math.sqrt(num / den) if den else 0.0)
                partial_bytes += sum(len(r.partial) for r in results)
                contributions = [encode_contribution(delta, raw_cfg, stage_index=stage,
                                                     outer_round=outer_round)[0]]
            hashes = {engines[r][stage].apply_round(outer_round, contributions).weights_hash
                          for r in range(replicas)}
            assert len(hashes) == 1, "replicas disagree"
        eval_loss = None
        if (outer_round + 1) % eval_every == 0 or outer_round == rounds - 1:
            merged = {}
            for engine in engines[0]:
                merged.update(engine.global_weights)
            evaluator.load_state_dict(merged)
            eval_loss = evaluator.eval_loss(held_out)
        records.append({"outer_round": outer_round, "eval_loss": eval_loss,
                        "slices": [p.num_slices for p in plans],
                        "contribution_bytes_per_replica": contribution_bytes, "partial_bytes": partial_bytes,
                        "partial_rel_error": partial_errors or None})
        print(f"  {scheme} round {outer_round}: eval {eval_loss}", flush=True)
    return records


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="corpus (default: tinyshakespeare as 'dlx-node data fetch tinyshakespeare' "
                             "keeps it, fetched if missing)")
    parser.add_argument("--presets", default="tiny,mini", help="traffic presets ('' to skip)")
    parser.add_argument("--replicas", default="4,8,16,64,256,1024")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--traffic-stages", default="",
                        help="stage indices whose traffic is measured (default all)")
    parser.add_argument("--inner-steps", type=int, default=50,
                        help="H of the budget and of the real pseudo-gradients")
    parser.add_argument("--base-replicas", type=int, default=2, help="K real pseudo-gradients")
    parser.add_argument("--materialize", type=int, default=6, help="contributions built per all-to-all node")
    parser.add_argument("--min-slice-numel", type=int, default=DEFAULT_MIN_SLICE_NUMEL)
    parser.add_argument("--conv-replicas", type=int, default=4)
    parser.add_argument("--conv-rounds", type=int, default=30)
    parser.add_argument("--conv-steps", type=int, default=20)
    parser.add_argument("--conv-preset", default="tiny")
    parser.add_argument("--conv-slices", default="4,16", help="slice counts of the sliced runs")
    parser.add_argument("--conv-min-slice-numel", type=int, default=1024)
    parser.add_argument("--conv-only", type=int, default=-1,
                        help="run only this convergence run (0: all-to-all)")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--parts", default="",
                        help="merge these JSON files (earlier runs' --out) into --out, no run")
    parser.add_argument("--out", default="bench/results/butterfly.json")
    args = parser.parse_args()
    if args.data is None:
        args.data = default_corpus()
    return args


def main() -> None:
    args = parse_args()
    if args.parts:
        merged: dict = {}
        for part in args.parts.split(","):
            data = json.loads(Path(part).read_text())
            for key, value in data.items():
                if isinstance(value, dict) and isinstance(merged.get(key), dict):
                    merged[key].update(value)
                elif value or key not in merged:
                    merged[key] = value
        merged["parts"] = {
            part: {key: json.loads(Path(part).read_text()).get(key)
                   for key in ("args", "load_average_start", "load_average_end", "seconds", "platform")}
            for part in args.parts.split(",")
        }
        for key in ("args", "load_average_start", "load_average_end", "seconds"):
            merged.pop(key, None)
        (REPO / args.out).write_text(json.dumps(merged, indent=1, default=float) + "\n")
        print(f"wrote {REPO / args.out}")
        return
    torch.set_num_threads(1)
    training_cfg = TrainingConfig()
    compression_cfg = CompressionConfig()
    norm_clip = DilocoConfig().norm_clip
    replica_counts = [int(r) for r in args.replicas.split(",")]
    started_all = time.perf_counter()
    out: dict = {"load_average_start": os.getloadavg(), "platform": platform.platform(), "args": vars(args),
                 "traffic": {}, "slicing_error": {}}
    path = REPO / args.out
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a run cut short still leaves what it measured
        out["load_average_end"] = os.getloadavg()
        out["seconds"] = time.perf_counter() - started_all
        path.write_text(json.dumps(out, indent=1, default=float) + "\n")

    for preset in filter(None, args.presets.split(",")):
        model_cfg = ModelConfig(preset=preset)
        corpus = load_corpus(REPO / args.data, training_cfg.eval_fraction, model_cfg.block_size)
        bases = real_pseudo_gradients(model_cfg, training_cfg, corpus, args.stages, args.base_replicas,
                                      args.inner_steps)
        specs = split_stages(model_cfg.n_layer, args.stages)
        rows = []
        measured = {int(i) for i in args.traffic_stages.split(",") if i} or {spec.index for spec in specs}
        for spec in specs:
            if spec.index not in measured:
                continue
            shapes = stage_param_shapes(model_cfg, spec)
            numel = sum(math.prod(s) for s in shapes.values())
            stage_bases = [b[spec.index] for b in bases]
            for replicas in replica_counts:
                budget = compression_cfg.stage_bandwidth_budget(numel, args.inner_steps, replicas)
                t0 = time.perf_counter()
                today = todays_traffic(stage_bases, replicas, compression_cfg, budget, spec.index, 0,
                                       args.materialize)
                sliced, extra = sliced_traffic(stage_bases, replicas, compression_cfg, budget, spec.index, 0,
                                               shapes=shapes, min_slice_numel=args.min_slice_numel,
                                               norm_clip=norm_clip, audit=True)
                # A node that aggregates nothing this round (A < R): the mean over the round's nodes.
                idle, _ = sliced_traffic(stage_bases, replicas, compression_cfg, budget, spec.index, 0,
                                         shapes=shapes, min_slice_numel=args.min_slice_numel,
                                         norm_clip=norm_clip, node=replicas - 1) if sliced.slices < replicas \
                                         else (sliced, {})
                share = sliced.slices / replicas
                mean_in = share * sliced.bytes_in + (1 - share) * idle.bytes_in
                mean_out = share * sliced.bytes_out + (1 - share) * idle.bytes_out
                row = {"stage": spec.index, "stage_numel": numel, "budget": budget, "replicas": replicas,
                       "all_to_all": dataclasses.asdict(today),
                       "sliced_aggregator": dataclasses.asdict(sliced),
                       "sliced_idle": dataclasses.asdict(idle), "sliced_mean_in": mean_in,
                       "sliced_mean_out": mean_out, **extra, "seconds": time.perf_counter() - t0}
                rows.append(row)
                out["traffic"][preset] = {"num_params": count_params(model_cfg), "rows": rows}
                save()
                print(f"{preset} stage {spec.index} R={replicas:5d} A={sliced.slices:4d}: all-to-all in "
                      f"{today.bytes_in:>11,} out {today.bytes_out:>11,} | sliced aggregator in "
                      f"{sliced.bytes_in:>9,} out {sliced.bytes_out:>9,} msgs {sliced.messages_in}"
                      f"/{sliced.messages_out} | mean in {mean_in:>10,.0f} out {mean_out:>10,.0f} | audit "
                      f"{extra.get('audit_ok')} {extra.get('audit_seconds', 0):.2f}s "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
            budget = compression_cfg.stage_bandwidth_budget(numel, args.inner_steps, 4)
            out["slicing_error"][f"{preset}/stage{spec.index}"] = slicing_error(
                stage_bases[0], shapes, compression_cfg, budget, [1, 4, 16, 32, 64, 128], 1)
            for r in out["slicing_error"][f"{preset}/stage{spec.index}"]:
                print(f"  slicing error {preset} stage {spec.index} A={r['slices']}: guided "
                      f"{r['guided']['rel_error']:.4f} ({r['guided']['bytes']:,} B), proportional "
                      f"{r['proportional']['rel_error']:.4f} ({r['proportional']['bytes']:,} B)", flush=True)
        out["traffic"][preset] = {"num_params": count_params(model_cfg), "rows": rows}
    if not args.skip_convergence:
        model_cfg = ModelConfig(preset=args.conv_preset)
        corpus = load_corpus(REPO / args.data, training_cfg.eval_fraction, model_cfg.block_size)
        conv = {}
        runs = [("all_to_all", 0)] + [(f"sliced_{count}", int(count))
                                      for count in args.conv_slices.split(",")]
        if args.conv_only >= 0:
            runs = [run for run in runs if run[1] == args.conv_only] \
                or [(f"sliced_{args.conv_only}", args.conv_only)]
        for label, count in runs:
            t0 = time.perf_counter()
            conv[label] = convergence("sliced" if count else "all_to_all", corpus, model_cfg, training_cfg,
                                      args.conv_replicas, args.stages, args.conv_steps, args.conv_rounds,
                                      compression_cfg, norm_clip, args.conv_min_slice_numel, eval_every=5,
                                      num_slices=count)
            print(f"{label}: final held-out {conv[label][-1]['eval_loss']:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            out["convergence"] = {"preset": args.conv_preset, "replicas": args.conv_replicas,
                                  "inner_steps": args.conv_steps, "rounds": args.conv_rounds, **conv}
            save()
        out["convergence"] = {"preset": args.conv_preset, "replicas": args.conv_replicas,
                              "inner_steps": args.conv_steps, "rounds": args.conv_rounds, **conv}
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
