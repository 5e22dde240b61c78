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
link carried, to peers and to the chain, counted by the forwarder, not by the node); what each node's RSS is
made of (anonymous and file-backed pages, from /proc; glibc's heap in use and free-but-kept and Python's
blocks, from bench/churn_probe's light probe, which every node loads, ``--no-probe`` not) and each part's
growth from a quarter of the run to its end (``memory_growth``), and from the probe's object walk every
``--deep-sample-s`` which types, classes and containers grew in that time (``object_growth``); per node
traffic by protocol (status.json); each round's time beside the slowest link of the run; tracebacks in any
log; ``dlx-node audit --reexecute all`` at the end; the emulator's own measurement of every site's
RTT to the relay before the run. Writes bench/results/soak.json and bench/results/soak.svg.
SIGTERM or SIGINT stops the run and takes its nodes, chain and lab down (no result is written).
``--reaudit --workdir DIR`` audits a kept soak again with today's checkout (after a fix of the audit) and
replaces only the JSON's audit, which then says when and at which commit it was taken.

Modules: this one builds the lab and the run (outside and inside the lab's core); bench/soak_churn.py
drives the churn and the watch, bench/soak_sampling.py takes the samples, bench/soak_report.py makes
the figures, the audit and the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
PROBE = REPO / "bench" / "churn_probe"

from bench.benchio import default_out, write_result  # noqa: E402
from bench.soak_churn import Soak  # noqa: E402
from bench.soak_report import audit, summarize, summary_line, svg  # noqa: E402


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
        child = subprocess.Popen(lab.cmd(None, sys.executable, str(Path(__file__).resolve()), "--inside",
                                         str(spec_path), *inner_argv))
        # SIGTERM or SIGINT (also where a background shell ignored SIGINT) stops the run inside, which stops
        # its nodes and chain; then the lab comes down (below) and nothing this bench started is left.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: child.send_signal(signal.SIGTERM))
        try:
            child.wait(timeout=args.duration_min * 60 + 3600)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGTERM)
            child.wait(timeout=600)
        done = child
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


# --------------------------------------------------------------------------------------------- inside the lab

def _stop_by_signal(signum, frame) -> None:
    for other in (signal.SIGTERM, signal.SIGINT):  # once: a second signal must not cut the clean-up short
        signal.signal(other, signal.SIG_IGN)
    raise SystemExit(128 + signum)


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
    if not args.no_probe:  # every node (and the joiner) loads the light probe: what its RSS is made of
        soak.probe_dir = workdir / "probe"
        soak.probe_dir.mkdir(parents=True, exist_ok=True)
        os.environ.update(DLX_CHURN_PROBE=str(soak.probe_dir), DLX_CHURN_PROBE_EVERY=str(args.sample_s),
                          DLX_CHURN_PROBE_DEEP_EVERY=str(args.deep_sample_s),
                          PYTHONPATH=os.pathsep.join(
                              filter(None, [str(PROBE), os.environ.get("PYTHONPATH")])))
        # an experiment beside the defaults: these nodes get another M_ARENA_MAX (the probe sets it)
        if args.arena_max:
            os.environ["DLX_CHURN_PROBE_ARENA_MAX"] = args.arena_max
    soak.link = run_link(run.chain_id, run.ledger, run.run_id, rpc_url, [relay_addr], checkpoint_every=2)
    soak.spare_account = spare_accounts[-1] if spare_accounts else None
    result = {"nodes": len(run.nodes), "clusters": clusters, "stages": 2, "settings": settings,
              "k": 2, "quorum_bps": 5000, "duration_min": args.duration_min, "rounds_asked": args.rounds,
              "deep_sample_s": 0 if args.no_probe else args.deep_sample_s,
              "churn": not args.no_churn, "load_before": load,
              "emulator": {"delays_ms": spec["delays_ms"], "jitter_ms": args.jitter_ms,
                           "chain_delay_ms": args.chain_delay_ms,
                           "rates_mbit": {name: s["rate_mbit"] for name, s in sites.items()},
                           "nat_sites": [name for name, s in sites.items() if s["nat"]],
                           "rtt_to_relay_ms": spec["rtt_to_relay_ms"]},
              "placement": site_of, "arena_max": dict(item.split("=", 1) for item in args.arena_max.split(",")
                                                      if item)}
    # from here a signal unwinds: the finally stops nodes and chain
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_by_signal)
    try:
        run.start()
        try:
            soak.loop()
        except Exception:  # a fault of this harness: keep what the run did, and say so
            import traceback
            result["harness_error"] = traceback.format_exc()[-2000:]
            print(result["harness_error"], file=sys.stderr, flush=True)
        result["run_s"] = soak.now()
        soak.stop()
        summarize(soak, result)
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


