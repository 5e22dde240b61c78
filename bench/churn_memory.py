"""What a surviving node keeps per churn event: its RSS and container sizes across kill/restart cycles.

    python bench/churn_memory.py [--cycles 6] [--inner-steps 10] [--connections 20] [--warmup-rounds 1]
        [--workdir /tmp/dlx-churnmem]
    python bench/churn_memory.py --cycles 0 --connections 0 --inner-steps 2 --sample-rounds 40,80,120 \
        [--tracemalloc 6]

A real local run (anvil, 3 replicas of one node each, the ``tiny`` model, k = 2): once a round with
every node is committed (``--warmup-rounds R``: once round R is), one node (r2; ``--victim``) is killed
with SIGKILL and started again (or, with ``--stall-s S``, stopped S seconds and resumed), ``--cycles``
times, each time as soon as its new life has met its peers (the start-up mark "peers met",
node/live/startup.py). The watched node r0 runs throughout with bench/churn_probe/sitecustomize.py loaded
(``DLX_CHURN_PROBE``): after warm-up and after each cycle it samples, in one pass inside the process, its RSS,
gc object counts by type and the summed length of every dict/set/list/deque attribute of the node's, p2p's and
py-libp2p's objects. The result gives, per container, its size at each sample and the growth per cycle fitted
over the cycles, beside the rounds the run went through meanwhile (a container that grows with the round, not
with the churn, grows as much in a run without churn). ``--sample-rounds`` samples again once the chain holds
each of those rounds (after the cycles, or instead of them with ``--cycles 0``): what grows with the rounds
alone, the growth then fitted per sample. ``--tracemalloc N`` has the watched node trace its allocations (N
frames) from the first sample and report, at every later one, what grew most since the one before, by
traceback; it slows the node several times over (its peers then see stalls and reset connections), so use it
to find, not to time.

Then, in this process, the cost of one inbound connection that comes and goes, without a run around it:
``--connections`` times a fresh peer host in its own process (tests/p2p_agent.py; no listener, as a
``dlx-node join`` fetch host or a restarted member dialling in) connects to a host, serves it a 4 MiB blob
and exits; the host's inbound limiter
slots held, the bytes of TCP receive buffers (p2p.fastpath) still alive and this process's RSS after the
last one, with py-libp2p's own inbound handler (``stock``, the patch of p2p.inbound undone) and with the
patch. Writes bench/results/churn_memory.json (bench/benchio.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.benchio import default_out, write_result  # noqa: E402
from bench.soak_sampling import fit_slope  # noqa: E402
from node.commands.launcher import LocalRun  # noqa: E402
from node.live.startup import parse_marks  # noqa: E402

PROBE = ROOT / "bench" / "churn_probe"


def slope(values: list[float]) -> float:
    """Least-squares growth per step of ``values`` taken at steps 0, 1, 2, ..."""
    return fit_slope(list(enumerate(values))) if len(values) >= 2 else 0.0


class Probe:
    """Asks the watched node for a sample and waits for it."""

    def __init__(self, directory: Path, timeout: float = 120.0) -> None:
        self.directory = directory
        self.timeout = timeout
        directory.mkdir(parents=True, exist_ok=True)
        self.samples: list[dict] = []

    def sample(self, label: str, run: LocalRun) -> dict:
        (self.directory / "trigger").write_text(label)
        deadline = time.monotonic() + self.timeout
        path = self.directory / "samples.jsonl"
        while time.monotonic() < deadline:
            if path.exists():
                lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                found = [s for s in lines if s.get("label") == label]
                if found:
                    sample = found[0]
                    sample["last_round"] = _last_round(run)
                    self.samples.append(sample)
                    print(label, "rss", sample.get("rss_kib"), "round", sample["last_round"],
                          "pass", sample.get("pass_s"), flush=True)
                    return sample
            time.sleep(1.0)
        raise SystemExit(f"the probe gave no sample {label!r} in {self.timeout:g} s (--probe-timeout)")


def _last_round(run: LocalRun) -> int:
    last = run.client().last_round(run.run_id)
    return -1 if last is None else last


def wait_mark(slot, phase: str, timeout: float) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if slot.process.poll() is not None:
            raise SystemExit(f"{slot.name} exited with {slot.process.returncode}")
        marks = parse_marks(slot.log_path.read_text(errors="replace"))
        if phase in marks:
            return marks[phase]
        time.sleep(1.0)
    return None


def growth(samples: list[dict], key: str, first: int) -> dict:
    """Per container (or type): its values over the samples and its fitted growth per cycle from ``first``."""
    names = set().union(*(s.get(key, {}).keys() for s in samples))
    table = {}
    for name in names:
        values = [s.get(key, {}).get(name, 0) for s in samples]
        table[name] = {"values": values, "per_cycle": round(slope(values[first:]), 2)}
    return table


def connection_cycles(count: int, workdir: Path, stock: bool) -> dict:
    """``count`` peers connect to one host, serve it a 4 MiB blob and go away; what the host keeps of them."""
    import gc

    from libp2p.io.trio import TrioTCPStream
    from libp2p.network.swarm import Swarm

    from p2p import inbound  # noqa: F401  (applied by p2p.transport too)
    from p2p.config import P2PConfig
    from p2p.host import P2PHost
    from p2p.identity import Identity

    workdir.mkdir(parents=True, exist_ok=True)
    patched = Swarm._do_handle_inbound_connection, Swarm.upgrade_inbound_raw_conn
    if stock:
        Swarm._do_handle_inbound_connection = patched[0]._dlx_original
        Swarm.upgrade_inbound_raw_conn = patched[1]._dlx_original

    def buffers() -> int:
        gc.collect()
        return sum(len(o._dlx_buffer.data) for o in gc.get_objects()
                   if type(o) is TrioTCPStream and getattr(o, "_dlx_buffer", None) is not None)

    def rss_mib() -> float:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    host = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=workdir / "host")
    try:
        limiter = host._libp2p.get_network()._inbound_limiter
        rss = []
        for index in range(count):
            # The peer in its own process (tests/p2p_agent.py), so this process's RSS is the host's alone.
            agent = subprocess.Popen([sys.executable, str(ROOT / "tests" / "p2p_agent.py"),
                                      json.dumps({"listen": False, "gossip_resync_interval": 0}),
                                      str(workdir / f"peer{index}")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                peer_id = json.loads(agent.stdout.readline())["peer_id"]

                def ask(request: dict) -> dict:
                    agent.stdin.write(json.dumps(request) + "\n")
                    agent.stdin.flush()
                    return json.loads(agent.stdout.readline())

                if not ask({"cmd": "connect", "addr": host.listen_addrs[0], "timeout": 30})["ok"]:
                    raise SystemExit(f"peer {index} could not connect")
                digest = ask({"cmd": "provide", "size": 4 << 20})["sha256"]
                host.fetch_blob(digest, workdir / "fetched", providers=[peer_id], timeout=60)
            finally:
                agent.stdin.close()
                agent.wait(timeout=60)
            deadline = time.monotonic() + 30
            while peer_id in host.peers() and time.monotonic() < deadline:
                time.sleep(0.2)
            rss.append(rss_mib())
        time.sleep(2.0)  # the last handler's end (patched) reaches the limiter
        return {"inbound_handler": "stock" if stock else "patched", "connections": count,
                "limiter_slots_held": limiter.borrowed_tokens, "open_connections": len(host.peers()),
                "receive_buffer_bytes_alive": buffers(), "rss_mib": [round(x, 1) for x in rss],
                "rss_mib_per_connection": round(slope(rss[count // 4:]), 3)}
    finally:
        host.close()
        Swarm._do_handle_inbound_connection, Swarm.upgrade_inbound_raw_conn = patched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--connections", type=int, default=20, help="inbound connection cycles (0: none)")
    parser.add_argument("--skip-run", action="store_true", help="only the inbound connection cycles")
    parser.add_argument("--round-timeout", type=float, default=60)
    parser.add_argument("--trace", default="RawConnection,SwarmEvent,YamuxStream",
                        help="classes (comma-separated) whose holders the probe counts")
    parser.add_argument("--stall-s", type=float, default=0,
                        help="each cycle stops the victim (SIGSTOP) this long and resumes it (no restart)")
    parser.add_argument("--victim", type=int, default=2,
                        help="the node each cycle kills or stalls (0: the watched one)")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="the first sample (and the cycles) once the chain holds this round: past the "
                             "windows' warm-up (provider records 600 s, caches), the cycles' "
                             "growth is the churn's")
    parser.add_argument("--sample-rounds", default="",
                        help="after the cycles, also sample once the chain has these rounds "
                             "(comma-separated): what grows with the rounds alone")
    parser.add_argument("--tracemalloc", type=int, default=0,
                        help="frames: the watched node traces its allocations from the first sample (slower)")
    parser.add_argument("--probe-timeout", type=float, default=120.0,
                        help="seconds to wait for one sample (a tracemalloc comparison on a loaded "
                             "machine takes minutes)")
    parser.add_argument("--workdir", default="/tmp/dlx-churnmem")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    load = list(os.getloadavg())
    workdir = Path(args.workdir)
    result: dict = {}
    if args.connections:
        result["inbound_connections"] = [connection_cycles(args.connections, workdir / f"conns-{variant}",
                                                           stock=variant == "stock")
                                         for variant in ("stock", "patched")]
        print(json.dumps(result["inbound_connections"]), flush=True)
    if not args.skip_run:
        result["restart_cycles"] = churn_run(args, workdir)
    write_result(args.out, result, load)
    return 0


def churn_run(args, workdir: Path) -> dict:
    """The local run of the module docstring: the watched node's samples across the victim's restarts."""
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"round_timeout={args.round_timeout}", "checkpoint_every=1", "rounds=0", "join_timeout=60"]
    run = LocalRun(workdir, replicas=3, stages=1, split=False, settings=settings, attest_quorum=2,
                   stake_wei=10**18)
    run.setup()
    probe = Probe(workdir / "probe", args.probe_timeout)
    watched, victim = run.nodes[0], run.nodes[args.victim]
    cycles: list[dict] = []
    started = time.monotonic()
    try:
        plain = dict(os.environ)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PROBE), str(ROOT), plain.get("PYTHONPATH", "")])
        os.environ["DLX_CHURN_PROBE"] = str(probe.directory)
        os.environ["DLX_CHURN_PROBE_TRACE"] = args.trace
        if args.tracemalloc:
            os.environ["DLX_CHURN_PROBE_TRACEMALLOC"] = str(args.tracemalloc)
        run.start_node(watched)
        os.environ.clear()
        os.environ.update(plain)
        for slot in run.nodes[1:]:
            run.start_node(slot)
        warm = max(1, args.warmup_rounds)
        deadline = time.monotonic() + 900 + 6 * warm  # a round of the tiny model takes 1-3 s here
        while _last_round(run) < warm:
            if time.monotonic() > deadline or watched.process.poll() is not None:
                raise SystemExit(f"the run never committed round {warm}")
            time.sleep(2)
        probe.sample("warm", run)
        for index in range(args.cycles):
            if args.stall_s:  # a node frozen (swapping, a long pause, a link down): its peers time it out
                victim.process.send_signal(signal.SIGSTOP)
                time.sleep(args.stall_s)
                victim.process.send_signal(signal.SIGCONT)
                time.sleep(20.0)  # reconnections settle
                probe.sample(f"cycle-{index + 1}", run)
                cycles.append({"cycle": index + 1, "stalled_s": args.stall_s})
                continue
            run.kill(victim, signal.SIGKILL)
            time.sleep(2.0)
            run.start_node(victim)
            met = wait_mark(victim, "peers met", 300)
            time.sleep(5.0)  # the survivor's side of the new connections settles
            probe.sample(f"cycle-{index + 1}", run)
            cycles.append({"cycle": index + 1, "peers_met_s": met})
        for target in [int(r) for r in args.sample_rounds.split(",") if r.strip()]:
            deadline = time.monotonic() + 60 * 60
            while _last_round(run) < target:
                if time.monotonic() > deadline or watched.process.poll() is not None:
                    raise SystemExit(f"the run never reached round {target}")
                time.sleep(2)
            probe.sample(f"round-{target}", run)
    finally:
        run.stop()
    samples = probe.samples
    rss = [s["rss_kib"] / 1024 for s in samples]
    containers = growth(samples, "containers", 1)
    types = growth(samples, "types", 1)
    rounds = [s["last_round"] for s in samples]
    per_round = (rounds[-1] - rounds[1]) / max(1, len(rounds) - 2)
    # What grows by more than one element a cycle, largest first; the rest is in the table of all.
    growing = {k: v for k, v in sorted(containers.items(), key=lambda kv: -kv[1]["per_cycle"])
               if v["per_cycle"] >= 1.0}
    result = {"settings": settings, "nodes": 3, "k": 2, "watched": watched.name, "victim": victim.name,
              "warmup_rounds": max(1, args.warmup_rounds),
              "cycles": cycles, "wall_s": round(time.monotonic() - started),
              "rounds_at_sample": rounds, "rounds_per_cycle": round(per_round, 2),
              "rss_mib": [round(x, 1) for x in rss], "rss_mib_per_cycle": round(slope(rss[1:]), 2),
              "growing_containers": growing,
              "growing_types": {k: v for k, v in sorted(types.items(), key=lambda kv: -kv[1]["per_cycle"])
                                if v["per_cycle"] >= 5.0},
              "growing_module_containers": {k: v for k, v in sorted(growth(samples, "modules", 1).items(),
                                                                    key=lambda kv: -kv[1]["per_cycle"])
                                            if v["per_cycle"] > 0},
              "referrers": {s["label"]: s.get("referrers", {}) for s in samples},
              "tracemalloc": {s["label"]: s["tracemalloc"] for s in samples if "tracemalloc" in s},
              "pass_s": [s.get("pass_s") for s in samples]}
    print(json.dumps({k: result[k] for k in ("rss_mib", "rss_mib_per_cycle", "rounds_at_sample")}))
    for name, row in list(growing.items())[:40]:
        print(f"{row['per_cycle']:8.2f}  {name}  {row['values']}")
    return result


if __name__ == "__main__":
    sys.exit(main())
