"""Crashes in a real run: random nodes killed with SIGKILL and restarted, the run loses nothing.

    python bench/bench_chaos.py --split [--replicas 2] [--kills 20] [--min-rounds 30] [--inner-steps 20]

A real local run (anvil, ``--replicas`` clusters, the ``tiny`` model, k = 2 staked
members per record); with ``--split`` every cluster is split over 2 nodes, one per
stage (else one node holds both stages). Over and over: let the run train a
moment, SIGKILL a random node, restart it after 2-6 s (as issue 30 did), and wait
until it has recovered: the run commits a round again that every replica
contributed to (so the killed node is back and its cluster's pipeline is formed
again). Every ``--entry-every``-th fault hits entry: once the restarted node says
it is joining again, its partner (split) or the node itself is killed too, so a
pipeline partner dies while the other enters the run. Then the next kill, until
``--kills`` kills are done and at least ``--min-rounds`` rounds are committed.
The nodes are stopped (SIGTERM) and ``dlx-node audit --reexecute`` checks the
whole history against every node's archive.

Each kill is classed by the phase the killed node reported (status.json) at that
moment: entry (joining), training, exchange (finishing a round: close, fetch,
aggregate, attest), checkpoint (writing its stage shard), waiting (for a
partner). It records, per kill, the round committed at the restart and the first
later round with every contributor (recovery rounds: how many rounds after its
restart the replica was back; rounds after entry: the same from the round its new
life entered at, without the process start-up; rounds missed after ready: the rounds committed
without the replica (fewer contributors than nodes) after its restarted process was ready
(node/live/startup.py, "pipeline
formed": imports, chain, host, placement and partner done), before the round it is back in; of those, the
rounds still open at ready: the round the other replicas trained then or a later one, the rest being rounds
closed before and committed after it, the commit lag), and
overall: rounds committed (each exactly once,
in order), rounds with fewer contributors than every node, every node exit that
was not a kill, tracebacks in any log, the audit verdict, and a table by phase.
Writes bench/results/chaos.json.
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

from bench.benchio import default_out, write_result  # noqa: E402
from node.commands.launcher import LocalRun  # noqa: E402
from node.live.startup import parse_marks, process_start_time  # noqa: E402

#: The start-up phase after which a restarted process is ready (bench/bench_restart.py: imports, chain,
#: host, placement and the pipeline with its partner done); rounds are counted from there too.
READY = "pipeline formed"


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


#: status.json "state" -> phase of a kill (the node's own report at that moment).
PHASES = {"joining": "entry", "training": "training", "finishing": "exchange", "checkpointing": "checkpoint",
          "waiting for partner": "waiting"}


def phase_of(slot) -> str:
    state = slot.status().get("state", "") if slot.process is not None and slot.process.poll() is None \
        else "down"
    return PHASES.get(state, state or "unknown")


def partner_of(run: LocalRun, slot):
    """Another node of the slot's cluster (split clusters), else the slot itself."""
    return next((s for s in run.nodes if s.cluster == slot.cluster and s is not slot), slot)


