"""The results page's section of a node that is a cluster (issue 75: bench/bench_cluster_memory.py)."""

from __future__ import annotations

from results_sections import table


def cluster_memory(r: dict) -> list[str]:
    """bench/bench_cluster_memory.py: the training state per rank of a stage trained by N processes."""
    base = r["one_process"]
    mib = 2 ** 20
    out = [f"One stage, a whole `{r['preset']}` replica ({r['params']:,} parameters), one round (an inner "
           f"step on a {r['batch'][0]} x {r['batch'][1]} batch, the encode, the aggregation with two more "
           "contributions, the weights hash and chunk roots). Training state counted by tensor accounting "
           "(parameters or FSDP shards, gradients, inner AdamW state, outer state), one thread per rank. One "
           f"process (a plain StageEngine): {base['total_bytes'] / mib:.1f} MiB "
           f"({', '.join(f'{k} {v / mib:.1f}' for k, v in base['state_bytes'].items())}), peak RSS "
           f"{base['peak_rss_bytes'] / mib:.0f} MiB.", ""]
    rows = []
    for world, c in r["clusters"].items():
        ranks = c["ranks"]
        rows.append([world, f"{max(row['total_bytes'] for row in ranks) / mib:.1f} MiB",
                     f"{c['largest_share']:.4f}", f"{1 / int(world):.4f}", f"{c['goal_strict']:.4f}",
                     "yes" if c["meets_goal_strict"] else "no",
                     f"{max(row['peak_rss_bytes'] for row in ranks) / mib:.0f} MiB",
                     f"{max(row['seconds']['encode_and_join'] for row in ranks):.2f} s"])
    out += table(["N", "largest rank's state", "share of one process", "1/N", "goal 1.1/N", "met",
                  "peak RSS of a rank", "encode + join"], rows)
    node = r.get("node") or {}
    if node:
        out += ["The same round through a cluster node's path (`[compute] processes = N`: the inner "
                "steps under FSDP2, the outer state sharded over the ranks, the live weights the FSDP "
                "shards only: a rank holds its tensors' whole live weights only while a command runs; N = 1 "
                "is the one process above):", ""]
        rows = []
        for world, c in node.items():
            first = c["ranks"][0]
            rows.append([world, f"{first['total_bytes'] / mib:.1f} MiB", f"{c['rank0_share']:.4f}",
                         f"{first['state_bytes']['params'] / mib:.1f} MiB",
                         f"{first['state_bytes']['outer'] / mib:.1f} MiB ({c['rank0_outer_share']:.3f})",
                         f"{c['largest_worker_share']:.4f}", f"{c['goal_strict']:.4f}",
                         "yes" if c["meets_goal_strict"] else "no",
                         f"{max(row['peak_rss_bytes'] for row in c['ranks']) / mib:.0f} MiB"])
        out += table(["N", "rank 0's state", "its share", "its weights (FSDP shard)",
                      "its outer state (share)", "largest worker's share", "goal 1.1/N", "met",
                      "peak RSS of a rank"], rows)
        kept = [(world, c) for world, c in node.items() if c.get("kept_state_bytes")]
        if kept:
            out += ["", "The global state before the apply, kept by the node as its finisher and fork repair "
                    "keep a few rounds' (a one-process node holds each whole): "
                    + "; ".join(f"N = {world}: rank 0 holds {c['ranks'][0]['kept_bytes'] / mib:.1f} MiB "
                                f"of its {c['kept_state_bytes'] / mib:.1f} MiB ({c['rank0_kept_share']:.3f})"
                                for world, c in kept) + "."]
    return out + cluster_round(r)


def cluster_round(r: dict) -> list[str]:
    """The ``round`` part: every rank's transient peak over a running node's whole round, part by part."""
    rounds = r.get("round") or {}
    if not rounds:
        return []
    mib = 2 ** 20
    out = ["", "A running node's whole round, part by part (bench/cluster_round.py: start state, inner step, "
           "held-out eval, encode, screening, apply, weights hash and chunk roots, the finisher's kept state "
           "and checkpoint shard; then fork repair's derive and move), after a first round. A part's "
           "*transient*: a rank's peak RSS over the part less its RSS before it (glibc's mmap threshold "
           f"fixed at {r.get('mmap_threshold', 0) // 1024} KiB: a freed tensor's pages go back at once). "
           "*peak share*: the rank's training state (tensor accounting) plus its round's largest transient, "
           "over the one-process state. N = 1 is the one-process node.", ""]
    parts = ("eval", "encode", "screen", "apply", "inner_steps")
    rows = []
    for world, c in rounds.items():
        ranks = c["ranks"]
        shown = [0] + ([max(range(1, len(ranks)), key=lambda r: ranks[r]["round_transient"])]
                       if len(ranks) > 1 else [])
        for rank in shown:  # rank 0 and the worker of the largest transient (every rank is in the JSON)
            row = ranks[rank]
            rows.append([world, str(rank), f"{row['state_share']:.3f}",
                         f"{row['round_transient'] / mib:.0f} MiB", row["largest_part"],
                         f"{row['peak_share']:.3f}",
                         *(f"{row['parts'][name] / mib:.0f}" for name in parts),
                         f"{row['fork_transient'] / mib:.0f}"])
    out += table(["N", "rank", "state share", "round's transient", "largest part", "peak share",
                  *(f"{name} (MiB)" for name in parts), "fork repair (MiB)"], rows)
    return out


