"""Blob throughput between two hosts behind NAT: through the relay vs hole punched; writes
bench/results/nat.json.

Builds the lab of tests/netns_lab.py (root, ``ip`` and ``nft`` needed), a relay in the public
namespace and one host per site (tests/p2p_agent.py processes). Once with ``hole_punch`` off (every
byte goes through the relay, which copies it in Python), once with it on (waits for the punched
connection). Each: ``--repeats`` fetches of a fresh ``--size-mb`` blob from site 2 to site 1; the
median and every run's figure are kept, with the load average at the start (the machine is shared).

Usage: sudo python bench/bench_nat.py [--size-mb 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from netns_lab import PUBLIC_IP, SITE_IPS, NatLab  # noqa: E402
from test_p2p_nat import Agent  # noqa: E402


def measure(lab: NatLab, hole_punch: bool, size: int, repeats: int, workdir: str) -> dict:
    agents = []
    try:
        relay = Agent(lab, lab.public, {"listen_host": PUBLIC_IP, "listen_port": 4001, "relay_serve": True},
                      f"{workdir}/relay")
        agents.append(relay)
        sites = []
        for namespace, ip in zip(lab.sites, SITE_IPS):
            config = {"listen_host": ip, "listen_port": 4001, "relay_use": [relay.listen_addrs[0]],
                      "hole_punch": hole_punch, "autonat": False}
            sites.append(Agent(lab, namespace, config, f"{workdir}/{namespace}-{hole_punch}"))
            agents.append(sites[-1])
        one, two = sites
        deadline = time.monotonic() + 60
        while not any("/p2p-circuit" in a for a in two.ask(cmd="status")["listen_addrs"]):
            if time.monotonic() > deadline:
                raise RuntimeError("site 2 got no reservation")
            time.sleep(0.5)
        relayed = [a for a in two.ask(cmd="status")["listen_addrs"] if "/p2p-circuit" in a][0]
        assert one.ask(cmd="connect", addr=relayed, timeout=60)["ok"]
        want = "hole_punched" if hole_punch else "relayed"
        path = one.ask(cmd="wait_path", peer=two.peer_id, path=want, timeout=60)["path"]
        runs = []
        for _ in range(repeats):
            sha = two.ask(cmd="provide", size=size)["sha256"]
            load = os.getloadavg()[0]
            start = time.monotonic()
            fetched = one.ask(cmd="fetch", sha256=sha, provider=two.peer_id, timeout=600)
            seconds = time.monotonic() - start
            if not fetched["ok"]:
                raise RuntimeError(fetched["error"])
            runs.append({"seconds": round(seconds, 3), "mb_per_s": round(size / seconds / 1e6, 2),
                         "load": load})
        return {"path": path, "path_after": one.ask(cmd="paths")["paths"][two.peer_id],
                "mb_per_s_median": statistics.median(r["mb_per_s"] for r in runs), "runs": runs}
    finally:
        for agent in agents:
            agent.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "nat.json"))
    args = parser.parse_args()
    import tempfile

    workdir = tempfile.mkdtemp(prefix="dlx-bench-nat-")
    size = args.size_mb * 1_000_000
    with NatLab() as lab:
        result = {
            "size_mb": args.size_mb, "repeats": args.repeats, "cpus": os.cpu_count(),
            "relayed": measure(lab, False, size, args.repeats, workdir),
            "hole_punched": measure(lab, True, size, args.repeats, workdir),
        }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
