"""What a node joining a running run costs it: round durations around a ``dlx-node join``.

    python bench/bench_join.py [--rounds 16] [--baseline DIR]

Starts a local run shaped like ``dlx-node demo`` (a managed anvil, 2 replicas x 2 stages, one node
per stage, model ``mini``, H = 20, a checkpoint every 2 rounds, k = 2 and half the members), waits
for the first checkpoint on chain, then runs ``dlx-node join <link>`` from an empty directory (one
node holding both stages: a third replica) and lets the run finish. Each round's time is when the
first founder signed its close (the coordinators' logs: ``round t stage s closed``); the duration
of round t is the gap to round t-1's. Recorded per round: duration, the replicas closed with, and
the replicas missing from a close made at the deadline; for the joiner: the round open when it was
placed (its hello and seat known), the round it entered at, and the first committed round holding
its contribution. ``--baseline DIR`` runs the same again with the node code of another checkout
(``PYTHONPATH=DIR``; e.g. the commit before a change) and records both runs in the one result.
``--catch-up-delay S`` makes the joiner sleep S seconds before its first catch-up round
(tests/slow_joiner.py), standing in for a joiner on a starved machine. Writes bench/results/join.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchio import default_out, write_result  # noqa: E402

from node.commands.launcher import LocalRun  # noqa: E402

LINE = re.compile(
    r"^(\d\d:\d\d:\d\d) \S+ +node\.live\.coordination: round (\d+) stage (\d+) closed with replicas "
    r"\[([\d, ]*)\]( \(missing \[([\d, ]*)\]\))?", re.MULTILINE)
STAMP = re.compile(r"^(\d\d:\d\d:\d\d) ", re.MULTILINE)


def _seconds(stamp: str) -> int:
    h, m, s = (int(x) for x in stamp.split(":"))
    return h * 3600 + m * 60 + s


def _day_seconds(at: float) -> int:
    moment = datetime.datetime.fromtimestamp(at)
    return moment.hour * 3600 + moment.minute * 60 + moment.second


def founder_closes(run: LocalRun) -> dict[int, dict]:
    """round -> first close time (seconds of the day), replicas and missing replicas over every stage."""
    rounds: dict[int, dict] = {}
    for slot in run.nodes:
        for log in slot.data_dir.glob("node-*.log"):
            for m in LINE.finditer(log.read_text(errors="replace")):
                entry = rounds.setdefault(int(m.group(2)), {"at": None, "replicas": set(), "missing": set()})
                at = _seconds(m.group(1))
                entry["at"] = at if entry["at"] is None else min(entry["at"], at)
                entry["replicas"] |= {int(x) for x in m.group(4).split(",") if x.strip()}
                entry["missing"] |= {int(x) for x in (m.group(6) or "").split(",") if x.strip()}
    return rounds


def round_at(rounds: dict[int, dict], second: int) -> int:
    """The round open at ``second``: the first round not closed by then."""
    closed = [r for r, e in rounds.items() if e["at"] is not None and e["at"] <= second]
    return max(closed, default=-1) + 1


def first_logged(text: str, pattern: str) -> tuple[int | None, re.Match | None]:
    for line in text.splitlines():
        m = re.search(pattern, line)
        if m and STAMP.match(line):
            return _seconds(line[:8]), m
    return None, None


def one_run(args, code: Path, workdir: Path) -> dict:
    """One run with the node code under ``code``; the figures of its join."""
    os.environ["PYTHONPATH"] = str(code)
    settings = [f"model.preset={args.preset}", f"rounds={args.rounds}",
                f"diloco.inner_steps={args.inner_steps}", "checkpoint_every=2", "round_timeout=120"]
    run = LocalRun(workdir / "run", replicas=2, stages=2, split=True, settings=settings, attest_quorum=2,
                   attest_quorum_bps=5000, stake_wei=10**18)
    run.setup()
    started = time.time()
    run.start()
    client = run.client()
    joiner = None
    log = workdir / "joiner.log"
    try:
        deadline = time.monotonic() + args.timeout
        while client.latest_checkpoint(run.run_id) is None:
            if time.monotonic() > deadline or not run.running():
                raise RuntimeError("no checkpoint committed")
            time.sleep(1.0)
        head = ([sys.executable, str(REPO / "tests" / "slow_joiner.py"), str(args.catch_up_delay)]
                if args.catch_up_delay > 0 else [sys.executable, "-m", "node.cli"])
        join_started = time.time()
        joiner = subprocess.Popen(
            [*head, "--log-file", str(log), "join", run.link(), "--data-dir", str(workdir / "joiner"),
             "--dev-account", str(len(run.nodes) + 1), "--yes", "--no-progress", "--set", "torch_threads=1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        while run.running() or joiner.poll() is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the run did not finish in time")
            time.sleep(2.0)
    finally:
        if joiner is not None and joiner.poll() is None:
            joiner.terminate()
            joiner.wait(60)
        run.stop_nodes()
    history = client.history(run.run_id, with_registrations=False)
    run.anvil.stop()
    rounds = founder_closes(run)
    joiner_log = log.read_text(errors="replace") if log.exists() else ""
    placed_at, _ = first_logged(joiner_log, r"node\.live\.assembly: placed:")
    _, entered = first_logged(joiner_log, r"entering at round (\d+)")
    founders = len(run.nodes)  # a record counts one contribution per (replica, stage): 4 before the join
    with_joiner = [c.commit.round for c in history.commits if c.commit.num_contributors > founders]
    ordered = sorted(rounds)
    table = []
    for r in ordered:
        e = rounds[r]
        previous = rounds.get(r - 1, {}).get("at") if r > 0 else _day_seconds(started)
        table.append({"round": r, "duration_s": None if previous is None else e["at"] - previous,
                      "replicas": sorted(e["replicas"]), "missing": sorted(e["missing"])})
    placed_round = round_at(rounds, placed_at) if placed_at is not None else None
    first_in = min(with_joiner, default=None)
    before = [row["duration_s"] for row in table if row["duration_s"] is not None and row["round"] >= 1
              and (placed_round is None or row["round"] < placed_round)]
    window = [row for row in table if placed_round is not None and first_in is not None
              and placed_round <= row["round"] <= first_in]
    after = [row["duration_s"] for row in table if first_in is not None and row["round"] > first_in
             and row["duration_s"] is not None]
    typical = statistics.median(before + after) if before + after else None
    return {
        "code": str(code), "commit": _commit(code),
        "rounds_committed": len(history.commits),
        "rounds_in_order_once": [c.commit.round for c in history.commits]
            == list(range(len(history.commits))),
        "join_started_round": round_at(rounds, _day_seconds(join_started)),
        "joiner": {"placed_round": placed_round, "entered_at": int(entered.group(1)) if entered else None,
                   "first_committed_round_with_it": first_in, "committed_rounds_with_it": len(with_joiner),
                   "exit_code": joiner.returncode if joiner is not None else None},
        "rounds": table,
        "summary": {
            "median_round_s_without_join": typical,
            "join_window_rounds": [row["round"] for row in window],
            "longest_round_in_window_s": max((row["duration_s"] for row in window), default=None),
            "window_s_beyond_median": (sum(row["duration_s"] - typical for row in window)
                                       if window and typical is not None else None),
            "rounds_closed_at_deadline_missing_a_replica": [row["round"] for row in table if row["missing"]],
        },
    }


def _commit(code: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--catch-up-delay", type=float, default=0.0, metavar="S")
    parser.add_argument("--baseline", default="", metavar="DIR",
                        help="also run the node code of this checkout")
    parser.add_argument("--keep-baseline", action="store_true",
                        help="keep the baseline run of the result file --out already holds (its "
                             "code did not change)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the runs' finally clauses stop their nodes
    load = list(os.getloadavg())
    root = Path(tempfile.mkdtemp(prefix="bench-join-"))
    runs = {}
    try:
        runs["this"] = one_run(args, REPO, root / "this")
        print("this:", runs["this"]["summary"], flush=True)
        if args.baseline:
            runs["baseline"] = one_run(args, Path(args.baseline).resolve(), root / "baseline")
            print("baseline:", runs["baseline"]["summary"], flush=True)
        elif args.keep_baseline:
            runs["baseline"] = json.loads(Path(args.out).read_text())["runs"]["baseline"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"args": {"rounds": args.rounds, "preset": args.preset, "inner_steps": args.inner_steps,
                       "replicas": 2, "stages": 2, "catch_up_delay_s": args.catch_up_delay,
                       "round_timeout_s": 120}, "cpus": os.cpu_count(), "runs": runs}
    print(f"wrote {write_result(args.out, result, load)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