class Chaos:
    """The faults, their recoveries and the run's figures (see module docstring)."""

    def __init__(self, run: LocalRun, args, rng: random.Random) -> None:
        self.run = run
        self.args = args
        self.rng = rng
        self.client = run.client()
        self.nodes = len(run.nodes)
        self.killed_pids: set[int] = set()
        self.kills: list[dict] = []
        self.unexpected_exits: list[dict] = []
        self.samples: list[tuple[float, int]] = []  # (wall time, last committed round), polled
        # (wall time, cluster -> the highest round its live nodes train), polled with the commits
        self.trained: list[tuple[float, dict[str, int]]] = []

    def last_round(self) -> int:
        last = self.client.last_round(self.run.run_id)
        last = -1 if last is None else last
        self.samples.append((time.time(), last))
        trained: dict[str, int] = {}
        for slot in self.run.nodes:
            if slot.process is not None and slot.process.poll() is None:
                training = slot.status().get("round")
                if isinstance(training, int):
                    trained[slot.cluster] = max(trained.get(slot.cluster, -1), training)
        self.trained.append((time.time(), trained))
        return last

    def trained_at(self, when: float, cluster: str) -> int:
        """The highest round the other clusters' nodes trained at wall time ``when`` (last sample before
        it)."""
        before = [t for at, t in self.trained if at <= when]
        return max((r for c, r in before[-1].items() if c != cluster), default=-1) if before else -1

    def round_at(self, when: float) -> int:
        """The last round committed at wall time ``when`` (the last sample taken before it)."""
        before = [last for t, last in self.samples if t <= when]
        return before[-1] if before else -1

    def kill(self, victim, phase: str | None = None) -> dict:
        """SIGKILL ``victim`` now; returns its entry (phase, round, what its life had contributed)."""
        phase = phase or phase_of(victim)
        entry = {"kill": len(self.kills), "node": victim.name, "phase": phase,
                 "round_at_kill": self.last_round(), "contributed_before_kill": last_contributed(victim)}
        self.killed_pids.add(victim.process.pid)
        self.run.kill(victim, signal.SIGKILL)
        entry["killed_at"] = time.monotonic()
        self.kills.append(entry)
        return entry

    def restart(self, victim, entry: dict) -> None:
        delay = self.rng.uniform(2, 6)
        time.sleep(max(0.0, entry["killed_at"] + delay - time.monotonic()))
        entry["restart_delay_s"] = round(delay, 1)
        entry["round_at_restart"] = self.last_round()
        self.run.start_node(victim)
        entry["process_started"] = process_start_time(victim.process.pid)

    def await_joining(self, slot, timeout: float = 120) -> bool:
        """Wait until a restarted node reports that it is entering the run (its new life's status)."""
        deadline = time.monotonic() + timeout
        pid = slot.process.pid
        while time.monotonic() < deadline:
            status = slot.status()
            if status.get("pid") == pid and status.get("state") == "joining":
                return True
            time.sleep(0.1)
        return False

    def check_exits(self) -> None:
        """A node that exits unasked (not killed by us) is a failure of the run; it is started again."""
        for slot in self.run.nodes:
            if slot.process.poll() is not None and slot.process.pid not in self.killed_pids:
                self.unexpected_exits.append({"node": slot.name, "code": slot.process.returncode,
                                              "kill": len(self.kills)})
                self.killed_pids.add(slot.process.pid)
                self.run.start_node(slot)

    def entered_round(self, name: str) -> int | None:
        """The round the node's current life entered the run at (its log), None before it entered."""
        slot = next(s for s in self.run.nodes if s.name == name)
        if slot.log_path is None or not slot.log_path.exists():
            return None
        for line in slot.log_path.read_text(errors="replace").splitlines():
            if "entering at round " in line:
                return int(line.split("entering at round ", 1)[1].split()[0])
        return None

    def await_recovery(self, entries: list[dict]) -> None:
        """Wait until, for every entry, a round past its restart holds every node's contribution."""
        while True:
            self.check_exits()
            pending = [e for e in entries if e.get("recovered_round") is None]
            self.last_round()  # a sample: which round was committed when each start-up phase ended
            for entry in pending:
                if entry.get("entered_round") is None:
                    entry["entered_round"] = self.entered_round(entry["node"])
                # Past the rounds committed at the restart and every round the killed life contributed
                # to (with the commit lag, those can be full rounds it never saw).
                after = max(entry["round_at_restart"] + 1, entry["contributed_before_kill"])
                recovered = full_round_after(self.client, self.run.run_id, after, self.nodes)
                if recovered is not None:
                    entry["recovered_round"] = recovered
                    entry["recovery_rounds"] = recovered - entry["round_at_restart"]
                    # the protocol's part, without process start-up
                    if entry.get("entered_round") is not None:
                        entry["rounds_after_entry"] = recovered - entry["entered_round"]
                    entry["recovery_s"] = round(time.monotonic() - entry["killed_at"], 1)
                    self.ready_figures(entry, recovered)
            if not [e for e in entries if e.get("recovered_round") is None]:
                return
            if any(time.monotonic() - e["killed_at"] > self.args.recovery_timeout for e in entries):
                for entry in entries:
                    entry.setdefault("recovered_round", None)
                    entry.setdefault("recovery_rounds", None)
                    entry.setdefault("recovery_s", None)
                return
            time.sleep(1)

    def ready_figures(self, entry: dict, recovered: int) -> None:
        """When the restarted process was ready (seconds after its start) and the rounds committed without
        its replica from then on, before the round it is back in."""
        slot = next(s for s in self.run.nodes if s.name == entry["node"])
        marks = parse_marks(slot.log_path.read_text(errors="replace")) if slot.log_path is not None else {}
        if READY not in marks or "process_started" not in entry:
            return
        entry["ready_s"] = marks[READY]
        entry["first_contribution_s"] = marks.get("first contribution")
        entry["round_at_ready"] = self.round_at(entry["process_started"] + marks[READY])
        entry["round_trained_at_ready"] = self.trained_at(entry["process_started"] + marks[READY],
                                                          slot.cluster)
        # Only the rounds committed short of a contributor count: a round after ready that still holds
        # the killed life's contribution (killed during its exchange, committed later) was not missed.
        # (Before, every round in between counted: kills 0/10/11 of the first --split run read 3 where
        # 2 rounds were committed without the replica.) Kills are sequential, so a short round is its.
        between = range(entry["round_at_ready"] + 1, recovered)
        entry["rounds_after_ready"] = len(between)
        short = {r for r in between if self.client.commit_of(self.run.run_id, r).num_contributors
                     < self.nodes}
        entry["rounds_missed_after_ready"] = len(short)
        # Of those, the rounds the other replicas had not yet trained through when it was ready (the round
        # they trained then and later ones): what entering the open round (RunEntry.reenter) can save. The
        # others are rounds closed before it was ready and committed after (the commit lag).
        entry["rounds_missed_open_at_ready"] = sum(1 for r in short if r >= entry["round_trained_at_ready"])

    def fault(self, index: int) -> list[dict]:
        """One fault: a kill at a random moment, or (every --entry-every-th) a kill during entry too."""
        time.sleep(self.rng.uniform(2, 10))  # the run trains a moment between faults
        victim = self.rng.choice(self.run.nodes)
        first = self.kill(victim)
        self.restart(victim, first)
        entries = [first]
        entry_fault = self.args.entry_every and index % self.args.entry_every == self.args.entry_every - 1
        # Every --entry-every-th fault: the partner dies while the restarted node enters the run (issue 30).
        if entry_fault and self.await_joining(victim):
            target = partner_of(self.run, victim)
            second = self.kill(target, phase="entry")
            second["entering"] = victim.name
            self.restart(target, second)
            entries.append(second)
        self.await_recovery(entries)
        return entries


