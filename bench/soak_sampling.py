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


def take_sample(members, sites: dict, at: float, last: int | None) -> dict:
    """One sample: ``members`` are (name, process or None, data dir); ``sites`` the lab's (their forwarder's
    stats file under ``"stats"``); ``at`` seconds into the run; ``last`` the last committed round."""
    nodes = {}
    for name, process, data_dir in members:
        entry: dict = {}
        if process is not None and process.poll() is None:
            entry.update(proc_figures(process.pid))
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


def proc_figures(pid: int) -> dict:
    """RSS (MiB) and open file descriptors of a live process."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out["rss_mib"] = round(int(line.split()[1]) / 1024, 1)
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def series(samples: list[dict]) -> dict:
    """Per node RSS and fds, per site dials per minute, over time (from the samples)."""
    out: dict = {"at_s": [s["at_s"] for s in samples], "rss_mib": {}, "fds": {}, "dials_per_min": {},
                 "chain_connections_per_min": {}, "load_1min": [(s.get("load") or [None])[0] for s in samples]}
    names = sorted({n for s in samples for n in s["nodes"]})
    for name in names:
        out["rss_mib"][name] = [s["nodes"].get(name, {}).get("rss_mib") for s in samples]
        out["fds"][name] = [s["nodes"].get(name, {}).get("fds") for s in samples]
    sites = sorted({site for s in samples for site in s["links"]})
    for site in sites:
        for key, target in (("syns_to_peers", "dials_per_min"), ("syns_to_chain", "chain_connections_per_min")):
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
