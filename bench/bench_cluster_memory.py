"""Training state per rank of a node that is a cluster, at N = 1, 2, 4, against one process (issue 75).

One stage (a whole replica of ``--preset``, one pipeline stage) trains a round and applies it: one inner step
on a batch of random tokens, the contribution encoded (the run's codec, error feedback on), the round
aggregated with two more replicas' contributions. Then each process counts the training state it holds,
by tensor accounting (bytes of the tensors themselves, not RSS): the parameters, their gradients, the inner
AdamW state, and the outer state (global weights, outer momentum, round start, error-feedback residual).

* ``one_process``: a plain :class:`training.stage_engine.StageEngine` on the module's own parameters (no
  torch.distributed): the stage's training state, the denominator;
* ``cluster[N]``: N spawned ranks (gloo, one thread each), FSDP2 (:mod:`training.cluster_engine`), each
  rank's state and its share of the one-process state; the goal is at most ``1/N + 10%`` per rank (read
  strictly: ``1.1 / N``).

* ``node[N]``: the same round through a cluster *node's* path (``[compute] processes = N``:
  :class:`training.cluster_replica.ClusterReplicaTrainer` with its outer state sharded,
  :class:`training.cluster_node_engine.ShardedStageEngine`; docs/CLUSTER.md "The node wiring"), each N in
  a fresh process that is rank 0 and spawns the others: each rank's state (the live weights are the FSDP
  shards only: a rank gathers its tensors' live weights only while an outer command runs, ``live_copy``,
  0 at rest; the held-out eval's snapshot is gathered a tensor at a time and dropped after the eval). N = 1
  is the one-process node (``one_process``).

* ``round[N]``: a running node's whole round, part by part (bench/cluster_round.py: the start state, the inner
  step, the held-out eval, the encode, screening, the apply, the weights hash and chunk roots, the finisher's
  kept state and checkpoint shard; then fork repair's derive and move), after a first round; every rank's
  peak RSS over each part less its RSS before it (the part's *transient*), with glibc's mmap threshold
  fixed so that a freed tensor's pages go back at once; N = 1 is the one-process node. ``--rounds-only``
  prints these and writes nothing.

Each rank's peak RSS (VmHWM) is recorded too: it includes the interpreter and torch (about
300 MB a process here) and the round's transients (one whole tensor gathered at a time, the encoder's
work), so it is not the measure of the goal. Writes ONE JSON, bench/results/cluster_memory.json.

    PYTHONPATH=$PWD python bench/bench_cluster_memory.py [--preset llama-20m] [--ranks 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.benchio import default_out, peak_rss_bytes, write_result  # noqa: E402
from bench.cluster_round import FORK_PARTS, ROUND_PARTS  # noqa: E402
from training.compression import encode_contribution  # noqa: E402
from training.config import DilocoConfig, ModelConfig, TrainingConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.stages import StageModule, split_stages  # noqa: E402

BATCH, SEQ = 8, 64


def configs():
    return DilocoConfig(one_step_delay=False, num_replicas=3), CompressionConfig(), TrainingConfig()


def module_of(preset: str) -> StageModule:
    cfg = ModelConfig(preset=preset)
    return StageModule(cfg, split_stages(cfg.n_layer, 1)[0], seed=0)


def batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def others(shapes: dict, comp: CompressionConfig, outer_round: int = 0) -> list[bytes]:
    out = []
    for replica in (1, 2):
        tensors = {}
        for name, shape in shapes.items():
            generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + replica)
            tensors[name] = torch.mul(torch.randn(shape, generator=generator), 1e-3)
        out.append(encode_contribution(tensors, comp, stage_index=0, outer_round=outer_round)[0])
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def one_process(preset: str) -> dict:
    from training.model import lm_loss
    from training.pipeline import make_inner_optimizer
    from training.stage_engine import StageEngine

    torch.set_num_threads(1)
    dcfg, comp, tcfg = configs()
    module = module_of(preset)
    params = dict(module.named_parameters())
    optimizer = make_inner_optimizer(module, tcfg)
    engine = StageEngine(0, params, dcfg, comp)
    started = time.perf_counter()
    x, y = batch(module.cfg)
    optimizer.zero_grad(set_to_none=True)
    lm_loss(module(x), y).backward()
    optimizer.step()
    trained = time.perf_counter()
    own, _ = engine.encode_contribution(0)
    encoded = time.perf_counter()
    engine.apply_round(0, [own, *others({n: tuple(p.shape) for n, p in params.items()}, comp)])
    applied = time.perf_counter()
    state = {
        "params": nbytes(params.values()),
        "grads": nbytes(p.grad for p in params.values() if p.grad is not None),
        "inner_optimizer": nbytes(v for s in optimizer.state.values() for v in s.values()
                                  if isinstance(v, torch.Tensor) and v.dim() > 0),
        "outer": nbytes([*engine.global_weights.values(), *engine.momentum.values(),
                         *engine._round_start.values(), *engine.compressor.residual.values()]),
    }
    return {"state_bytes": state, "total_bytes": sum(state.values()),
            "peak_rss_bytes": peak_rss_bytes(),
            "seconds": {"inner_step": trained - started, "encode": encoded - trained,
                        "apply": applied - encoded},
            "params": sum(p.numel() for p in params.values()),
            "largest_tensor_bytes": max(p.numel() * 4 for p in params.values())}


def cluster_rank(rank: int, world: int, preset: str, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from training.cluster_engine import ClusterStageEngine, ClusterTrainer, shard_stage_module

    dcfg, comp, tcfg = configs()
    mesh = init_device_mesh("cpu", (world,))
    module = shard_stage_module(module_of(preset), mesh)
    trainer = ClusterTrainer(module, tcfg)
    engine = ClusterStageEngine(0, module, dcfg, comp)
    started = time.perf_counter()
    trainer.train_step(*batch(module.cfg))
    trained = time.perf_counter()
    part, _ = engine.encode_contribution(0)
    own = engine.gather_contribution(part)
    encoded = time.perf_counter()
    engine.apply_round(0, [own, *others(dict(engine.plan.shapes), comp)] if rank == 0 else None)
    applied = time.perf_counter()
    weights_hash = engine.weights_hash()
    roots = engine.chunk_roots()
    recorded = time.perf_counter()
    state = engine.state_bytes(trainer.optimizer)
    row = {"rank": rank, "tensors": len(engine.own), "state_bytes": state, "total_bytes": sum(state.values()),
           "outer_elements": engine.plan.numel(rank),
           "peak_rss_bytes": peak_rss_bytes(),
           "seconds": {"inner_step": trained - started, "encode_and_join": encoded - trained,
                       "apply": applied - encoded, "hash_and_roots": recorded - applied},
           "weights_hash": weights_hash.hex() if weights_hash else None,
           "weights_root": roots[0].hex() if roots else None}
    rows: list | None = [None] * world if rank == 0 else None
    dist.gather_object(row, rows, dst=0)
    if rank == 0:
        Path(path).write_text(json.dumps(rows))


NODE_OUTER = ("global", "momentum", "round_start", "residual")  # the kinds one_process counts as "outer"


def node_cluster(world: int, preset: str, path: str) -> None:
    """One round through a cluster node's path (module docstring, ``node[N]``); rank 0 is this process."""
    from training.cluster_replica import ClusterReplicaTrainer
    from training.model import init_state_dict

    torch.set_num_threads(1)
    dcfg, comp, tcfg = configs()
    model = ModelConfig(preset=preset)
    trainer = ClusterReplicaTrainer(model, TrainingConfig(batch_size=BATCH), world, init_state_dict(model, 0),
                                    threads=1)
    try:
        engine = trainer.outer_engine(0, dcfg, comp)
        started = time.perf_counter()
        trainer.begin_steps()
        trainer.train_step(*batch(model))
        trainer.end_steps()
        trained = time.perf_counter()
        own, _ = engine.encode_contribution(0)
        encoded = time.perf_counter()
        # the node keeps the state before the apply a few rounds (the finisher's held states, fork repair's
        # bases): handles, whose shards the ranks keep (training.cluster_node_engine.KeptState)
        kept = (engine.global_weights, engine.momentum)
        engine.finish_round(0, [own, *others(dict(engine.shapes), comp)])
        applied = time.perf_counter()
        weights_hash = engine.weights_hash()
        trainer.eval_loss([batch(model)])  # the node's held-out eval: a snapshot gathered and dropped
        rows = trainer.accounting()
        del kept
    finally:
        trainer.close()
    for rank, row in enumerate(rows):
        outer = row.pop("outer")
        row["rank"] = rank
        row["state_bytes"] = {key: row.pop(key)
                              for key in ("params", "grads", "inner_optimizer", "live_copy")}
        row["state_bytes"]["outer"] = sum(outer[key] for key in NODE_OUTER)
        row["snapshot_bytes"] = outer["snapshots"]  # the delay correction's (not counted by one_process)
        row["kept_bytes"] = row.pop("kept")  # the kept earlier state's shard (one process: that state whole)
        row["total_bytes"] = sum(row["state_bytes"].values())
    rows[0]["seconds"] = {"train": trained - started, "encode_and_join": encoded - trained,
                          "apply": applied - encoded}
    rows[0]["weights_hash"] = weights_hash.hex()
    Path(path).write_text(json.dumps(rows))


