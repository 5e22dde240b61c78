"""Benchmark of the p2p layer on loopback; writes bench/results/p2p.json.

Measures (issue 3):
- blob throughput between two processes (``python -m p2p.serve`` provider, fetcher here),
  uncapped and with the per-peer rate cap at 1 Gbps and 100 Mbps (achieved vs cap);
- CPU seconds per 100 MB on each side (uncapped run);
- a small blob (a DiLoCoX contribution's size) under a slow cap with a small bucket: seconds
  against bytes / rate (both ends cap, as two nodes of a run do);
- gossip latency p50/p99 across 5 hosts, each in its own process;
- resident memory of an idle host process.

Usage: python bench/bench_p2p.py [--size-mb 100] [--repeats 3] [--messages 200] [--only blob,gossip,memory]
                                 [--profile] [--direct-staging]
``--only staging`` alternates ``p2p.blob_direct_io`` on and off (``--repeats`` rounds of each),
each download followed by one read of the blob, as every caller in node/ does.
Each blob run connects, waits ``SETTLE_SECONDS`` for the connection's start-up traffic, then
times ``fetch_blob`` alone. The machine is shared: every figure is the median of ``--repeats`` runs, each
run's own figure is kept beside it (the spread), and the load average at the
start of each run is recorded. ``--only`` measures some sections and keeps the
others already in ``--out``. ``--profile`` adds to each blob run where its time
went (the fetcher's time stamps along the download, as seconds from the call:
size request, first reply, last byte, hash, fsync, commit) and where the
fetcher's CPU went (per thread; event-loop passes, task steps and ``recv`` calls).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import trio  # noqa: E402

from bench.p2p_gossip import bench_gossip  # noqa: E402
from bench.p2p_probes import (  # noqa: E402
    PERF_DIR,
    DataPathCounter,
    LoopCounter,
    perf_record,
    process_cpu_seconds,
    rss_mib,
    thread_cpu_seconds,
    timeline_breakdown,
)
from p2p.config import P2PConfig  # noqa: E402
from p2p.host import P2PHost  # noqa: E402
from p2p.identity import Identity  # noqa: E402
from p2p.ratelimit import MIN_BURST_BYTES  # noqa: E402

#: Seconds between connecting and the timed transfer: the connection's own start-up traffic
#: (identify, the DHT's routing-table queries, pubsub hellos) is done by then (measured: the
#: fetcher's CPU stops rising ~2 s after connect); before, it overlapped the timed transfer.
SETTLE_SECONDS = 2.0
#: ``--direct-staging``: the fetcher writes its staging file without the page cache (``p2p.blob_direct_io``).
DIRECT_STAGING = False
#: The small-blob run: a contribution of `mini` (docs/DILOCOX.md) under a 16 KiB bucket.
SMALL_BLOB_BYTES = 344_000
SMALL_CAP_BPS = 200_000.0
SMALL_BURST_BYTES = 16 << 10


def start_provider(
    path: Path, data_dir: Path, rate_limit_bps: float = 0.0, burst: float = 0.0
) -> tuple[subprocess.Popen, dict]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "p2p.serve",
            str(path),
            "--data-dir",
            str(data_dir),
            "--rate-limit-bps",
            str(rate_limit_bps),
            "--rate-limit-burst",
            str(burst),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    return process, json.loads(process.stdout.readline())


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.stdin.close()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def blob_run(
    blob: Path, work: Path, rate_limit_bps: float, burst: float = 0.0, profile: bool = False
) -> dict:
    """One transfer of ``blob`` from a provider process to a host in this process."""
    provider, info = start_provider(blob, work / "provider", rate_limit_bps, burst)
    extra: dict = {}
    try:
        config = P2PConfig(
            rate_limit_bps=rate_limit_bps,
            rate_limit_burst=burst,
            transfer_timeout=600,
            blob_direct_io=DIRECT_STAGING,
        )
        with P2PHost.start(config, Identity.generate(), data_dir=work / "fetcher") as fetcher:
            fetcher.connect(info["listen_addrs"][0])
            time.sleep(SETTLE_SECONDS)
            load = os.getloadavg()[0]
            sha = info["blobs"][str(blob)]
            counter = LoopCounter()
            if profile:
                fetcher._blobs.timeline = []

                async def add_counter() -> None:
                    trio.lowlevel.add_instrument(counter)

                fetcher._call(add_counter, timeout=10, what="add loop counter")
            # The first full collection of this process's start-up objects (libp2p's import
            # graph: ~0.1-0.2 CPU-s) would otherwise land in whichever run triggers it; it is
            # paid once per process, not per 100 MB.
            gc.collect()
            datapath = DataPathCounter()
            recorders = [perf_record(pid, f"{side}-{os.getpid()}-{time.monotonic_ns()}")
                         for side, pid in (("fetcher", os.getpid()), ("provider", provider.pid))] \
                         if PERF_DIR else []
            with datapath if profile else contextlib.nullcontext():
                threads0 = thread_cpu_seconds()
                server_cpu0 = process_cpu_seconds(provider.pid)
                client_cpu0 = time.process_time()
                start = time.monotonic()
                out = fetcher.fetch_blob(sha, work / "out.bin", providers=[info["peer_id"]])
                end = time.monotonic()
                client_cpu = time.process_time() - client_cpu0
                server_cpu = process_cpu_seconds(provider.pid) - server_cpu0
                threads1 = thread_cpu_seconds()
            read_s, read_cpu_s = consumer_read(out)
            for recorder in recorders:
                recorder.send_signal(signal.SIGINT)
                recorder.wait(timeout=60)
            elapsed = end - start
            size = out.stat().st_size
            if profile:
                async def remove_counter() -> None:
                    trio.lowlevel.remove_instrument(counter)

                fetcher._call(remove_counter, timeout=10, what="remove loop counter")
                cap_burst = burst or max(rate_limit_bps * 0.01, MIN_BURST_BYTES)
                extra["profile"] = {
                    **timeline_breakdown(fetcher._blobs.timeline, start, end),
                    # the sender's bucket starts full: the least a capped transfer can take
                    "bytes_minus_burst_over_rate_s": max(0.0, size - cap_burst) / rate_limit_bps
                    if rate_limit_bps else None,
                    "fetcher_thread_cpu_s": {
                        name: round(threads1.get(name, 0.0) - threads0.get(name, 0.0), 3)
                        for name in sorted(set(threads0) | set(threads1))
                    },
                    "fetcher_loop_passes": counter.passes,
                    "fetcher_task_steps": counter.task_steps,
                    "fetcher_loop_io_wait_s": round(counter.io_wait_s, 4),
                    "fetcher_recv_calls": datapath.recv_calls,
                    "fetcher_fresh_frame_bodies": datapath.fresh_bodies,
                }
                fetcher._blobs.timeline = None
            fetcher.remove_blob(sha)
            out.unlink()
    finally:
        stop(provider)
        for leftover in (work / "provider" / "blobs").glob("*"):
            if leftover.is_file():
                leftover.unlink()
    return {
        "load_1min_at_start": load,
        "bytes": size,
        "seconds": elapsed,
        "mb_per_s": size / elapsed / 1e6,
        "fetcher_cpu_s_per_100mb": client_cpu * 100e6 / size,
        "provider_cpu_s_per_100mb": server_cpu * 100e6 / size,
        # every caller of fetch_blob in node/ reads the blob right after: its cost depends on
        # whether the download left it in the page cache
        "consumer_read_s": read_s,
        "consumer_read_cpu_s_per_100mb": read_cpu_s * 100e6 / size,
        **extra,
    }


def consumer_read(path: Path) -> tuple[float, float]:
    """Seconds and CPU seconds (this process) to read ``path`` once and sha256 it, as a caller would."""
    buffer = bytearray(4 << 20)  # reused: a fresh allocation per read would add its page faults
    digest = hashlib.sha256()
    cpu0, start = time.process_time(), time.monotonic()
    with open(path, "rb", buffering=0) as handle, memoryview(buffer) as view:
        while count := handle.readinto(view):
            digest.update(view[:count])
    return time.monotonic() - start, time.process_time() - cpu0


def machine() -> dict:
    """What the figures were measured on (the same code measured ~2x apart on the VMs of sessions 6 and 9)."""
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        None,
    ) if Path("/proc/cpuinfo").exists() else None
    uptime = Path("/proc/uptime")
    return {
        "cpu_model": model,
        "kernel": os.uname().release,
        "uptime_s": float(uptime.read_text().split()[0]) if uptime.exists() else None,
    }


def bench_blobs(size_mb: int, repeats: int, work: Path, profile: bool = False,
                caps: list[str] | None = None) -> dict:
    blob = work / "blob.bin"
    with open(blob, "wb") as handle:
        handle.writelines(os.urandom(1 << 20) for _ in range(size_mb))
    results = {}
    for label, cap in (("uncapped", 0.0), ("cap_1gbps", 125e6), ("cap_100mbps", 12.5e6)):
        if caps is not None and label not in caps:
            continue
        runs = [blob_run(blob, work, cap, profile=profile) for _ in range(repeats if cap != 12.5e6 else 1)]
        summary = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "profile"}
        if profile:
            summary["runs_profile"] = [r["profile"] for r in runs]
        summary["runs_mb_per_s"] = [round(r["mb_per_s"], 1) for r in runs]
        summary["runs_fetcher_cpu_s_per_100mb"] = [round(r["fetcher_cpu_s_per_100mb"], 3) for r in runs]
        summary["runs_consumer_read_cpu_s_per_100mb"] = [
            round(r["consumer_read_cpu_s_per_100mb"], 3) for r in runs
        ]
        summary["runs_load_1min_at_start"] = [round(r["load_1min_at_start"], 2) for r in runs]
        if cap:
            summary["cap_mb_per_s"] = cap / 1e6
            summary["achieved_fraction_of_cap"] = summary["mb_per_s"] / (cap / 1e6)
        results[label] = summary
        print(
            f"blob {label}: {summary['mb_per_s']:.1f} MB/s (runs {summary['runs_mb_per_s']}), "
            f"cpu/100MB fetcher {summary['fetcher_cpu_s_per_100mb']:.2f} s "
            f"(runs {summary['runs_fetcher_cpu_s_per_100mb']}), "
            f"provider {summary['provider_cpu_s_per_100mb']:.2f} s, "
            f"then a read of it {summary['consumer_read_cpu_s_per_100mb']:.2f} CPU-s, "
            f"load {summary['runs_load_1min_at_start']}",
            flush=True,
        )
    blob.unlink()
    if caps is None or "small_capped" in caps:
        results["small_capped"] = bench_small_blob(work, repeats)
    return results


def bench_staging(size_mb: int, rounds: int, work: Path, caps: list[str] | None = None) -> dict:
    """``p2p.blob_direct_io`` on and off, alternated run by run: the download, then one read of the blob.

    O_DIRECT takes the page-cache copy off the download but leaves the blob out of the page
    cache, so the read that every caller makes next pays instead; only the two together say
    whether it saves anything.
    """
    global DIRECT_STAGING
    blob = work / "blob.bin"
    with open(blob, "wb") as handle:
        handle.writelines(os.urandom(1 << 20) for _ in range(size_mb))
    results: dict = {}
    try:
        for label, cap in (("uncapped", 0.0), ("cap_1gbps", 125e6)):
            if caps is not None and label not in caps:
                continue
            runs: dict[str, list[dict]] = {"direct": [], "buffered": []}
            for _ in range(rounds):
                for mode in runs:
                    DIRECT_STAGING = mode == "direct"
                    runs[mode].append(blob_run(blob, work, cap))
            results[label] = {}
            for mode, mode_runs in runs.items():
                total = [r["fetcher_cpu_s_per_100mb"] + r["consumer_read_cpu_s_per_100mb"] for r in mode_runs]
                median = lambda key: statistics.median(r[key] for r in mode_runs)  # noqa: E731
                results[label][mode] = {
                    "fetcher_cpu_s_per_100mb": median("fetcher_cpu_s_per_100mb"),
                    "consumer_read_cpu_s_per_100mb": median("consumer_read_cpu_s_per_100mb"),
                    "fetch_and_read_cpu_s_per_100mb": statistics.median(total),
                    "mb_per_s": median("mb_per_s"),
                    "consumer_read_s": median("consumer_read_s"),
                    "fetch_and_read_s": statistics.median(
                        r["seconds"] + r["consumer_read_s"] for r in mode_runs
                    ),
                    "runs": [{key: round(value, 4) for key, value in r.items()} for r in mode_runs],
                }
                summary = results[label][mode]
                print(
                    f"staging {label} {mode}: fetch {summary['fetcher_cpu_s_per_100mb']:.3f} + read "
                    f"{summary['consumer_read_cpu_s_per_100mb']:.3f} = "
                    f"{summary['fetch_and_read_cpu_s_per_100mb']:.3f} CPU-s per 100 MB; "
                    f"fetch + read {summary['fetch_and_read_s']:.3f} s, {summary['mb_per_s']:.1f} MB/s "
                    f"(loads {[round(r['load_1min_at_start'], 2) for r in mode_runs]})",
                    flush=True,
                )
    finally:
        DIRECT_STAGING = False
        blob.unlink()
    return results


def bench_small_blob(work: Path, repeats: int) -> dict:
    """A contribution-sized blob under a slow cap with a small bucket: seconds / (bytes / rate)."""
    blob = work / "small.bin"
    blob.write_bytes(os.urandom(SMALL_BLOB_BYTES))
    runs = [blob_run(blob, work, SMALL_CAP_BPS, SMALL_BURST_BYTES) for _ in range(repeats)]
    blob.unlink()
    ideal = SMALL_BLOB_BYTES / SMALL_CAP_BPS
    result = {
        "bytes": SMALL_BLOB_BYTES,
        "cap_bytes_per_s": SMALL_CAP_BPS,
        "burst_bytes": SMALL_BURST_BYTES,
        "bytes_over_rate_s": ideal,
        "seconds": statistics.median(r["seconds"] for r in runs),
        "runs_seconds": [round(r["seconds"], 3) for r in runs],
        "runs_load_1min_at_start": [round(r["load_1min_at_start"], 2) for r in runs],
    }
    result["seconds_over_bytes_over_rate"] = result["seconds"] / ideal
    print(
        f"blob small_capped: {SMALL_BLOB_BYTES} B at {SMALL_CAP_BPS:.0f} B/s: {result['seconds']:.3f} s "
        f"= {result['seconds_over_bytes_over_rate']:.2f} x bytes/rate (runs {result['runs_seconds']})",
        flush=True,
    )
    return result


def bench_idle_memory() -> dict:
    """RSS of a ``python -m p2p.serve`` host with no blobs, after 5 s idle, vs a bare interpreter."""
    process = subprocess.Popen(
        [sys.executable, "-m", "p2p.serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    process.stdout.readline()
    time.sleep(5)
    host_rss = rss_mib(process.pid)
    stop(process)
    bare = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
    )
    time.sleep(1)
    bare_rss = rss_mib(bare.pid)
    stop(bare)
    result = {"idle_host_rss_mib": host_rss, "bare_python_rss_mib": bare_rss}
    print(f"idle host RSS {host_rss:.1f} MiB (bare python {bare_rss:.1f} MiB)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--gossip-rate", type=float, default=20.0)
    parser.add_argument("--hosts", type=int, default=5, help="hosts in the gossip test, one process each")
    parser.add_argument("--only", default="blob,gossip,memory",
                        help="comma-separated sections to measure (blob, gossip, memory, staging)")
    parser.add_argument("--profile", action="store_true", help="blob runs: time stamps and CPU breakdown")
    parser.add_argument(
        "--blob-runs",
        default=None,
        help="comma-separated blob runs to make (uncapped, cap_1gbps, cap_100mbps, "
             "small_capped; default all)",
    )
    parser.add_argument(
        "--direct-staging",
        action="store_true",
        help="blob runs: the fetcher writes its staging file with O_DIRECT (p2p.blob_direct_io)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "p2p.json"))
    args = parser.parse_args()
    global DIRECT_STAGING
    DIRECT_STAGING = args.direct_staging
    sections = set(args.only.split(","))
    unknown = sections - {"blob", "gossip", "memory", "staging"}
    if unknown:
        parser.error(f"--only: unknown sections {sorted(unknown)}")
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.exists() else {}
    load = os.getloadavg()
    print(f"load average at start: {load}", flush=True)
    report.update(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "load_average_at_start": load,
                "python": sys.version.split()[0],
                **machine(),
            },
            "libp2p_version": __import__("importlib.metadata").metadata.version("libp2p"),
            "target_mb_per_s": 125,
        }
    )
    report.pop("commit", None)  # each section names the commit it measured (--only mixes runs)
    commit = _git_commit()
    if "blob" in sections:
        with tempfile.TemporaryDirectory(prefix="bench-p2p-") as work:
            caps = args.blob_runs.split(",") if args.blob_runs else None
            report["blob"] = bench_blobs(args.size_mb, args.repeats, Path(work), args.profile, caps)
        report["blob"]["commit"] = commit
        report["blob"]["staging"] = "direct (O_DIRECT where possible)" if args.direct_staging else "buffered"
        report["blob_size_mb"] = args.size_mb
    if "staging" in sections:
        with tempfile.TemporaryDirectory(prefix="bench-p2p-") as work:
            caps = args.blob_runs.split(",") if args.blob_runs else None
            report["staging"] = bench_staging(args.size_mb, args.repeats, Path(work), caps)
        report["staging"]["commit"] = commit
    if "gossip" in sections:
        report["gossip"] = bench_gossip(args.messages, args.gossip_rate, args.hosts, args.repeats)
        report["gossip"]["commit"] = commit
    if "memory" in sections:
        report["memory"] = bench_idle_memory()
        report["memory"]["commit"] = commit
    report["load_average_at_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def _git_commit() -> str | None:
    """The commit the measured code is at (None outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
