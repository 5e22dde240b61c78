"""A day on the internet, on one machine: a real run on the emulated network of tests/netlab.py, with churn.

    python bench/bench_soak.py [--duration-min 60] [--split-clusters 3] [--single-clusters 2] [--seed 45]

Every cluster runs in its own network namespace (a split cluster's two nodes share theirs, as two
machines of one site do; the pipeline rendezvous stays inside the site) behind an emulated access
link: a rate drawn from ``--rate-mbit`` (tc tbf), a one-way delay per pair of sites drawn from
``--delay-ms`` (the C forwarder of tests/netlab_fwd.c), ``--jitter-ms`` of jitter. ``--nat`` one-node
clusters sit behind nftables NAT and reach the others through the relay (cluster 0, public) and hole
punching. The chain (anvil) runs in the lab's core, ``--chain-delay-ms`` away from every site.

Churn, at fixed fractions of the duration: a node killed (SIGKILL) and restarted 5 s later (a public
one at 15 %, a NATed one at 45 %, a split cluster's at 80 %); the chain's RPC unreachable to every node
for ``--outage-s`` (nftables drops its port in the core) at 30 %; a one-node member leaves for good at
55 % (``dlx-node leave``, then its node is stopped); a new member joins at 65 % (``dlx-node join`` from
an empty directory, in a site of its own). ``--no-churn`` leaves all that out, and ``--rounds N`` lets
the nodes end the run themselves after N rounds (tests/test_soak_e2e.py does both: the slow suite's
short soak).

Recorded (one JSON, time series in it): the rounds committed (each once, in order) and when each was
first seen; rounds short of a contributor, with the replicas the closes missed and the churn events
around them; per node RSS and open fds every ``--sample-s``; dials per minute (TCP SYNs each site's
link carried, to peers and to the chain, counted by the forwarder, not by the node); per node traffic
by protocol (status.json); each round's time beside the slowest link of the run; tracebacks in any
log; ``dlx-node audit --reexecute all`` at the end; the emulator's own measurement of every site's
RTT to the relay before the run. Writes bench/results/soak.json and bench/results/soak.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from bench.benchio import default_out, write_result  # noqa: E402

#: A coordinator's close line: round, stage, the replicas it closed with, the missing ones (bench_join.py).
CLOSE = re.compile(r"round (\d+) stage (\d+) closed with replicas \[([\d, ]*)\]( \(missing \[([\d, ]*)\]\))?")
OUTAGE_TABLE = "dlxsoak"
#: Log lines counted over every node's logs (``log_counts`` in the JSON): timeouts that met a slow link.
LOG_COUNTS = {"spot checks not done": r"spot check of replica \d+ round \d+ not done",
              "contributions not fetched": r"contribution \w+ from \w+ not fetched",
              "TooSlowError": r"TooSlowError", "timed out": r"timed out",
              "relay reservation late": r"no reservation yet",
              "closes at the deadline (missing)": r"closed with replicas \[[\d, ]*\] \(missing"}
#: The last line of a traceback (plain or inside an exception group's "| " frame): ``Name: message``.
EXCEPTION_LINE = re.compile(r"^[\s|+]*(\w+(?:Error|Exception|Group|Cancelled|Exit|Interrupt)\w*: .*)$")


def plan_clusters(args, rng: random.Random) -> list[dict]:
    """The clusters: cluster 0 public and one-node (the relay), then the NATed one-node ones, the split
    ones and the other one-node ones; each with its link's rate."""
    singles = max(args.single_clusters, 1 + args.nat)
    clusters = [{"split": False, "nat": i > 0 and i <= args.nat} for i in range(singles)]
    clusters += [{"split": True, "nat": False} for _ in range(args.split_clusters)]
    low, high = args.rate_mbit
    for index, cluster in enumerate(clusters):
        cluster["name"] = f"c{index}"
        cluster["rate_mbit"] = round(rng.uniform(low, high)) if index else high  # the relay: the fast link
    return clusters


