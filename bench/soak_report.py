"""The soak's figures (bench/bench_soak.py): rounds and short rounds, tracebacks, the audit, the plot.

Everything here reads what the run left (the chain's history, the nodes' logs, the samples) after it
stopped; nothing here drives the run.
"""

from __future__ import annotations

import re
import subprocess
import sys

from bench.soak_sampling import memory_growth, object_growth, series

#: A coordinator's close line: round, stage, the replicas it closed with, the missing ones (bench_join.py).
CLOSE = re.compile(r"round (\d+) stage (\d+) closed with replicas \[([\d, ]*)\]( \(missing \[([\d, ]*)\]\))?")
#: Log lines counted over every node's logs (``log_counts`` in the JSON): timeouts that met a slow link.
LOG_COUNTS = {"spot checks not done": r"spot check of replica \d+ round \d+ not done",
              "contributions not fetched": r"contribution \w+ from \w+ not fetched",
              "TooSlowError": r"TooSlowError", "timed out": r"timed out",
              "relay reservation late": r"no reservation yet",
              "closes at the deadline (missing)": r"closed with replicas \[[\d, ]*\] \(missing"}
#: The last line of a traceback (plain or inside an exception group's "| " frame): ``Name: message``.
EXCEPTION_LINE = re.compile(r"^[\s|+]*(\w+(?:Error|Exception|Group|Cancelled|Exit|Interrupt)\w*: .*)$")


def node_logs(soak) -> dict[str, str]:
    """Every node's logs, whole (its lives after restarts included), and the joiner's."""
    out = {s.name: "\n".join(p.read_text(errors="replace") for p in sorted(s.data_dir.glob("node-*.log")))
           for s in soak.run.nodes}
    log = soak.joiner_dir.parent / "joiner.log"
    if log.exists():
        out["joiner"] = log.read_text(errors="replace")
    return out


def summarize(soak, result: dict) -> None:
    """The run's figures into ``result``: rounds, short rounds and why, logs' tracebacks and counts,
    series."""
    history = soak.client.history(soak.run.run_id)
    rounds = [c.commit.round for c in history.commits]
    contributors = [c.commit.num_contributors for c in history.commits]
    logs = node_logs(soak)
    closes: dict[int, dict] = {}
    for text in logs.values():
        for m in CLOSE.finditer(text):
            entry = closes.setdefault(int(m.group(1)), {"replicas": set(), "missing": set()})
            entry["replicas"] |= {int(x) for x in m.group(3).split(",") if x.strip()}
            entry["missing"] |= {int(x) for x in (m.group(5) or "").split(",") if x.strip()}
    most = max(contributors, default=0)
    replica_names: dict[int, set[str]] = {}
    for sample in soak.samples:
        for name, entry in sample["nodes"].items():
            if entry.get("replica") is not None:
                replica_names.setdefault(entry["replica"], set()).add(name)
    every = set().union(*(c["replicas"] for c in closes.values())) if closes else set()
    short = []
    for r, count in zip(rounds, contributors):
        if count >= most:
            continue
        # The replicas no close of the round had (a coordinator names as missing only those it waited
        # for), and the churn from the previous round's commit, less a deadline, to this one's.
        close = closes.get(r, {"replicas": set(), "missing": set()})
        missing = sorted((every - close["replicas"]) | close["missing"])
        seen = soak.first_seen.get(r, soak.now())
        window = (soak.first_seen.get(r - 1, 0.0) - soak.args.round_timeout, seen)
        short.append({"round": r, "contributors": count, "missing_replicas": missing,
                      "missing_nodes": sorted(n for m in missing for n in replica_names.get(m, ())),
                      "events_near": [f"{e['kind']} {e.get('node', '')}".strip() for e in soak.events
                                      if window[0] <= e["at_s"] <= window[1] and e["kind"] != "poll_error"]})
    result["rounds"] = len(rounds)
    result["rounds_in_order_once"] = rounds == list(range(len(rounds)))
    result["contributors_per_round"] = contributors
    result["rounds_short"] = short
    result["rounds_first_seen_s"] = [soak.first_seen.get(r) for r in rounds]
    durations = [None] + [round(b - a, 1) if a is not None and b is not None else None
                          for a, b in zip(result["rounds_first_seen_s"], result["rounds_first_seen_s"][1:])]
    result["round_s"] = durations
    delays = soak.spec["delays_ms"]
    result["slowest_link"] = {"one_way_ms": max(d for row in delays.values() for d in row.values()),
                              "rate_mbit": min(s["rate_mbit"] for s in soak.spec["sites"].values())}
    result["disputes"] = len(history.disputes)
    result["events"] = soak.events
    result["unexpected_exits"] = soak.unexpected_exits
    result["tracebacks"] = {n: t.count("Traceback") for n, t in logs.items() if "Traceback" in t}
    result["traceback_heads"] = {n: traceback_heads(t) for n, t in logs.items() if "Traceback" in t}
    # Where a fixed timeout met a slow link: counted over every log, for runs to compare.
    result["log_counts"] = {label: sum(len(re.findall(pattern, t)) for t in logs.values())
                            for label, pattern in LOG_COUNTS.items()}
    result["series"] = series(soak.samples)
    result["memory_growth"] = memory_growth(soak.samples, result["run_s"])
    result["object_growth"] = object_growth(soak.samples, result["memory_growth"], soak.probe_dir,
                                            soak.started, result["run_s"])
    # Connection paths (peer id -> direct/relayed/hole_punched) only as they were at the end: per
    # sample they were most of the JSON's megabyte.
    result["paths_at_end"] = {n: e.get("paths") for n, e in (soak.samples[-1]["nodes"] if soak.samples
                                                             else {}).items()}
    result["samples"] = [{**sample, "nodes": {n: {k: v for k, v in e.items() if k != "paths"}
                                             for n, e in sample["nodes"].items()}} for sample in soak.samples]


