"""Renderers of docs/RESULTS.md for the emulated internet: the emulator measured (bench/bench_netlab.py) and
the soak on it (bench/bench_soak.py). Numbers come only from the JSON."""

from __future__ import annotations

from results_sections import table

#: RSS is judged flat from this far into the run on (the model, torch and the pipelines are loaded by then).
WARM_UP_S = 600


def netlab(r: dict) -> list[str]:
    """bench/bench_netlab.py: RTT and rate given against asked, and the forwarders' CPU."""
    delay_rows = [[f"{d['rtt_asked_ms']:g} ms" + (f" (jitter {d['jitter_ms']:g} ms each way)"
                                                  if d["jitter_ms"] else ""),
                   d["answered"], d.get("min_ms", "-"), d.get("median_ms", "-"), d.get("p90_ms", "-"),
                   d.get("max_ms", "-")] for d in r["delay"]]
    rate_rows = [[f"{row['rate_mbit']:g} Mbit/s" + (" (no tbf limit: the ceiling)"
                                                    if row["rate_mbit"] >= 10000 else ""),
                  f"{row['one_way_ms']} ms", f"{row['mbit_s']:.0f} Mbit/s",
                  f"{row['forwarder_cpu_share'] * 100:.0f} %", f"{row['cpu_pct_per_100mbit']:.1f} %"
                  if row.get("cpu_pct_per_100mbit") is not None else "-"]
                 for row in r["rate"]]
    nat = r["nat"]
    return (
        [f"Round trips of {r['echoes']} UDP echoes between two namespaces of tests/netlab.py (the delay held "
         "by the C forwarder of each sender's link), in milliseconds:", ""]
        + table(["RTT asked", "answered", "min", "median", "p90", "max"], delay_rows)
        + [f"One TCP stream (a Python socket pair, {r['stream_s']:g} s) through two emulated "
           "links (tc tbf on the "
           "sender's), and the CPU both links' forwarders used meanwhile:", ""]
        + table(["rate asked", "one-way delay", "received", "forwarders' CPU (of a core)",
                 "CPU per 100 Mbit/s"],
                rate_rows)
        + [f"NAT: {nat['echoes_out_answered']} of 3 echoes from behind the NAT answered, "
           f"{nat['echoes_in_answered']} of 2 sent into it (unsolicited: dropped).", ""])


