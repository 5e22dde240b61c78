"""Disk and memory per node over a long run under the default retention (issue 75).

A real local run (managed anvil, the contracts, ``--replicas`` one-node replicas of the ``tiny`` model,
each a ``dlx-node start`` process on loopback, H = ``--inner-steps``, a checkpoint every round, spot
checks at the node's default rate, the run's windows ``--dispute-blocks`` and ``--accusation-blocks``, 16
each: the local chain mines about one block a round, so the defaults, 64, would hold 64-130 rounds open)
trains until the chain holds ``--rounds`` committed rounds, with ``storage.retention`` as the nodes'
default (``"windows"``) unless ``--set`` says otherwise. After every committed round it reads, per node:

* the bytes on disk of its data directory (each file once: a checkpoint hard-linked into the blob store is
  one copy), and of ``archive/``, ``checkpoints/``, ``blobs/``, ``chunk-states/``, and per kind of file
  (start states, checkpoints, published stage states, spilled chunk states, archive, other blobs, other:
  :func:`bench.retention_disk.file_kind`) its files and bytes (the summary gives the last sample's as
  multiples of the stage);
* resident memory now (``VmRSS``) and the peak so far (``VmHWM``) from ``/proc/PID/status``.

It writes ONE JSON, ``bench/results/retention.json`` (rewritten after every sample, so a run cut short keeps
its figures; a run with ``--mine-per-second``, whose empty blocks make a round outlast its windows as a
large model's does, is written as its ``"ontime"`` part, without the samples): the per-round series, the
stage's bytes (fp32 weights of the stage a node holds: here the whole ``tiny`` model) and the start state's
bytes (what a rerun starts from, one a round), the disk as a multiple of each, and whether disk stayed flat
after the windows filled (the largest total from ``--flat-from`` on against the total at that round). Then,
with the chain still up, it audits the run from the nodes' directories (``audit --reexecute`` of ``--audit``
contributions, -1: all) and records the verdict, the counts and every distinct reason an item could not be
checked (what the retention dropped). It also measures what serving a checkpoint costs in memory and disk
(``serve_checkpoint``: a ``--serve-mib`` file stored in a blob store the old way, read whole and copied, and
the new way, hard-linked and hashed in 4 MiB reads; each in a fresh process, its peak RSS growth). Nothing
asserts: a person reads the figures.

    nice -n 5 python bench/bench_retention.py --rounds 100
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node.commands.launcher import LocalRun  # noqa: E402
from bench.retention_disk import (disk_bytes, memory_kib, rebuilds, stage_bytes, summarise,  # noqa: E402
                                  unnamed_by_dir)

RESULTS = Path(__file__).resolve().parent / "results"
#: What the JSON's multiples are (docs/PROTOCOL.md, "Archive and retention").
MULTIPLE = ("a node's disk multiple: the bytes of its data directory (each file once: a hard link "
            "counts once) over its stage's bytes, the float32 weights of the stage it holds (stage_bytes); "
            "also over the stage's training state, its weights, gradients and AdamW's two moments "
            "(training_state_bytes, 4 x stage_bytes)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="committed rounds to reach")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=1)
    parser.add_argument("--preset", default="tiny", help="the model preset (e.g. mini: fixed per-round files "
                                                          "weigh less against its stage)")
    parser.add_argument("--dispute-blocks", type=int, default=16,
                        help="the run's dispute window in blocks (the local chain mines ~one block a round)")
    parser.add_argument("--accusation-blocks", type=int, default=16, help="the run's accusation window")
    parser.add_argument("--mine-per-second", type=float, default=0.0,
                        help="also mine this many empty blocks a second (anvil_mine), so that blocks go by "
                             "on time and a round outlasts its windows, as a large model's does (0: only "
                             "the run's transactions mine)")
    parser.add_argument("--flat-from", type=int, default=50,
                        help="the round from which the windows are full (the flatness is judged from it)")
    parser.add_argument("--serve-mib", type=int, default=400, help="checkpoint size for serve_checkpoint")
    parser.add_argument("--serve-only", action="store_true",
                        help="measure serve_checkpoint alone, into --out's existing result, and exit")
    parser.add_argument("--summarise-only", action="store_true",
                        help="recompute the summary of --out from its samples (with --flat-from) and exit")
    parser.add_argument("--set", action="append", default=[], dest="extra",
                        help="extra KEY=VALUE node settings (e.g. storage.retention=all)")
    parser.add_argument("--audit", type=int, default=-1,
                        help="contributions the closing audit reruns (-1: all, 0: no audit)")
    parser.add_argument("--keep-all", action="append", default=[], metavar="NODE",
                        help="a node (e.g. r1) that keeps every round (storage.retention = \"all\"), as an "
                             "archive node or a seeder does: the audit is then made twice, from the other "
                             "nodes' directories alone and with this one's (audit_with_archive)")
    parser.add_argument("--archive-audit", type=int, default=16,
                        help="contributions the audit with the --keep-all nodes' directories reruns")
    parser.add_argument("--workdir", default="", help="keep the run here (default: a temporary directory)")
    parser.add_argument("--stages", type=int, default=1,
                        help="pipeline stages, one node each (the whole checkpoint is then S times a stage)")
    parser.add_argument("--part", default="",
                        help="write the run as this part of --out's result, without its samples (a run with "
                             "--mine-per-second: 'ontime' unless named)")
    parser.add_argument("--out", default=str(RESULTS / "retention.json"))
    parser.add_argument("--samples-out", default="", help="also write the per-round samples here (a part's "
                                                          "JSON leaves them out)")
    args = parser.parse_args()
    if args.serve_only:
        result = json.loads(Path(args.out).read_text())
        result["serve_checkpoint"] = serve_checkpoint(args.serve_mib)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["serve_checkpoint"], indent=1))
        return 0
    if args.summarise_only:
        result = json.loads(Path(args.out).read_text())
        result["summary"] = summarise(result["samples"], result["stage_bytes"], args.flat_from)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result["summary"], indent=1))
        return 0

    settings = [f"model.preset={args.preset}", f"diloco.inner_steps={args.inner_steps}",
                "training.batch_size=4", "round_timeout=60", "join_timeout=60", "checkpoint_every=1",
                "rounds=0", *args.extra]
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dlx-retention-"))
    stage = stage_bytes(args.stages, args.preset)
    run = LocalRun(workdir, replicas=args.replicas, stages=args.stages, split=args.stages > 1,
                   settings=settings,
                   dispute_blocks=args.dispute_blocks, accusation_blocks=args.accusation_blocks)
    print(f"retention run: {args.replicas} replicas x {args.stages} stages (one node each) of "
          f"{args.preset!r} ({stage} bytes of fp32 weights a stage), "
          f"H={args.inner_steps}, a checkpoint every round, {args.rounds} rounds, in {workdir}", flush=True)
    samples: list[dict] = []
    audit: dict = {}
    serve: dict = {}
    started = time.monotonic()
    stopped = ""

    def write(final: bool) -> None:
        result = {
            "command": "python " + " ".join(sys.argv),
            "cpu": _cpu(), "cpu_count": os.cpu_count(),
            "preset": args.preset, "replicas": args.replicas, "stages": args.stages,
            "inner_steps": args.inner_steps,
            "checkpoint_every": 1, "settings": settings,
            "dispute_blocks": args.dispute_blocks, "accusation_blocks": args.accusation_blocks,
            "mine_per_second": args.mine_per_second, "keep_all": args.keep_all,
            "blocks_per_round": _blocks_per_round(samples),
            "stage_bytes": stage,
            "training_state_bytes": 4 * stage,
            "multiple": MULTIPLE,
            "target_rounds": args.rounds,
            "reached_rounds": samples[-1]["round"] if samples else 0,
            "wall_s": round(time.monotonic() - started, 1),
            "finished": final, "stopped": stopped,
            "summary": summarise(samples, stage, args.flat_from),
            # start states rebuilt when asked (storage.start_states = "rebuild") and spot checks, per node
            "rebuilds": {slot.name: rebuilds(slot.data_dir) for slot in run.nodes},
            "audit": audit,
            "serve_checkpoint": serve,
            "samples": samples,
        }
        _write(Path(args.out), result, args.part or ("ontime" if args.mine_per_second > 0 else ""))
        if args.samples_out:  # a part's samples, which its JSON leaves out
            Path(args.samples_out).write_text(json.dumps(samples, indent=1) + "\n")

    try:
        run.setup()
        keep_all(run, args.keep_all)
        run.start()
        client = run.client()
        miner = _Miner(run.url, args.mine_per_second) if args.mine_per_second > 0 else None
        last_sampled = 0
        while last_sampled < args.rounds:
            if len(run.running()) < len(run.nodes):
                stopped = "a node exited early; see the logs in " + str(workdir)
                print(stopped, file=sys.stderr)
                break
            try:
                last = client.last_round(run.run_id)
            except Exception as exc:  # noqa: BLE001 - a chain read failed: try again on the next tick
                print(f"chain read failed: {exc}", file=sys.stderr)
                last = None
            committed = 0 if last is None else last + 1
            if committed > last_sampled:
                last_sampled = committed
                nodes = {}
                try:
                    block = client.w3.eth.block_number
                except Exception:  # noqa: BLE001 - a figure, not the run
                    block = None
                for slot in run.nodes:
                    alive = slot.process is not None and slot.process.poll() is None
                    pid = slot.process.pid if alive else None
                    disk = disk_bytes(slot.data_dir)
                    by_dir = unnamed_by_dir(pid, slot.data_dir)  # O_TMPFILE spills the walk misses
                    disk["unnamed"] = sum(size for size, _count in by_dir.values())
                    disk["unnamed_by_dir"] = by_dir
                    disk["checkpoint_files"] = sorted(p.name for p in
                                                      (slot.data_dir / "checkpoints").glob("*"))
                    nodes[slot.name] = {**memory_kib(pid), "disk": disk}
                entry = {"round": committed, "block": block,
                         "elapsed_s": round(time.monotonic() - started, 1),
                         "loadavg1": round(os.getloadavg()[0], 2), "nodes": nodes}
                samples.append(entry)
                print(f"round {committed:4d} t={entry['elapsed_s']:6.0f}s " + "  ".join(
                    f"{k}: disk {v['disk']['total'] / 1e6:6.2f} MB rss {v.get('rss_kib', 0) / 1024:5.0f} MiB"
                    for k, v in nodes.items()), flush=True)
                write(False)
            time.sleep(0.5)
        if miner is not None:
            miner.stop()
        if args.audit and samples:
            run.stop_nodes()  # their files as they left them; the chain stays up for the audit
            windows = [slot.data_dir for slot in run.nodes if slot.name not in args.keep_all]
            audit.update(_audit_or_error(run, windows, args.audit))
            if args.keep_all:
                audit["with_archive"] = _audit_or_error(
                    run, [slot.data_dir for slot in run.nodes], args.archive_audit)
                audit["with_archive"]["archives"] = sorted(args.keep_all)
            print("audit:", json.dumps({k: v for k, v in audit.items() if k != "unverifiable_reasons"}))
    except KeyboardInterrupt:
        stopped = "interrupted (SIGINT)"
    finally:
        run.stop()
    serve.update(serve_checkpoint(args.serve_mib))
    write(not stopped)
    print(json.dumps(summarise(samples, stage, args.flat_from), indent=1))
    print(f"wrote {args.out}")
    return 0 if not stopped else 1


def _write(out: Path, result: dict, part: str) -> None:
    """Write ``result`` to ``out``: a named ``part`` (the run with blocks mined beside it, ``"ontime"``; one
    with more stages) as that part of the current result, without its samples; the main run as the result,
    keeping the parts."""
    try:
        current = json.loads(out.read_text())
    except (OSError, ValueError):
        current = {}
    if part:
        result, current[part] = current, {k: v for k, v in result.items() if k != "samples"}
    else:
        result.update({k: v for k, v in current.items() if isinstance(v, dict) and "target_rounds" in v})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


class _Miner:
    """Mines empty blocks on the run's anvil at a steady rate (``anvil_mine``) on a thread, until stopped."""

    def __init__(self, url: str, per_second: float) -> None:
        import threading

        from web3 import HTTPProvider, Web3

        self.w3 = Web3(HTTPProvider(url))
        self.period = 1.0 / per_second
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="miner", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.done.wait(self.period):
            try:
                self.w3.provider.make_request("anvil_mine", ["0x1"])
            except Exception as exc:  # noqa: BLE001 - a missed block only slows the chain
                print(f"anvil_mine failed: {exc}", file=sys.stderr)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


