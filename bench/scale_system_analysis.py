"""The analysis half of bench/bench_scale_system.py (split from it): a finished demo's samples, RSS log,
timing records, disk, chain gas and pulled model, per node and summed up."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The training thread's phases of a period record (node/live/state/roundclock.py), besides inner_s.
PERIOD_PHASES = (
    "start_state_s",
    "eval_s",
    "encode_s",
    "close_wait_s",
    "fetch_wait_s",
    "aggregate_s",
    "finish_other_s",
    "commit_wait_s",
    "other_s",
)


def node_dirs(workdir: Path) -> list[Path]:
    """The demo's node directories (``r<replica>n<stage>``)."""
    return sorted(p for p in workdir.iterdir() if p.is_dir() and re.fullmatch(r"r\d+n\d+", p.name))


def _rss_peaks(path: Path) -> dict[str, int]:
    """Peaks of an rss log (bytes): ``<node>`` the node process's VmHWM, ``<node>/child`` the highest VmHWM of
    its child processes (the spot checks' reruns), ``<node>/sum`` the highest sum of the node's and its
    children's RSS at one sample, ``all`` the highest sum of every node's and child's RSS at one sample (what
    the machine held for the run), ``demo`` the demo process's."""
    peaks: dict[str, int] = {}
    if not path.exists():
        return peaks
    at: dict[tuple[str, str], int] = {}
    for line in path.read_text().splitlines():
        parts = line.split(maxsplit=4)
        if len(parts) < 5:
            continue
        match = re.search(r"/(r\d+n\d+)/", parts[4])
        if parts[4].startswith("demo"):
            name = "demo"
        elif match and parts[4].startswith("child "):
            name = f"{match.group(1)}/child"
        elif match and (parts[4].startswith("node ") or "node.cli" in parts[4]):
            name = match.group(1)
        else:
            continue
        peaks[name] = max(peaks.get(name, 0), int(parts[2]) * 1024)
        if match:
            key = (match.group(1), parts[0])
            at[key] = at.get(key, 0) + int(parts[3]) * 1024
    every: dict[str, int] = {}
    for (node, second), total in at.items():
        peaks[f"{node}/sum"] = max(peaks.get(f"{node}/sum", 0), total)
        every[second] = every.get(second, 0) + total
    if every:
        peaks["all"] = max(every.values())
    return peaks


def memory_at_peak(node: Path) -> dict | None:
    """The node's memory probe (node/live/memprofile.py, ``DLX_MEMORY_PROFILE=1``): its peak's busy threads
    and heap, the sites its resident set grew at (the largest 10)."""
    try:
        probe = json.loads((node / "memory_profile.json").read_text())
    except (OSError, ValueError):
        return None
    peak = probe.get("peak") or {}
    return {
        "rss_bytes": peak.get("rss"),
        "t_s": peak.get("t_s"),
        "busy": [
            f"{b['thread']}: {b['component']} {' < '.join(b['frames'][:3])}" for b in peak.get("busy", [])
        ],
        "malloc": peak.get("malloc"),
        "growth_by_site_bytes": dict(list((probe.get("growth_by_site_bytes") or {}).items())[:10]),
    }


def _window(samples: list[dict], rounds: int, partial: bool = False) -> tuple[dict, dict] | None:
    """The last snapshot before a node's round 0 trains (or, if its profile was not written yet, an empty
    one) and the first one after it stopped (its last rounds' spot checks included)."""
    start, end = None, None
    for s in samples:
        status = s.get("status") or {}
        if status.get("round", -1) < 0 or status.get("state") in ("joining", "starting"):
            start = s if s.get("profile") else start
        elif status.get("state") == "stopped" and s.get("profile"):
            end = s
            break
    if end is None:
        timed = [
            s
            for s in samples
            if s.get("profile") and (s.get("status") or {}).get("last_finished", -1) >= rounds - 1
        ]
        end = timed[0] if timed else None  # the node stopped no more: to where its last round finished
    if end is None and partial:  # a run that broke off: up to its last snapshot
        profiled = [s for s in samples if s.get("profile")]
        end = profiled[-1] if profiled else None
    if end is None:
        return None
    if start is None:
        start = {
            "t": min(s["t"] for s in samples),
            "status": {},
            "profile": {"interval_s": 1.0, "samples": 0, "wall_s": 0.0, "counts": {}},
        }
    return start, end


def _profile_delta(start: dict, end: dict) -> dict[str, float]:
    def seconds(profile: dict) -> dict[str, float]:
        counts = (
            profile["counts"]
            if "counts" in profile
            else {k: v / profile["interval_s"] for k, v in profile["thread_seconds"].items()}
        )
        per = profile["wall_s"] / profile["samples"] if profile.get("samples") else 0.0
        return {k: v * per for k, v in counts.items()}

    a, b = seconds(start["profile"]), seconds(end["profile"])
    return {k: max(0.0, b.get(k, 0.0) - a.get(k, 0.0)) for k in sorted(set(a) | set(b))}


