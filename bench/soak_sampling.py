"""The soak's samples (bench/bench_soak.py): per node RSS, fds, state and traffic, per site link counters.

A sample is taken every ``--sample-s`` by :meth:`bench.soak_churn.Soak.sample`; :func:`series` turns the
samples into the time series the JSON carries (RSS and fds per node, dials per minute per site, the load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: The chain's address in the lab's core: SYNs to it are connections to the chain, not dials to peers.
CHAIN_IP = "100.64.0.1"


#: What a node's sample holds beside its RSS: the RSS split into anonymous and file-backed pages (from /proc),
#: and from the in-process probe (bench/churn_probe, light mode) glibc's heap in use and free-but-kept (MiB),
#: Python's allocated blocks (a count) and pymalloc's arenas (MiB mapped), and the anonymous pages by mapping
#: (MiB resident: glibc's main heap, its other arenas' heaps, the rest: pymalloc arenas, mmapped chunks,
#: thread stacks; the rest split by mapping size into threads' stacks, pymalloc's arenas and the other
#: chunks), and glibc's bytes in use and free-but-kept in its main
#: arena and in the others (``malloc_info``) and in mmapped blocks.
HEAP_SERIES = ("rss_anon_mib", "rss_file_mib", "malloc_in_use_mib", "malloc_free_mib", "py_blocks",
               "py_arenas_mib", "anon_brk_mib", "anon_arenas_mib", "anon_other_mib", "anon_other_stacks_mib",
               "anon_other_pymalloc_mib", "anon_other_chunks_mib", "malloc_main_in_use_mib",
               "malloc_main_free_mib", "malloc_others_in_use_mib", "malloc_others_free_mib",
               "malloc_mmapped_mib")


def take_sample(members, sites: dict, at: float, last: int | None, probe_dir: Path | None = None) -> dict:
    """One sample: ``members`` are (name, process or None, data dir); ``sites`` the lab's (their forwarder's
    stats file under ``"stats"``); ``at`` seconds into the run; ``last`` the last committed round;
    ``probe_dir`` where the nodes' light probes write (``light-<pid>.jsonl``), if they run one."""
    nodes = {}
    for name, process, data_dir in members:
        entry: dict = {}
        if process is not None and process.poll() is None:
            entry["pid"] = process.pid
            entry.update(proc_figures(process.pid))
            if probe_dir is not None:
                entry.update(probe_figures(probe_dir / f"light-{process.pid}.jsonl"))
        try:
            status = json.loads((data_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        placement = status.get("placement") or {}
        entry.update(state=status.get("state"), round=status.get("round"), peers=status.get("peers"),
                     replica=placement.get("replica"),
                     traffic={k: [v.get("sent", 0), v.get("received", 0)]
                              for k, v in (status.get("traffic") or {}).items()},
                     paths=status.get("paths"))
        nodes[name] = entry
    links = {}
    for site, info in sites.items():
        try:
            stats = json.loads(Path(info["stats"]).read_text())
        except (OSError, ValueError):
            continue
        sent = stats.get("sent", {})
        links[site] = {"syns_to_peers": sum(v["syns"] for ip, v in sent.items() if ip != CHAIN_IP),
                       "syns_to_chain": sent.get(CHAIN_IP, {}).get("syns", 0),
                       "bytes_sent": sum(v["bytes"] for v in sent.values()),
                       "bytes_received": stats.get("received", {}).get("bytes", 0)}
    return {"at_s": at, "last_round": last, "load": [round(x, 2) for x in os.getloadavg()],
            "nodes": nodes, "links": links}


#: /proc/<pid>/status lines a sample keeps (kB), and their names in it (MiB).
_STATUS = {"VmRSS": "rss_mib", "RssAnon": "rss_anon_mib", "RssFile": "rss_file_mib"}


def proc_figures(pid: int) -> dict:
    """RSS (MiB; all of it, its anonymous and its file-backed pages) and open file descriptors of a live
    process."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in _STATUS:
                out[_STATUS[key]] = round(int(line.split()[1]) / 1024, 1)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def probe_figures(path: Path) -> dict:
    """What only the process itself sees, from its last light-probe line (bench/churn_probe/sitecustomize.py):
    glibc's heap in use and free-but-kept (MiB), Python's allocated blocks, its threads; {} if none yet."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = handle.read().decode("utf-8", "replace").splitlines()
        line = json.loads(next(x for x in reversed(lines) if x.strip().endswith("}")))
    except (OSError, ValueError, StopIteration):
        return {}
    malloc = line.get("malloc") or {}
    mib = lambda kib: round(kib / 1024, 1)  # noqa: E731
    out = {"py_blocks": line.get("allocated_blocks"), "threads": line.get("threads")}
    if malloc:
        out.update(malloc_in_use_mib=mib(malloc["in_use"] / 1024), malloc_free_mib=mib(malloc["free"] / 1024))
        if "mmapped" in malloc:
            out["malloc_mmapped_mib"] = mib(malloc["mmapped"] / 1024)
    # the main arena, then the others summed: whose pages hold what, whose hold holes
    if malloc.get("arenas"):
        main, others = malloc["arenas"][0], malloc["arenas"][1:]
        out.update(malloc_main_in_use_mib=mib(main["in_use"] / 1024),
                   malloc_main_free_mib=mib(main["free"] / 1024),
                   malloc_others_in_use_mib=mib(sum(a["in_use"] for a in others) / 1024),
                   malloc_others_free_mib=mib(sum(a["free"] for a in others) / 1024))
    if line.get("arena_max"):
        out["arena_max"] = line["arena_max"]
    if (line.get("pymalloc") or {}).get("arenas") is not None:
        out["py_arenas_mib"] = line["pymalloc"]["arenas"]  # each arena is 1 MiB
    mappings = line.get("mappings") or {}
    for key in ("brk", "arenas", "other", "other_stacks", "other_pymalloc", "other_chunks"):
        if key in mappings:
            out[f"anon_{key}_mib"] = mib(mappings[key])
    if mappings.get("other_top"):  # the largest other chunks (MiB mapped, MiB resident): what a step was
        out["anon_other_top"] = [[mib(size), mib(kib)] for size, kib in mappings["other_top"]]
    return out


def memory_growth(samples: list[dict], run_s: float) -> dict:
    """Per node that ran one life from a quarter of the run to its end (the same pid): the growth of RSS and
    of each part the probe sees (:data:`HEAP_SERIES`) from the first sample past the quarter to the last, and
    its slope over the last quarter (per minute, least squares). Warm-up is the first quarter."""
    out = {}
    names = sorted({n for s in samples for n in s["nodes"]})
    for name in names:
        life = [s for s in samples if s["nodes"].get(name, {}).get("pid") is not None]
        if not life:
            continue
        pid = life[-1]["nodes"][name]["pid"]
        tail = [s for s in life if s["at_s"] >= run_s / 4]
        if not tail or any(s["nodes"][name]["pid"] != pid for s in tail) or tail[0]["at_s"] > run_s / 2:
            continue
        last_quarter = [s for s in tail if s["at_s"] >= 3 * run_s / 4]
        entry = {}
        for key in ("rss_mib",) + HEAP_SERIES:
            values = [(s["at_s"], s["nodes"][name].get(key)) for s in tail]
            values = [(t, v) for t, v in values if v is not None]
            if len(values) < 2:
                continue
            quarter = [(t, v) for t, v in values if t >= 3 * run_s / 4]
            entry[key] = {"quarter_to_end": round(values[-1][1] - values[0][1], 1),
                          "last_quarter_per_min": round(fit_slope(quarter) * 60, 3) if len(quarter) >= 2
                              else None}
        if last_quarter and entry:
            out[name] = entry
    return out


def object_growth(samples: list[dict], names, probe_dir: Path | None, started: float, run_s: float,
                  top: int = 12) -> dict:
    """Per node of ``names`` (those :func:`memory_growth` kept: one life from the quarter on), what its deep
    probe samples (``deep-<pid>.jsonl``, ``DLX_CHURN_PROBE_DEEP_EVERY``) say grew from the first past the
    quarter to the
    last: the ``top`` largest increases of gc-tracked objects by type, of instances by class and of
    container lengths by ``module.Class.attribute``; {} without a probe directory."""
    if probe_dir is None:
        return {}
    out = {}
    for name in names:
        pid = next(s["nodes"][name]["pid"] for s in reversed(samples) if s["nodes"].get(name, {}).get("pid"))
        deep = []
        try:
            for line in (probe_dir / f"deep-{pid}.jsonl").read_text().splitlines():
                try:
                    deep.append(json.loads(line))
                except ValueError:
                    continue
        except OSError:
            continue
        deep = [d for d in deep if "types" in d and d.get("time", 0) >= started + run_s / 4]
        if len(deep) < 2:
            continue
        first, last = deep[0], deep[-1]
        entry = {"span_s": round(last["time"] - first["time"]),
                 "pass_s": max(d.get("pass_s", 0) for d in deep)}
        for key in ("types", "instances", "containers"):
            grown = {k: v - first[key].get(k, 0) for k, v in last[key].items() if v > first[key].get(k, 0)}
            entry[key] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:top])
        out[name] = entry
    return out