def cluster_exchange(r: dict) -> list[str]:
    """bench/bench_cluster_exchange.py: rank 0's memory for the exchange, whole contributions or parts."""
    mib = 2 ** 20
    out = [f"One stage, a whole `{r['preset']}` replica ({r['params']:,} parameters, {r['tensors']} "
           f"tensors), {r['contributions']} other replicas' contributions, each a version-2 envelope of "
           f"{r['parts']} parts, on a node of {r['ranks']} processes (gloo). *whole*: rank 0 reads every "
           "closed envelope, cuts each along the ranks' plan and scatters the pieces (today's path); "
           f"*parts*: rank 0 takes each part as a range of the envelope's blob, {r['streams']} at once, "
           "checks it and forwards its pieces to their ranks (training/cluster_exchange.py). Rank 0's peak "
           "of Python allocations over the exchange (tracemalloc; the whole path's pickled tensors are not "
           "counted); every rank's messages are the same bits on both paths.", ""]
    rows = []
    for label, run in r["runs"].items():
        whole, parts = run["rank0"]["whole"], run["rank0"]["parts"]
        rows.append([label, f"{sum(run['envelope_bytes']) / mib:.1f} MiB",
                     f"{run['largest_part_bytes'] / mib:.2f} MiB",
                     f"{whole['peak_traced_bytes'] / mib:.1f} MiB",
                     f"{parts['peak_traced_bytes'] / mib:.1f} MiB",
                     f"{run['rank0_ratio']:.3f}",
                     f"{whole['rss_bytes'] / mib:.0f} / {parts['rss_bytes'] / mib:.0f} MiB",
                     f"{whole['seconds']:.2f} s / {parts['seconds']:.2f} s"])
    out += table(["contributions", "their envelopes", "largest part", "rank 0 peak, whole",
                  "rank 0 peak, parts", "parts / whole", "rank 0 peak RSS (whole / parts)",
                  "seconds (whole / parts)"], rows)
    applies = {label: run["apply"] for label, run in r["runs"].items() if "apply" in run}
    return out + (_cluster_apply(applies) if applies else [])


def _cluster_apply(applies: dict) -> list[str]:
    """The apply's rows of bench/bench_cluster_exchange.py: rank 0 over a round's apply in a cluster node."""
    mib = 2 ** 20
    out = ["", "A round's apply of the same contributions in a cluster node (the `finish` command on FSDP2 "
           "replicas, training/cluster_outer.py): *whole*, a run without parts (rank 0 splits every "
           "contribution and scatters the pieces); *parts*, a run in parts (rank 0 checks each and forwards "
           "it a part at a time, `forward_to_ranks`). Rank 0's peak of Python allocations over the "
           "distribution step and over the whole command (the contributions, held before it, are not "
           "counted); the new weights hash is the same on both paths.", ""]
    rows = []
    for label, run in applies.items():
        whole, parts = run["rank0"]["whole"], run["rank0"]["parts"]
        rows.append([label, f"{whole['distribute_peak_bytes'] / mib:.1f} MiB",
                     f"{parts['distribute_peak_bytes'] / mib:.1f} MiB",
                     f"{run['rank0_distribute_ratio']:.3f}",
                     f"{whole['peak_traced_bytes'] / mib:.1f} / {parts['peak_traced_bytes'] / mib:.1f} MiB",
                     f"{whole['rss_bytes'] / mib:.0f} / {parts['rss_bytes'] / mib:.0f} MiB",
                     f"{whole['seconds']:.2f} s / {parts['seconds']:.2f} s"])
    return out + table(["contributions", "distribution, whole", "distribution, parts", "parts / whole",
                        "whole command (whole / parts)", "rank 0 peak RSS (whole / parts)",
                        "seconds (whole / parts)"], rows)
