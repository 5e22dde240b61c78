"""The network sections of docs/RESULTS.md (transfer, many-node runs, the traffic models, NAT, joins); the
formatting is :mod:`results_sections`'s.
"""

from __future__ import annotations

import statistics

from results_sections import kb, mb, num, table


def p2p(r: dict) -> list[str]:
    blob, gossip = r["blob"], r.get("gossip", {})
    rows = []
    for key, label in (("uncapped", "uncapped"), ("cap_1gbps", "1 Gbps cap (125 MB/s)"),
                       ("cap_100mbps", "100 Mbps cap (12.5 MB/s)")):
        if key in blob:
            b = blob[key]
            runs = b.get("runs_mb_per_s") or []
            spread = f" ({min(runs):.1f}-{max(runs):.1f})" if len(runs) > 1 else ""
            frac = f", {100 * b['achieved_fraction_of_cap']:.1f}% of the cap" \
                if "achieved_fraction_of_cap" in b else ""
            rows.append([f"blob throughput, {label}", f"{b['mb_per_s']:.1f} MB/s{spread}{frac}"])
            if key == "uncapped":
                rows.append(["fetcher CPU per 100 MB, uncapped", f"{b['fetcher_cpu_s_per_100mb']:.2f} s"])
                rows.append(["provider CPU per 100 MB, uncapped", f"{b['provider_cpu_s_per_100mb']:.2f} s"])
    if "small_capped" in blob:
        s = blob["small_capped"]
        rows.append([(f"{s['bytes'] / 1e3:.0f} kB at {s['cap_bytes_per_s'] / 1e3:.0f} kB/s, "
                     f"{s['burst_bytes'] / 1024:.0f} KiB bucket"),
                     f"{s['seconds_over_bytes_over_rate']:.2f}x bytes/rate"])
    if gossip:
        rows.append([f"gossip latency, {gossip['hosts']} processes, p50 / p99",
                     f"{gossip['latency_ms_p50']:.1f} / {gossip['latency_ms_p99']:.1f} ms"])
    if "memory" in r:
        rows.append(["idle host resident memory", f"{r['memory']['idle_host_rss_mib']:.1f} MiB"])
    return [(f"Two processes on loopback, {r.get('blob_size_mb', 100)} MB blobs, TCP + Noise + yamux "
            f"(py-libp2p {r.get('libp2p_version', '?')}); medians of the runs in the JSON."), ""] + table(
        ["measure", "value"], rows)


def _scale_rows(points: list[dict]) -> list[list]:
    rows = []
    for p in points:
        loads = p.get("load_1min_samples") or []
        attacker = p.get("attacker")
        honest_blobs = (f" (honest nodes {kb(p.get('honest_blob_received_per_node_round'))} / "
                        f"{kb(p.get('honest_blob_sent_per_node_round'))})" if attacker else "")
        rows.append(
            [
                f"{p['replicas']}" + (f", attacker `{attacker}`" if attacker else ""),
                num(p.get("seconds_per_round"), 1),
                f"{kb(p.get('sent_per_node_round'))} / {kb(p.get('received_per_node_round'))}",
                f"{kb(p.get('blob_received_per_node_round'))} / {kb(p.get('blob_sent_per_node_round'))}"
                + honest_blobs,
                (
                    f"{num(p.get('gossip_sent_per_node_round'), 0)} / "
                    f"{num(p.get('gossip_received_per_node_round'), 0)}"
                ),
                num(p.get("cpu_per_node_round"), 1),
                f"{p['rounds_committed']} rounds, contributors {p.get('commit_contributors')}, roots "
                f"{'agree' if p.get('weights_roots_agree') else 'differ'}, "
                + ("honest " if attacker else "")
                + ("every exit 0" if all(e == 0 for e in p.get("exits", [1])[: -1 if attacker else None])
                   else "exits " + str(p.get("exits")))
                + (", timed out" if p.get("timed_out") else ""),
                f"{min(loads):.0f}-{max(loads):.0f}" if loads else "?",
            ]
        )
    return rows


