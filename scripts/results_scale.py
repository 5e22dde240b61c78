"""docs/RESULTS.md's sections on the whole system at size and a calibrated model of a large run (issue 75)."""

from __future__ import annotations

from results_sections import load_text, table


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:.1f} MB"


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s" if x < 100 else f"{x:,.0f} s"


def _share(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


COMPONENTS = (
    "inner_steps",
    "hashing",
    "codec",
    "start_state",
    "outer_step",
    "archive",
    "exchange",
    "chain",
    "spot_checks",
    "rng",
    "other",
)


def _pulled(pull: dict) -> str:
    """What the pull gave: the transformers class and parameters, or why not."""
    loaded = pull.get("transformers") or {}
    if "parameters" in loaded:
        return f"{loaded.get('class', '')} {loaded['parameters']:,}" + (
            " (--pending)" if pull.get("pending") else ""
        )
    if loaded.get("error"):
        return f"pulled, not loaded: {loaded['error'][:80]}"
    if "exit" in pull:
        tail = pull.get("log_tail", "")
        why = (
            "not final on chain"
            if "not final" in tail
            else tail.strip().splitlines()[-1][:80]
            if tail
            else ""
        )
        return f"refused (exit {pull['exit']}: {why})"
    return "not run"


def _memory_at_peak(label: str, run: dict) -> list[str]:
    """The largest node's memory probe (node/live/memprofile.py): its peak's heap and busy threads."""
    probed = [n for n in run.get("nodes", []) if (n.get("memory_at_peak") or {}).get("rss_bytes")]
    if not probed:
        return []
    node = max(probed, key=lambda n: n["memory_at_peak"]["rss_bytes"])
    m = node["memory_at_peak"]
    heap = m.get("malloc") or {}
    busy = "; ".join(m.get("busy") or []) or "no thread busy"
    return [f"{label}: the largest node's peak ({node['name']}, {_gb(m['rss_bytes'])} at {m.get('t_s')} s; "
            f"glibc arenas {_gb(heap.get('in_use_bytes'))} in use, {_gb(heap.get('free_in_arenas_bytes'))} "
            f"free, {_gb(heap.get('mapped_bytes'))} mapped on their own): {busy}.", ""]


def scale_system(r: dict) -> list[str]:
    lines = [
        "Real `dlx-node demo` runs (2 replicas x 2 stages on a local anvil, normed commitments, every "
        "contribution spot-checked once, checkpoints every 2 rounds), each then audited with "
        "`--reexecute all` and pulled into transformers. Per node (mean over the 4 nodes): the training "
        "thread's round, every thread's busy time by component (sampling profile, "
        "node/live/costprofile.py, from round 0's start to the node's stop) as a share of all busy time, "
        "bytes sent, peak RSS and disk at the end.",
        "",
    ]
    rows, shares = [], []
    ordered = sorted(r["runs"].items(), key=lambda item: item[1]["parameters"]["total"])
    for label, run in ordered:
        s = run["summary"]
        audit = run.get("audit") or {}
        rows.append(
            [
                label,
                f"{run['parameters']['total']:,}",
                f"{run['args']['rounds']} x H={run['args']['inner_steps']}",
                _s(s.get("wall_s_per_round")),
                _s(s.get("inner_s_per_round")),
                _s(s.get("process_cpu_s_per_round")),
                "-" if run["args"].get("partial") else _mb(s.get("bytes_sent_per_round")),
                f"{_gb(s.get('peak_rss_bytes'))} / {_gb(s.get('child_peak_rss_bytes'))}",
                _gb(run.get("all_nodes_peak_rss_bytes")),
                _gb(s.get("disk_bytes")),
                ("exit " + str(audit["exit"]) + (f", {audit['seconds']:.0f} s" if "seconds" in audit else ""))
                if "exit" in audit
                else "skipped" if audit.get("skipped") else "not run",
                _pulled(run.get("pull") or {}),
                load_text((run.get("recorded") or {}).get("load_average", {}).get("end")),
            ]
        )
        busy = s.get("busy_shares") or {}
        shares.append([label] + [_share(busy.get(k)) for k in COMPONENTS])
    lines += table(
        [
            "model",
            "parameters",
            "rounds",
            "round (training thread)",
            "inner steps",
            "process CPU / round",
            "sent / node / round",
            "peak RSS / node / spot-check child",
            "all nodes and children at once",
            "disk / node",
            "audit --reexecute all",
            "pulled model",
            "1-min load",
        ],
        rows,
    )
    lines += ["Every thread's busy time by component, as a share of the node's busy time:", ""]
    lines += table(["model", *COMPONENTS], shares)
    for label, run in ordered:
        if run.get("note"):
            lines += [f"{label}: {run['note']}", ""]
        lines += _memory_at_peak(label, run)
        rec = run.get("recorded") or {}
        if rec.get("command"):
            lines += [f"{label}: `{rec['command']}` ({rec.get('date', '')} at {rec.get('commit', '')}).", ""]
    return lines


def scale_model(r: dict) -> list[str]:
    lines = [
        f"Fitted `q = a + b x` on {', '.join(r['fit_sizes'])} (x: parameters per node, or the model's for "
        f"the inner step), then checked at {', '.join(r['check_sizes'])}, which the fit did not see (a "
        "partial run checks only what it measured; CPU seconds are the node process's, split by the "
        "sampling profile's shares):",
        "",
    ]
    rows = [
        [
            size,
            q,
            f"{row['predicted']:.4g}",
            f"{row['measured']:.4g}",
            "-" if row["error"] is None else f"{100 * row['error']:+.1f}%",
        ]
        for size, checked in r["check"].items()
        for q, row in checked.items()
    ]
    lines += table(["size", "quantity", "predicted", "measured", "error"], rows)
    lines += [
        "The bytes as the nodes counted them, per size (a spot check fetches the replica's whole start "
        "state, of the round it checks: the mean over the size's checks, of rounds 0, 1, ...; the exchange "
        "is the least over the nodes of bytes received less the start states fetched: a state still "
        "fetching at the stop is received in part and not counted):",
        "",
    ]
    rows = []
    for size, point in r["measured"].items():
        per_param = point.get("start_state_bytes_per_param")
        exchange = point.get("exchange_bytes_per_round")
        if per_param is None and exchange is None:
            continue
        role = "fit" if size in r["fit_sizes"] else "check" if size in r["check_sizes"] else "-"
        fetch_rate = point.get("spot_check_fetch_rate")
        rows.append([size, role, f"{point['parameters']:,}",
                     "-" if per_param is None else f"{per_param:.2f}",
                     "-" if fetch_rate is None else f"{fetch_rate:.2f}",
                     "-" if exchange is None else f"{exchange / point['per_node']:.2f}",
                     f"{point['disk_bytes_per_round'] / point['per_node']:.1f}",
                     f"{point['disk_held_bytes_per_round'] / point['per_node']:.1f}",
                     load_text(point.get("load_end"))])
    lines += table(["size", "role", "parameters", "start state / check, bytes per parameter",
                    "checks fetched / replica / round", "exchange, bytes per parameter held / round",
                    "disk / round, bytes per parameter held",
                    "the same less the checks' working files", "1-min load at the end"], rows)
    state = (r.get("refit") or {}).get("start_state")
    if state:
        lines += [
            "A check's start state by the round it is of, fitted over every node (bytes per parameter of the "
            f"replica): round 0 {state['first']:.1f}, round 1 {state['second']:.1f}, later rounds "
            f"{state['later']:.1f} ({state['nodes']} nodes); the large layouts take the later rounds'.",
            "",
        ]
    lines += [
        "Predicted for large layouts (refit on every size measured on the code of the fit, the runs not "
        "marked `fit: false`; inner steps on A800s at the MFU "
        "measured on an H200, the node's own per-round work at this CPU's measured cost per parameter):",
        "",
    ]
    rows = []
    for row in r["large"]:
        rows.append(
            [
                row["label"],
                f"{row['replicas']} x {row['stages']}",
                f"{row['per_node'] / 1e9:.2f} B",
                _s(row["round_s"]),
                _s(row["compute_s_per_round"]),
                _s(row["node_work_s"]),
                _s(row["link_s_per_round"]),
                _gb(row["bytes_per_round"]),
                _gb(row["host_ram_bytes"]),
                _gb(row["disk_bytes_per_round"]),
                _gb(row.get("spot_check_state_bytes")),
                _gb(row["disk_bytes_per_node_retained"]) if row.get("disk_bytes_per_node_retained") else "-",
                f"{row['commit_gas']:,}",
                f"{row['fraud_proof']['worst_gas']:,}",
                f"{row['speedup_over_allreduce']:.0f}x",
            ]
        )
    lines += table(
        [
            "model",
            "M x S",
            "params / node",
            "round",
            "inner steps",
            "node work",
            "link",
            "bytes / node / round",
            "host RAM / node",
            "disk / node / round (less the checks' files)",
            "a check's claimant state (disk)",
            "disk / node (default retention)",
            "commit gas",
            "fraud proof worst gas",
            "over AllReduce",
        ],
        rows,
    )
    calibrated = [(row["label"], row["d_model"], row["components_s_per_round"]) for row in r["large"]
                  if row.get("components_s_per_round")]
    if calibrated:
        lines += [
            "The node's codec and weights root per round from bench/bench_components.py's fit (one core of "
            "this CPU, checked within 20% at a size it did not see; the matrices' cubic term taken as the "
            "parameters held x d_model): what the node's host CPU would pay unless that work moves to the "
            "GPU or to more cores.",
            "",
        ]
        lines += table(["model", "d_model", "encode", "apply", "weights root"],
                       [[label, str(d), _s(c["encode"]), _s(c["apply"]), _s(c["weights_hash"])]
                        for label, d, c in calibrated])
    paper = r["paper"]
    lines += [
        f"The DiLoCoX paper ({paper['source']}): {paper['model']} on {paper['hardware']} over "
        f"{paper['network']}, {paper['speedup_over_allreduce']}x faster than AllReduce.",
        "",
    ]
    return lines


def components(r: dict) -> list[str]:
    """bench/bench_components.py: a node's own work per round in CPU seconds, fitted and checked."""
    shapes = r["shapes"]
    lines = [
        f"One node's work per round measured alone (one thread, a fresh process per stage; vocabulary "
        f"{shapes['vocab_size']:,}, {shapes['block_size']} tokens x batch {shapes['batch_size']}, "
        f"{shapes['stages']} stages, the mean of the two), fitted `q = a + b x` on "
        f"{', '.join(r['fit_sizes'])} (x: parameters per node) and checked at {', '.join(r['check_sizes'])}:",
        "",
    ]
    rows = [[size, f"{m['node']['parameters']:,.0f}", *(f"{m['node'][q]:.3f} s" for q in
                                                      ("inner_step", "encode", "apply", "weights_hash")),
             _gb(m["node"]["peak_rss"])] for size, m in r["measured"].items()]
    lines += table(["size", "per node", "inner step", "encode", "apply", "weights hash", "peak RSS"], rows)
    rows = [[size, q, f"{row['predicted']:.4g}", f"{row['measured']:.4g}",
             "-" if row["error"] is None else f"{100 * row['error']:+.1f}%"]
            for size, checked in r["check"].items() for q, row in checked.items()]
    lines += table(["size", "quantity", "predicted", "measured", "error"], rows)
    verdict = "met" if r["met"] else "NOT met"
    worst = f"Worst error {100 * r['worst_error']:.1f}% (goal {100 * r['goal']:.0f}%): {verdict}."
    return lines + [worst, ""]


def stage_memory(r: dict) -> list[str]:
    """bench/bench_stage_memory.py: a node's stage and a rerun child, peak memory per phase, before/after."""
    lines = ["Peak resident set per phase of one process (VmHWM reset at each phase), above the process's "
             "resident set before the model was built, in bytes per parameter it holds (a node: its stage "
             "of 2, its engine's outer state on disk or in RAM, storage.outer_state; the rerun child: the "
             "whole replica). Before: the same script on commit "
             f"{(r.get('baseline') or {}).get('commit', '-')}.", ""]
    runs = [("after", r["results"])] + ([("before", r["baseline"]["results"])] if r.get("baseline") else [])
    rows = []
    for when, results in runs:
        for preset, entry in results.items():
            measured = [(f"node stage {s}" + (f", outer {m['outer_state']}" if "outer_state" in m else ""), m)
                        for key in entry if key.startswith("nodes") for s, m in entry[key].items()]
            measured += [("rerun child", entry["child"])] if "child" in entry else []
            for who, m in measured:
                phases = ", ".join(f"{name} {phase['bytes_per_parameter']:.0f}"
                                   for name, phase in m["phases"].items())
                held = m.get("held_bytes_per_parameter")
                rows.append([when, preset, who, f"{m['parameters']:,}", _gb(m["peak_rss_bytes"]),
                             f"{m['peak_bytes_per_parameter']:.1f}", "-" if held is None else f"{held:.1f}",
                             phases])
    lines += table(["", "size", "process", "parameters", "peak RSS", "peak B/param", "held B/param",
                    "per phase (B/param)"], rows)
    return lines
