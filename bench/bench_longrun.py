"""Long runs: do a node's memory, open files and disk use stay flat over many rounds? (issue 15, item 6)

A real local run (managed anvil, the contracts, ``--replicas`` one-node replicas of the ``tiny``
model, each a ``dlx-node start`` process on loopback, H = ``--inner-steps``) trains until the chain
holds ``--rounds`` committed rounds; the run is open-ended on chain (``rounds=0``) and the script
stops the nodes once it has its last sample. At each sample round (10, 100, 500, 1000 by default,
plus every ``--every`` rounds for the curve) it reads, for every node process and for anvil:

* resident memory, ``VmRSS`` of ``/proc/PID/status``;
* open file descriptors, the entries of ``/proc/PID/fd``;
* threads, ``Threads`` of ``/proc/PID/status``;
* and per node data directory: files and bytes under ``archive/``, ``checkpoints/``, ``blobs/``.

It prints a table and writes ``bench/results/longrun.json`` (with the machine's load average).
Nothing here asserts: the figures are read by a person (the growth between the first and the last
sample is printed as a ratio). ``--measure-only N`` runs N rounds and prints the seconds per round,
to size a campaign before starting it.

    python bench/bench_longrun.py --rounds 1000 --samples 10,100,500,1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.commands.launcher import LocalRun  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def proc_figures(pid: int | None) -> dict:
    """VmRSS (KiB), open fds and threads of ``pid`` from /proc; {} if it is gone."""
    if pid is None:
        return {}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_kib": int(fields["VmRSS"].split()[0]),
        "fds": fds,
        "threads": int(fields["Threads"]),
    }


def disk_figures(data_dir: Path) -> dict:
    """Files and bytes under the node's archive, checkpoints and blob store (what retention bounds)."""
    out = {}
    for part in ("archive", "checkpoints", "blobs"):
        files = size = 0
        for root, _dirs, names in os.walk(data_dir / part):
            for name in names:
                try:
                    size += os.stat(os.path.join(root, name)).st_size
                    files += 1
                except OSError:
                    pass
        out[part] = {"files": files, "bytes": size}
    return out


def sample(run: LocalRun, committed: int, started: float) -> dict:
    nodes = {}
    for slot in run.nodes:
        pid = slot.process.pid if slot.process is not None and slot.process.poll() is None else None
        nodes[slot.name] = {**proc_figures(pid), "disk": disk_figures(slot.data_dir)}
    return {
        "round": committed,
        "elapsed_s": round(time.monotonic() - started, 1),
        "nodes": nodes,
        "anvil": proc_figures(run.anvil.pid if run.anvil is not None else None),
        "loadavg": os.getloadavg(),
    }


def print_sample(entry: dict) -> None:
    parts = [f"round {entry['round']:5d}  t={entry['elapsed_s']:7.0f}s"]
    for name, node in entry["nodes"].items():
        disk = node["disk"]
        files = sum(d["files"] for d in disk.values())
        parts.append(f"{name}: rss {node.get('rss_kib', 0) / 1024:6.1f} MiB fds {node.get('fds', -1):3d} "
                     f"thr {node.get('threads', -1):3d} files {files:5d}")
    anvil = entry["anvil"]
    parts.append(f"anvil rss {anvil.get('rss_kib', 0) / 1024:6.1f} MiB")
    print("  ".join(parts), flush=True)


