"""The network emulator measured: the delay, jitter and rate tests/netlab.py gives against what it was asked.

    python bench/bench_netlab.py [--echoes 20] [--seconds 5]

Builds one lab (tests/netlab.py): a sink site with a fast link (10 Gbit/s tbf) and one source site per
case. Delay: UDP echoes from the sink to sites whose path has a one-way delay of 0, 10, 50, 100 and
200 ms each way (RTT asked = twice that), and one with 5 ms of jitter; the RTTs measured (min, median,
p90, max) beside the RTT asked. Rate: one TCP stream (a Python socket pair) for ``--seconds`` from
sites with a 50, 200 and 1000 Mbit/s link and one with 10 Gbit/s (the forwarder's ceiling: nothing
else limits it), without delay and with 20 ms each way; the Mbit/s received beside the rate asked, and
the CPU the forwarders used meanwhile (both links the stream crosses), per 100 Mbit/s carried. A NATed
site is checked too: its echo to the sink answers, the sink's to it does not (the NAT drops it).
Writes bench/results/netlab.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from netlab import NetLab, Site, probe_rtt, probe_throughput  # noqa: E402

from bench.benchio import default_out, write_result  # noqa: E402

DELAYS_MS = (0, 10, 50, 100, 200)
RATES_MBIT = (50, 200, 1000, 10000)
SINK_MBIT = 10000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--echoes", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    load = list(os.getloadavg())
    sites = [Site("sink", SINK_MBIT)]
    delays: dict[str, dict[str, float]] = {"sink": {}}
    for d in DELAYS_MS:
        sites.append(Site(f"d{d}", SINK_MBIT))
        delays["sink"][f"d{d}"] = delays.setdefault(f"d{d}", {})["sink"] = d
    sites.append(Site("jitter", SINK_MBIT))
    delays["sink"]["jitter"] = delays.setdefault("jitter", {})["sink"] = 50
    for rate in RATES_MBIT:
        for d in (0, 20):
            name = f"r{rate}d{d}"
            sites.append(Site(name, rate))
            delays["sink"][name] = delays.setdefault(name, {})["sink"] = d
    sites.append(Site("nat", 1000, nat=True))
    delays["sink"]["nat"] = delays.setdefault("nat", {})["sink"] = 10
    started = time.monotonic()
    result: dict = {"echoes": args.echoes, "stream_s": args.seconds, "delay": [], "rate": []}
    # Jitter is one setting for the whole lab: a second lab would double the cost; the jitter site is
    # measured in its own lab below.
    with NetLab(sites, delays) as lab:
        for d in DELAYS_MS:
            result["delay"].append(rtt_row(probe_rtt(lab, "sink", f"d{d}", args.echoes), 2 * d, 0))
        nat_out = probe_rtt(lab, "nat", "sink", 3)
        nat_in = probe_rtt(lab, "sink", "nat", 2)
        result["nat"] = {"echoes_out_answered": len(nat_out), "echoes_in_answered": len(nat_in)}
        for rate in RATES_MBIT:
            for d in (0, 20):
                row = probe_throughput(lab, f"r{rate}d{d}", "sink", args.seconds)
                row.update(rate_mbit=rate, one_way_ms=d,
                           cpu_pct_per_100mbit=round(100 * row["forwarder_cpu_share"] / row["mbit_s"] * 100,
                                                     2)
                           if row["mbit_s"] else None)
                result["rate"].append(row)
                print(row, flush=True)
    with NetLab([Site("sink", SINK_MBIT), Site("jitter", SINK_MBIT)],
                {"sink": {"jitter": 50}, "jitter": {"sink": 50}}, jitter_ms=5.0) as lab:
        result["delay"].append(rtt_row(probe_rtt(lab, "sink", "jitter", args.echoes), 100, 5.0))
    for row in result["delay"]:
        print(row)
    result["wall_s"] = round(time.monotonic() - started, 1)
    write_result(args.out or default_out(__file__), result, load)
    return 0


def rtt_row(rtts: list[float], asked_ms: float, jitter_ms: float) -> dict:
    rtts = sorted(rtts)
    if not rtts:
        return {"rtt_asked_ms": asked_ms, "jitter_ms": jitter_ms, "answered": 0}
    return {"rtt_asked_ms": asked_ms, "jitter_ms": jitter_ms, "answered": len(rtts),
            "min_ms": round(rtts[0], 2), "median_ms": round(statistics.median(rtts), 2),
            "p90_ms": round(rtts[int(0.9 * (len(rtts) - 1))], 2), "max_ms": round(rtts[-1], 2),
            "median_excess_ms": round(statistics.median(rtts) - asked_ms, 2)}


if __name__ == "__main__":
    sys.exit(main())
