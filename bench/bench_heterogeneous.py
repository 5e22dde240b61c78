"""Heterogeneous contributors (issue 44): replicas slowed 1x, 2x, 4x by the cgroup cpu controller, rounds
bounded by time (``diloco.round_budget_s``) against the same run with fixed H.

What runs: one process per replica (``multiprocessing``, spawn), each with its own cgroup v1 cpu group
(``/sys/fs/cgroup/cpu/<name>``) with ``cpu.cfs_quota_us = cfs_period_us * quota / factor``: the
replica of factor 4 may use a quarter of the CPU time of the replica of factor 1 (the quota is set
below what the machine's load leaves a process, so that it binds). A replica moves into its group
for its inner steps and back out for the rest (encode, apply): the slow part is the accelerator, as
with a slow GPU whose host CPU is ordinary. Each replica holds a whole model (one stage) and runs the node's
parts: ``LocalReplicaTrainer.train_step`` (the one inner step), ``training.schedule.takes_another_step``
(the budget rule), ``StageEngine.encode_contribution`` with its declared steps and
``StageEngine.apply_round``. The parent is the exchange and the auditor: it gathers the
contributions, screens them (``training.screening``, per step in the time-bounded run), replays the
aggregation (``training.diloco.aggregate_with_report``), checks that every replica reached the same
weights hash, and evaluates the held-out loss of the global weights outside the round's clock.
Not the libp2p node: contributions travel over pipes and there is no chain; the training, the
declared steps, the aggregation and the slowdown are the real ones.

Figures per mode: wall seconds per round (from "train" to every replica having applied the round,
the held-out eval excluded), each replica's inner steps per round and seconds per step, the share of
each replica's wall time spent on inner steps that reached the outer step (accepted contributions),
and held-out loss against cumulative wall time and tokens; compared at equal wall time and at equal
tokens (linear interpolation between rounds).

With ``--node`` the replicas are real ``dlx-node start`` processes (bench/hetero_node.py, whose docstring
defines the compute share exactly: the wall seconds of inner steps that reached the outer step over the wall
seconds of the replica's periods, and beside it the CPU share of those steps in the whole node process).

    python bench/bench_heterogeneous.py                     # writes bench/results/heterogeneous.json
    python bench/bench_heterogeneous.py --node              # the same through real dlx-node processes
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.benchio import default_corpus, default_out, write_result  # noqa: E402
from node.commands.throttle import CpuGroup, unavailable  # noqa: E402


def configs(args, mode: str):
    from training.config import DilocoConfig, ModelConfig, TrainingConfig
    from training.config_compression import CompressionConfig

    model = ModelConfig(preset=args.preset)
    training = TrainingConfig(seed=args.seed, batch_size=args.batch_size, inner_lr=args.inner_lr,
                              warmup_steps=args.warmup_steps, lr_schedule="constant")
    common = dict(num_replicas=len(args.factors), one_step_delay=False, outer_lr=args.outer_lr,
                  outer_momentum=args.outer_momentum)
    if mode == "fixed":
        diloco = DilocoConfig(inner_steps=args.fixed_h, **common)
    else:
        diloco = DilocoConfig(inner_steps=args.max_steps, round_budget_s=args.budget_s,
                              min_inner_steps=args.min_steps, screen_rule=args.screen_rule,
                              screen_batch_size=args.screen_batch, **common)
    return model, training, diloco, CompressionConfig()


# ----------------------------------------------------------------------------- a replica


def replica_process(index: int, conn, args, mode: str, group: CpuGroup) -> None:
    import torch

    torch.set_num_threads(1)
    from training.data import load_corpus, round_batches
    from training.model import init_state_dict
    from training.pipeline import LocalReplicaTrainer
    from training.schedule import inner_lr, set_lr, takes_another_step
    from training.stage_engine import StageEngine

    model, training, diloco, compression = configs(args, mode)
    corpus = load_corpus(args.data, training.eval_fraction, model.block_size)
    trainer = LocalReplicaTrainer(model, training, 1, state_dict=init_state_dict(model, training.seed))
    engine = StageEngine(0, dict(trainer.stage_modules[0].named_parameters()), diloco, compression)
    conn.send(("ready", index))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] == "train":
            outer_round = message[1]
            batches = round_batches(corpus, training.seed, index, outer_round, diloco.inner_steps,
                                    training.batch_size, model.block_size)
            elapsed, steps = 0.0, 0
            # The slow accelerator: the inner steps run in the replica's cgroup; the host's work (encode,
            # apply) runs outside it, as a slow GPU's node encodes on its CPU.
            group.add_thread(os.getpid())
            while takes_another_step(diloco, steps, elapsed):
                started = time.perf_counter()
                set_lr(trainer.optimizers, inner_lr(training, outer_round * diloco.inner_steps + steps, None))
                trainer.train_step(*batches[steps])
                elapsed += time.perf_counter() - started
                steps += 1
            CpuGroup.release_thread(os.getpid())
            blob, _ = engine.encode_contribution(outer_round, steps if diloco.budgeted else None)
            conn.send(("trained", blob, steps, elapsed))
        elif message[0] == "apply":
            _, outer_round, blobs, excluded = message
            result = engine.apply_round(outer_round, blobs, excluded=excluded)
            conn.send(("applied", result.weights_hash))


# ----------------------------------------------------------------------------- one run


def run_mode(args, mode: str) -> dict:
    import torch

    from training.data import eval_batches, load_corpus
    from training.diloco import aggregate_with_report
    from training.model import init_state_dict
    from training.pipeline import LocalReplicaTrainer
    from training.screening import (
        decode_full,
        model_loss_fn,
        screen_contributions,
        screening_batch,
        screening_exclusions,
        screening_steps,
    )

    model, training, diloco, compression = configs(args, mode)
    corpus = load_corpus(args.data, training.eval_fraction, model.block_size)
    held_out = eval_batches(corpus, args.eval_batches, training.batch_size, model.block_size)
    initial = init_state_dict(model, training.seed)
    evaluator = LocalReplicaTrainer(model, training, 1, state_dict=initial)
    weights = {n: t.clone() for n, t in initial.items()}
    momentum = {n: torch.zeros_like(t) for n, t in initial.items()}
    shapes = {n: tuple(t.shape) for n, t in initial.items()}
    tokens_per_step = training.batch_size * model.block_size

    context = mp.get_context("spawn")
    groups, processes, pipes = [], [], []
    for index, factor in enumerate(args.factors):
        groups.append(CpuGroup(f"dlx-bench-het-{os.getpid()}-{index}", args.quota / factor))
        parent, child = context.Pipe()
        process = context.Process(target=replica_process, args=(index, child, args, mode, groups[-1]))
        process.start()
        processes.append(process)
        pipes.append(parent)
    rounds = []
    try:
        for pipe in pipes:
            assert pipe.recv()[0] == "ready"
        evaluator.load_state_dict(weights)
        curve = [{"wall_s": 0.0, "tokens": 0, "eval_loss": evaluator.eval_loss(held_out)}]
        wall = 0.0
        tokens = 0
        outer_round = 0
        while wall < args.wall_s:
            started = time.perf_counter()
            for pipe in pipes:
                pipe.send(("train", outer_round))
            trained = [pipe.recv() for pipe in pipes]
            train_done = time.perf_counter()
            blobs = [t[1] for t in trained]
            excluded = {}
            if diloco.screening:
                decoded = [decode_full([b], [shapes], outer_round=outer_round, refuse_raw=compression.enabled)
                           for b in blobs]
                x, y = screening_batch(corpus, training.seed, outer_round, diloco.screen_batch_size,
                                       model.block_size)
                reports = screen_contributions(model_loss_fn(model, x, y), weights, decoded, diloco,
                                               screening_steps(diloco, [[b] for b in blobs]))
                excluded = screening_exclusions(reports)
            aggregation = aggregate_with_report(weights, momentum, blobs, diloco, stage_index=0,
                                                outer_round=outer_round, compression_cfg=compression,
                                                excluded=excluded)
            for pipe in pipes:
                pipe.send(("apply", outer_round, blobs, excluded))
            hashes = {pipe.recv()[1] for pipe in pipes}
            if hashes != {aggregation.weights_hash}:
                raise RuntimeError(f"round {outer_round}: replicas and the replay disagree on the weights")
            round_wall = time.perf_counter() - started
            weights, momentum = aggregation.new_global, aggregation.new_momentum
            accepted = set(aggregation.accepted)
            steps = [t[2] for t in trained]
            wall += round_wall
            tokens += sum(s for i, s in enumerate(steps) if i in accepted) * tokens_per_step
            evaluator.load_state_dict(weights)
            eval_loss = evaluator.eval_loss(held_out)
            rounds.append({
                "round": outer_round, "wall_s": round_wall, "train_wall_s": train_done - started,
                "steps": steps, "train_s": [t[3] for t in trained], "accepted": sorted(accepted),
                "scales": [r.scale for r in aggregation.contributions], "eval_loss": eval_loss,
            })
            curve.append({"wall_s": wall, "tokens": tokens, "eval_loss": eval_loss})
            print(f"{mode} round {outer_round}: {round_wall:.2f}s steps {steps} held-out {eval_loss:.4f}",
                  flush=True)
            outer_round += 1
    finally:
        for pipe in pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
        for group in groups:
            group.remove()
    total_wall = sum(r["wall_s"] for r in rounds)
    replicas = []
    for index, factor in enumerate(args.factors):
        steps = sum(r["steps"][index] for r in rounds)
        seconds = sum(r["train_s"][index] for r in rounds)
        reached = sum(r["train_s"][index] for r in rounds if index in r["accepted"])
        replicas.append({"factor": factor, "cpu_quota": args.quota / factor, "steps": steps,
                         "steps_per_round": steps / len(rounds), "s_per_step": seconds / steps,
                         "compute_share_reaching_outer_step": reached / total_wall})
    return {"mode": mode, "diloco": {k: getattr(diloco, k) for k in
                                     ("inner_steps", "round_budget_s", "min_inner_steps", "outer_lr",
                                      "outer_momentum")},
            "rounds": len(rounds), "wall_s": total_wall, "wall_s_per_round": total_wall / len(rounds),
            "tokens": tokens, "final_eval_loss": curve[-1]["eval_loss"], "replicas": replicas,
            "curve": curve, "per_round": rounds}


def at(curve: list[dict], key: str, value: float) -> float:
    """Held-out loss at ``key`` = ``value`` by linear interpolation between the rounds of ``curve``."""
    for before, after in zip(curve, curve[1:]):
        if before[key] <= value <= after[key]:
            span = after[key] - before[key]
            weight = (value - before[key]) / span if span else 1.0
            return before["eval_loss"] + weight * (after["eval_loss"] - before["eval_loss"])
    return curve[-1]["eval_loss"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="the training text (default: tinyshakespeare as 'dlx-node data fetch "
                             "tinyshakespeare' keeps it, fetched if missing)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.5)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--quota", type=float, default=0.4, help="CPUs of the 1x replica's cgroup")
    parser.add_argument("--fixed-h", type=int, default=40, help="H of the fixed-H run")
    parser.add_argument("--max-steps", type=int, default=120,
                        help="diloco.inner_steps of the time-bounded run")
    parser.add_argument("--min-steps", type=int, default=4)
    parser.add_argument("--budget-s", type=float, default=4.0)
    parser.add_argument("--wall-s", type=float, default=90.0, help="wall seconds of rounds each mode runs")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--node", action="store_true",
                        help="drive real 'dlx-node start' processes (LocalRun: anvil, libp2p, the chain), "
                             "each node process under its cgroup quota (bench/hetero_node.py)")
    parser.add_argument("--node-round-timeout", type=float, default=600.0,
                        help="--node: the nodes' round_timeout (a close waits this long for every replica)")
    parser.add_argument("--keep-workdir", action="store_true", help="--node: keep the runs' node directories")
    parser.add_argument("--throttle", choices=("training", "process"), default="training",
                        help="--node: what of each node the cgroup quota slows: its training thread (a slow "
                             "accelerator, default) or its whole process (a slow machine)")
    parser.add_argument("--no-delay", action="store_true",
                        help="--node: no one-step delay (a round's exchange waits for its close and apply, "
                             "as in the in-process mode) instead of the node's default delay")
    parser.add_argument("--screen-rule", choices=("auto", "one_sided", "two_sided", "paired"), default="auto",
                        help="diloco.screen_rule of the time-bounded run (docs/DILOCOX.md section 13; auto: "
                             "the run's default, version 1)")
    parser.add_argument("--screen-batch", type=int, default=16,
                        help="diloco.screen_batch_size of the time-bounded run (windows of the screening "
                             "batch; the fixed-H run keeps the default, 16)")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args(argv)
    args.data = args.data or default_corpus()
    if unavailable() is not None:
        print(f"needs the cgroup v1 cpu controller as root: {unavailable()}", file=sys.stderr)
        return 2
    load_at_start = list(os.getloadavg())
    import torch

    torch.set_num_threads(1)
    if args.node:
        from bench.hetero_node import run_node_mode as run
    else:
        run = run_mode
    fixed = run(args, "fixed")
    budget = run(args, "budget")
    equal_wall = min(fixed["wall_s"], budget["wall_s"])
    equal_tokens = min(fixed["tokens"], budget["tokens"])
    comparison = {
        "equal_wall_s": equal_wall,
        "loss_at_equal_wall": {"fixed": at(fixed["curve"], "wall_s", equal_wall),
                               "budget": at(budget["curve"], "wall_s", equal_wall)},
        "equal_tokens": equal_tokens,
        "loss_at_equal_tokens": {"fixed": at(fixed["curve"], "tokens", equal_tokens),
                                 "budget": at(budget["curve"], "tokens", equal_tokens)},
    }
    for key in ("loss_at_equal_wall", "loss_at_equal_tokens"):
        pair = comparison[key]
        pair["budget_vs_fixed"] = pair["budget"] / pair["fixed"] - 1
    comparison["min_compute_share_budget"] = min(r["compute_share_reaching_outer_step"]
                                                 for r in budget["replicas"])
    comparison["min_compute_share_fixed"] = min(r["compute_share_reaching_outer_step"]
                                                for r in fixed["replicas"])
    result = {
        "what": "replicas slowed 1x/2x/4x by cgroup v1 cpu quotas, time-bounded rounds vs fixed H " + (
            "(real dlx-node start processes: a local anvil, libp2p, the full exchange, each node's "
            f"{'training thread' if args.throttle == 'training' else 'process'} in its cpu group)"
            if args.node else
            "(one process per replica, contributions over pipes, the parent replays the aggregation)"),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "fixed": fixed, "budget": budget, "comparison": comparison,
    }
    path = write_result(args.out, result, load_at_start)
    print(f"wall per round: fixed {fixed['wall_s_per_round']:.2f}s, budget {budget['wall_s_per_round']:.2f}s")
    for name, run in (("fixed", fixed), ("budget", budget)):
        print(name,
              " ".join(
                  f"{r['factor']:g}x: {r['steps_per_round']:.1f} steps/round, {r['s_per_step'] * 1000:.0f} "
                  f"ms/step, share {r['compute_share_reaching_outer_step']:.1%}" + (
                                 f" (cpu {r['cpu_share_in_inner_steps']:.1%})"
                                 if r.get("cpu_share_in_inner_steps")
                                 else "") for r in run["replicas"]))
    print(
        f"held-out at equal wall ({equal_wall:.0f}s): fixed {comparison['loss_at_equal_wall']['fixed']:.4f}, "
        f"budget {comparison['loss_at_equal_wall']['budget']:.4f}; at equal tokens ({equal_tokens:,}): fixed "
        f"{comparison['loss_at_equal_tokens']['fixed']:.4f}, budget "
        f"{comparison['loss_at_equal_tokens']['budget']:.4f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