def public_kills(kills: list[dict]) -> list[dict]:
    """The kills as the JSON keeps them (without this process's clock readings)."""
    return [{k: v for k, v in e.items() if k not in ("killed_at", "process_started")} for e in kills]


def phase_table(kills: list[dict]) -> dict:
    """Per phase of the kill: kills, recovered, recovery rounds and seconds (mean, max)."""
    table = {}
    for phase in sorted({k["phase"] for k in kills}):
        rows = [k for k in kills if k["phase"] == phase]
        rounds = [k["recovery_rounds"] for k in rows if k.get("recovery_rounds") is not None]
        after_entry = [k["rounds_after_entry"] for k in rows if k.get("rounds_after_entry") is not None]
        seconds = [k["recovery_s"] for k in rows if k.get("recovery_s") is not None]
        missed = [k["rounds_missed_after_ready"] for k in rows if k.get("rounds_missed_after_ready")
                  is not None]
        missed_open = [k["rounds_missed_open_at_ready"] for k in rows
                       if k.get("rounds_missed_open_at_ready") is not None]
        ready = [k["ready_s"] for k in rows if k.get("ready_s") is not None]
        table[phase] = {"kills": len(rows), "recovered": len(rounds),
                        "recovery_rounds_mean": round(sum(rounds) / len(rounds), 2) if rounds else None,
                        "recovery_rounds_max": max(rounds, default=None),
                        "rounds_after_entry_max": max(after_entry, default=None),
                        "recovery_s_mean": round(sum(seconds) / len(seconds), 1) if seconds else None,
                        "recovery_s_max": max(seconds, default=None),
                        "rounds_missed_after_ready_max": max(missed, default=None),
                        "rounds_missed_open_at_ready_max": max(missed_open, default=None),
                        "ready_s_mean": round(sum(ready) / len(ready), 1) if ready else None}
    return table


