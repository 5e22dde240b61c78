"""Where a restarted node's time goes, from its process start to its first contribution.

    python bench/bench_restart.py [--restarts 4] [--inner-steps 20] [--workdir /tmp/dlx-restart]

A real local run (anvil, 2 split clusters x 2 stages = 4 nodes, the ``tiny`` model,
k = 2 staked members, a checkpoint every round: bench_chaos.py's settings). Once a
round with every node is committed, one node after the other is killed with
SIGKILL and restarted 2 s later; for each restart the new process's log gives the
end of each start-up phase (node/live/startup.py: interpreter, imports, chain,
libp2p host, peers, placement, pipeline rendezvous with the partner, entry point
with the checkpoint restored, the entry round agreed, catch-up, first
contribution), in seconds since the process started. The chain is polled
meanwhile, so each phase also has the last round committed when it ended.

How the rounds are counted: the replica is back at the first committed round with
every node's contribution from the round its new life entered at; *rounds missed
after ready* are the rounds committed without it after the process was ready (its
pipeline formed: imports, chain, host, placement and partner done), before the
round it is back in (back in round L + 3 when round L was the last committed at
ready: 2 missed); *rounds after restart* is the round it is back in minus the round
committed when the process was started. Also measured: decrypting a keystore as
``dlx-node init --password-file`` makes it. Writes bench/results/restart.json
(bench/benchio.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import default_out, write_result  # noqa: E402
from node.commands.launcher import LocalRun  # noqa: E402
from node.live.startup import parse_marks, process_start_time  # noqa: E402

#: The start-up phases in the order a node passes them (node/live/startup.py marks).
PHASES = ("interpreter and command line", "imports", "chain checked", "host started", "peers met", "placed",
          "trainer imports warmed up", "model initialised", "pipeline group joined", "pipeline formed",
          "entry point", "entry round agreed with the partner", "caught up", "first contribution")
READY = "pipeline formed"


class ChainWatch:
    """The last committed round over time (polled), to say which round each phase ended in."""

    def __init__(self, client, run_id: int) -> None:
        self.client, self.run_id = client, run_id
        self.samples: list[tuple[float, int]] = []

    def poll(self) -> int:
        last = self.client.last_round(self.run_id)
        last = -1 if last is None else last
        self.samples.append((time.time(), last))
        return last

    def at(self, when: float) -> int:
        """The last round committed at wall time ``when`` (the last sample not after it)."""
        before = [last for t, last in self.samples if t <= when]
        return before[-1] if before else -1

    def full_round_after(self, after: int, contributors: int) -> int | None:
        last = self.samples[-1][1] if self.samples else -1
        for round_index in range(after + 1, last + 1):
            if self.client.commit_of(self.run_id, round_index).num_contributors == contributors:
                return round_index
        return None


def entered_round(log: str) -> int | None:
    for line in log.splitlines():
        if "entering at round " in line:
            return int(line.split("entering at round ", 1)[1].split()[0])
    return None


def measure_restart(run: LocalRun, watch: ChainWatch, victim, timeout: float) -> dict:
    """Kill ``victim``, start it again 2 s later, follow it until its replica is back in a committed round."""
    killed_round = watch.poll()
    run.kill(victim, signal.SIGKILL)
    time.sleep(2.0)
    restart_round = watch.poll()
    run.start_node(victim)
    started = process_start_time(victim.process.pid)
    deadline = time.monotonic() + timeout
    entry: dict = {"node": victim.name, "round_at_kill": killed_round, "round_at_restart": restart_round}
    marks: dict[str, float] = {}
    recovered = None
    while time.monotonic() < deadline:
        watch.poll()
        log = victim.log_path.read_text(errors="replace")
        marks = parse_marks(log)
        entered = entered_round(log)
        if "first contribution" in marks and entered is not None:
            # Its new life's first round with every node in it (the round it entered at, or a later one).
            recovered = watch.full_round_after(max(entered, restart_round + 1) - 1, len(run.nodes))
            if recovered is not None:
                break
        if victim.process.poll() is not None:
            entry["exited"] = victim.process.returncode
            break
        time.sleep(0.5)
    log = victim.log_path.read_text(errors="replace")
    entry["marks_s"] = marks
    entry["phase_s"] = phase_durations(marks)
    entry["round_at_mark"] = {phase: watch.at(started + s) for phase, s in marks.items()}
    entry["entered_round"] = entered_round(log)
    entry["recovered_round"] = recovered
    if recovered is not None:
        entry["rounds_after_restart"] = recovered - restart_round
        if READY in marks:
            # Rounds committed without the replica once its process was ready: those after the last one
            # committed at that moment, before the round it is back in.
            entry["rounds_missed_after_ready"] = recovered - entry["round_at_mark"][READY] - 1
    entry["tracebacks"] = log.count("Traceback")
    return entry


def phase_durations(marks: dict[str, float]) -> dict[str, float]:
    """Seconds spent in each phase (from the end of the phase before it)."""
    durations, before = {}, 0.0
    for phase in PHASES:
        if phase in marks:
            durations[phase] = round(marks[phase] - before, 2)
            before = marks[phase]
    return durations


def summary(entries: list[dict]) -> dict:
    """Per phase: mean and max seconds over the restarts; the round counts' max."""
    per_phase = {}
    for phase in PHASES:
        values = [e["phase_s"][phase] for e in entries if phase in e["phase_s"]]
        if values:
            per_phase[phase] = {"mean_s": round(statistics.mean(values), 2), "max_s": max(values)}
    firsts = [e["marks_s"]["first contribution"] for e in entries if "first contribution" in e["marks_s"]]
    readies = [e["marks_s"][READY] for e in entries if READY in e["marks_s"]]
    return {"phases": per_phase,
            "ready_s": {"mean": round(statistics.mean(readies), 1), "max": max(readies)} if readies else None,
            "first_contribution_s": {"mean": round(statistics.mean(firsts), 1), "max": max(firsts)} if firsts
                else None,
            "rounds_missed_after_ready_max": max((e.get("rounds_missed_after_ready", 99) for e in entries),
                                                 default=None),
            "rounds_after_restart_max": max((e.get("rounds_after_restart", 99) for e in entries),
                                            default=None),
            "recovered": sum(1 for e in entries if e.get("recovered_round") is not None),
            "tracebacks": sum(e["tracebacks"] for e in entries)}