#: glibc's mmap threshold for the round's processes (bytes): every allocation from it up is its own mapping.
MMAP_ENV, MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_", 131072


def node_round(world: int, preset: str, path: str) -> None:
    """A running node's whole round, part by part, every rank's memory peak over each part
    (bench/cluster_round.py, ``round[N]``): N = 1 is the one-process node; rank 0 is this process."""
    from bench.cluster_round import RoundDriver, local_memory, node_cfg
    from training.model import init_state_dict

    torch.set_num_threads(1)
    dcfg, comp, tcfg = configs()
    model, training = ModelConfig(preset=preset), TrainingConfig(batch_size=BATCH)
    cfg = node_cfg(model, training, dcfg, comp)
    if world == 1:
        from training.pipeline import LocalReplicaTrainer
        from training.stage_engine import StageEngine

        trainer = LocalReplicaTrainer(model, training, 1, state_dict=init_state_dict(model, 0))
        engine = StageEngine(0, dict(trainer.stage_modules[0].named_parameters()), dcfg, comp)
        memory, close = local_memory, (lambda: None)
    else:
        from training.cluster_replica import ClusterReplicaTrainer

        trainer = ClusterReplicaTrainer(model, training, world, init_state_dict(model, 0), threads=1)
        engine = trainer.outer_engine(0, dcfg, comp)
        memory, close = trainer.memory, trainer.close
    try:
        shapes = {name: tuple(shape) for name, shape in engine.shapes.items()}
        driver = RoundDriver(trainer, engine, cfg, memory, lambda r: others(shapes, comp, r), batch(model),
                             [batch(model)])
        driver.round(0, measured=False)  # the state a running node holds: momentum, residual, snapshots
        base = driver.kept
        summary = driver.round(1, measured=True)
        driver.fork(1, base, [b"", *driver.others(1)])
        rows = trainer.accounting() if world > 1 else None
    finally:
        close()
    Path(path).write_text(json.dumps({"parts": driver.parts, "summary": summary, "accounting": rows}))


