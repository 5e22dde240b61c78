"""bench/bench_heterogeneous.py ``--node``: the same comparison driven through real ``dlx-node start`` processes.

A :class:`node.commands.launcher.LocalRun` (a managed anvil, the contracts, one node process per replica,
one stage each, libp2p on loopback, the full exchange) with every replica's node process in a cgroup v1
cpu group of ``quota / factor`` CPUs (node/commands/throttle.py) from the moment it logs that its start-up
is done (``start-up: caught up``; a whole node at 0.02 CPU took minutes to import torch and join): from
then on the whole node is slowed (its inner steps, its encode, gossip and chain work), as on a slower
machine. Its first few inner steps of round 0 may run before the limit (round 0's wall time is not
measured: it has no round before it). Figures come from
what the run leaves: each node's log line per round (``round t: k inner steps in X s (Y s since the last
round's ...)``: the replica's inner-step seconds and the round's wall time as it saw it), the chain's
records (which rounds committed, their ``tokens``: what the contributions declared), the logs' "our
contribution was not in the close" (a contribution that did not reach the outer step), and the held-out
loss of each round's checkpoint (the global weights, every round: ``checkpoint_every = 1``) evaluated
after the run, outside its clock. A round's wall time is the mean over the nodes of the seconds between
the ends of their inner steps of that round and of the round before; the run is stopped once the rounds
so far add up to ``--wall-s``. Without ``--node-delay`` the nodes run the in-process mode's algorithm (no
one-step delay: a round's exchange waits for its close and apply, the bench's outer lr and momentum); with
it, the node's default one-step delay (the exchange of round t overlaps round t+1's inner steps, the whole
round: ``overlap_steps = 0``) and its default outer settings.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

from node.commands.throttle import CpuGroup

TRAINED = re.compile(r"round (\d+): (\d+) inner steps in ([0-9.]+)s \((?:first period|([0-9.]+)s since)")
DROPPED = re.compile(r"round (\d+) stage \d+: our contribution was not in the close")


def _settings(args, mode: str) -> list[str]:
    common = [f"model.preset={args.preset}", f"training.batch_size={args.batch_size}",
              f"training.inner_lr={args.inner_lr}", f"training.warmup_steps={args.warmup_steps}",
              "training.lr_schedule=constant", f"training.seed={args.seed}", f"training.data_path={args.data}",
              *(["diloco.overlap_steps=0"] if args.node_delay else [
                  f"diloco.outer_lr={args.outer_lr}", f"diloco.outer_momentum={args.outer_momentum}",
                  "diloco.one_step_delay=false"]),
              "rounds=100000", "checkpoint_every=1", "spot_checks=0",
              "join_timeout=600", f"round_timeout={args.node_round_timeout}", "p2p.transfer_timeout=120"]
    if mode == "fixed":
        return common + [f"diloco.inner_steps={args.fixed_h}"]
    return common + [f"diloco.inner_steps={args.max_steps}", f"diloco.round_budget_s={args.budget_s}",
                     f"diloco.min_inner_steps={args.min_steps}"]


def _log_rounds(slot) -> tuple[dict[int, tuple[int, float, float | None]], set[int]]:
    """round -> (inner steps, their seconds, wall seconds since the previous round's), and the dropped rounds."""
    trained, dropped = {}, set()
    for path in sorted(slot.data_dir.glob("node-*.log")):
        text = path.read_text(errors="replace")
        for match in TRAINED.finditer(text):
            trained[int(match[1])] = (int(match[2]), float(match[3]), float(match[4]) if match[4] else None)
        dropped.update(int(m[1]) for m in DROPPED.finditer(text))
    return trained, dropped


def _rounds_so_far(run) -> list[dict]:
    """The rounds every node trained and logged, in order, with their wall time (module docstring)."""
    logs = [_log_rounds(slot) for slot in run.nodes]
    rounds = []
    for outer_round in range(100000):
        if not all(outer_round in trained for trained, _dropped in logs):
            break
        periods = [trained[outer_round][2] for trained, _dropped in logs]
        walls = [p for p in periods if p is not None]
        rounds.append({"round": outer_round, "steps": [trained[outer_round][0] for trained, _d in logs],
                       "train_s": [trained[outer_round][1] for trained, _d in logs],
                       "wall_s": sum(walls) / len(walls) if walls else None,
                       "dropped": [i for i, (_t, dropped) in enumerate(logs) if outer_round in dropped]})
    first = next((r["wall_s"] for r in rounds if r["wall_s"] is not None), None)
    for r in rounds:  # round 0 has no period before it: the round after's (its steps ran under the same budget)
        if r["wall_s"] is None:
            r["wall_s"] = first if first is not None else max(r["train_s"])
    return rounds


def _throttle_started(run, limits: dict[int, float], groups: dict) -> None:
    """Put each node whose start-up is done into its replica's cpu group (module docstring)."""
    for slot in run.nodes:
        if slot.replica in groups:
            continue
        if any("start-up: caught up" in path.read_text(errors="replace") for path in slot.data_dir.glob("node-*.log")):
            groups[slot.replica] = CpuGroup(f"dlx-bench-het-{run.run_id}-{time.monotonic_ns()}-r{slot.replica}",
                                            limits[slot.replica])
            groups[slot.replica].add(slot.process.pid)


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
            _throttle_started(run, limits, groups)
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
                        for p in [slot.data_dir / "checkpoints" / f"round-{r['round']:08d}.safetensors"] if p.exists())
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
    replicas = []
    for index, factor in enumerate(args.factors):
        steps = sum(r["steps"][index] for r in rounds)
        seconds = sum(r["train_s"][index] for r in rounds)
        reached = sum(r["train_s"][index] for r in rounds if index not in r["dropped"])
        replicas.append({"factor": factor, "cpu_quota": limits[index], "steps": steps,
                         "steps_per_round": steps / len(rounds), "s_per_step": seconds / steps,
                         "compute_share_reaching_outer_step": reached / wall})
    if not args.keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    settings = _settings(args, mode)
    return {"mode": mode, "node_settings": settings, "rounds": len(rounds), "wall_s": wall,
            "wall_s_per_round": wall / len(rounds), "tokens": tokens, "final_eval_loss": curve[-1]["eval_loss"],
            "replicas": replicas, "curve": curve, "per_round": rounds, "workdir": str(workdir)}