def scale(r: dict) -> list[str]:
    a = r["args"]
    lines = [f"Real local runs (anvil, one-node replicas of `tiny`, 2 stages chained in each node, "
             f"{a['rounds']} rounds of H = {a['inner_steps']}, spot checks off, `{a['exchange']}` exchange"
             + (f", settings {a['setting']}" if a.get("setting") else "") + "). Per node and round:", ""]
    lines += table(["nodes", "s/round", "sent / received", "blobs in / out", "gossip msgs sent / received",
                    "CPU s", "result", "1-min load"], _scale_rows(r["measured"]))
    if r.get("model"):
        lines += [
            "The full exchange's linear model from this run: contribution bytes in per node and round at "
            + ", ".join(f"{m['replicas']} replicas {mb(m['contribution_bytes_in'])}" for m in r["model"])
            + ".", ""]
    return lines


def scale_curve(r: dict) -> list[str]:
    rows = []
    for row in r["rows"]:
        full = row.get("full_measured", {}).get("blob_received")
        sliced = row.get("sliced_measured", {}).get("blob_received")
        model = row.get("sliced_model", {})
        rows.append([row["replicas"], kb(full), kb(sliced), kb(row.get("full_model_blob_received")),
                     f"{kb(model.get('blob_received_per_node_round'))} (A = {model.get('slices')})",
                     kb(model.get("with_withholder")), kb(model.get("with_withholding_aggregator")),
                     kb(model.get("with_wrong_partial_replayed")),
                     (f"{kb(model.get('coordinator_round_received'))} / "
                      f"{kb(model.get('spoiled_round_received'))}"),
                     f"{_duration(model.get('spoiled_round_delay_s'))} (every turn: "
                     f"{_duration(model.get('spoiled_round_delay_s_every_turn'))})"])
    return [("Contribution blob bytes received per node and round, the full exchange against the sliced "
            "one (`diloco.exchange = \"sliced\"`): measured points of local runs and each exchange's model "
            "(`bench_scale.py --curve`, `sliced_model`). With one attacker, modelled mean per node and "
            "round: a member that withholds its bundle in the rounds it coordinates (every holder reads the "
            "inputs at the last turn, then the round again under the next coordinator), an aggregator that "
            "withholds its partial (the next candidate reads the slice's inputs), an aggregator that signs a "
            "wrong partial beside a fallback's right one (every holder replays the slice); and a round's "
            "worst node: the coordinator (it fetches every bundle to close) / a holder in a spoiled round; "
            "and how long a spoiled round waits before its close is refused, at the default "
            "`p2p.transfer_timeout`: the first `CANDIDATE_TURNS` candidates' turns and the replay's, per "
            "stage (when every candidate had a turn: `(R + 1) x` per stage)."), ""] + table(
        ["nodes", "full, measured", "sliced, measured", "full, model", "sliced, model",
         "withholding coordinator", "withholding aggregator", "wrong partial, replayed",
         "coordinator's / spoiled round", "spoiled round's wait"], rows)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 60:.0f} min" if seconds < 3 * 3600 else f"{seconds / 3600:.0f} h"