def outer(args) -> int:
    """Build the lab, run :func:`inner` inside its core, take the lab down."""
    from netlab import NetLab, Site, probe_rtt, random_delays

    rng = random.Random(args.seed)
    clusters = plan_clusters(args, rng)
    sites = [Site(c["name"], c["rate_mbit"], c["nat"]) for c in clusters]
    if not args.no_churn:
        sites.append(Site("joiner", round(rng.uniform(*args.rate_mbit)), False))
    names = [s.name for s in sites]
    delays = random_delays(names, *args.delay_ms, rng)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    lab = NetLab(sites, delays, jitter_ms=args.jitter_ms, chain_delay_ms=args.chain_delay_ms, seed=args.seed,
                 workdir=workdir / "lab")
    try:
        rtts = {s: probe_rtt(lab, s, "c0", count=5) for s in names if s != "c0"}
        spec = {"clusters": clusters, "delays_ms": delays,
                "sites": {s.name: {"ns": lab.namespaces[s.name], "host_ip": lab.host_ip(s.name),
                                   "public_ip": lab.public_ip(s.name), "nat": s.nat, "rate_mbit": s.rate_mbit,
                                   "stats": str(lab.stats_path(s.name))} for s in sites},
                "rtt_to_relay_ms": {s: {"configured": delays[s]["c0"] + delays["c0"][s],
                                        "measured": sorted(round(x, 1) for x in v)} for s, v in rtts.items()},
                "forwarder_pids": [p.pid for p in lab.forwarders.values()], "started": time.time()}
        spec_path = workdir / "lab.json"
        spec_path.write_text(json.dumps(spec))
        cpu_before = lab.forwarder_cpu_s()
        inner_argv = [a for a in sys.argv[1:]]
        done = subprocess.run(lab.cmd(None, sys.executable, str(Path(__file__).resolve()), "--inside",
                                      str(spec_path), *inner_argv), timeout=args.duration_min * 60 + 3600)
        result_path = workdir / "result.json"
        if not result_path.exists():
            print("the run inside the lab wrote no result", file=sys.stderr)
            return 1
        result = json.loads(result_path.read_text())
        result["emulator"]["forwarder_cpu_s"] = round(lab.forwarder_cpu_s() - cpu_before, 1)
        result["wall_s"] = round(time.monotonic() - started, 1)
        load = result.pop("load_before")
        out = Path(args.out or default_out(__file__))
        write_result(out, result, load)
        if not args.out:
            (out.parent / "soak.svg").write_text(svg(result))
        print(summary_line(result))
        return done.returncode
    finally:
        lab.close()


# ------------------------------------------------------------------------------------------------ inside the lab