def traceback_heads(text: str, limit: int = 3) -> list[str]:
    """The exception of each of the first ``limit`` tracebacks in a log (in an exception group, the first
    one inside it that is not itself a group)."""
    heads, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback") or line.lstrip(" +|").startswith("Exception Group Traceback"):
            if i and lines[i - 1].lstrip(" +|").startswith(("Traceback", "Exception Group Traceback")):
                continue
            found = [m.group(1) for later in lines[i + 1:i + 200] if (m := EXCEPTION_LINE.match(later))]
            inner = [f for f in found if not f.startswith(("ExceptionGroup", "BaseExceptionGroup"))]
            heads.append((inner or found or [""])[0][:300])
            if len(heads) >= limit:
                break
    return heads


def audit(run, soak) -> dict:
    """``dlx-node audit --reexecute all`` over every node's archive (the joiner's too)."""
    archives = [str(s.data_dir) for s in run.nodes] + ([str(soak.joiner_dir)] if soak.joiner_dir.exists()
                                                       else [])
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id),
         "--deployment", str(run.workdir / "deployment.json"), "--json", str(run.workdir / "audit.json"),
         "--reexecute", "all", *[a for d in archives for a in ("--archive", d)]],
        capture_output=True, text=True, timeout=3600, check=False)
    return {"exit_code": done.returncode, "reexecute": "all",
            "verdict": next((w for w in ("PASSED", "INCOMPLETE", "FAILED") if w in done.stdout), None),
            "tail": done.stdout.splitlines()[-4:] + done.stderr.splitlines()[-3:]}


def summary_line(result: dict) -> str:
    return (f"rounds {result['rounds']} (in order, each once: {result['rounds_in_order_once']}), short "
            f"{len(result['rounds_short'])}, unexpected exits {len(result['unexpected_exits'])}, tracebacks "
            f"{result['tracebacks']}, audit {result['audit']['verdict']}")


def svg(result: dict, width: int = 720, height: int = 260) -> str:
    """Round time (s) over the run's time, churn events marked: a hand-written SVG (no matplotlib here)."""
    points = [(t, d) for t, d in zip(result["rounds_first_seen_s"], result["round_s"]) if t is not None and d]
    end = max([t for t, _ in points] + [e["at_s"] for e in result["events"]] + [1.0])
    top = max([d for _, d in points] + [1.0]) * 1.1
    x = lambda t: 50 + (width - 70) * t / end  # noqa: E731
    y = lambda d: height - 30 - (height - 50) * d / top  # noqa: E731
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="50" y1="{height - 30}" x2="{width - 20}" y2="{height - 30}" stroke="black"/>',
        f'<line x1="50" y1="20" x2="50" y2="{height - 30}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">seconds into the run</text>',
        f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">'
        'round time (s)</text>']
    for frac in (0, 0.5, 1):
        parts.append(f'<text x="46" y="{y(top * frac) + 4:.0f}" text-anchor="end">{top * frac:.0f}</text>')
        parts.append(
            f'<text x="{x(end * frac):.0f}" y="{height - 18}" text-anchor="middle">{end * frac:.0f}</text>')
    for e in result["events"]:
        if e["kind"] in ("kill", "rpc_outage_begin", "leave", "join"):
            parts.append(f'<line x1="{x(e["at_s"]):.1f}" y1="20" x2="{x(e["at_s"]):.1f}" y2="{height - 30}" '
                         'stroke="#c33" stroke-dasharray="3,3"/>')
            parts.append(
                f'<text x="{x(e["at_s"]) + 2:.1f}" y="30" fill="#c33">{e["kind"].split("_")[0]}</text>')
    if points:
        path = " ".join(f"{x(t):.1f},{y(d):.1f}" for t, d in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#246" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