def butterfly(r: dict) -> list[str]:
    rows = []
    for row in r["traffic"].get("mini", {}).get("rows", []):
        agg = row["sliced_aggregator"]
        rows.append([row["replicas"],
                     f"{kb(row['all_to_all']['bytes_in'])} / {kb(row['all_to_all']['bytes_out'])}",
                     f"{kb(row['sliced_mean_in'])} / {kb(row['sliced_mean_out'])}", agg["slices"],
                     kb(agg["bytes_in"])])
    lines = [
        ("Simulation of one `mini` stage's traffic per node and round (real identities, signed messages and "
             "codec bytes from real pseudo-gradients; at 64 replicas and more from one node's and one "
             "aggregator's real view): today's all-to-all exchange against the sliced one."), ""]
    lines += table(["replicas", "all-to-all in / out", "sliced, mean per node in / out", "slices A",
                    "sliced, a round's aggregator in"], rows)
    conv = r.get("convergence") or {}
    finals = {}
    for name, rounds in conv.items():
        if isinstance(rounds, list) and rounds:
            last = next((x["eval_loss"] for x in reversed(rounds) if x.get("eval_loss") is not None), None)
            per_round = statistics.mean(x["contribution_bytes_per_replica"] for x in rounds)
            finals[name] = f"{name.replace('_', ' ')} {num(last)} ({kb(per_round)} per replica and round)"
    if finals:
        lines += [f"Convergence cost (`{conv.get('preset')}`, {conv.get('replicas')} replicas, H = "
                  f"{conv.get('inner_steps')}, {conv.get('rounds')} rounds; the partial is "
                  "compressed a second "
                  "time with no error feedback): final held-out loss " + ", ".join(finals.values()) + ".", ""]
    return lines


def nat(r: dict) -> list[str]:
    rows = [[name.replace("_", " "), d["path_after"], f"{d['mb_per_s_median']:.1f} MB/s",
             f"{min(run['load'] for run in d['runs']):.0f}-{max(run['load'] for run in d['runs']):.0f}"]
            for name, d in r.items() if isinstance(d, dict) and "runs" in d]
    return [(f"A {r['size_mb']} MB blob between two nodes behind separate NATs (network namespaces, nftables "
             f"masquerade), median of {r['repeats']} transfers on {r['cpus']} cores:"), ""] + table(
        ["path", "path after the transfer", "rate", "load average"], rows)


def join(r: dict) -> list[str]:
    """bench/bench_join.py: round durations around a node joining a running run."""
    a = r["args"]
    names = {"baseline": "before (node code of the baseline checkout)", "this": "this commit"}
    rows, durations = [], []
    for name, run in r["runs"].items():
        s, j = run["summary"], run["joiner"]
        median = s["median_round_s_without_join"]
        rows.append([names.get(name, name) + (f" `{run['commit']}`" if run.get("commit") else ""),
                     f"{median:.0f} s" if median is not None else "-",
                     f"{j['placed_round']} / {j['entered_at']} / {j['first_committed_round_with_it']}",
                     f"{s['longest_round_in_window_s']} s" if s["longest_round_in_window_s"] is not None
                     else "-",
                     f"{s['window_s_beyond_median']:+.0f} s" if s["window_s_beyond_median"] is not None
                     else "-",
                     ", ".join(map(str, s["rounds_closed_at_deadline_missing_a_replica"])) or "none",
                     f"{run['rounds_committed']}{'' if run['rounds_in_order_once'] else ' (not in order!)'}"])
        window = s["join_window_rounds"]
        shown = [row for row in run["rounds"] if window and window[0] - 2 <= row["round"] <= window[-1] + 2]
        durations.append(f"{names.get(name, name)}: " + ", ".join(
            f"r{row['round']} {row['duration_s']} s" + ("*" if row["round"] in window else "")
            for row in shown))
    return [(f"A local run shaped like `dlx-node demo` ({a['replicas']} replicas x {a['stages']} stages, "
             f"`{a['preset']}`, H = {a['inner_steps']}, {a['rounds']} rounds, deadline {a['round_timeout_s']}"
             f" s) on {r['cpus']} cores; "
             "`dlx-node join` from an empty directory once the first checkpoint is on chain"
             + (f", the joiner's catch-up held back {a['catch_up_delay_s']:.0f} s" if a["catch_up_delay_s"]
                else "")
             + ". A round's time is when its first close was signed; the join window runs from "
               "the round open when "
             "the joiner was placed to the first committed round holding its contribution."), ""] + table(
        ["node code", "median round (no join)", "placed / entered / first counted round",
         "longest round in window", "window beyond the median", "rounds closed at the deadline",
         "rounds committed"], rows) + [
        "Round durations around the join (* the join window):", ""] + [f"- {line}" for line in durations] \
        + [""]
