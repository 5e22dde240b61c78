"""bench/bench_heterogeneous.py ``--node``: the same comparison driven through real ``dlx-node start``
processes.

A :class:`node.commands.launcher.LocalRun` (a managed anvil, the contracts, one node process per replica,
one stage each, libp2p on loopback, the full exchange) with every replica's training thread in a cgroup v1
cpu group of ``quota / factor`` CPUs (node/commands/throttle.py) from the moment it logs that its start-up
is done (``start-up: caught up``; a whole node at 0.02 CPU took minutes to import torch and join): a slow
accelerator on an ordinary host, the issue's case (a consumer GPU beside a datacenter one). The training
thread is the node process's main thread; what it does is slowed (the inner steps, and its own work around
them: the start-state copies, the outer step) and so are the threads it starts from then on (each round's
prefetch: the close, the fetch, the aggregation), while the node's other threads (the lane's encode and
attestation, libp2p, the chain, status) run at the machine's pace. ``--throttle process`` slows the whole
node process instead, a slower machine: at quotas that bind on a loaded machine its host work (about a
CPU-second a round: libp2p, the chain, the encode) starves it. The nodes run the node's default one-step delay
(the exchange of round t overlaps round t+1's inner steps, the whole round: ``overlap_steps = 0``) with the
bench's outer lr and momentum; ``--no-delay`` runs the in-process mode's algorithm instead (a round's exchange
waits for its close and apply).

Figures come from what the run leaves: each node's ``timing.jsonl`` (node/live/state/roundclock.py: one record
per period, from the end of one round's inner steps to the end of the next one's: its steps, the wall
seconds of its inner steps, the period's wall seconds, the training thread's waits for others and its own
work, the lane's work, the CPU seconds of the inner steps and of the whole process), the chain's records
(which rounds committed, their ``tokens``: what the contributions declared), the logs' "our contribution
was not in the close" and "contribution .. of replica i .. excluded" (a contribution that did not reach the
outer step), and the held-out loss of each round's checkpoint (the global weights, every round:
``checkpoint_every = 1``) evaluated after the run, outside its clock. A round's wall time is the mean over
the nodes of their periods ending with that round (round 0 has none: the next round's); the run is stopped
once the rounds so far add up to ``--wall-s``.

**The compute share** of a replica, over its periods with a known wall time (round 1 on):

- *compute*: the wall seconds of the inner steps of rounds whose contribution reached the outer step
  (committed, in the close, not excluded);
- *idle*: everything else of the period: the training thread's waits for others (a close, contributions,
  the chain's commits), its own work around the steps (start-state copies, encode hand-off, the outer
  step, finishing a round not overlapped), and inner steps whose contribution was lost;
- ``compute_share_reaching_outer_step`` = compute / the periods' wall seconds (the issue's goal: >= 95%).

On a GPU the node's host work (encode, aggregate, libp2p, the chain) runs beside the inner steps; here the
whole node shares one throttled CPU, so that work also slows the inner steps it overlaps, and the wall
seconds of the inner steps include it. ``cpu_share_in_inner_steps`` says how much: the CPU seconds of the
training thread in inner steps that reached the outer step / the CPU seconds of the whole node process over
the same periods.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from node.commands.throttle import CpuGroup

DROPPED = re.compile(r"round (\d+) stage \d+: our contribution was not in the close")
EXCLUDED = re.compile(r"round (\d+) stage \d+: contribution [0-9a-f]+ of replica (\d+) \(.*?\) excluded")
#: The training thread's waits for others, and its own work around the inner steps (RoundClock's phases).
WAITS = ("close_wait", "fetch_wait", "commit_wait")
OWN_WORK = ("start_state", "eval", "encode", "aggregate", "finish_other", "other")


def _settings(args, mode: str) -> list[str]:
    common = [f"model.preset={args.preset}", f"training.batch_size={args.batch_size}",
              f"training.inner_lr={args.inner_lr}", f"training.warmup_steps={args.warmup_steps}",
              "training.lr_schedule=constant", f"training.seed={args.seed}",
              f"training.data_path={args.data}", f"diloco.outer_lr={args.outer_lr}",
              f"diloco.outer_momentum={args.outer_momentum}", "diloco.one_step_delay=false" if args.no_delay
              else "diloco.overlap_steps=0",
              "rounds=100000", "checkpoint_every=1", "spot_checks=0",
              "join_timeout=600", f"round_timeout={args.node_round_timeout}", "p2p.transfer_timeout=120"]
    if mode == "fixed":
        return common + [f"diloco.inner_steps={args.fixed_h}"]
    return common + [f"diloco.inner_steps={args.max_steps}", f"diloco.round_budget_s={args.budget_s}",
                     f"diloco.min_inner_steps={args.min_steps}", f"diloco.screen_rule={args.screen_rule}",
                     f"diloco.screen_batch_size={args.screen_batch}"]


def _periods(slot) -> dict[int, dict]:
    """round -> the node's period record ending with that round's inner steps (its timing.jsonl)."""
    periods = {}
    path = slot.data_dir / "timing.jsonl"
    if not path.exists():
        return periods
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if record.get("kind") == "period":
            periods[record["round"]] = record
    return periods


def _lost(run) -> set[tuple[int, int]]:
    """(round, replica) of every contribution that did not reach the outer step, as the nodes' logs say."""
    lost = set()
    for slot in run.nodes:
        for path in sorted(slot.data_dir.glob("node-*.log")):
            text = path.read_text(errors="replace")
            lost.update((int(m[1]), slot.replica) for m in DROPPED.finditer(text))
            lost.update((int(m[1]), int(m[2])) for m in EXCLUDED.finditer(text))
    return lost