def fit_slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``points`` (x, y)."""
    n = len(points)
    mean_t, mean_v = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    den = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / den if den else 0.0


def series(samples: list[dict]) -> dict:
    """Per node RSS and fds, per site dials per minute, over time (from the samples)."""
    out: dict = {"at_s": [s["at_s"] for s in samples], "rss_mib": {}, "fds": {}, "dials_per_min": {},
                 "chain_connections_per_min": {},
                 "load_1min": [(s.get("load") or [None])[0] for s in samples]}
    names = sorted({n for s in samples for n in s["nodes"]})
    for name in names:
        out["rss_mib"][name] = [s["nodes"].get(name, {}).get("rss_mib") for s in samples]
        out["fds"][name] = [s["nodes"].get(name, {}).get("fds") for s in samples]
        for key in HEAP_SERIES:
            values = [s["nodes"].get(name, {}).get(key) for s in samples]
            if any(v is not None for v in values):
                out.setdefault(key, {})[name] = values
    sites = sorted({site for s in samples for site in s["links"]})
    for site in sites:
        for key, target in (("syns_to_peers", "dials_per_min"),
                            ("syns_to_chain", "chain_connections_per_min")):
            values = []
            for a, b in zip(samples, samples[1:]):
                if site in a["links"] and site in b["links"] and b["at_s"] > a["at_s"]:
                    values.append(round((b["links"][site][key] - a["links"][site][key]) * 60
                                        / (b["at_s"] - a["at_s"]), 1))
                else:
                    values.append(None)
            out[target][site] = values
    last = samples[-1]["nodes"] if samples else {}
    out["traffic_by_kind_at_end"] = {name: entry.get("traffic", {}) for name, entry in last.items()}
    return out