def inner(args) -> int:
    from nat_run import forward_tcp

    from node.commands.launcher import LocalRun
    from node.commands.link import run_link
    from node.config import dump_toml, load_config

    spec = json.loads(Path(args.inside).read_text())
    workdir = Path(args.workdir).resolve()
    clusters, sites = spec["clusters"], spec["sites"]
    core_ip = "100.64.0.1"
    load = list(os.getloadavg())
    settings = ["model.preset=tiny", f"diloco.inner_steps={args.inner_steps}", "training.batch_size=4",
                f"round_timeout={args.round_timeout}", "checkpoint_every=2", f"rounds={args.rounds}",
                f"join_timeout={args.join_timeout}"]
    run = LocalRun(workdir / "run", replicas=len(clusters), stages=2, split=True, settings=settings,
                   attest_quorum=2, attest_quorum_bps=5000, stake_wei=10**18)
    run.setup()
    anvil_port = int(run.url.rsplit(":", 1)[1])
    forward_tcp(core_ip, anvil_port, "127.0.0.1", anvil_port)
    rpc_url = f"http://{core_ip}:{anvil_port}"
    spare_accounts = []
    site_of: dict[str, str] = {}
    for replica, cluster in enumerate(clusters):
        slots = [s for s in run.nodes if s.cluster == f"cluster-{replica}"]
        if not cluster["split"]:  # a one-node cluster: its node holds both stages
            run.nodes.remove(slots[1])
            spare_accounts.append(slots[1].account)
            slots = slots[:1]
        for slot in slots:
            site_of[slot.name] = cluster["name"]
    public_addr = {s.name: f"/ip4/{sites[site_of[s.name]]['public_ip']}/tcp/{s.listen_port}/p2p/{s.peer_id}"
                   for s in run.nodes if not sites[site_of[s.name]]["nat"]}
    relay = next(s for s in run.nodes if site_of[s.name] == "c0")
    relay_addr = public_addr[relay.name]
    for slot in run.nodes:
        site = sites[site_of[slot.name]]
        table = load_config(slot.config_path).to_dict()
        table["cluster_size"] = sum(1 for s in run.nodes if s.cluster == slot.cluster)
        table["p2p"]["listen_host"] = site["host_ip"]
        table["ledger"]["rpc_url"] = rpc_url
        if slot is relay:
            table["p2p"]["relay_serve"] = True
        if site["nat"]:
            table["p2p"]["bootstrap"] = [relay_addr]
            table["p2p"]["relay_use"] = [relay_addr]
        else:
            table["p2p"]["bootstrap"] = [a for name, a in public_addr.items() if name != slot.name]
        slot.config_path.write_text("# placed in the network lab by bench/bench_soak.py\n" + dump_toml(table))
        load_config(slot.config_path)
        slot.command = ["ip", "netns", "exec", site["ns"], sys.executable, "-m", "node.cli"]
    soak = Soak(run, args, spec, site_of, rpc_url, anvil_port)
    soak.link = run_link(run.chain_id, run.ledger, run.run_id, rpc_url, [relay_addr], checkpoint_every=2)
    soak.spare_account = spare_accounts[-1] if spare_accounts else None
    result = {"nodes": len(run.nodes), "clusters": clusters, "stages": 2, "settings": settings,
              "k": 2, "quorum_bps": 5000, "duration_min": args.duration_min, "rounds_asked": args.rounds,
              "churn": not args.no_churn, "load_before": load,
              "emulator": {"delays_ms": spec["delays_ms"], "jitter_ms": args.jitter_ms,
                           "chain_delay_ms": args.chain_delay_ms,
                           "rates_mbit": {name: s["rate_mbit"] for name, s in sites.items()},
                           "nat_sites": [name for name, s in sites.items() if s["nat"]],
                           "rtt_to_relay_ms": spec["rtt_to_relay_ms"]},
              "placement": site_of}
    try:
        run.start()
        try:
            soak.loop()
        except Exception as exc:  # a fault of this harness: keep what the run did, and say so
            import traceback
            result["harness_error"] = traceback.format_exc()[-2000:]
            print(result["harness_error"], file=sys.stderr, flush=True)
        result["run_s"] = soak.now()
        soak.stop()
        soak.summarize(result)
        result["audit"] = audit(run, soak)
    finally:
        soak.outage_end()
        run.stop()
        if soak.joiner is not None and soak.joiner.poll() is None:
            soak.joiner.kill()
    (workdir / "result.json").write_text(json.dumps(result, default=str))
    ok = (result["rounds_in_order_once"] and result["rounds"] > 0 and not result["tracebacks"]
          and "harness_error" not in result
          and result["audit"]["verdict"] == "PASSED" and not result["unexpected_exits"])
    return 0 if ok else 1


