"""Profile of the DiLoCoX codec and apply path on captured stage contributions of `mini` (issue 16 item 3).

    capture: run a short DiLoCoX simulation (bench_diloco's defaults and encoder) and keep every
             stage pseudo-gradient the compressor coded (its error-feedback target), its byte budget
             and every round's contribution bytes
    profile: CPU seconds (one torch thread, min over repeats) of each part of the encode and of the
             apply path on those captures
    compare: the encoders' coding error on the same captured inputs, round by round: per round, over
             both replicas and stages, sqrt(sum ||X - decode(encode(X))||^2 / sum ||X||^2) (the
             stateful encoders carry their memo from round to round as in a run)

    .venv/bin/python bench/codec_profile.py capture --rounds 3 --out /tmp/capture.pt
    .venv/bin/python bench/codec_profile.py profile --capture /tmp/capture.pt
    .venv/bin/python bench/codec_profile.py compare --capture /tmp/capture.pt --encoders v2,v3,v4

Timings are CPU seconds of this process (time.process_time), so other jobs' load inflates them
only through shared caches and memory bandwidth; the figures compare parts, the benchmark of record
is bench_diloco.py --cpu-clock.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_corpus, least_cpu_seconds  # noqa: E402
from training import compression  # noqa: E402
from training.codec.registry import encoder_for  # noqa: E402
from training.codec.reselect import RESELECT_ROUNDS  # noqa: E402
from training.compression import encode_with_memo, encode_within_bandwidth  # noqa: E402
from training.config import (  # noqa: E402
    DEFAULT_ENCODER,
    DilocoConfig,
    ModelConfig,
    PipelineConfig,
    TrainingConfig,
)
from training.config_compression import CompressionConfig  # noqa: E402


def capture(args) -> None:
    from training.data import load_corpus
    from training.simulate import simulate

    torch.set_num_threads(1)
    model_cfg = ModelConfig(preset="mini")
    training_cfg = TrainingConfig(data_path=default_corpus(), seed=0, batch_size=8,
                                  inner_lr=3e-3, eval_batches=2, warmup_steps=100, beta2=0.99,
                                  weight_decay=0.1)
    diloco_cfg = DilocoConfig(inner_steps=args.inner_steps, outer_lr=1.0, outer_momentum=0.5, num_replicas=2,
                              screening=False)
    compression_cfg = CompressionConfig(encoder=args.encoder)
    corpus = load_corpus(REPO / training_cfg.data_path, training_cfg.eval_fraction, model_cfg.block_size)
    targets: list[dict] = []
    original = compression.ErrorFeedbackCompressor.compress

    def recording(self, pseudo_gradient, *, stage_index, outer_round):
        carry = self.cfg.enabled and self.cfg.error_feedback
        target = {n: (torch.add(v.to(torch.float32), self.residual[n]) if carry else v.clone())
                  for n, v in pseudo_gradient.items()}
        targets.append({"round": outer_round, "stage": stage_index, "budget": self.bandwidth_budget,
                        "target": target})
        return original(self, pseudo_gradient, stage_index=stage_index, outer_round=outer_round)

    blobs: dict[tuple[int, int], list[bytes]] = {}

    def tamper(outer_round, stage, contributions):
        blobs[(outer_round, stage)] = list(contributions)
        return contributions

    compression.ErrorFeedbackCompressor.compress = recording
    try:
        simulate("diloco_x", corpus, model_cfg, training_cfg, diloco_cfg, compression_cfg, PipelineConfig(),
                 args.rounds, eval_every=args.rounds, num_eval_batches=2, tamper=tamper)
    finally:
        compression.ErrorFeedbackCompressor.compress = original
    torch.save({"targets": targets, "blobs": blobs, "inner_steps": args.inner_steps}, args.out)
    print(f"captured {len(targets)} stage targets, {len(blobs)} rounds x stages of blobs -> {args.out}")


def profile(args) -> None:
    from training.codec_wire import decode_contribution
    from training.diloco import average_contributions, outer_step
    from training.hashing import stage_weights_hash
    from training.robust import contribution_norm

    torch.set_num_threads(1)
    data = torch.load(args.capture, weights_only=False)
    chosen = [t for t in data["targets"] if t["round"] == args.round]
    diloco_cfg = DilocoConfig(inner_steps=data["inner_steps"], outer_lr=1.0, outer_momentum=0.5,
                              num_replicas=2)
    previous = [t for t in data["targets"] if t["round"] == args.round - 1]
    for encoder in args.encoders.split(","):
        cfg = CompressionConfig(encoder=encoder)
        total = 0.0
        for index, item in enumerate(chosen[:2]):  # replica 0's two stages
            # a warm round: the memo of a selection on the previous round's target
            if encoder_for(cfg).keeps_memo:
                memo = encode_with_memo(previous[index]["target"], cfg, item["budget"], None,
                                        stage_index=item["stage"], outer_round=0)[3]

                def run():
                    return encode_with_memo(item["target"], cfg, item["budget"], memo,
                                            stage_index=item["stage"], outer_round=1)
            else:
                def run():
                    return encode_within_bandwidth(item["target"], cfg, item["budget"],
                                                   stage_index=item["stage"], outer_round=args.round)
            seconds = least_cpu_seconds(run, args.repeat)
            total += seconds
            print(f"encode {encoder} stage {item['stage']}: {1000 * seconds:.1f} ms")
        print(f"encode {encoder} both stages: {1000 * total:.1f} ms")
    apply_total = 0.0
    for stage in (0, 1):
        blobs = data["blobs"][(args.round, stage)]
        shapes = {n: tuple(v.shape) for n, v in chosen[stage]["target"].items()}
        decoded = [decode_contribution(b, shapes, stage_index=stage, outer_round=args.round, refuse_raw=True)
                   for b in blobs]
        weights = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) * 0.02
                       for n, s in shapes.items()}
        momentum = {n: torch.zeros(s) for n, s in shapes.items()}
        average = average_contributions(decoded)
        new, _ = outer_step(weights, momentum, average, diloco_cfg, args.round)
        parts = {
            "decode one": lambda: decode_contribution(blobs[1], shapes, stage_index=stage,
                                                      outer_round=args.round, refuse_raw=True),
            "norm one": lambda: contribution_norm(decoded[1]),
            "average": lambda: average_contributions(decoded),
            "outer step": lambda: outer_step(weights, momentum, average, diloco_cfg, args.round),
            "hash": lambda: stage_weights_hash(new),
            "rebase (3 snapshots x 2 ops)": lambda: [
                {n: torch.add(new[n], torch.sub(weights[n], momentum[n])) for n in new} for _ in range(3)],
        }
        stage_total = 0.0
        for label, fn in parts.items():
            seconds = least_cpu_seconds(fn, args.repeat)
            stage_total += seconds * (2 if label == "norm one" else 1)
            print(f"apply stage {stage}: {label}: {1000 * seconds:.2f} ms")
        apply_total += stage_total
        codecs = {}
        import msgpack

        from training.codec_wire import decode_contribution as _d  # noqa: F401
        for entry in msgpack.unpackb(blobs[1], raw=False)["t"]:
            key = (entry["c"], entry.get("r", 0), entry.get("b", 32))
            codecs[key] = codecs.get(key, 0) + 1
        print(f"stage {stage} codings of replica 1: {sorted(codecs.items())}")
    print(f"apply, both stages (2 norms each): {1000 * apply_total:.1f} ms")


def compare(args) -> None:
    """Coding error of each encoder on the same inputs (the captured error-feedback targets)."""
    torch.set_num_threads(1)
    data = torch.load(args.capture, weights_only=False)
    by_round: dict[int, list[dict]] = {}
    for item in data["targets"]:
        by_round.setdefault(item["round"], []).append(item)
    encoders = args.encoders.split(",")
    memos: dict[str, dict[int, object]] = {encoder: {} for encoder in encoders}
    errors: dict[str, list[float]] = {encoder: [] for encoder in encoders}
    for outer_round in sorted(by_round):
        row = []
        for encoder in encoders:
            cfg = CompressionConfig(encoder=encoder)
            squared = total = 0.0
            for index, item in enumerate(by_round[outer_round]):
                target = item["target"]
                if encoder_for(cfg).keeps_memo:
                    _, decoded, _, memos[encoder][index] = encode_with_memo(
                        target, cfg, item["budget"], memos[encoder].get(index), stage_index=item["stage"],
                        outer_round=outer_round)
                else:
                    _, decoded, _ = encode_within_bandwidth(target, cfg, item["budget"],
                                                            stage_index=item["stage"],
                                                            outer_round=outer_round)
                for name, value in target.items():
                    squared += float(torch.sum((value.double() - decoded[name].double()) ** 2))
                    total += float(torch.sum(value.double() ** 2))
            errors[encoder].append((squared / total) ** 0.5 if total else 0.0)
            row.append(f"{encoder} {errors[encoder][-1]:.4f}")
        print(f"round {outer_round:3d}: " + "  ".join(row))
    rounds = sorted(by_round)
    for encoder in encoders:
        warm = [e for r, e in zip(rounds, errors[encoder]) if r % RESELECT_ROUNDS]
        print(f"{encoder}: mean {sum(errors[encoder]) / len(rounds):.4f}, rounds t % {RESELECT_ROUNDS} != 0 "
              f"{sum(warm) / max(len(warm), 1):.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("--rounds", type=int, default=3)
    cap.add_argument("--inner-steps", type=int, default=50)
    cap.add_argument("--encoder", default=DEFAULT_ENCODER.value)
    cap.add_argument("--out", required=True)
    prof = sub.add_parser("profile")
    prof.add_argument("--capture", required=True)
    prof.add_argument("--round", type=int, default=2)
    prof.add_argument("--repeat", type=int, default=7)
    prof.add_argument("--encoders", default="v2,v3,v4")
    comp = sub.add_parser("compare")
    comp.add_argument("--capture", required=True)
    comp.add_argument("--encoders", default="v2,v3,v4")
    args = parser.parse_args()
    {"capture": capture, "profile": profile, "compare": compare}[args.command](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