def _rounds_so_far(run) -> list[dict]:
    """The rounds every node trained, in order, with their periods and wall time (module docstring)."""
    periods = {slot.replica: _periods(slot) for slot in run.nodes}
    replicas = sorted(periods)
    lost = _lost(run)
    rounds = []
    for outer_round in range(100000):
        if not all(outer_round in periods[i] for i in replicas):
            break
        records = [periods[i][outer_round] for i in replicas]
        walls = [p["wall_s"] for p in records if p["wall_s"] is not None]
        rounds.append({"round": outer_round, "steps": [p["steps"] for p in records],
                       "train_s": [p["inner_s"] for p in records],
                       "wall_s": sum(walls) / len(walls) if walls else None,
                       "dropped": [i for i in replicas if (outer_round, i) in lost], "periods": records})
    first = next((r["wall_s"] for r in rounds if r["wall_s"] is not None), None)
    # round 0 has no period before it: the round after's (its steps ran under the same budget)
    for r in rounds:
        if r["wall_s"] is None:
            r["wall_s"] = first if first is not None else max(r["train_s"])
    return rounds


def _replica_figures(rounds: list[dict], index: int, factor: float, cpus: float) -> dict:
    """One replica's steps, speed, compute share and where the rest of its periods went (module docstring)."""
    steps = sum(r["steps"][index] for r in rounds)
    seconds = sum(r["train_s"][index] for r in rounds)
    timed = [(r["periods"][index], index not in r["dropped"]) for r in rounds
             if r["periods"][index]["wall_s"]]
    wall = sum(p["wall_s"] for p, _reached in timed)
    cpu = [(p, reached) for p, reached in timed if p.get("process_cpu_s")
           and p.get("inner_cpu_s") is not None]
    per_round = {"waits_s": sum(p[f"{k}_s"] for p, _r in timed for k in WAITS) / len(timed),
                 "own_work_s": sum(p.get(f"{k}_s") or 0.0 for p, _r in timed for k in OWN_WORK) / len(timed),
                 "lost_inner_s": sum(p["inner_s"] for p, reached in timed if not reached) / len(timed),
                 "lane_s": sum(v for p, _r in timed for k, v in p.items() if k.startswith("lane_"))
                     / len(timed)}
    return {"factor": factor, "cpu_quota": cpus, "steps": steps, "steps_per_round": steps / len(rounds),
            "s_per_step": seconds / steps, "periods": len(timed), "period_wall_s": wall / len(timed),
            "compute_share_reaching_outer_step": sum(min(p["inner_s"], p["wall_s"]) for p, reached in timed
                                                     if reached) / wall,
            "cpu_share_in_inner_steps": sum(p["inner_cpu_s"] for p, reached in cpu if reached) / sum(
                p["process_cpu_s"] for p, _r in cpu) if cpu else None,
            "idle_per_round": per_round}


