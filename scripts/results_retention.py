"""The results page's sections of issue 75's disk and memory over a long run (bench/bench_retention.py)
and issue 77's reward pool gas (bench/bench_rewards_gas.py)."""

from __future__ import annotations

from results_sections import table


def retention(r: dict) -> list[str]:
    """bench/bench_retention.py: disk and RSS per node under the default retention, round by round; then the
    same run with empty blocks mined beside it (``ontime``), whose windows span a round or two."""
    out = _retention_run(r)
    ontime = r.get("ontime")
    if ontime:
        out += ["", f"`{ontime['command']}`: the same run with empty blocks mined beside it, so that the "
                "chain's windows (in blocks) span a round or two, as they do for a large model's rounds of "
                "minutes to hours; what the retention keeps is then the rounds in flight and those whose "
                "windows are open, plus the checkpoints.", ""]
        out += _retention_run(ontime)
    tiny = r.get("tiny")
    if tiny:
        out += ["", f"`{tiny['command']}`: the same at `tiny` (the settings recorded before, the fixed "
                "per-round files weigh more against its stage):", ""]
        out += _retention_run(tiny)
    for name in sorted(k for k in r if k.startswith("before_")):  # the same runs before a change
        part = r[name]
        title = part.get("note", "Before issue 75's last cuts").rstrip(".")
        out += ["", f"{title}: `{part['command']}`:", ""]
        out += _retention_run(part)
    for name in ("stages2_whole", "stages2_split"):  # a pipeline of two stages, checkpoints whole or split
        part = r.get(name)
        if part:
            out += ["", f"`{part['command']}`: " + (
                "two stages, one node each, every node keeping each checkpoint whole (S x its stage)."
                if name.endswith("whole") else "the same with `storage.checkpoints = \"stages\"`: a node "
                "keeps each checkpoint's header and its own stage's shard (docs/PROTOCOL.md)."), ""]
            out += _retention_run(part)
    return out


def _retention_run(r: dict) -> list[str]:
    """One run's figures (its samples, where kept, give one node's disk by folder at the last round)."""
    mb = 1e6
    out = [f"{r['reached_rounds']} of {r['target_rounds']} rounds of `{r['preset']}` ({r['replicas']} "
           f"replicas x {r['stages']} stage, H = {r['inner_steps']}, a checkpoint every "
           f"{r['checkpoint_every']} round, "
           f"dispute and accusation windows of {r['dispute_blocks']} blocks{_pace(r)}) under the default "
           f"retention (`storage.retention = \"windows\"`), {r['wall_s']:.0f} s on {r['cpu_count']} cores of "
           f"{r['cpu']}. The stage's float32 weights: {r['stage_bytes']:,} bytes"
           f"{_keeping(r)}.", ""]
    rows = []
    flat = next((k for k in next(iter(r["summary"].values()), {}) if k.startswith("disk_from_round_")),
                "disk_from_round_50")
    for node, s in r["summary"].items():
        low, high = s[flat] or (0, 0)
        training = s.get("disk_max_over_training_state")
        held = s.get("held_last") or {}
        rows.append([node + (" (keeps all)" if node in r.get("keep_all", []) else ""),
                     f"{s['disk_max_bytes'] / mb:.1f} MB",
                     f"{low / mb:.1f} to {high / mb:.1f} MB" if high else "not reached",
                     f"{s['disk_max_over_stage_bytes']:.0f}x", f"{training:.0f}x" if training else "",
                     _unnamed(s),
                     f"{s['disk_max_over_start_state']:.1f}",
                     f"{held.get('start_state', 0)} / {held.get('published_state', 0)}" if held else "",
                     f"{s['peak_rss_mib']:.0f} MiB"])
    out += table(["node", "disk at most", flat.replace("_", " "), "over the stage's weights",
                  "over its training state", "with its files without a name", "in start states",
                  "rounds of start / published states kept", "peak RSS"], rows)
    out += _kinds(r) + _largest(r) + _rebuilds(r)
    audit = r["audit"]
    serve = r["serve_checkpoint"]
    if "samples" not in r:
        return out + [_audit_line(audit)]
    last = r["samples"][-1]["nodes"]
    parts = ", ".join(f"{k} {v / mb:.1f} MB" for k, v in next(iter(last.values()))["disk"].items()
                      if k not in ("total", "kinds", "held"))
    out += [f"At the last round, one node's disk: {parts}. {_audit_line(audit)} "
            f"Serving a {serve['file_mib']} MiB checkpoint: peak RSS growth "
            f"{serve['copy']['peak_rss_growth_mib']} MiB and {serve['copy']['copies_on_disk']} copies on "
            "disk before, "
            f"{serve['link']['peak_rss_growth_mib']} MiB and {serve['link']['copies_on_disk']} copy now."]
    return out


def _unnamed(s: dict) -> str:
    """The disk at most with the node's files without a name (O_TMPFILE spills: the outer state between outer
    steps, a start state's copies of the trainer's tensors), over the stage's weights; "" where not sampled
    (runs before issue 75's last measurement counted named files only)."""
    figure, unnamed = s.get("disk_with_unnamed_max_over_stage_bytes"), s.get("unnamed_max_over_stage_bytes")
    return "" if figure is None else f"{figure:.0f}x (of which up to {unnamed:.1f}x unnamed)"


def _largest(r: dict) -> list[str]:
    """What each node held at its largest sample once the windows filled (``at_max_from_flat``), the kinds
    of 1x the stage or more, largest first."""
    lines = []
    for node, s in r["summary"].items():
        at = s.get("at_max_from_flat")
        if at:
            kinds = ", ".join(f"{k} {v:.1f}x" for k, v in sorted(at["kinds"].items(), key=lambda kv: -kv[1])
                              if v >= 1)
            lines.append(f"{node} at its largest from the flat round on (round {at['round']}, "
                         f"{at['over_stage_bytes']:.1f}x): {kinds}.")
    return ["", " ".join(lines)] if lines else []