def reaudit(args) -> int:
    """Audit a kept soak again (``--reaudit``): the chain from the run's saved state (a copy: anvil rewrites
    it), every node's archive under ``--workdir``, this checkout's ``audit``; the result JSON keeps the run's
    figures and its ``recorded`` block and gets the new audit, with the command, commit and date it was taken
    at."""
    import shutil
    import tempfile
    from types import SimpleNamespace

    from bench.benchio import recorded
    from ledger.anvil import AnvilProcess

    workdir = Path(args.workdir).resolve()
    out = Path(args.out or default_out(__file__))
    result = json.loads(out.read_text())
    deployment = json.loads((workdir / "run" / "deployment.json").read_text())
    nodes = sorted(p.parent for p in (workdir / "run").glob("*/archive"))
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "chain-state.json"
        shutil.copyfile(workdir / "run" / "chain-state.json", state)
        with AnvilProcess(state_file=state) as anvil:
            run = SimpleNamespace(url=anvil.url, run_id=int(deployment["run_id"]), workdir=workdir / "run",
                                  nodes=[SimpleNamespace(data_dir=d) for d in nodes])
            before = result.get("audit", {})
            result["audit"] = {**audit(run, SimpleNamespace(joiner_dir=workdir / "joiner")),
                               "reaudited": {**recorded(), "verdict_at_the_run": before.get("verdict"),
                                             "tail_at_the_run": before.get("tail")}}
    temporary = out.with_name(out.name + ".tmp")
    temporary.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(temporary, out)
    print(summary_line(result))
    return 0 if result["audit"]["verdict"] == "PASSED" else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-min", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=0,
                        help="let the nodes end the run after N rounds (0: run "
                                                               "for --duration-min)")
    parser.add_argument("--split-clusters", type=int, default=2)
    parser.add_argument("--single-clusters", type=int, default=4,
                        help="one-node clusters (cluster 0 is the relay)")
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
    parser.add_argument("--deep-sample-s", type=float, default=300.0,
                        help="every node's probe walks its objects this often (a pause of 3 s per walk "
                             "at load 11; 0: never)")
    parser.add_argument("--no-probe", action="store_true",
                        help="nodes run without bench/churn_probe's light probe (RSS only, "
                             "not what it is made of)")
    parser.add_argument("--no-churn", action="store_true")
    parser.add_argument("--arena-max", default="", metavar="NODE=N,...",
                        help="an experiment: these nodes run with glibc's M_ARENA_MAX at N instead of the "
                             "node's 2 (set by the probe; the JSON's arena_max says which)")
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument("--workdir", default="/tmp/dlx-soak")
    parser.add_argument("--out", default="")
    parser.add_argument("--reaudit", action="store_true",
                        help="audit the soak kept under --workdir again with this checkout (its chain "
                             "restarted from the saved state) and put that audit into the result JSON; "
                             "the run's figures stay")
    parser.add_argument("--inside", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reaudit:
        return reaudit(args)
    return inner(args) if args.inside else outer(args)


if __name__ == "__main__":
    sys.exit(main())
