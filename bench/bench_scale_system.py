"""The whole system at one model size: where a round's time, bytes, memory and disk go (issue 75).

    nice -n 5 python bench/bench_scale_system.py --preset llama-124m --vocab-size 32000 --block-size 128 \\
        --batch-size 2 --rounds 3 --inner-steps 4 --data /tmp/bpe32k [--label llama-124m]

One real ``dlx-node demo`` (2 replicas x 2 stages on a local anvil, normed commitments, spot checks
``--spot-checks``, checkpoints every 2 rounds, ``--keep``), with ``DLX_COST_PROFILE=1`` in every node's
environment (node/live/costprofile.py). While it runs the script samples every node's ``status.json``,
``cost_profile.json`` and ``/proc/<pid>/status`` (VmHWM: peak RSS) every 2 s. When the demo has printed its
summary it runs ``dlx-node audit --reexecute all`` and ``dlx-node pull`` of the run (each timed, with its
peak RSS), loads the pulled directory with transformers (model and tokenizer, a few tokens generated),
reads the gas of every transaction the chain holds, stops the demo and measures each node's disk.

Per node and round it reports:

- the training thread's period (``timing.jsonl``, node/live/state/roundclock.py): inner steps,
  start-state capture, eval, encode, waits, aggregation, the rest;
- every thread's busy time by component (the sampling profile: inner steps, hashing and commitments,
  codec, outer step, archive writes, exchange, chain, spot checks, start state, portable RNG, other),
  between the first round's start and the last round's end, each as a share of the busy time and of the
  round's wall time x threads;
- bytes sent and received, peak RSS, disk (by top-level directory).

Each run is stored under ``runs[<label>]`` of ``--out`` (default bench/results/scale_system.json): a second
size adds to the file, the same label replaces its entry (bench/scale_model.py fits its model to them).
``--attach DIR`` analyses a demo started by hand (its ``demo.out``, ``samples.jsonl`` and ``rss.log`` in
the formats this script writes) instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import RESULTS, recorded, write_result  # noqa: E402
from bench.scale_system_analysis import (  # noqa: E402
    _du, analyse, chain_gas, node_dirs, pulled_model,
)

OUT = RESULTS / "scale_system.json"
DLX = [sys.executable, "-m", "node.cli"]
SUMMARY_MARK = "audit it (with --keep"
#: What a run records after training, while the chain runs (kept when it is analysed again with --attach).
AFTER_KEYS = ("demo_summary", "audit", "pull", "chain_gas", "demo_seconds_to_summary", "recorded")


# ------------------------------------------------------------------------------------------------ sampling


def _vm(pid: int) -> tuple[int, int] | None:
    """(VmHWM, VmRSS) of ``pid`` in bytes, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = dict(re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", text, flags=re.M))
    if "VmHWM" not in values:
        return None
    return int(values["VmHWM"]) * 1024, int(values.get("VmRSS", 0)) * 1024


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Sampler(threading.Thread):
    """Every ``every`` s: each node's status and cost profile (``samples.jsonl``), its and its children's
    peak RSS (``rss.log``)."""

    def __init__(self, workdir: Path, demo_pid: int, every: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.workdir, self.demo_pid, self.every = workdir, demo_pid, every
        self.stop = threading.Event()

    def run(self) -> None:
        samples, rss = self.workdir / "samples.jsonl", self.workdir / "rss.log"
        while not self.stop.wait(self.every):
            now = time.time()
            lines, rss_lines = [], []
            for node in node_dirs(self.workdir):
                status = _read_json(node / "status.json")
                profile = _read_json(node / "cost_profile.json")
                if status is None and profile is None:
                    continue
                lines.append(json.dumps({"t": now, "node": node.name, "profile": profile, "status": status}))
                pid = (status or {}).get("pid")
                vm = _vm(int(pid)) if pid else None
                if vm:
                    rss_lines.append(f"{now:.0f} {pid} {vm[0] // 1024} {vm[1] // 1024} node {node}/")
                    for child in _children(int(pid)):  # the spot checks' rerun processes
                        cvm = _vm(child)
                        if cvm:
                            rss_lines.append(
                                f"{now:.0f} {child} {cvm[0] // 1024} {cvm[1] // 1024} child {node}/"
                            )
            vm = _vm(self.demo_pid)
            if vm:
                rss_lines.append(f"{now:.0f} {self.demo_pid} {vm[0] // 1024} {vm[1] // 1024} demo")
            with samples.open("a") as f:
                f.writelines(line + "\n" for line in lines)
            with rss.open("a") as f:
                f.writelines(line + "\n" for line in rss_lines)


def _run_measured(command: list[str], log: Path, timeout: float, env: dict | None = None) -> dict:
    """Run ``command`` (stdout and stderr to ``log``), return its exit code, seconds and peak RSS."""
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.5)
    return {
        "exit": os.waitstatus_to_exitcode(status),
        "seconds": round(time.monotonic() - started, 2),
        "peak_rss_bytes": usage.ru_maxrss * 1024,
        "timed_out": time.monotonic() > deadline,
        "log_tail": log.read_text(errors="replace")[-600:],
    }


# ------------------------------------------------------------------------------------------------ the run


def _demo_command(args) -> list[str]:
    command = DLX + [
        "demo",
        "--preset",
        args.preset,
        "--rounds",
        str(args.rounds),
        "--inner-steps",
        str(args.inner_steps),
        "--checkpoint-every",
        str(args.checkpoint_every),
        "--spot-checks",
        str(args.spot_checks),
        "--out",
        str(args.workdir),
        "--no-reference",
        "--keep",
        "--timeout",
        str(args.timeout),
    ]
    if args.data:
        command += ["--data", args.data]
    settings = [
        f"round_timeout={args.round_timeout}",
        f"training.batch_size={args.batch_size}",
        "training.eval_batches=1",
    ]
    if args.vocab_size:
        settings.append(f"model.vocab_size={args.vocab_size}")
    if args.block_size:
        settings.append(f"model.block_size={args.block_size}")
    for setting in settings + args.set:
        command += ["--set", setting]
    return command


def _wait_for_summary(log: Path, process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if SUMMARY_MARK in log.read_text(errors="replace"):
            return True
        if process is not None and process.poll() is not None:
            return False
        time.sleep(2)
    return False


def after_training(workdir: Path, args, demo_log: Path) -> dict:
    """The audit with every re-execution, the pull into transformers and the chain's gas (the chain runs)."""
    text = demo_log.read_text(errors="replace")
    audit_line = text[text.index(SUMMARY_MARK) :].splitlines()[1].strip()
    audit = shlex.split(audit_line)[1:]  # drop "dlx-node"
    deployment = json.loads((workdir / "deployment.json").read_text())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    extra: dict = {"demo_summary": text[text.rfind("run 1:") : text.index(SUMMARY_MARK)].strip()[-3000:]}
    if args.skip_audit:
        extra["audit"] = {"skipped": "--skip-audit (a lease too short for every re-execution)"}
    else:
        audit_cmd = DLX + audit + ["--reexecute", "all", "--json", str(workdir / "audit.json")]
        if args.data:
            audit_cmd += ["--data", args.data]
        extra["audit"] = _run_measured(audit_cmd, workdir / "audit.log", args.timeout, env)
        report = _read_json(workdir / "audit.json") or {}
        extra["audit"]["verdict"] = report.get("verdict") or report.get("passed")
        extra["audit"]["counts"] = report.get("counts") or report.get("summary")
    pulled = workdir / "pulled"
    shutil.rmtree(pulled, ignore_errors=True)
    pull = DLX + [
        "pull",
        "--rpc",
        deployment["rpc_url"],
        "--run",
        str(deployment["run_id"]),
        "--deployment",
        str(workdir / "deployment.json"),
        "--archive",
        str(workdir / "r0n0"),
        str(pulled),
    ]
    extra["pull"] = _run_measured(pull, workdir / "pull.log", args.timeout, env)
    if extra["pull"]["exit"] != 0 and "--pending" in extra["pull"]["log_tail"]:
        # A demo's last rounds are not final on chain yet (their proof windows are open): take them as
        # pending, and say so.
        shutil.rmtree(pulled, ignore_errors=True)
        refused = extra["pull"]["log_tail"]
        extra["pull"] = _run_measured(
            pull[:-1] + ["--pending", str(pulled)], workdir / "pull.log", args.timeout, env
        )
        extra["pull"]["pending"] = True
        extra["pull"]["refused_without_pending"] = refused
    if extra["pull"]["exit"] == 0:
        try:
            extra["pull"]["transformers"] = pulled_model(pulled)
        except Exception as exc:  # noqa: BLE001 (recorded, not hidden)
            extra["pull"]["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
        extra["pull"]["bytes"] = _du(pulled)
    try:
        extra["chain_gas"] = chain_gas(deployment["rpc_url"])
    except Exception as exc:  # noqa: BLE001
        extra["chain_gas"] = {"error": f"{type(exc).__name__}: {exc}"}
    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-124m")
    parser.add_argument("--label", default="", help="the run's key in the result (default: the preset)")
    parser.add_argument("--vocab-size", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--spot-checks", type=float, default=1.0)
    parser.add_argument("--round-timeout", type=float, default=1800)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--data", default="", help="prepared dataset directory (dlx-node data prepare)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--workdir", default="/tmp/dlx-bench-scale-system")
    parser.add_argument("--attach", default="", help="analyse this demo directory (started by hand) instead")
    parser.add_argument(
        "--partial",
        action="store_true",
        help="with --attach: a run that broke off (per round over --rounds, to its last snapshot)",
    )
    parser.add_argument(
        "--skip-audit", action="store_true", help="no `dlx-node audit --reexecute all` after the demo"
    )
    parser.add_argument("--note", default="", help="what to say beside the run on the results page")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    load = list(os.getloadavg())
    label = args.label or args.preset
    args_doc = {k: v for k, v in vars(args).items() if k not in ("out", "attach", "note")}
    if args.attach:
        args.workdir = Path(args.attach)
        demo_log = args.workdir / "demo.out"
        if _demo_alive(args.workdir):
            extra = after_training(args.workdir, args, demo_log)
        else:  # the demo is gone: keep what its run recorded while it ran (audit, pull, gas)
            before = ((_read_json(Path(args.out)) or {}).get("runs") or {}).get(label) or {}
            extra = {k: v for k, v in before.items() if k in AFTER_KEYS}
        run = analyse(args.workdir, args.rounds, args_doc, extra, partial=args.partial)
    else:
        args.workdir = Path(args.workdir)
        if args.workdir.exists():
            shutil.rmtree(args.workdir)
        args.workdir.parent.mkdir(parents=True, exist_ok=True)
        demo_log = args.workdir.parent / f"{args.workdir.name}.demo.out"
        env = dict(os.environ, DLX_COST_PROFILE="1", DLX_MEMORY_PROFILE="1", PYTHONPATH=str(ROOT))
        started = time.monotonic()
        with demo_log.open("w") as log:
            demo = subprocess.Popen(
                _demo_command(args),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                start_new_session=True,
            )
        while not args.workdir.exists():
            time.sleep(0.5)
        sampler = Sampler(args.workdir, demo.pid)
        sampler.start()
        try:
            trained = _wait_for_summary(demo_log, demo, args.timeout)
            trained_s = time.monotonic() - started
            extra = (
                after_training(args.workdir, args, demo_log)
                if trained
                else {
                    "error": "the demo did not print its summary",
                    "demo_tail": demo_log.read_text()[-3000:],
                }
            )
            extra["demo_seconds_to_summary"] = round(trained_s, 1)
        finally:
            sampler.stop.set()
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGINT)
                try:
                    demo.wait(120)
                except subprocess.TimeoutExpired:
                    os.killpg(demo.pid, signal.SIGKILL)
        shutil.copy(demo_log, args.workdir / "demo.out")
        # a demo that did not reach its summary in --timeout is analysed as one that broke off
        run = analyse(args.workdir, args.rounds, args_doc, extra, partial=not trained)
    run["parameters"] = _parameters(args)
    if args.note:
        run["note"] = args.note
    # each size's own command, date and load (the file holds several); a re-analysis keeps the run's
    run["recorded"] = run.get("recorded") or recorded(load)
    previous = _read_json(Path(args.out)) or {}
    runs = previous.get("runs", {})
    runs[label] = run
    write_result(args.out, {"benchmark": "scale_system", "runs": runs}, load)
    s = run["summary"]
    print(json.dumps({"label": label, "parameters": run["parameters"], **s}, indent=1))
    return 0


def _demo_alive(workdir: Path) -> bool:
    deployment = _read_json(workdir / "deployment.json")
    if not deployment:
        return False
    from urllib.request import Request, urlopen

    try:
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_blockNumber", "params": []}).encode()
        urlopen(Request(deployment["rpc_url"], body, {"Content-Type": "application/json"}), timeout=5).read()
        return True
    except OSError:
        return False


def _parameters(args) -> dict:
    """The model's size, from its configuration."""
    from training.config import ModelConfig
    from training.model import count_params

    settings = {"preset": args.preset}
    if args.vocab_size:
        settings["vocab_size"] = args.vocab_size
    if args.block_size:
        settings["block_size"] = args.block_size
    for setting in args.set:  # --set model.n_layer=4 and the like
        key, _, value = setting.partition("=")
        if key.startswith("model."):
            settings[key.removeprefix("model.")] = int(value) if value.lstrip("-").isdigit() else value
    cfg = ModelConfig(**settings)
    return {
        "total": count_params(cfg),
        "vocab_size": cfg.vocab_size,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "block_size": cfg.block_size,
    }


if __name__ == "__main__":
    sys.exit(main())