def _throttle_started(run, limits: dict[int, float], groups: dict, what: str) -> None:
    """Put each node whose start-up is done into its replica's cpu group (module docstring): its training
    thread (``what = "training"``) or its whole process (``"process"``)."""
    for slot in run.nodes:
        if slot.replica in groups:
            continue
        if any("start-up: caught up" in path.read_text(errors="replace")
               for path in slot.data_dir.glob("node-*.log")):
            groups[slot.replica] = CpuGroup(
                f"dlx-bench-het-{run.run_id}-{time.monotonic_ns()}-r{slot.replica}",
                limits[slot.replica])
            if what == "process":
                groups[slot.replica].add(slot.process.pid)
            else:  # `dlx-node start` trains on its main thread, whose thread id is the process id
                groups[slot.replica].add_thread(slot.process.pid)


def run_node_mode(args, mode: str) -> dict:
    import torch

    from node.commands.launcher import LocalRun
    from node.store.checkpoint import read_checkpoint
    from training.config import ModelConfig, TrainingConfig
    from training.data import eval_batches, load_corpus
    from training.pipeline import LocalReplicaTrainer

    workdir = Path(tempfile.mkdtemp(prefix=f"dlx-bench-het-node-{mode}-"))
    limits = {index: args.quota / factor for index, factor in enumerate(args.factors)}
    run = LocalRun(workdir, replicas=len(args.factors), stages=1, split=False, settings=_settings(args, mode),
                   attest_quorum=1, attest_quorum_bps=0, allow_weak_quorum=True)
    rounds: list[dict] = []
    groups: dict[int, CpuGroup] = {}
    try:
        run.setup()
        run.start()
        while True:
            time.sleep(0.5 if len(groups) < len(run.nodes) else 2.0)
            _throttle_started(run, limits, groups, args.throttle)
            if any(slot.process.poll() is not None for slot in run.nodes):
                raise RuntimeError(f"a node exited; logs under {workdir}")
            rounds = _rounds_so_far(run)
            if rounds and sum(r["wall_s"] for r in rounds) >= args.wall_s:
                break
        client = run.client()
        history = client.history(run.run_id)
        # Only the committed rounds count; wait a little for the ones the nodes have trained to be recorded.
        deadline = time.monotonic() + args.node_round_timeout
        while len(history.commits) < len(rounds) and time.monotonic() < deadline:
            time.sleep(2.0)
            history = client.history(run.run_id)
        commits = {c.commit.round: c.commit for c in history.commits}
        run.stop_nodes()
        rounds = [r for r in _rounds_so_far(run) if r["round"] in commits][:len(rounds)]
        model = ModelConfig(preset=args.preset)
        training = TrainingConfig(seed=args.seed, batch_size=args.batch_size)
        corpus = load_corpus(args.data, training.eval_fraction, model.block_size)
        held_out = eval_batches(corpus, args.eval_batches, training.batch_size, model.block_size)
        evaluator = LocalReplicaTrainer(model, training, 1)
        torch.set_num_threads(1)
        curve = [{"wall_s": 0.0, "tokens": 0, "eval_loss": evaluator.eval_loss(held_out)}]
        wall = tokens = 0
        for r in rounds:
            path = next(p for slot in run.nodes
                        for p in [slot.data_dir / "checkpoints" / f"round-{r['round']:08d}.safetensors"]
                        if p.exists())
            evaluator.load_state_dict(read_checkpoint(path).weights)
            r["eval_loss"] = evaluator.eval_loss(held_out)
            r["record_tokens"] = commits[r["round"]].tokens
            r["contributors"] = commits[r["round"]].num_contributors
            wall += r["wall_s"]
            tokens += r["record_tokens"]
            curve.append({"wall_s": wall, "tokens": tokens, "eval_loss": r["eval_loss"]})
    finally:
        run.stop()
        for group in groups.values():
            group.remove()
    replicas = [_replica_figures(rounds, index, factor, limits[index])
                for index, factor in enumerate(args.factors)]
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    settings = _settings(args, mode)
    return {"mode": mode, "node_settings": settings, "rounds": len(rounds), "wall_s": wall,
            "wall_s_per_round": wall / len(rounds), "tokens": tokens,
            "final_eval_loss": curve[-1]["eval_loss"], "replicas": replicas, "curve": curve,
            "per_round": rounds, "workdir": str(workdir)}