def round_rows(world: int, preset: str, stage: int) -> dict:
    """``node_round`` in a fresh process: each rank's peak over the round (its parts) and its largest part."""
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "round.json")
        process = multiprocessing.get_context("spawn").Process(target=node_round, args=(world, preset, out))
        # a freed tensor's pages go back at once (glibc's fixed mmap threshold, inherited by the ranks): the
        # peaks follow the tensors held, not the heap's fragmentation (docs/CLUSTER.md)
        before = os.environ.get(MMAP_ENV)
        os.environ[MMAP_ENV] = str(MMAP_THRESHOLD)
        try:
            process.start()
        finally:
            if before is None:
                os.environ.pop(MMAP_ENV)
            else:
                os.environ[MMAP_ENV] = before
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"node round at N={world}: exit code {process.exitcode}")
        got = json.loads(Path(out).read_text())
    parts = got["parts"]
    ranks = []
    accounting = got["accounting"] or [None]
    for rank in range(world):
        row = accounting[rank]
        state = stage if row is None else sum(row[key] for key in ("params", "grads", "inner_optimizer")) + \
            sum(row["outer"][key] for key in NODE_OUTER)
        rest = parts["start_state"][rank]["rss_before"]
        of_round = {name: parts[name][rank] for name in ROUND_PARTS}
        largest = max(of_round, key=lambda name: of_round[name]["transient"])
        peak = max(row["peak"] for row in of_round.values())
        fork = max(parts[name][rank]["transient"] for name in FORK_PARTS)
        ranks.append({"state_bytes": state, "state_share": state / stage,
                      "peak_share": (state + peak - rest) / stage,
                      "rss_at_rest": rest, "round_peak_rss": peak, "round_transient": peak - rest,
                      "round_transient_share": (peak - rest) / stage, "largest_part": largest,
                      "fork_transient": fork, "fork_transient_share": fork / stage,
                      "parts": {name: parts[name][rank]["transient"]
                                for name in (*ROUND_PARTS, *FORK_PARTS)}})
    print(f"round N={world}: rank 0 transient {ranks[0]['round_transient'] / 2**20:.1f} MiB "
          f"({ranks[0]['round_transient_share']:.3f} of the stage's state, largest part "
          f"{ranks[0]['largest_part']}), fork repair {ranks[0]['fork_transient'] / 2**20:.1f} MiB",
          flush=True)
    return {"ranks": ranks, "summary": got["summary"], "accounting": got["accounting"]}