def keystore_decryption(workdir: Path) -> dict:
    """Seconds (wall, CPU) to decrypt a keystore made as ``dlx-node init --password-file`` makes one (scrypt,
    eth-account's default work factor): what a node with a keystore pays once at start (ledger/account.py)."""
    import resource

    from ledger.account import create_keystore, load_keystore

    path = workdir / "bench-keystore.json"
    path.unlink(missing_ok=True)
    create_keystore(path, "bench restart")
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    load_keystore(path, "bench restart")
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall_s": round(time.monotonic() - started, 2),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--round-timeout", type=float, default=60)
    parser.add_argument("--timeout", type=float, default=600,
                        help="give up on one restart after this many seconds")
    parser.add_argument("--workdir", default="/tmp/dlx-restart")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    load = list(os.getloadavg())
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"round_timeout={args.round_timeout}", "checkpoint_every=1", "rounds=0", "join_timeout=60"]
    run = LocalRun(Path(args.workdir), replicas=2, stages=2, split=True, settings=settings, attest_quorum=2,
                   stake_wei=10**18)
    run.setup()
    entries: list[dict] = []
    try:
        run.start()
        watch = ChainWatch(run.client(), run.run_id)
        deadline = time.monotonic() + 900
        while watch.full_round_after(0, len(run.nodes)) is None:
            if time.monotonic() > deadline:
                raise SystemExit("the run never committed a round with every node")
            watch.poll()
            time.sleep(1)
        for index in range(args.restarts):
            victim = run.nodes[[1, 2, 0, 3][index % 4]]
            time.sleep(3.0)  # the run trains a moment
            entry = measure_restart(run, watch, victim, args.timeout)
            print(entry, flush=True)
            entries.append(entry)
        first_round_s = [t for t, _ in watch.samples]
        rounds = watch.samples[-1][1] + 1
    finally:
        run.stop()
    result = {"settings": settings, "nodes": 4, "split": True, "k": 2, "restarts": entries,
              "keystore_decryption": keystore_decryption(Path(args.workdir)),
              "summary": summary(entries), "rounds_committed": rounds,
              "seconds_per_round": round((first_round_s[-1] - first_round_s[0]) / max(1, rounds), 1)}
    write_result(args.out, result, load)
    print(result["summary"])
    return 0 if result["summary"]["recovered"] == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())