def _du(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def _disk(node: Path) -> dict:
    parts = {}
    for child in sorted(node.iterdir()):
        parts[child.name] = _du(child) if child.is_dir() else child.stat().st_size
    for name in ("archive", "spotchecks"):  # spotchecks/linkable: claimants' states held for chain checks
        if (node / name).is_dir():
            for child in sorted((node / name).iterdir()):
                if child.is_dir():
                    parts[f"{name}/{child.name}"] = _du(child)
    return {"total_bytes": _du(node), "parts": {k: v for k, v in parts.items() if v >= 1 << 20}}


def _mean_of(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return round(sum(values) / len(values), 3) if values else None


def analyse_node(node: Path, samples: list[dict], rounds: int, partial: bool = False) -> dict:
    periods = (
        [json.loads(line) for line in (node / "timing.jsonl").read_text().splitlines() if line.strip()]
        if (node / "timing.jsonl").exists()
        else []
    )
    finishes = [p for p in periods if p.get("kind") == "finish"]
    periods = [p for p in periods if p.get("kind") == "period"]
    out: dict = {"name": node.name, "periods": len(periods)}
    timed = [p for p in periods if p.get("wall_s")]
    if timed:
        wall = sum(p["wall_s"] for p in timed)
        out["training_thread"] = {
            "rounds": len(timed),
            "wall_s_per_round": round(wall / len(timed), 3),
            "inner_s_per_round": round(sum(p["inner_s"] for p in timed) / len(timed), 3),
            # CPU seconds (load-independent, unlike the wall figures): the training thread's inner steps
            # and the whole process's (every thread, not the spot checks' child processes)
            "inner_cpu_s_per_round": _mean_of(timed, "inner_cpu_s"),
            "process_cpu_s_per_round": _mean_of(timed, "process_cpu_s"),
            "shares": {
                k.removesuffix("_s"): round(sum(p.get(k) or 0 for p in timed) / wall, 4)
                for k in ("inner_s", *PERIOD_PHASES)
            },
            "lane_s_per_round": {
                k.removeprefix("lane_").removesuffix("_s"): round(
                    sum(p.get(k) or 0 for p in timed) / len(timed), 3
                )
                for k in timed[0]
                if k.startswith("lane_")
            },
        }
    if periods:
        out["first_period_inner_s"] = periods[0]["inner_s"]
    if finishes:
        exchange = [f["exchange_s"] for f in finishes if f.get("exchange_s") is not None]
        out["exchange_s_mean"] = round(sum(exchange) / len(exchange), 3) if exchange else None
    window = _window(samples, rounds, partial)
    if window:
        start, end = window
        wall = end["t"] - start["t"]
        delta = _profile_delta(start, end)
        busy = sum(v for k, v in delta.items() if k != "idle")
        out["window_s"] = round(wall, 2)
        out["busy_thread_s_per_round"] = {k: round(v / rounds, 3) for k, v in delta.items() if k != "idle"}
        out["busy_shares"] = {k: round(v / busy, 4) for k, v in delta.items() if k != "idle" and busy}
        s0, s1 = start.get("status") or {}, end.get("status") or {}
        out["bytes_sent_per_round"] = round((s1.get("bytes_sent", 0) - s0.get("bytes_sent", 0)) / rounds)
        out["bytes_received_per_round"] = round(
            (s1.get("bytes_received", 0) - s0.get("bytes_received", 0)) / rounds
        )
        if "spot_check_state_bytes" in s1:  # the start states its checks fetched (nodes since 2026-11-30)
            out["spot_check_state_bytes_per_round"] = round(
                (s1["spot_check_state_bytes"] - s0.get("spot_check_state_bytes", 0)) / rounds
            )
        if "spot_check_state_fetches" in s1:  # the checks that fetched them (nodes since 2026-11-30 03:15)
            out["spot_check_state_fetches_per_round"] = round(
                (s1["spot_check_state_fetches"] - s0.get("spot_check_state_fetches", 0)) / rounds, 4
            )
        t0, t1 = s0.get("traffic") or {}, s1.get("traffic") or {}
        out["traffic_per_round"] = {
            proto: {
                k: round((v.get(k, 0) - t0.get(proto, {}).get(k, 0)) / rounds) for k in ("sent", "received")
            }
            for proto, v in t1.items()
        }
        out["spot_checks"] = {
            k: s1.get(k)
            for k in ("spot_checks", "spot_check_mismatches", "spot_checks_not_done", "spot_check_seconds")
        }
    return out


def chain_gas(rpc: str) -> dict:
    """Gas of every transaction on the chain, by contract function (selectors named from the artifacts)."""
    from web3 import Web3

    names: dict[str, str] = {}
    for artifact in (ROOT / "contracts" / "artifacts").glob("*.json"):
        for signature, selector in (json.loads(artifact.read_text()).get("methodIdentifiers") or {}).items():
            names.setdefault(selector, signature.split("(")[0])
    w3 = Web3(Web3.HTTPProvider(rpc, request_kwargs={"timeout": 60}))
    gas: dict[str, list[int]] = {}
    for number in range(w3.eth.block_number + 1):
        block = w3.eth.get_block(number, full_transactions=True)
        for tx in block.transactions:
            data = bytes(tx["input"])
            name = (
                "deploy" if tx.get("to") is None else names.get(data[:4].hex(), data[:4].hex() or "transfer")
            )
            gas.setdefault(name, []).append(w3.eth.get_transaction_receipt(tx["hash"])["gasUsed"])
    return {
        name: {"count": len(v), "mean": round(sum(v) / len(v)), "max": max(v)}
        for name, v in sorted(gas.items())
    }


def pulled_model(directory: Path) -> dict:
    """Load a pulled directory with transformers (model and tokenizer) and generate a few tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer("First Citizen:", return_tensors="pt").input_ids
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer": type(tokenizer).__name__,
        "vocab": len(tokenizer),
        "generated": tokenizer.decode(generated[0]),
        "seconds": round(time.monotonic() - started, 2),
    }


def analyse(workdir: Path, rounds: int, args_doc: dict, extra: dict, partial: bool = False) -> dict:
    samples: dict[str, list[dict]] = {}
    path = workdir / "samples.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            s = json.loads(line)
        except ValueError:
            continue
        samples.setdefault(s["node"], []).append(s)
    peaks = _rss_peaks(workdir / "rss.log")
    nodes = []
    for node in node_dirs(workdir):
        row = analyse_node(node, samples.get(node.name, []), rounds, partial)
        row["peak_rss_bytes"] = peaks.get(node.name)
        row["child_peak_rss_bytes"] = peaks.get(f"{node.name}/child")
        row["peak_rss_with_children_bytes"] = peaks.get(f"{node.name}/sum")
        row["disk"] = _disk(node)
        probe = memory_at_peak(node)
        if probe is not None:
            row["memory_at_peak"] = probe
        nodes.append(row)
    run = {"args": args_doc, "nodes": nodes, "demo_peak_rss_bytes": peaks.get("demo"), **extra}
    if peaks.get("all"):
        run["all_nodes_peak_rss_bytes"] = peaks["all"]
    run["summary"] = summarise(nodes)
    return run


def summarise(nodes: list[dict]) -> dict:
    """Means over the nodes: seconds per round, busy thread-seconds per component, bytes, RSS, disk."""

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    components = sorted({k for n in nodes for k in n.get("busy_thread_s_per_round", {})})
    busy = {
        k: round(mean(n.get("busy_thread_s_per_round", {}).get(k, 0.0) for n in nodes), 3) for k in components
    }
    total = sum(busy.values())
    wall = mean(n.get("training_thread", {}).get("wall_s_per_round") for n in nodes)
    cpu = mean(n.get("training_thread", {}).get("process_cpu_s_per_round") for n in nodes)
    return {
        "process_cpu_s_per_round": cpu,
        "inner_cpu_s_per_round": mean(
            n.get("training_thread", {}).get("inner_cpu_s_per_round") for n in nodes
        ),
        # the process's CPU split by the profile's shares (an estimate: the shares are of wall samples)
        "cpu_s_per_round_by_component": {k: round(cpu * v / total, 3) for k, v in busy.items()}
        if cpu is not None and total
        else {},
        "wall_s_per_round": None if wall is None else round(wall, 3),
        "inner_s_per_round": mean(n.get("training_thread", {}).get("inner_s_per_round") for n in nodes),
        "busy_thread_s_per_round": busy,
        "busy_shares": {k: round(v / total, 4) for k, v in busy.items()} if total else {},
        "bytes_sent_per_round": mean(n.get("bytes_sent_per_round") for n in nodes),
        "bytes_received_per_round": mean(n.get("bytes_received_per_round") for n in nodes),
        "peak_rss_bytes": max((n["peak_rss_bytes"] for n in nodes if n.get("peak_rss_bytes")), default=None),
        "child_peak_rss_bytes": max(
            (n["child_peak_rss_bytes"] for n in nodes if n.get("child_peak_rss_bytes")), default=None
        ),
        "peak_rss_with_children_bytes": max(
            (n["peak_rss_with_children_bytes"] for n in nodes if n.get("peak_rss_with_children_bytes")),
            default=None,
        ),
        "disk_bytes": max((n["disk"]["total_bytes"] for n in nodes), default=None),
    }
