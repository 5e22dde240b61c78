"""Crashes in a real run: random nodes killed with SIGKILL and restarted, the run loses nothing.

    python bench/bench_chaos.py [--replicas 2] [--kills 20] [--min-rounds 30] [--inner-steps 20]

A real local run (anvil, ``--replicas`` split clusters of 2 stages each, one node
per stage, the ``tiny`` model, k = 2 staked members per record). Over and over:
let the run train a moment, SIGKILL a random node, restart it after a random
delay, and wait until it has recovered: the run commits a round again that
every replica contributed to (so the killed node is back, from the chain's
checkpoint, and its cluster's pipeline is formed again). Then the next kill,
until ``--kills`` kills are done and at least ``--min-rounds`` rounds are
committed. The nodes are stopped (SIGTERM) and ``dlx-node audit`` checks the
whole history against every node's archive.

It records: rounds committed (each exactly once, in order, none lost), kills,
rounds with fewer contributors than every node, the recovery time of each kill
(SIGKILL to the first later round committed with every contributor), every
node exit that was not a kill (there must be none: a split cluster's survivor
waits for its partner and re-forms the pipeline), how each restarted node
entered (the chain-verified checkpoint), and the audit verdict. Writes
bench/results/chaos.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from node.commands.launcher import LocalRun  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def log_text(slot) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(slot.data_dir.glob("node-*.log")))


def last_contributed(slot) -> int:
    """The last round the node contributed to, from its state.json (-1 if none or unreadable)."""
    try:
        return int(json.loads((slot.data_dir / "state.json").read_text()).get("last_contributed", -1))
    except (OSError, ValueError):
        return -1


def full_round_after(client, run_id: int, after: int, contributors: int) -> int | None:
    """The first committed round > ``after`` that every contributor is in, or None yet."""
    last = client.last_round(run_id)
    if last is None:
        return None
    for round_index in range(after + 1, last + 1):
        if client.commit_of(run_id, round_index).num_contributors == contributors:
            return round_index
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--min-rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--round-timeout", type=float, default=60)
    parser.add_argument("--recovery-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--workdir", default="/tmp/dlx-chaos")
    parser.add_argument("--out", default=str(RESULTS / "chaos.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    started = time.monotonic()
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"round_timeout={args.round_timeout}", "checkpoint_every=1", "rounds=0", "join_timeout=60"]
    run = LocalRun(Path(args.workdir), replicas=args.replicas, stages=2, split=True, settings=settings,
                   attest_quorum=2, stake_wei=10**18)
    run.setup()
    nodes = len(run.nodes)
    result: dict = {"command": "python " + " ".join(sys.argv), "replicas": args.replicas, "stages": 2, "nodes": nodes, "settings": settings, "k": 2,
                    "kills": [], "unexpected_exits": [], "load_before": os.getloadavg()}
    try:
        run.start()
        client = run.client()
        deadline = time.monotonic() + 600
        while full_round_after(client, run.run_id, -1, nodes) is None:
            if time.monotonic() > deadline:
                raise SystemExit("the run never committed a round with every node")
            time.sleep(2)
        killed_pids: set[int] = set()
        kill = 0
        while kill < args.kills or (client.last_round(run.run_id) or 0) + 1 < args.min_rounds:
            time.sleep(rng.uniform(2, 10))  # the run trains a moment between faults
            victim = rng.choice(run.nodes)
            last_before = client.last_round(run.run_id)
            killed_pids.add(victim.process.pid)
            run.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            contributed_before = last_contributed(victim)  # what its killed life had sent
            delay = rng.uniform(1, 20)
            time.sleep(delay)
            last_at_restart = client.last_round(run.run_id)
            run.start_node(victim)
            entry = {"kill": kill, "node": victim.name, "round_at_kill": last_before,
                     "contributed_before_kill": contributed_before, "restart_delay_s": round(delay, 1)}
            recovered = None
            while time.monotonic() - killed_at < args.recovery_timeout:
                # A node that exits unasked (not killed by us) is a failure of the run.
                for slot in run.nodes:
                    if slot.process.poll() is not None and slot.process.pid not in killed_pids:
                        result["unexpected_exits"].append({"node": slot.name, "code": slot.process.returncode,
                                                           "kill": kill})
                        killed_pids.add(slot.process.pid)
                        run.start_node(slot)
                # Recovered: a round trained after the restart holds every node's contribution: a
                # full round past the rounds committed by the restart and past every round the killed
                # life contributed to (with the commit lag, those can be full rounds it never saw).
                recovered = full_round_after(client, run.run_id, max(last_at_restart + 1, contributed_before),
                                             nodes)
                if recovered is not None:
                    break
                time.sleep(1)
            entry["recovered_round"] = recovered
            entry["recovery_s"] = None if recovered is None else round(time.monotonic() - killed_at, 1)
            result["kills"].append(entry)
            print(json.dumps(entry), flush=True)
            # Kept up to date after every kill: a run cut short still leaves its figures.
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({**result, "partial": True}, indent=1) + "\n")
            kill += 1
        run.stop_nodes()
        result["exit_codes_at_stop"] = {s.name: s.process.returncode for s in run.nodes}
        history = client.history(run.run_id)
        rounds = [c.commit.round for c in history.commits]
        contributors = [c.commit.num_contributors for c in history.commits]
        result["rounds"] = len(rounds)
        result["rounds_in_order_once"] = rounds == list(range(len(rounds)))
        result["rounds_with_fewer_contributors"] = sum(1 for c in contributors if c < nodes)
        result["contributors_per_round"] = contributors
        result["disputes"] = len(history.disputes)
        result["checkpoint_entries"] = sum(log_text(s).count("from the chain-verified checkpoint of round")
                                           for s in run.nodes)
        result["restarts"] = sum(s.starts - 1 for s in run.nodes)
        result["pipeline_reformed"] = sum(log_text(s).count("re-formed; entering at round") for s in run.nodes)
        recoveries = [k["recovery_s"] for k in result["kills"] if k["recovery_s"] is not None]
        result["recovery_s"] = {"min": min(recoveries, default=None), "max": max(recoveries, default=None),
                                "mean": round(sum(recoveries) / len(recoveries), 1) if recoveries else None,
                                "unrecovered": sum(1 for k in result["kills"] if k["recovery_s"] is None)}
        audit = subprocess.run(
            [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id),
             "--deployment", str(run.workdir / "deployment.json"), "--json", str(run.workdir / "audit.json"),
             *[a for s in run.nodes for a in ("--archive", str(s.data_dir))]],
            capture_output=True, text=True, timeout=1800, check=False)
        result["audit"] = {"exit_code": audit.returncode,
                           "verdict": next((w for w in ("PASSED", "INCOMPLETE", "FAILED") if w in audit.stdout), None),
                           "tail": audit.stdout.splitlines()[-3:]}
    finally:
        run.stop()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"rounds {result['rounds']} (in order, each once: {result['rounds_in_order_once']}), kills "
          f"{len(result['kills'])}, rounds with fewer contributors {result['rounds_with_fewer_contributors']}, "
          f"recovery {result['recovery_s']}, unexpected exits {len(result['unexpected_exits'])}, "
          f"audit {result['audit']['verdict']}")
    ok = (result["rounds_in_order_once"] and not result["unexpected_exits"] and result["audit"]["exit_code"] == 0
          and result["recovery_s"]["unrecovered"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