def _rebuilds(r: dict) -> list[str]:
    """Per node, the start states it rebuilt when a peer asked (``storage.start_states = "rebuild"``) and
    its spot checks' verdicts, from its logs (bench.retention_disk.rebuilds); none for runs before it."""
    rows = []
    for node, t in (r.get("rebuilds") or {}).items():
        seconds = f"{t['seconds_median']:g} / {t['seconds_max']:g} s" if t["rebuilt"] else ""
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(t["spot_checks"].items())) or "none"
        rows.append([node, str(t["rebuilt"]), f"{t['rounds_replayed']} ({t['max_rounds_replayed']} at most)",
                     seconds, str(t["failed"]), verdicts, str(t["spot_checks_not_done"])])
    if not rows:
        return []
    return ["", "Start states rebuilt when a peer asked (a spot check of the node's round whose state it did "
            "not keep), and the node's own spot checks of the other replica:", ""] + table(
        ["node", "rebuilt", "rounds replayed", "median / longest rebuild", "failed", "its spot checks",
         "checks not done"], rows)


def _audit_line(audit: dict) -> str:
    """The audit's verdict from the windows nodes' directories, and with an archive node's where made."""
    if "counts" not in audit:
        return f"The audit failed: {audit.get('error', 'not made')}."
    line = (f"The audit with every rerun asked, against what the retention kept: {audit['verdict']} "
            f"({audit['counts']['ok']} items ok, {audit['counts']['FAIL']} failed, "
            f"{audit['counts']['unverifiable']} unverifiable, each named")
    items = audit.get("unverifiable_items")
    if items:
        line += ": " + "; ".join(f"{', '.join(f'{n} ({spans})' for n, spans in names.items())}: {reason}"
                                 for reason, names in list(items.items())[:6])
    line += ")."
    more = audit.get("with_archive")
    if more and "counts" in more:
        line += (f" With the directory of {', '.join(more['archives'])}, which kept every round (an archive "
                 f"node's or a seeder's files), {more['reexecute']} reruns asked: {more['verdict']} "
                 f"({more['counts']['ok']} items ok, {more['counts']['FAIL']} failed, "
                 f"{more['counts']['unverifiable']} unverifiable; reruns {more.get('reexecuted', {})}).")
    return line


def _keeping(r: dict) -> str:
    """How its nodes kept checkpoints, where a setting says (``storage.checkpoints``)."""
    setting = next((s for s in r.get("settings", []) if s.startswith("storage.checkpoints=")), "")
    return f"; checkpoints kept `{setting.split('=', 1)[1]}`" if setting else ""


def _pace(r: dict) -> str:
    """How fast the chain went by against the rounds (``--mine-per-second``), where the run says."""
    per_round = r.get("blocks_per_round")
    mined = f", {r['mine_per_second']:g} empty blocks a second mined beside the run" if r.get(
        "mine_per_second") else ""
    return f"{mined}, {per_round:g} blocks a round" if per_round is not None else mined


def _kinds(r: dict) -> list[str]:
    """The last sample's disk of each node by kind of file, in files and multiples of the stage's bytes."""
    by_node = {node: s.get("last_by_kind") for node, s in r["summary"].items() if s.get("last_by_kind")}
    if not by_node:
        return []
    kinds = sorted({k for v in by_node.values() for k in v})
    rows = [[kind] + [f"{v[kind]['files']} files, {v[kind]['over_stage_bytes']:.1f}x" if kind in v else ""
                      for v in by_node.values()] for kind in kinds]
    return ["At the last round, by kind of file (files kept, bytes over the stage's weights):", ""] + table(
        ["kind", *by_node], rows)


def rewards_gas(r: dict) -> list[str]:
    """bench/bench_rewards_gas.py: what the reward pool costs (issue 77; docs/REWARDS.md)."""
    rows = [[f"commit, {c['signers']} signers", f"{c['commit_gas_without_pool']:,}",
             f"{c['commit_gas_with_pool']:,}"] for c in r["commits"]]
    out = ["Gas on anvil. A commit writes nothing for the pool (its cost with and without a pool differs "
           "only by the record's calldata bytes); members claim against the record, paying for their own "
           "proof.", ""]
    out += table(["call", "without a pool", "with a pool"], rows)
    claims = [[f"contribution claim, {n} listed", f"{v.get('later_claim', v['first_claim_of_the_round']):,}",
               f"{v['first_claim_of_the_round']:,}"]
              for n, v in r["claim_contribution_gas"].items() if n != "note"]
    claims += [[f"attester claim, {n} attesters", f"{gas:,}", ""]
               for n, gas in r["claim_attestation_gas"].items()]
    out += [""] + table(["claim", "gas", "first claim of its round (opens it)"], claims)
    out += ["", f"createPool {r['create_pool_gas']:,}, fund {r['fund_gas']:,}, sweep {r['sweep_gas']:,} gas."]
    token = r.get("token_pool")
    if token:
        claim = token["claim_contribution_gas"]
        out += ["", f"A pool in an ERC-20 (a plain test token): createPool {token['create_pool_gas']:,}, "
                    f"fund {token['fund_gas']:,}, a contribution's claim "
                    f"{claim['first_claim_of_the_round']:,} (the round's first) and "
                    f"{claim['later_claim']:,}, an attester's claim {token['claim_attestation_gas']:,} gas."]
    return out