class Soak:
    """The run's churn, its samples and its figures (see module docstring)."""

    def __init__(self, run, args, spec: dict, site_of: dict[str, str], rpc_url: str, anvil_port: int) -> None:
        self.run, self.args, self.spec, self.site_of = run, args, spec, site_of
        self.rpc_url, self.anvil_port = rpc_url, anvil_port
        self.client = run.client()
        self.started = time.time()
        self.link = ""
        self.spare_account: int | None = None
        self.joiner: subprocess.Popen | None = None
        self.joiner_dir = Path(args.workdir).resolve() / "joiner"
        self.left: set[str] = set()
        self.asked_down: set[int] = set()  # pids this harness killed or stopped
        self.events: list[dict] = []
        self.unexpected_exits: list[dict] = []
        self.first_seen: dict[int, float] = {}
        self.samples: list[dict] = []
        self.outage_on = False
        self.outage_lock = threading.Lock()
        self.outage_timer: threading.Timer | None = None
        self.schedule = [] if args.no_churn else self._schedule()

    def _schedule(self) -> list[tuple[float, str, object]]:
        duration = self.args.duration_min * 60
        by_site = {self.site_of[s.name]: s for s in self.run.nodes}
        nat_sites = [n for n, s in self.spec["sites"].items() if s["nat"]]
        singles = [c["name"] for c in self.spec["clusters"] if not c["split"] and not c["nat"] and c["name"] != "c0"]
        split = next((s for s in self.run.nodes if self.spec["clusters"][int(s.cluster.split("-")[1])]["split"]),
                     None)
        plan = []
        if singles:
            plan += [(0.15, "kill", by_site[singles[0]])]
        plan += [(0.30, "outage", None)]
        if nat_sites:
            plan += [(0.45, "kill", by_site[nat_sites[0]])]
        if singles:
            plan += [(0.55, "leave", by_site[singles[-1]])]
        plan += [(0.65, "join", None)]
        if split is not None:
            plan += [(0.80, "kill", split)]
        return sorted(((at * duration, kind, slot) for at, kind, slot in plan), key=lambda e: e[0])

    def now(self) -> float:
        return round(time.time() - self.started, 1)

    def event(self, kind: str, **fields) -> dict:
        entry = {"at_s": self.now(), "kind": kind, **fields}
        self.events.append(entry)
        print(json.dumps(entry), flush=True)
        return entry

    # -- the faults ----------------------------------------------------------------------------------

    def kill(self, slot) -> None:
        if slot.process is None or slot.process.poll() is not None:
            return
        self.asked_down.add(slot.process.pid)
        state = slot.status().get("state", "")
        self.run.kill(slot, signal.SIGKILL)
        self.event("kill", node=slot.name, site=self.site_of[slot.name], state=state)
        time.sleep(5)
        self.run.start_node(slot)
        self.event("restart", node=slot.name)

    def outage_begin(self) -> None:
        rules = (f"table inet {OUTAGE_TABLE} {{\n chain input {{\n  type filter hook input priority filter; "
                 f"policy accept;\n  iifname != \"lo\" tcp dport {self.anvil_port} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)
        self.outage_on = True
        self.event("rpc_outage_begin", seconds=self.args.outage_s)
        # Ended on its own timer: the loop may be busy with a kill or a leave when the minute is up.
        self.outage_timer = threading.Timer(self.args.outage_s, self.outage_end)
        self.outage_timer.start()

    def outage_end(self) -> None:
        with self.outage_lock:
            self._outage_end()

    def _outage_end(self) -> None:
        if self.outage_on:
            subprocess.run(["nft", "delete", "table", "inet", OUTAGE_TABLE], capture_output=True, timeout=30)
            self.outage_on = False
            self.event("rpc_outage_end")

    def leave(self, slot) -> None:
        done = subprocess.run([sys.executable, "-m", "node.cli", "leave", "--config", str(slot.config_path), "--yes"],
                              capture_output=True, text=True, timeout=300)
        self.event("leave", node=slot.name, exit_code=done.returncode, out=done.stdout.strip()[-300:])
        if slot.process is not None and slot.process.poll() is None:
            self.asked_down.add(slot.process.pid)
            self.run.kill(slot, signal.SIGTERM)
        self.left.add(slot.name)

    def join(self) -> None:
        if self.spare_account is None:
            return
        site = self.spec["sites"]["joiner"]
        self.joiner_dir.mkdir(parents=True, exist_ok=True)
        log = self.joiner_dir.parent / "joiner.log"
        self.joiner = subprocess.Popen(
            ["ip", "netns", "exec", site["ns"], sys.executable, "-m", "node.cli", "--log-file", str(log), "join",
             self.link, "--data-dir", str(self.joiner_dir), "--dev-account", str(self.spare_account), "--yes",
             "--no-progress", "--listen-host", site["host_ip"], "--listen-port", "4101",
             "--set", "torch_threads=1", "--set", f"round_timeout={self.args.round_timeout}",
             "--set", f"join_timeout={self.args.join_timeout}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.site_of["joiner"] = "joiner"
        self.event("join", node="joiner", account=self.spare_account)

    # -- the loop ------------------------------------------------------------------------------------

    def members(self) -> list[tuple[str, subprocess.Popen | None, Path]]:
        out = [(s.name, s.process, s.data_dir) for s in self.run.nodes]
        if self.joiner is not None:
            out.append(("joiner", self.joiner, self.joiner_dir))
        return out

    def loop(self) -> None:
        duration = self.args.duration_min * 60
        next_sample = 0.0
        while True:
            elapsed = time.time() - self.started
            if self.args.rounds == 0 and elapsed >= duration:
                return
            if self.args.rounds and not self.run.running():
                return
            if elapsed > duration + 1800:
                self.event("gave_up")
                return
            while self.schedule and self.schedule[0][0] <= elapsed:
                _, kind, slot = self.schedule.pop(0)
                if kind == "outage":
                    self.outage_begin()
                else:
                    getattr(self, kind)(*([slot] if slot is not None else []))
            self.check_exits()
            self.poll_rounds()
            if elapsed >= next_sample:
                self.sample()
                next_sample = elapsed + self.args.sample_s
            time.sleep(1)

    def check_exits(self) -> None:
        """A node that exits unasked is a failure of the run: recorded, then started again (soak mode)."""
        for slot in self.run.nodes:
            if slot.name in self.left or slot.process is None or slot.process.poll() is None:
                continue
            if slot.process.pid in self.asked_down:
                continue
            if self.args.rounds and slot.process.returncode == 0:
                continue  # the run ended (--rounds): its nodes exit by themselves
            self.asked_down.add(slot.process.pid)
            self.unexpected_exits.append({"node": slot.name, "code": slot.process.returncode, "at_s": self.now()})
            if not self.args.rounds:
                self.run.start_node(slot)

    def poll_rounds(self) -> int | None:
        """The last committed round, noting when each round was first seen (polled once a second)."""
        try:
            last = self.client.last_round(self.run.run_id)
        except Exception as exc:  # the orchestrator's own RPC is local; record, do not stop the soak
            self.event("poll_error", error=str(exc)[:200])
            return None
        at = self.now()
        for r in range(0 if not self.first_seen else max(self.first_seen) + 1, (last if last is not None else -1) + 1):
            self.first_seen[r] = at
        return last

    def sample(self) -> None:
        last = self.poll_rounds()
        at = self.now()
        nodes = {}
        for name, process, data_dir in self.members():
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
        for site, info in self.spec["sites"].items():
            try:
                stats = json.loads(Path(info["stats"]).read_text())
            except (OSError, ValueError):
                continue
            sent = stats.get("sent", {})
            links[site] = {"syns_to_peers": sum(v["syns"] for ip, v in sent.items() if ip != "100.64.0.1"),
                           "syns_to_chain": sent.get("100.64.0.1", {}).get("syns", 0),
                           "bytes_sent": sum(v["bytes"] for v in sent.values()),
                           "bytes_received": stats.get("received", {}).get("bytes", 0)}
        self.samples.append({"at_s": at, "last_round": last, "load": [round(x, 2) for x in os.getloadavg()],
                             "nodes": nodes, "links": links})

    def stop(self) -> None:
        self.outage_end()
        if self.joiner is not None and self.joiner.poll() is None:
            self.asked_down.add(self.joiner.pid)
            self.joiner.send_signal(signal.SIGTERM)
        for slot in self.run.nodes:
            if slot.process is not None:
                self.asked_down.add(slot.process.pid)
        self.sample()
        self.run.stop_nodes()
        if self.joiner is not None:
            try:
                self.joiner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.joiner.kill()

    # -- the figures ---------------------------------------------------------------------------------

    def logs(self) -> dict[str, str]:
        out = {s.name: "\n".join(p.read_text(errors="replace") for p in sorted(s.data_dir.glob("node-*.log")))
               for s in self.run.nodes}
        log = self.joiner_dir.parent / "joiner.log"
        if log.exists():
            out["joiner"] = log.read_text(errors="replace")
        return out

    def summarize(self, result: dict) -> None:
        history = self.client.history(self.run.run_id)
        rounds = [c.commit.round for c in history.commits]
        contributors = [c.commit.num_contributors for c in history.commits]
        logs = self.logs()
        closes: dict[int, dict] = {}
        for text in logs.values():
            for m in CLOSE.finditer(text):
                entry = closes.setdefault(int(m.group(1)), {"replicas": set(), "missing": set()})
                entry["replicas"] |= {int(x) for x in m.group(3).split(",") if x.strip()}
                entry["missing"] |= {int(x) for x in (m.group(5) or "").split(",") if x.strip()}
        most = max(contributors, default=0)
        replica_names: dict[int, set[str]] = {}
        for sample in self.samples:
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
            seen = self.first_seen.get(r, self.now())
            window = (self.first_seen.get(r - 1, 0.0) - self.args.round_timeout, seen)
            short.append({"round": r, "contributors": count, "missing_replicas": missing,
                          "missing_nodes": sorted(n for m in missing for n in replica_names.get(m, ())),
                          "events_near": [f"{e['kind']} {e.get('node', '')}".strip() for e in self.events
                                          if window[0] <= e["at_s"] <= window[1] and e["kind"] != "poll_error"]})
        result["rounds"] = len(rounds)
        result["rounds_in_order_once"] = rounds == list(range(len(rounds)))
        result["contributors_per_round"] = contributors
        result["rounds_short"] = short
        result["rounds_first_seen_s"] = [self.first_seen.get(r) for r in rounds]
        durations = [None] + [round(b - a, 1) if a is not None and b is not None else None
                              for a, b in zip(result["rounds_first_seen_s"], result["rounds_first_seen_s"][1:])]
        result["round_s"] = durations
        delays = self.spec["delays_ms"]
        result["slowest_link"] = {"one_way_ms": max(d for row in delays.values() for d in row.values()),
                                  "rate_mbit": min(s["rate_mbit"] for s in self.spec["sites"].values())}
        result["disputes"] = len(history.disputes)
        result["events"] = self.events
        result["unexpected_exits"] = self.unexpected_exits
        result["tracebacks"] = {n: t.count("Traceback") for n, t in logs.items() if "Traceback" in t}
        result["traceback_heads"] = {n: traceback_heads(t) for n, t in logs.items() if "Traceback" in t}
        # Where a fixed timeout met a slow link: counted over every log, for runs to compare.
        result["log_counts"] = {label: sum(len(re.findall(pattern, t)) for t in logs.values())
                                for label, pattern in LOG_COUNTS.items()}
        result["series"] = series(self.samples)
        # Connection paths (peer id -> direct/relayed/hole_punched) only as they were at the end: per
        # sample they were most of the JSON's megabyte.
        result["paths_at_end"] = {n: e.get("paths") for n, e in (self.samples[-1]["nodes"] if self.samples
                                                                 else {}).items()}
        result["samples"] = [{**sample, "nodes": {n: {k: v for k, v in e.items() if k != "paths"}
                                                 for n, e in sample["nodes"].items()}} for sample in self.samples]


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


def audit(run, soak: Soak) -> dict:
    archives = [str(s.data_dir) for s in run.nodes] + ([str(soak.joiner_dir)] if soak.joiner_dir.exists() else [])
    done = subprocess.run(
        [sys.executable, "-m", "node.cli", "audit", "--rpc", run.url, "--run", str(run.run_id), "--deployment",
         str(run.workdir / "deployment.json"), "--json", str(run.workdir / "audit.json"), "--reexecute", "all",
         *[a for d in archives for a in ("--archive", d)]],
        capture_output=True, text=True, timeout=3600, check=False)
    return {"exit_code": done.returncode, "reexecute": "all",
            "verdict": next((w for w in ("PASSED", "INCOMPLETE", "FAILED") if w in done.stdout), None),
            "tail": done.stdout.splitlines()[-4:] + done.stderr.splitlines()[-3:]}


# ------------------------------------------------------------------------------------------------ outputs

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
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="11">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="50" y1="{height - 30}" x2="{width - 20}" y2="{height - 30}" stroke="black"/>',
             f'<line x1="50" y1="20" x2="50" y2="{height - 30}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">seconds into the run</text>',
             f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">'
             'round time (s)</text>']
    for frac in (0, 0.5, 1):
        parts.append(f'<text x="46" y="{y(top * frac) + 4:.0f}" text-anchor="end">{top * frac:.0f}</text>')
        parts.append(f'<text x="{x(end * frac):.0f}" y="{height - 18}" text-anchor="middle">{end * frac:.0f}</text>')
    for e in result["events"]:
        if e["kind"] in ("kill", "rpc_outage_begin", "leave", "join"):
            parts.append(f'<line x1="{x(e["at_s"]):.1f}" y1="20" x2="{x(e["at_s"]):.1f}" y2="{height - 30}" '
                         'stroke="#c33" stroke-dasharray="3,3"/>')
            parts.append(f'<text x="{x(e["at_s"]) + 2:.1f}" y="30" fill="#c33">{e["kind"].split("_")[0]}</text>')
    if points:
        path = " ".join(f"{x(t):.1f},{y(d):.1f}" for t, d in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#246" stroke-width="1.5"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-min", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=0, help="let the nodes end the run after N rounds (0: run "
                                                               "for --duration-min)")
    parser.add_argument("--split-clusters", type=int, default=2)
    parser.add_argument("--single-clusters", type=int, default=4, help="one-node clusters (cluster 0 is the relay)")
    parser.add_argument("--nat", type=int, default=2, help="one-node clusters behind NAT")
    parser.add_argument("--delay-ms", type=float, nargs=2, default=[20.0, 200.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--rate-mbit", type=float, nargs=2, default=[50.0, 1000.0], metavar=("LOW", "HIGH"))
    parser.add_argument("--jitter-ms", type=float, default=5.0)
    parser.add_argument("--chain-delay-ms", type=float, default=20.0)
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--round-timeout", type=float, default=120.0)
    parser.add_argument("--join-timeout", type=float, default=180.0)
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--no-churn", action="store_true")
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--workdir", default="/tmp/dlx-soak")
    parser.add_argument("--out", default="")
    parser.add_argument("--inside", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    return inner(args) if args.inside else outer(args)


if __name__ == "__main__":
    sys.exit(main())