def soak(r: dict) -> list[str]:
    """bench/bench_soak.py: a run on the emulated internet with churn."""
    e = r["emulator"]
    delays = [d for row in e["delays_ms"].values() for d in row.values()]
    rates = list(e["rates_mbit"].values())
    splits = sum(1 for c in r["clusters"] if c["split"])
    rounds = r["rounds_first_seen_s"]
    durations = [d for d in r["round_s"] if d]
    lines = [(
        f"{r['nodes']} nodes in {len(r['clusters'])} clusters ({splits} split over two nodes, the others one "
        f"node), each cluster in its own namespace; one-way delays {min(delays):.0f}-{max(delays):.0f} ms "
        f"between sites (jitter up to {e['jitter_ms']:g} ms), links of {min(rates):.0f}-{max(rates):.0f} "
        f"Mbit/s, {len(e['nat_sites'])} one-node clusters behind NAT ({', '.join(e['nat_sites'])}), the "
        f"chain {e['chain_delay_ms']:g} ms away; {r['run_s'] / 60:.0f} minutes of training"
        + (" with churn." if r["churn"] else " without churn.")
        + f" The emulator's forwarders used {e.get('forwarder_cpu_s', '?')} CPU seconds in all."), ""]
    lines += table(["rounds committed", "each once, in order", "short of a contributor",
                    "round time (median, max)", "unexpected exits", "tracebacks", "audit --reexecute all"],
                   [[r["rounds"], "yes" if r["rounds_in_order_once"] else "**no**", len(r["rounds_short"]),
                     f"{_median(durations):.0f} s, {max(durations):.0f} s" if durations else "-",
                     len(r["unexpected_exits"]), sum(r["tracebacks"].values()) if r["tracebacks"] else 0,
                     r["audit"]["verdict"]]])
    again = r["audit"].get("reaudited")
    if again:
        lines += [f"The audit above was taken again on the kept archives and chain ({again['date']}, commit "
                  f"`{again['commit']}`, `{again['command']}`); at the run it was "
                  f"{again['verdict_at_the_run']}.", ""]
    if r["events"]:
        lines += ["Churn (seconds into the run):", ""] + table(
            ["at", "event", "node"],
            [[f"{ev['at_s']:.0f} s", ev["kind"].replace("_", " "), ev.get("node", "")]
             for ev in r["events"] if ev["kind"] != "poll_error"])
    if r["rounds_short"]:
        lines += ["Rounds short of a contributor:", ""] + table(
            ["round", "contributors", "nodes of the replicas missing from the closes", "churn near it"],
            [[s["round"], s["contributors"],
              ", ".join(s.get("missing_nodes") or map(str, s["missing_replicas"])) or "-",
              ", ".join(s["events_near"]) or "-"] for s in r["rounds_short"]])
    series = r["series"]
    rss_rows = []
    for name, values in sorted(series["rss_mib"].items()):
        seen = [v for v in values if v is not None]
        fds = [v for v in series["fds"][name] if v is not None]
        warm = [(t, v) for t, v in zip(series["at_s"], values) if v is not None and t >= WARM_UP_S]
        traffic = series["traffic_by_kind_at_end"].get(name, {})
        rss_rows.append([name, r["placement"].get(name, "joiner"),
                         f"{seen[0]:.0f} / {max(seen):.0f} / {seen[-1]:.0f}" if seen else "-",
                         f"{warm[-1][1] - warm[0][1]:+.0f}" if len(warm) > 1 else "-",
                         f"{min(fds)}-{max(fds)}" if fds else "-",
                         ", ".join(f"{kind.split('/')[2] if kind.count('/') > 1 else kind.strip('/')} "
                                   f"{(sent + received) / 1e6:.1f}"
                                   for kind, (sent, received) in sorted(traffic.items()))
                         or "-"])
    lines += [
        "Per node: resident memory (MiB: first sample, highest, last; and its change from the first sample "
        f"after {WARM_UP_S // 60} minutes of the run to the last: a restart in between resets it), open file "
        "descriptors, and traffic by protocol at the last sample (MB sent + received, the node's own "
        "counters over its current life):", ""]
    lines += table(["node", "site", "RSS", "RSS after warm-up", "fds", "traffic"], rss_rows)
    growth = r.get("memory_growth") or {}
    if growth:
        parts = [("rss_mib", "RSS"), ("rss_anon_mib", "anonymous"), ("rss_file_mib", "file-backed"),
                 ("malloc_in_use_mib", "glibc heap in use"), ("malloc_free_mib", "glibc free, kept"),
                 ("py_blocks", "Python blocks"), ("py_arenas_mib", "pymalloc arenas"),
                 ("anon_brk_mib", "main heap pages"), ("anon_arenas_mib", "other arenas' pages"),
                 ("anon_other_mib", "other anonymous pages")]
        parts = [(key, label) for key, label in parts if any(key in entry for entry in growth.values())]

        def cell(entry: dict | None, blocks: bool) -> str:
            if not entry:
                return "-"
            per_min = entry["last_quarter_per_min"]
            fmt = (lambda v: f"{v:+,.0f}") if blocks else (lambda v: f"{v:+.1f}")  # noqa: E731
            return fmt(entry["quarter_to_end"]) + (f" ({fmt(per_min)}/min)" if per_min is not None else "")

        lines += ["What the RSS is made of, on the nodes that ran one life from a quarter of the run to its "
                  "end (VmRSS split into anonymous and file-backed pages, from /proc; glibc's `mallinfo2` "
                  "and Python's allocated blocks and arenas, and the anonymous pages by mapping from "
                  "/proc/self/smaps, from bench/churn_probe's light probe, which every node loads): the "
                  "change from the first sample past the quarter to the last (MiB, blocks), and in brackets "
                  "the slope over the last quarter:", ""]
        lines += table(["node"] + [label for _, label in parts],
                       [[name] + [cell(entry.get(key), key == "py_blocks") for key, _ in parts]
                        for name, entry in sorted(growth.items())])
    objects = r.get("object_growth") or {}
    if objects:
        top = lambda d: ", ".join(  # noqa: E731
            f"{k.rsplit('.', 2)[-2] + '.' + k.rsplit('.', 1)[-1] if k.count('.') > 1 else k} "
            f"+{v:,}" for k, v in list(d.items())[:3]) or "-"
        span = max(e["span_s"] for e in objects.values())
        lines += ["What grew, by object (the probe's walk of the gc-tracked objects every "
                  f"{r.get('deep_sample_s', 300):g} s, a pause of up to "
                  f"{max(e['pass_s'] for e in objects.values()):.1f} s each, from the first walk past the "
                  f"quarter to the last, {span / 60:.0f} minutes): the three largest increases of "
                  "objects by type and of "
                  "container lengths by class attribute (bytes and numbers are not gc-tracked; "
                  "their containers are):", ""]
        lines += table(["node", "objects by type", "containers (entries)"],
                       [[name, top(e["types"]), top(e["containers"])] for name, e in sorted(objects.items())])
    dial_rows = []
    for site, values in sorted(series["dials_per_min"].items()):
        seen = [v for v in values if v is not None]
        chain = [v for v in series["chain_connections_per_min"][site] if v is not None]
        if seen:
            dial_rows.append([site, f"{_median(seen):.1f}", f"{max(seen):.0f}", f"{_median(chain):.1f}"
                              if chain else "-"])
    lines += [
        "Dials per minute (TCP SYNs each site's link carried, counted by the emulator): median and highest "
        "over the samples, and connections to the chain's RPC:", ""]
    lines += table(["site", "dials/min (median)", "dials/min (max)", "RPC connections/min (median)"],
                   dial_rows)
    link = r["slowest_link"]
    lines += [
        f"Round time against the slowest link: its one-way delay is {link['one_way_ms']:.0f} ms, its rate "
        f"{link['rate_mbit']:.0f} Mbit/s; the median round took {_median(durations):.0f} s"
        if durations else "No round times.", ""]
    load = [v for v in series.get("load_1min", []) if v is not None]
    if load:
        lines += ["The machine's 1-minute load average over the samples (it has "
                  f"{r['recorded']['machine']['cpus']} cores, shared with other work): median "
                  f"{_median(load):.1f}, highest {max(load):.1f}.", ""]
    lines += ["![round time over the run, churn marked](../bench/results/soak.svg)", ""] if rounds else []
    return lines


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def churn_memory(r: dict) -> list[str]:
    """bench/churn_memory.py: what a host keeps of inbound connections gone, and a surviving node across
    restarts."""
    out: list[str] = []
    conns = r.get("inbound_connections") or []
    if conns:
        rows = [[c["inbound_handler"], c["connections"], c["limiter_slots_held"], c["open_connections"],
                 f"{c['receive_buffer_bytes_alive'] / 2**20:.1f} MiB",
                 f"{c['rss_mib'][0]} -> {c['rss_mib'][-1]} MiB", f"{c['rss_mib_per_connection']:+.2f} MiB"]
                for c in conns]
        out += ["A host, and peers (each its own process, no listener) that connect to it one after the "
                "other, serve it a 4 MiB blob and exit; what the host holds after the last one is gone, with "
                "py-libp2p's inbound handler (stock) and with p2p/inbound.py's (patched); both release a TCP "
                "stream's receive buffer when it closes (p2p/fastpath_tcp.py):", ""]
        out += table(["inbound handler", "connections", "limiter slots held", "connections open",
                      "TCP receive buffers alive", "RSS after each", "RSS fitted per connection"], rows)
    run = r.get("restart_cycles")
    if run:
        growing = list(run["growing_containers"].items())[:8]
        handlers = [sum(n for k, n in held.items() if k.endswith("Swarm._do_handle_inbound_connection"))
                    for held in run["referrers"].values()]
        out += [f"A local run of {run['nodes']} nodes (k = {run['k']}, settings {run['settings']}): "
                f"{run['victim']} killed and started again {len(run['cycles'])} times, {run['watched']} "
                "sampled inside its process after warm-up and after each restart (rounds committed at each "
                f"sample: {run['rounds_at_sample']}). Inbound connection handlers alive at each sample: "
                f"{handlers}. RSS (MiB): {run['rss_mib']}, fitted "
                f"{run['rss_mib_per_cycle']:+.2f} MiB a cycle "
                + (f"(the cycles began once round {run['warmup_rounds']} was on chain, past the "
                   "warm-up of the caps and "
                   "windows). " if run.get("warmup_rounds", 1) > 1 else
                   "(the run is still warming up: caps and windows fill for about 17 minutes). ")
                + "The containers that grew most, summed over instances, per sample:", ""]
        out += table(["container", "sizes", "per cycle"],
                     [[name, " ".join(str(v) for v in row["values"]), row["per_cycle"]]
                      for name, row in growing])
    return out