def write_result(args, settings: list[str], target: int, samples: list[dict], started: float, ended: float,
                 per_round: float | None, exit_code: int, stopped_early: str) -> None:
    """Write ``args.out``: the settings, every sample so far and the growth from the first to the last."""
    result = {
        "command": "python " + " ".join(sys.argv),
        "replicas": args.replicas,
        "stages": 1,
        "preset": "tiny",
        "inner_steps": args.inner_steps,
        "checkpoint_every": args.checkpoint_every,
        "settings": settings,
        "target_rounds": target,
        "reached_rounds": samples[-1]["round"] if samples else 0,
        "wall_s": round(ended - started, 1),
        "seconds_per_round": per_round,
        "cpu_count": os.cpu_count(),
        "samples": samples,
        "exit_code": exit_code,
        "stopped_early": stopped_early,
    }
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        result["growth_first_to_last"] = {
            name: {key: (last["nodes"][name].get(key), first["nodes"][name].get(key))
                   for key in ("rss_kib", "fds", "threads")}
            for name in first["nodes"]
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1000, help="committed rounds to reach")
    parser.add_argument("--samples", default="10,100,500,1000", help="rounds at which to sample (comma list)")
    parser.add_argument("--every", type=int, default=50,
                        help="also sample every N rounds (0: only --samples)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], dest="extra",
                        help="extra KEY=VALUE node settings (e.g. storage.keep_rounds=20)")
    parser.add_argument("--measure-only", type=int, default=0, metavar="N",
                        help="run N rounds, print seconds per round, write nothing")
    parser.add_argument("--workdir", default="", help="keep the run here (default: a temporary directory)")
    parser.add_argument("--out", default=str(RESULTS / "longrun.json"))
    args = parser.parse_args()

    target = args.measure_only or args.rounds
    marks = sorted({int(x) for x in args.samples.split(",") if x} | (
        set(range(args.every, target + 1, args.every)) if args.every else set()))
    marks = [m for m in marks if m <= target] or [target]
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                "round_timeout=60", "join_timeout=60", f"checkpoint_every={args.checkpoint_every}",
                "rounds=0", *args.extra]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dlx-longrun-"))
    run = LocalRun(workdir, replicas=args.replicas, stages=1, split=False, settings=settings)
    print(f"long run: {args.replicas} one-node replicas of 'tiny', H={args.inner_steps}, "
          f"checkpoint every {args.checkpoint_every}, {target} rounds, in {workdir}", flush=True)
    samples: list[dict] = []
    exit_code = 0
    stopped_early = ""
    started = time.monotonic()
    try:
        run.setup()
        run.start()
        client = run.client()
        first_commit_at = None
        pending = list(marks)
        while pending:
            if not run.running() or len(run.running()) < len(run.nodes):
                print("a node exited early; see the logs in", workdir, file=sys.stderr)
                exit_code = 1
                break
            try:
                last = client.last_round(run.run_id)
            except Exception as exc:  # a chain read failed: try again on the next tick
                print(f"chain read failed: {exc}", file=sys.stderr)
                last = None
            committed = -1 if last is None else last + 1  # rounds on chain
            if committed >= 1 and first_commit_at is None:
                first_commit_at = time.monotonic()
                first_commit_round = committed
            if committed >= pending[0]:
                while pending and committed >= pending[0]:
                    pending.pop(0)
                entry = sample(run, committed, started)
                samples.append(entry)
                print_sample(entry)
                if not args.measure_only:  # kept up to date: a run cut short still leaves its figures
                    write_result(args, settings, target, samples, started, time.monotonic(), None, 0,
                                 "in progress (not yet at the last sample)")
            time.sleep(0.5)
    except KeyboardInterrupt:  # Ctrl-C: stop the run, keep the samples taken so far
        stopped_early = "interrupted (SIGINT) before the last sample"
        exit_code = 130
    finally:
        ended = time.monotonic()
        run.stop()
    per_round = None
    if first_commit_at is not None and samples and samples[-1]["round"] > first_commit_round:
        # Wall time from the first commit to the last sample, per committed round (startup excluded).
        per_round = (started + samples[-1]["elapsed_s"] - first_commit_at) \
            / (samples[-1]["round"] - first_commit_round)
    print(f"seconds per round (after the first commit): {per_round}", flush=True)
    if args.measure_only:
        return exit_code
    write_result(args, settings, target, samples, started, ended, per_round, exit_code,
                 stopped_early or ("a node exited early" if exit_code == 1 else ""))
    print(f"wrote {args.out}")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