def _blocks_per_round(samples: list[dict]) -> float | None:
    """Blocks the chain went by per committed round over the run's second half (None: not sampled)."""
    known = [s for s in samples if s.get("block") is not None]
    half = known[len(known) // 2:]
    if len(half) < 2 or half[-1]["round"] == half[0]["round"]:
        return None
    return round((half[-1]["block"] - half[0]["block"]) / (half[-1]["round"] - half[0]["round"]), 2)


def keep_all(run: LocalRun, names: list[str]) -> None:
    """Set ``storage.retention = "all"`` in the configuration of each node named (before it starts)."""
    from node.config import dump_toml, load_config

    for slot in run.nodes:
        if slot.name in names:
            table = load_config(slot.config_path).to_dict()
            table["storage"]["retention"] = "all"
            slot.config_path.write_text("# written by dlx-node's local launcher, then bench_retention\n"
                                        + dump_toml(table))
            load_config(slot.config_path)


def _audit_or_error(run: LocalRun, archives: list[Path], reexecute: int) -> dict:
    """:func:`audit_figures`, or what it raised (the samples are kept whatever the audit does)."""
    try:
        return audit_figures(run, reexecute, archives)
    except Exception as exc:  # noqa: BLE001 - the samples are kept whatever the audit does
        import traceback

        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def audit_figures(run: LocalRun, reexecute: int, archives: list[Path] | None = None) -> dict:
    """The audit of the run from the nodes' directories (``archives``, default every node's): verdict,
    counts, reruns, why items went unchecked and which."""
    from collections import Counter

    from node.tools.audit import audit_run
    from node.tools.report import OK, UNVERIFIABLE

    started = time.monotonic()
    archives = archives if archives is not None else [slot.data_dir for slot in run.nodes]
    report = audit_run(run.client(), run.run_id, archives=archives, reexecute=reexecute)
    unverifiable = [c for c in report.all_checks() if c.status == UNVERIFIABLE]
    reasons = Counter(" ".join(str(c.reason).split())[:160] for c in unverifiable)
    return {
        "reexecute": reexecute,
        "verdict": report.verdict,
        "counts": report.counts(),
        "reexecuted": dict(report.reexecuted),
        "rounds": len(report.rounds),
        "rounds_ok": sum(r.status == OK for r in report.rounds),
        "first_unverified_round": report.first_unverified_round,
        "summary": report.summary(),
        "unverifiable_reasons": dict(reasons.most_common(20)),
        # each reason's items by name and the rounds they belong to (what exactly went unchecked)
        "unverifiable_items": _items_by_reason(report),
        "reexecution": {k: v for k, v in report.reexecution.items() if not isinstance(v, (list, dict))
                        or len(json.dumps(v)) < 2000},
        "wall_s": round(time.monotonic() - started, 1),
    }


def _items_by_reason(report) -> dict:
    """reason -> item (its name, rounds and hashes left out: ``checkpoint of round N``) -> the rounds its
    unverifiable checks belong to, as spans; what exactly went unchecked, and why."""
    from node.tools.report import UNVERIFIABLE

    checks = [(c, c.round) for c in report.general + report.checkpoints]
    checks += [(c, verdict.round if c.round is None else c.round) for verdict in report.rounds
               for c in verdict.checks]
    out: dict[str, dict[str, list[int]]] = {}
    for check, outer_round in checks:
        if check.status != UNVERIFIABLE:
            continue
        reason, name = (_generic(" ".join(str(text).split()))[:160] for text in (check.reason, check.name))
        if outer_round is None:
            found = re.search(r"round (\d+)", check.name)
            outer_round = int(found.group(1)) if found else -1
        out.setdefault(reason, {}).setdefault(name, []).append(outer_round)
    return {reason: {name: _spans(sorted(set(rounds))) for name, rounds in names.items()}
            for reason, names in out.items()}


def _generic(text: str) -> str:
    """``text`` with its hashes and numbers left out (``N``), so that the items of every round group."""
    return re.sub(r"\d+", "N", re.sub(r"\b(?:0x)?[0-9a-f]{8,}\b", "H", text))


def _spans(rounds: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"`` (-1: an item of no round)."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


_SERVE = """
import sys
from pathlib import Path
from p2p.blobstore import BlobStore
def kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
src, how = Path(sys.argv[1]), sys.argv[2]
store = BlobStore(src.parent / ("blobs-" + how), max_blob_bytes=1 << 40)
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from now
base = kib("VmRSS")
store.put_bytes(src.read_bytes()) if how == "copy" else store.put_file(src, link=True)
print((kib("VmHWM") - base) // 1024, src.stat().st_nlink)
"""


def serve_checkpoint(mib: int) -> dict:
    """Peak RSS growth (MiB) and copies on disk of serving a ``mib`` MiB checkpoint file as a blob: read whole
    and copied (before issue 75) against hard-linked and hashed in 4 MiB reads (now)."""
    import shutil
    import subprocess

    out = {"file_mib": mib}
    tmp = Path(tempfile.mkdtemp(prefix="dlx-serve-"))
    try:
        src = tmp / "round-00000001.safetensors"
        with open(src, "wb") as handle:
            for _ in range(mib):
                handle.write(os.urandom(1 << 20))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        for how in ("copy", "link"):
            line = subprocess.run([sys.executable, "-c", _SERVE, str(src), how], env=env, check=True,
                                  capture_output=True, text=True).stdout.split()
            out[how] = {"peak_rss_growth_mib": int(line[0]), "copies_on_disk": 1 if how == "link" else 2}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