def summarize(chaos: Chaos, run: LocalRun, result: dict) -> None:
    nodes = chaos.nodes
    history = chaos.client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    contributors = [c.commit.num_contributors for c in history.commits]
    result["rounds"] = len(rounds)
    result["rounds_in_order_once"] = rounds == list(range(len(rounds)))
    result["rounds_with_fewer_contributors"] = sum(1 for c in contributors if c < nodes)
    result["contributors_per_round"] = contributors
    result["disputes"] = len(history.disputes)
    logs = {s.name: log_text(s) for s in run.nodes}
    result["tracebacks"] = {name: text.count("Traceback") for name, text in logs.items()
                                if "Traceback" in text}
    result["checkpoint_entries"] = sum(t.count("from the chain-verified checkpoint of round")
                                       for t in logs.values())
    result["restarts"] = sum(s.starts - 1 for s in run.nodes)
    result["pipeline_reformed"] = sum(t.count("re-formed; entering at round") for t in logs.values())
    result["rebased"] = sum(t.count("on the committed record (weights root") for t in logs.values())
    recoveries = [k["recovery_s"] for k in chaos.kills if k.get("recovery_s") is not None]
    result["recovery_s"] = {"min": min(recoveries, default=None), "max": max(recoveries, default=None),
                            "mean": round(sum(recoveries) / len(recoveries), 1) if recoveries else None,
                            "unrecovered": sum(1 for k in chaos.kills if k.get("recovery_s") is None)}
    # "Back within two rounds of its restart": counted from the round the restarted life entered at
    # (process start-up on a loaded machine spans several short rounds; that part is recovery_rounds).
    late = [k["kill"] for k in chaos.kills if k.get("rounds_after_entry") is None
            or k["rounds_after_entry"] > 2]
    result["back_within_two_rounds_of_entry"] = not late
    result["kills_not_back_within_two_rounds_of_entry"] = late
    # Counted from the moment the restarted process was ready (READY): rounds committed without its
    # replica after that, before the round it is back in.
    missed = [k.get("rounds_missed_after_ready") for k in chaos.kills]
    result["back_within_two_rounds_of_ready"] = all(m is not None and m <= 2 for m in missed)
    result["kills_not_back_within_two_rounds_of_ready"] = [k["kill"] for k, m in zip(chaos.kills, missed)
                                                           if m is None or m > 2]
    # Rounds missed that were still being trained by the others when it was ready (not closed before).
    result["kills_missing_an_open_round_at_ready"] = [k["kill"] for k in chaos.kills
                                                      if (k.get("rounds_missed_open_at_ready") or 0) > 0]
    result["by_phase"] = phase_table(chaos.kills)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", action="store_true", help="split clusters: one node per stage")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--entry-every", type=int, default=4, help="every N-th fault also kills during entry")
    parser.add_argument("--min-rounds", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--round-timeout", type=float, default=60)
    parser.add_argument("--recovery-timeout", type=float, default=600)
    parser.add_argument("--reexecute", default="4", help="audit --reexecute N (or 'all')")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--workdir", default="/tmp/dlx-chaos")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    out = Path(args.out or default_out(__file__))  # the JSON says which (split, replicas, settings)
    load = list(os.getloadavg())
    rng = random.Random(args.seed)
    started = time.monotonic()
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"round_timeout={args.round_timeout}", "checkpoint_every=1", "rounds=0", "join_timeout=60"]
    run = LocalRun(Path(args.workdir), replicas=args.replicas, stages=2, split=args.split, settings=settings,
                   attest_quorum=2, stake_wei=10**18)
    run.setup()
    result: dict = {"command": "python " + " ".join(sys.argv), "split": args.split, "replicas": args.replicas,
                    "stages": 2, "nodes": len(run.nodes), "settings": settings, "k": 2,
                    "load_before": os.getloadavg()}
    try:
        run.start()
        chaos = Chaos(run, args, rng)
        deadline = time.monotonic() + 600
        while full_round_after(chaos.client, run.run_id, -1, chaos.nodes) is None:
            if time.monotonic() > deadline:
                raise SystemExit("the run never committed a round with every node")
            time.sleep(2)
        fault = 0
        while len(chaos.kills) < args.kills or chaos.last_round() + 1 < args.min_rounds:
            for entry in chaos.fault(fault):
                print(
                    json.dumps({k: v for k, v in entry.items() if k not in ("killed_at", "process_started")}),
                    flush=True)
            fault += 1
            # Kept up to date after every fault: a run cut short still leaves its figures.
            result.update(kills=public_kills(chaos.kills),
                          unexpected_exits=chaos.unexpected_exits, by_phase=phase_table(chaos.kills),
                          partial=True)
            write_result(out, result, load)
        run.stop_nodes()
        result.pop("partial", None)
        result["exit_codes_at_stop"] = {s.name: s.process.returncode for s in run.nodes}
        result.update(kills=public_kills(chaos.kills),
                      unexpected_exits=chaos.unexpected_exits)
        summarize(chaos, run, result)
        audit = subprocess.run(
            [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id),
             "--deployment", str(run.workdir / "deployment.json"), "--json", str(run.workdir / "audit.json"),
             "--reexecute", args.reexecute, *[a for s in run.nodes for a in ("--archive", str(s.data_dir))]],
            capture_output=True, text=True, timeout=3600, check=False)
        result["audit"] = {"exit_code": audit.returncode, "reexecute": args.reexecute,
                           "verdict": next((w for w in ("PASSED", "INCOMPLETE", "FAILED")
                                            if w in audit.stdout), None),
                           "tail": audit.stdout.splitlines()[-3:]}
    finally:
        run.stop()
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_after"] = os.getloadavg()
    write_result(out, result, load)
    print(f"rounds {result['rounds']} (in order, each once: {result['rounds_in_order_once']}), kills "
          f"{len(result['kills'])}, rounds with fewer contributors {result['rounds_with_fewer_contributors']}"
          f", recovery {result['recovery_s']}, back within two rounds of ready "
          f"{result['back_within_two_rounds_of_ready']}, unexpected "
          f"exits {len(result['unexpected_exits'])}, tracebacks {result['tracebacks']}, audit "
          f"{result['audit']['verdict']}")
    for phase, row in result["by_phase"].items():
        print(f"  {phase:<11} {row}")
    ok = (result["rounds_in_order_once"] and not result["unexpected_exits"]
          and result["audit"]["exit_code"] == 0
          and result["recovery_s"]["unrecovered"] == 0 and not result["tracebacks"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
