"""Gossip latency across hosts, one process each: the gossip section of bench/bench_p2p.py.

A subscriber is ``python bench/p2p_gossip.py BOOTSTRAP --messages N --hosts H`` (started by
:func:`gossip_run`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p.config import P2PConfig  # noqa: E402
from p2p.host import P2PHost  # noqa: E402
from p2p.identity import Identity  # noqa: E402

GOSSIP_TOPIC = "bench/gossip"


def gossip_peer(bootstrap: str, expected: int, hosts: int) -> None:
    """Child process: one host that records (receive time - send time) of each bench message."""
    with tempfile.TemporaryDirectory(prefix="bench-gossip-") as data_dir, P2PHost.start(
        P2PConfig(bootstrap=[bootstrap], gossip_resync_interval=0),
        Identity.generate(),
        data_dir=data_dir,
    ) as host:
        messages = host.subscribe(GOSSIP_TOPIC)
        deadline = time.monotonic() + 60  # ready = connected to every host and seeing their subscriptions
        while time.monotonic() < deadline and (
            len(host.peers()) < hosts - 1 or len(host.topic_peers(GOSSIP_TOPIC)) < hosts - 1
        ):
            time.sleep(0.1)
        print(json.dumps({"ready": host.peer_id, "peers": len(host.peers())}), flush=True)
        latencies = []
        cpu_start = time.process_time()  # CPU per message delivered: a figure the machine's load barely moves
        deadline = time.monotonic() + 120
        while len(latencies) < expected and time.monotonic() < deadline:
            try:
                data, _ = messages.get(timeout=1)
            except Exception:  # queue.Empty: keep waiting until the deadline
                continue
            sent = json.loads(data)["sent"]
            latencies.append(time.time() - sent)
        print(json.dumps({"latencies": latencies, "cpu_s": time.process_time() - cpu_start}), flush=True)


def bench_gossip(messages: int, rate_per_s: float, hosts: int, repeats: int) -> dict:
    """``repeats`` runs of :func:`gossip_run`; medians of the per-run quantiles, and each run's figures."""
    runs = [gossip_run(messages, rate_per_s, hosts) for _ in range(repeats)]
    summary = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    summary["runs"] = runs
    print(
        f"gossip median of {repeats}: p50 {summary['latency_ms_p50']:.1f} ms, "
        f"p99 {summary['latency_ms_p99']:.1f} ms (runs {[round(r['latency_ms_p99'], 1) for r in runs]})",
        flush=True,
    )
    return summary


def gossip_run(messages: int, rate_per_s: float, hosts: int = 5) -> dict:
    """One publisher (this process) and ``hosts - 1`` subscriber processes; latency = receive - send time."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-gossip-") as data_dir, P2PHost.start(
        P2PConfig(gossip_resync_interval=0),
        Identity.generate(),
        data_dir=data_dir,
    ) as publisher:
        publisher.subscribe(GOSSIP_TOPIC)
        children = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    publisher.listen_addrs[0],
                    "--messages",
                    str(messages),
                    "--hosts",
                    str(hosts),
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            for _ in range(hosts - 1)
        ]
        for child in children:
            json.loads(child.stdout.readline())
        deadline = time.monotonic() + 30
        while len(publisher.topic_peers(GOSSIP_TOPIC)) < hosts - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(3)  # a few 1 s heartbeats for the mesh to settle after the last connection
        for index in range(messages):
            payload = json.dumps({"sent": time.time(), "index": index, "pad": "x" * 200}).encode()
            publisher.publish(GOSSIP_TOPIC, payload)
            time.sleep(1 / rate_per_s)
        latencies: list[float] = []
        receiver_cpu_s = 0.0
        for child in children:
            report = json.loads(child.stdout.readline())
            latencies += report["latencies"]
            receiver_cpu_s += report["cpu_s"]
            child.wait(timeout=30)
    latencies.sort()
    expected = messages * (hosts - 1)
    def quantile(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
    result = {
        "load_1min_at_start": load,
        "hosts": hosts,
        "messages": messages,
        "publish_rate_per_s": rate_per_s,
        "delivered_fraction": len(latencies) / expected,
        "latency_ms_p50": quantile(0.50),
        "latency_ms_p99": quantile(0.99),
        "latency_ms_max": latencies[-1] * 1000,
        # receiving processes' CPU (all their threads, while the messages came) per message delivered
        "receiver_cpu_ms_per_message": receiver_cpu_s * 1000 / max(1, len(latencies)),
    }
    print(
        f"gossip {hosts} hosts: p50 {result['latency_ms_p50']:.1f} ms, "
        f"p99 {result['latency_ms_p99']:.1f} ms, "
        f"delivered {result['delivered_fraction']:.3f}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="one subscriber of the gossip benchmark")
    parser.add_argument("bootstrap")
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--hosts", type=int, required=True)
    args = parser.parse_args()
    gossip_peer(args.bootstrap, args.messages, args.hosts)


if __name__ == "__main__":
    main()