def node_rows(world: int, preset: str, stage: int) -> dict:
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        process = multiprocessing.get_context("spawn").Process(target=node_cluster, args=(world, preset, out))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise SystemExit(f"node path at N={world}: exit code {process.exitcode}")
        rows = json.loads(Path(out).read_text())
    shares = [row["total_bytes"] / stage for row in rows]
    print(f"node N={world}: rank 0 share {shares[0]:.4f}, largest worker "
          f"{max(shares[1:], default=0):.4f} of the one-process state", flush=True)
    return {"ranks": rows, "shares": shares, "rank0_share": shares[0],
            "largest_worker_share": max(shares[1:], default=None),
            "rank0_outer_share": rows[0]["state_bytes"]["outer"] / max(1, sum(
                row["state_bytes"]["outer"] for row in rows)),
            "kept_state_bytes": sum(row["kept_bytes"] for row in rows),
            "rank0_kept_share": rows[0]["kept_bytes"] / max(1, sum(row["kept_bytes"] for row in rows)),
            "goal_strict": 1.1 / world, "meets_goal_strict": max(shares) <= 1.1 / world}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-20m")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", default=default_out(__file__))
    parser.add_argument("--rounds-only", action="store_true",
                        help="only the node's whole round (round[N]); print, write nothing")
    args = parser.parse_args()
    if args.rounds_only:
        stage = one_process(args.preset)["total_bytes"]
        for world in args.ranks:
            print(json.dumps(round_rows(world, args.preset, stage)["ranks"], indent=1), flush=True)
        return
    load = list(os.getloadavg())
    from training.cluster_launch import run_cluster

    base = one_process(args.preset)
    stage = base["total_bytes"]
    clusters = {}
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            run_cluster(cluster_rank, world, args.preset, out, backend="gloo", threads=1)
            rows = json.loads(Path(out).read_text())
        shares = [row["total_bytes"] / stage for row in rows]
        clusters[str(world)] = {
            "ranks": rows, "largest_share": max(shares), "shares": shares,
            "goal_strict": 1.1 / world, "goal_loose": 1 / world + 0.10,
            "meets_goal_strict": max(shares) <= 1.1 / world,
            "largest_share_times_n": max(shares) * world,
        }
        print(f"N={world}: largest rank share {max(shares):.4f} of the one-process state "
              f"(1/N = {1 / world:.4f}, goal {1.1 / world:.4f})", flush=True)
    node = {str(world): node_rows(world, args.preset, stage) for world in args.ranks if world > 1}
    rounds = {str(world): round_rows(world, args.preset, stage) for world in args.ranks}
    result = {
        "what": "training state per rank of one stage trained by N processes (FSDP2 + sharded outer state), "
                "tensor accounting, against one process",
        "preset": args.preset, "params": base["params"], "batch": [BATCH, SEQ],
        "measure": "bytes of the state tensors (params, grads, inner AdamW state, outer state); "
                   "RSS beside it",
        "one_process": base, "clusters": clusters, "node": node, "round": rounds,
        "round_note": "round[N]: a running node's whole round after a first one (bench/cluster_round.py: "
                      "start state, inner step, held-out eval, encode, screening, apply, weights hash and "
                      "chunk roots, the finisher's kept state and checkpoint shard), then fork repair's "
                      "derive and move; each part's transient per rank = its peak RSS over the part less its "
                      "RSS before it (free pages given back and the peak reset before each part); the "
                      "processes run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so a freed "
                      "tensor's pages go back at once; state_bytes: the rank's training state by tensor "
                      "accounting (N = 1: one_process's); peak_share = (state + round transient) / the "
                      "one-process state",
        "mmap_threshold": MMAP_THRESHOLD,
        "node_note": "node[N]: a cluster node's path (ClusterReplicaTrainer, outer state sharded); the live "
                     "weights are the FSDP shards only, a rank gathers its tensors' live weights only while "
                     "a command runs (live_copy, 0 at rest); 'outer' counts what "
                     "one_process counts (global, momentum, round start, residual), the delay correction's "
                     "snapshots are in snapshot_bytes; kept_bytes: a rank's shard of the earlier global "
                     "state (weights, momentum) the node keeps a handle on, as its finisher and fork repair "
                     "do (a one-process node keeps that state whole; not in total_bytes); N = 1 is "
                     "one_process",
        "note": "each N's weights hash differs after the round: the inner step's gradients are averaged by "
                "FSDP's reduce-scatter over N ranks and the byte budget is split N ways (docs/CLUSTER.md, "
                "Re-execution); the bit-exact comparisons are tests/test_cluster_engine.py's",
        "largest_transient_tensor_bytes": base["largest_tensor_bytes"],
        "cpu_threads_per_rank": 1,
    }
    path = write_result(args.out, result, load)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
