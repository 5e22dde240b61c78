"""``bench/bench_reproducible.py --audit``: a ``dlx-node demo`` run in the reproducible mode, trained under
one ATen instruction set and audited with ``dlx-node audit --reexecute all`` under each of several (issue
64: "as fast as a same-platform audit").

The demo (``--set training.reproducible=true``: kernel version 2, the default of a new reproducible run;
``--stages 1``, one node process per replica, since the mode refuses a replica split over processes) runs
in a child under ``ATEN_CPU_CAPABILITY=--audit-train`` with Numba's target following it
(``training.exact_probe.child_env``). Then, per capability of ``--audit-under``, a fresh anvil from the
demo's ``chain-state.json`` and ``dlx-node audit --reexecute all`` over every node's archive in a child
under that capability: its wall time, its verdict, and how each re-executed contribution was judged
(every one must be ``exact``: the reproducible rule's bit-for-bit rerun, no emulation child, no tolerance).
The first capability of ``--audit-under`` should be the training one: the same-platform time the others
are compared with. ``--audit-full``: the demo's own size (:func:`demo_defaults`), into ``audit_full``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from training.exact_probe import child_env

RERUN = "re-execution of round"


def demo_defaults() -> dict:
    """The full-size demo (``--audit-full``): ``dlx-node demo``'s own preset, replicas, rounds and inner steps
    (its parser's defaults, node/commands/parsers.py), so the bench follows the demo if they change."""
    from node.commands.parsers import build_parser

    demo = build_parser().parse_args(["demo"])
    return {"audit_preset": demo.preset, "audit_replicas": demo.replicas, "audit_rounds": demo.rounds,
            "audit_inner_steps": demo.inner_steps}


def train_demo(repo: Path, workdir: Path, args) -> dict:
    """Run the demo under ``args.audit_train``; its wall time and the run document's training settings."""
    out = workdir / "demo"
    command = [sys.executable, "-m", "node.cli", "demo", "--preset", args.audit_preset, "--replicas",
               str(args.audit_replicas), "--stages", "1", "--rounds", str(args.audit_rounds), "--inner-steps",
               str(args.audit_inner_steps), "--no-reference", "--out", str(out), "--timeout", "3000",
               "--set", "training.reproducible=true"]
    started = time.perf_counter()
    done = subprocess.run(command, env=child_env(repo, args.audit_train, args.audit_threads, None),
                          capture_output=True, text=True, timeout=3600, cwd=repo)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the demo failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    from node.config import load_config
    from node.runconfig import run_document

    training = run_document(load_config(out / "r0" / "node.toml"))["training"]
    return {"seconds": round(seconds, 1), "out": out, "rounds": len(summary.get("rounds", [])),
            "training": {k: training.get(k) for k in ("reproducible", "reproducible_kernels", "optimizer")}}


def audit_under(repo: Path, out: Path, capability: str, threads: int) -> dict:
    """``dlx-node audit --reexecute all`` of the demo under ``capability``: seconds, verdict, reruns."""
    from ledger.anvil import AnvilProcess

    deployment = json.loads((out / "deployment.json").read_text())
    state = out / f"chain-state-{capability}.json"
    shutil.copyfile(out / "chain-state.json", state)  # the demo's own stays as it ended
    report = out / f"audit-{capability}.json"
    anvil = AnvilProcess(state_file=state)
    url = anvil.start()
    try:
        archives = [arg for node in sorted(p for p in out.iterdir() if (p / "node.toml").is_file())
                    for arg in ("--archive", str(node))]
        command = [sys.executable, "-m", "node.cli", "audit", "--rpc", url, "--ledger", deployment["ledger"],
                   "--registry", deployment["registry"], "--run", str(deployment["run_id"]), *archives,
                   "--reexecute", "all", "--json", str(report)]
        started = time.perf_counter()
        done = subprocess.run(command, env=child_env(repo, capability, threads, None), capture_output=True,
                              text=True, timeout=1800, cwd=repo)
        seconds = time.perf_counter() - started
    finally:
        anvil.stop()
    data = json.loads(report.read_text()) if report.is_file() else {}
    reruns = [check for check in data.get("general", []) if check["name"].startswith(RERUN)]
    judged: dict[str, int] = {}
    for check in reruns:
        how = check["reason"].rsplit("judged ", 1)[-1].rstrip(")") if "judged " in check["reason"] else "?"
        key = f"{check['status']} {how}"
        judged[key] = judged.get(key, 0) + 1
    return {"capability": capability, "threads": threads, "seconds": round(seconds, 1),
            "exit_code": done.returncode, "verdict": data.get("verdict"), "reruns": len(reruns),
            "judged": judged, "all_exact": bool(reruns) and all(
                check["status"] == "ok" and check["reason"].startswith("reproduced (exact, distance 0")
                and check["reason"].endswith("judged exact)") for check in reruns),
            "reexecuted": data.get("reexecuted"),
            "tail": (done.stdout + done.stderr).strip().splitlines()[-2:]}


def run_audit_bench(repo: Path, args) -> dict:
    """The demo once, then one audit per capability of ``args.audit_under``; the result's ``audit`` block."""
    import tempfile

    workdir = Path(args.audit_workdir or tempfile.mkdtemp(prefix="repro-audit-"))
    load = list(os.getloadavg())
    demo = train_demo(repo, workdir, args)
    print({k: v for k, v in demo.items() if k != "out"}, flush=True)
    audits = []
    for capability in args.audit_under.split(","):
        audits.append(audit_under(repo, demo["out"], capability, args.audit_threads))
        print(audits[-1], flush=True)
    same = audits[0]["seconds"]
    for row in audits:
        row["vs_first"] = round(row["seconds"] / same, 2) if same else None
    return {"preset": args.audit_preset, "replicas": args.audit_replicas, "stages": 1,
            "rounds": args.audit_rounds, "inner_steps": args.audit_inner_steps, "threads": args.audit_threads,
            "trained_under": args.audit_train, "demo_seconds": demo["seconds"], "demo_rounds": demo["rounds"],
            "run_training": demo["training"], "audits": audits,
            "every_rerun_exact": all(row["all_exact"] for row in audits), "workdir": str(workdir),
            "load_average": {"start": load, "end": list(os.getloadavg())}}
