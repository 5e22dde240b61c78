"""The sections of docs/RESULTS.md: one renderer per result file of bench/results, and the formatting they
share.

Each renderer takes one benchmark's current JSON and returns the section's lines (what was measured, a table,
its provenance); :mod:`results_page` puts them in order, adds the prose and writes the page.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

# ---------------------------------------------------------------------------------------------- formatting

def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.{digits}f}%"


def num(x, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "diverged (non-finite)"
    return f"{x:.{digits}f}" if isinstance(x, float) else f"{x:,}" if isinstance(x, int) else str(x)


def kb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e3:.1f} kB"


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f} MB"


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines + [""]


def load_text(values) -> str:
    if not values:
        return "?"
    return "-".join(f"{v:.1f}" for v in values[:1]) if isinstance(values, list) else str(values)


def provenance(result: dict) -> list[str]:
    """The command, date, commit, machine and load a result recorded, whichever fields it has."""
    rec = result.get("recorded") or {}
    command = rec.get("command") or result.get("command") or result.get("replay_from_previous_command")
    machine = rec.get("machine") or result.get("machine") or result.get("platform")
    parts = []
    if command:
        command = command if len(command) <= 220 else command[:200] + " ..."
        parts.append(f"command `{command}`")
    if rec.get("date"):
        parts.append(f"{rec['date']}" + (f" at {rec['commit']}" if rec.get("commit") else ""))
    if isinstance(machine, dict):
        described = ", ".join(f"{k} {v}" for k, v in machine.items()
                              if k in ("cpu", "cpu_model", "cpus", "kernel", "platform", "torch", "threads"))
        parts.append(f"machine: {described}")
    elif machine:
        parts.append(f"machine: {machine}")
    load = rec.get("load_average") or result.get("load")
    if isinstance(load, dict) and (load.get("start") or load.get("end")):
        parts.append(
            f"1-min load {load_text(load.get('start'))} at start, {load_text(load.get('end'))} at end")
    return ["Recorded: " + "; ".join(parts) + ".", ""] if parts else []


# ----------------------------------------------------------------------------------------------- sections

def diloco(r: dict, check_defaults: bool = True) -> list[str]:
    a, s = r["args"], r["summary"]
    tokens = max((p["tokens"] for m in s.values() for p in m.get("curve", [])), default=None)
    if a.get("tokenizer", "bytes") == "bytes":
        data = f"`{Path(a['data']).parent.name}`"
    else:
        data = f"a prepared dataset in a {a.get('vocab_size')}-token BPE vocabulary"
    lines = [f"`{a['preset']}` model ({r.get('num_params', 0):,} parameters), {a['replicas']} replicas x "
             f"{a['stages']} stages, H = {a['inner_steps']} x {a['rounds']} rounds, {num(tokens)} training "
             f"tokens of {data}, the same tokens, seeds and inner schedule in every mode; DiLoCoX with "
             f"encoder `{a.get('encoder') or 'v1'}`, bandwidth budget `{a['bandwidth_budget']}`"
             + (f" (resolved: {r['resolved']['bandwidth_budget_per_stage']} bytes per stage, overlap "
                f"{r['resolved']['overlap_steps']} steps)" if r.get("resolved") else "") + ".", ""]
    rows = [["nanoGPT baby config (its own figure)", num(r.get("nanogpt_baby_val")), "", "", ""]] \
        if tokens == 1_536_000 and a["preset"] == "mini" else []  # nanoGPT's figure is of that model
    optimizer = {"adamw": "AdamW", "muon": "Muon"}.get(a.get("optimizer") or "adamw", a.get("optimizer"))
    names = {"ddp": f"DDP ({optimizer}, gradient AllReduce every step)",
             "diloco": "DiLoCo (synchronous, no compression)",
             "diloco_x": "DiLoCoX (delay + overlap + codec)"}
    for mode, m in s.items():
        fewer = m.get("fewer_bytes_than_ddp")
        rows.append([names.get(mode, mode), num(m["held_out_loss"]), pct(m.get("loss_vs_ddp")),
                     "-" if fewer is None else f"{fewer:.0f}x", f"{100 * m['codec_outer_share']:.2f}%"])
    lines += table(["mode", "held-out loss", "vs DDP", "fewer bytes than fp32 AllReduce",
                    "codec + outer step"], rows)
    stale = settings_not_default(a) if check_defaults else ""
    if stale:
        lines += [(f"**Not the benchmark's default settings:** this result was measured with {stale}; "
                  "`python bench/bench_diloco.py --cpu-clock` measures the defaults and replaces it."), ""]
    if r.get("targets") and check_defaults:
        lines += ["Goals (issue 14): " + ", ".join(f"`{k}` {'met' if v else '**not met**'}"
                                                  for k, v in r["targets"].items()) + ".", ""]
    return lines


ABLATION_DEFAULTS = {
    "preset": "mini", "stages": 2,
    "replicas": 2, "inner_steps": 50, "rounds": 30, "batch_size": 8, "inner_lr": 0.003,
    "lr_schedule": "cosine", "warmup_steps": 100, "beta2": 0.99, "weight_decay": 0.1, "outer_lr": 1.0,
    "outer_momentum": 0.5, "x_outer_lr": None, "x_outer_momentum": None, "outer_warmup_rounds": 0,
    "outer_decay": "constant", "outer_min_lr_ratio": 1.0, "outer_final_momentum": "auto",
    "delay_correction": "rebase", "no_delay": False, "error_budget": 0.4, "bandwidth_budget": "auto",
    "target_reduction": 1000.0, "overlap_steps": "auto", "max_rank": 32, "bits": "2,4,8",
    "no_error_feedback": False, "encoder": "v4", "seed": 0, "cpu_clock": False,
    "optimizer": "adamw",  # training.config.DEFAULT_OPTIMIZER
}
SHORT = {"inner_steps": "H", "rounds": "rounds", "inner_lr": "ilr", "outer_lr": "olr", "outer_momentum": "om",
         "x_outer_lr": "x olr", "x_outer_momentum": "x om", "bandwidth_budget": "bw",
         "overlap_steps": "overlap", "error_budget": "err", "delay_correction": "delay",
         "warmup_steps": "warmup", "lr_schedule": "schedule", "weight_decay": "wd",
         "outer_warmup_rounds": "owarm", "outer_decay": "odecay", "outer_min_lr_ratio": "omin",
         "outer_final_momentum": "ofinal", "cpu_clock": "cpu clock"}


def settings_not_default(args: dict) -> str:
    """What of a bench_diloco.py result's settings differs from the benchmark's defaults ("" if nothing)."""
    # Before compression.encoder existed: v1; before --optimizer: AdamW.
    settings = {**args, "encoder": args.get("encoder") or "v1", "optimizer": args.get("optimizer") or "adamw"}
    differences = _differences(settings)
    return "" if differences == "defaults" else differences


def _differences(settings: dict) -> str:
    out = []
    for key, default in ABLATION_DEFAULTS.items():
        value = settings.get(key)
        if value is None or value == default:
            continue
        # Values that mean the default: DiLoCoX's outer step given as synchronous DiLoCo's, "auto"'s overlap
        # written out, an error budget under a byte budget (unused there).
        if key in ("x_outer_lr", "x_outer_momentum") and value == settings.get(key.removeprefix("x_")):
            continue
        if key == "overlap_steps" and str(value) == str(settings.get("inner_steps", 50) // 10):
            continue
        if key == "error_budget" and settings.get("bandwidth_budget") not in (0, "0", None):
            continue
        if key in ("cpu_clock", "seed") or (key == "bandwidth_budget" and value == "auto"):
            if key == "seed" and value:
                out.append(f"seed {value}")
            continue
        out.append(f"{SHORT.get(key, key)} {value}")
    return ", ".join(out) or "defaults"


def diloco_ablations(r: dict) -> list[str]:
    rows = r["rows"]
    lines = [("Every `bench_diloco.py` run of other settings that this project kept, one row per mode "
             "(`bench/diloco_ablations.py` adds a run's rows). \"vs DDP\" compares with the DDP row of the "
             "same tokens and inner settings; \"vs best DDP\" with the best DDP row of the same tokens. Runs "
             "before `codec2_*` used encoder v1, those up to issue 29 v2 unless the row names another; rows "
             "of 4 rounds measure the codec's share of the round, not the loss. The settings column lists "
             "what differs from the benchmark's defaults."), ""]
    body = []
    for row in sorted(rows, key=lambda x: (x["settings"]["rounds"] * x["settings"]["inner_steps"], x["tag"],
                                           x["mode"])):
        fewer = row.get("fewer_bytes_than_ddp")
        body.append([f"`{row['tag']}`", row["mode"], _differences(row["settings"]), num(row["held_out_loss"]),
                     pct(row.get("vs_ddp"), 2), pct(row.get("vs_ddp_best"), 2),
                     "-" if not fewer else f"{fewer:.0f}x", f"{100 * row['codec_outer_share']:.2f}%"])
    lines += table(["run", "mode", "settings", "held-out", "vs DDP", "vs best DDP", "fewer bytes",
                    "codec + outer"],
                   body)
    lines += _encoder_seeds(rows)
    return lines


def _encoder_seeds(rows: list[dict]) -> list[str]:
    """Encoders v2 and v4 over the full budget and five seeds (the comparison behind v4 as the default)."""
    by_encoder: dict[str, list[dict]] = {}
    for row in rows:
        tag = row["tag"]
        if tag.startswith("codec5_v") and "_r30" in tag and "memo" not in tag and row["mode"] == "diloco_x":
            by_encoder.setdefault(tag.split("_")[1], []).append(row)
    if not by_encoder:
        return []
    body = []
    for encoder, group in sorted(by_encoder.items()):
        losses = [g["held_out_loss"] for g in group]
        shares = [g["codec_outer_share"] for g in group]
        stderr = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else None
        body.append([encoder, len(group), num(statistics.mean(losses)), "-" if stderr is None
                     else f"{stderr:.4f}",
                     f"{100 * min(shares):.2f}-{100 * max(shares):.2f}%"])
    return ["Encoders over the full budget, `codec5_*_r30*` rows above (seeds 0-4; CPU-clock shares):",
            ""] + table(
        ["encoder", "runs", "mean held-out", "standard error", "codec + outer step"], body)


def utilization(r: dict) -> list[str]:
    a = r["args"]
    rows = []
    for name, run in r["runs"].items():
        s = run.get("summary") or {}
        rows.append([name, f"{r.get('rate_limit_bps', 0):,.0f} B/s" if name != "calibrate" else "none",
                     num(s.get("exchange_over_inner"), 2), pct(s.get("utilization"), 1).lstrip("+"),
                     pct(s.get("utilization_min_period"), 1).lstrip("+"), num(s.get("inner_s_mean"), 1),
                     pct(s.get("own_work_share"), 2).lstrip("+"), "yes" if run.get("all_exited_0") else "no"])
    return [(f"Real nodes (2 one-node replicas of `{a['preset']}`, H = {a['inner_steps']}, batch "
            f"{a['batch_size']}, {a['rounds']} rounds) with blob traffic capped; utilization = time in inner "
            "steps / wall time per "
            "round, steady periods only."), ""] + table(
        ["run", "cap", "exchange / compute", "utilization", "lowest period", "compute s/round",
         "own work on the training thread", "all exit 0"], rows)


def robust_sim(r: dict) -> list[str]:
    a = r["args"]
    honest = r["runs"]["honest/on"]["held_out_loss"]
    rows = []
    for run in r["runs"].values():
        excluded = run.get("excluded (index:reason -> stage-rounds)") or {}
        rows.append([run["attack"] or "none (honest)", run["defences"], num(run["held_out_loss"]),
                     pct(run["held_out_loss"] / honest - 1, 2) if math.isfinite(run["held_out_loss"])
                     else "-",
                     ", ".join(f"{k}: {v}" for k, v in excluded.items()) or run.get("error", "")])
    return [(f"In-memory DiLoCoX, `{a['preset']}`, {a['replicas']} replicas x {a['stages']} stages, H = "
            f"{a['inner_steps']} x {a['rounds']} rounds, replica {a['attacker']} malicious, "
            "one seed (differences "
            "under ~1% are noise at this length). Defences: on = norm rule + screening, norm = the norm rule "
            "alone (a split cluster), off = none."), ""] + table(
        ["attack", "defences", "held-out", "vs honest", "left out (replica:reason: stage-rounds)"], rows)


def chaos(r: dict) -> list[str]:
    rec = r["recovery_s"]
    return [(f"{r['replicas']} split clusters x {r['stages']} stages = {r['nodes']} nodes, k = {r['k']}, a "
            f"random node killed with SIGKILL and restarted, {len(r['kills'])} times, then "
            "every node stopped and "
            "`dlx-node audit` run over all archives."), ""] + table(
        ["rounds committed", "each once, in order", "kills", "restarts entering from the checkpoint",
         "unexpected exits", "rounds with fewer contributors", "recovery per kill", "audit"],
        [[r["rounds"], "yes" if r["rounds_in_order_once"] else "**no**", len(r["kills"]),
          r.get("checkpoint_entries", "-"), len(r["unexpected_exits"]), r["rounds_with_fewer_contributors"],
          f"{rec['min']}-{rec['max']} s, mean {rec['mean']} s, unrecovered {rec['unrecovered']}",
          f"{r['audit']['verdict']}"]]) \
          + [(f"Wall time {r['wall_s'] / 60:.0f} min; load {load_text(r.get('load_before'))} "
                                           f"before, {load_text(r.get('load_after'))} after."),
             ""] + chaos_phases(r)


def chaos_phases(r: dict) -> list[str]:
    """The kills by the phase the killed node reported (bench_chaos --split)."""
    phases = r.get("by_phase") or {}
    if not phases:
        return []
    rows = [[phase, d["kills"], d["recovered"], f"{d['recovery_rounds_mean']} / {d['recovery_rounds_max']}",
             d.get("rounds_missed_after_ready_max", "-"), d.get("rounds_missed_open_at_ready_max", "-"),
             d["rounds_after_entry_max"],
             f"{d['recovery_s_mean']} / {d['recovery_s_max']} s", f"{d.get('ready_s_mean', '-')} s"]
            for phase, d in sorted(phases.items())]
    return [
        "By the phase of the kill (the restarted node's replica is back when it contributes again; rounds "
        "missed after ready: rounds committed without it once its restarted process was ready, i.e. its "
        "pipeline formed with its partner, before the round it is back in; of those still open at ready: "
        "the round the other replicas trained then or later, the others closed before and committed "
        "after):", ""] + table(
        ["phase", "kills", "recovered", "chain rounds after the restart (mean / max)",
         "rounds missed after ready (max)", "of them open at ready (max)",
         "rounds after its entry round (max)", "seconds (mean / max)", "process ready after (mean)"],
        rows) + [
        (f"Logs with a traceback: {sum(1 for v in (r.get('tracebacks') or {}).values() if v)}; forks "
         f"re-based in place: {r.get('rebased', '-')}."), ""]


def restart(r: dict) -> list[str]:
    """Where a restarted node's time goes (bench_restart.py)."""
    s = r["summary"]
    rows = [[phase, f"{d['mean_s']} s", f"{d['max_s']} s"] for phase, d in s["phases"].items()]
    per_restart = [[e["node"], e.get("round_at_restart"),
                    e.get("round_at_mark", {}).get("pipeline formed", "-"), e.get("entered_round"),
                    e.get("recovered_round"), e.get("rounds_missed_after_ready", "-")]
                   for e in r["restarts"]]
    return [(
        f"{r['nodes']} nodes (2 split clusters x 2 stages), k = {r['k']}, settings {r['settings']}: one node "
        f"after the other killed with SIGKILL and started again 2 s later, {len(r['restarts'])} times. Each "
        "start-up phase ends with a line in the node's log (node/live/startup.py), in seconds since the "
        "process started; a phase's time runs from the end of the one before it."), ""] + table(
        ["phase (ends when)", "mean", "max"], rows) + table(
        ["node", "round committed at the restart", "at ready (pipeline formed)", "entered at", "back in",
         "rounds missed after ready"], per_restart) + [
        (f"Ready after {s['ready_s']['mean'] if s['ready_s'] else '-'} s (mean), first contribution after "
         f"{s['first_contribution_s']['mean'] if s['first_contribution_s'] else '-'} s (mean); "
         f"{r['seconds_per_round']} s per round over the run; tracebacks {s['tracebacks']}. "
         "The run's nodes use "
         "dev accounts; a node with an encrypted keystore (scrypt, eth-account's default work "
         "factor) decrypts it "
         f"once at start: {r['keystore_decryption']['cpu_s']} s of CPU "
         f"({r['keystore_decryption']['wall_s']} s "
         "wall) here."), ""]


def longrun(r: dict) -> list[str]:
    wanted = [s for s in r["samples"] if s["round"] in (10, 100, 500, 1000)] \
        or r["samples"][:: max(1, len(r["samples"]) // 4)]
    nodes = sorted(wanted[0]["nodes"])
    rows = []
    for label, key, scale_ in (("resident memory (MiB)", "rss_kib", 1024),
                               ("open file descriptors", "fds", 1), ("threads", "threads", 1)):
        rows.append([label] + [" / ".join(f"{s['nodes'][n][key] / scale_:.0f}" if scale_ > 1
                                          else str(s["nodes"][n][key])
                                          for n in nodes) for s in wanted])
    rows.append([f"blob store ({nodes[0]})"] + [mb(s["nodes"][nodes[0]]["disk"]["blobs"]["bytes"])
                                                for s in wanted])
    return [
        (
            f"{r['replicas']} one-node replicas of `{r['preset']}`, H = {r['inner_steps']}, a checkpoint "
            f"every {r['checkpoint_every']} round(s), {r['reached_rounds']} of {r['target_rounds']} rounds "
            f"in {r['wall_s'] / 60:.0f} min ({r['seconds_per_round']:.1f} s a round), "
            f"settings {r['settings']}."
        ),
        "",
    ] + table([f"per node ({' / '.join(nodes)})"] + [f"round {s['round']}" for s in wanted], rows)


def fuzz(r: dict) -> list[str]:
    rows = [[name, f"{t['inputs']:,}", len(t["unexpected"]), f"{t['slowest_input_s']:.2f} s",
             f"{t['traced_peak_alloc_bytes'] / 1e6:.2f} MB"] for name, t in r["targets"].items()]
    return [(f"{r['inputs']:,} inputs over {len(r['targets'])} decoders in {r['seconds']:.0f} s "
            f"({r['inputs_per_second']:,.0f} inputs/s): **{r['unexpected']} unexpected exceptions**, "
            f"{r['over_time_bound']} over the {r['max_seconds']} s bound, {r['over_alloc_bound']} over the "
            f"{r['max_alloc_mib']} MiB bound. CI runs the same decoders under hypothesis "
            "(`tests/test_fuzz_decoders.py`)."), ""] + table(
        ["decoder", "inputs", "unexpected", "slowest input", "largest traced allocation"], rows)


def ledger(r: dict) -> list[str]:
    g, h = r["gas"], r["history"]
    commit = g["commitRound_by_quorum"]
    rows = [[f"`commitRound` signed by k = {k}",
             f"{v['later']:,} ({v['with_checkpoint']:,} with a checkpoint)"]
            for k, v in commit.items()]
    rows += [[f"`commitRound`, k = 3, {n} contributors", f"{v:,}"]
             for n, v in g["commitRound_k3_by_contributors"].items()]
    rows += [[f"`commitRound` at {k.replace('_', ' ')} members (quorum from the run's fraction)",
              f"{v['first']:,}"]
             for k, v in g.get("commitRound_by_fraction", {}).items()]
    rows += [[f"`{k}`", f"{v:,}"] for k, v in g.items() if isinstance(v, int)]
    return [f"{r['chain']}, {r['compiler']}. Gas per call:", ""] + table(["call", "gas"], rows) + [
        (f"Reading and verifying {h['rounds']} rounds of history: {h['read_and_verify_seconds']:.2f} s "
        f"(target <= {h['target_seconds']} s: {'met' if h['within_target'] else '**not met**'})."), ""]


def audit(r: dict) -> list[str]:
    c = r["chain_part"]
    rows = [[p["preset"], f"{p['replicas']} x {p['stages']}", p["rounds"],
             f"{p['replay_mean_seconds_per_round']:.2f} s", "yes" if p["all_rounds_ok"] else "**no**"]
            for p in r.get("replay", [])]
    return [(f"Chain part of `dlx-node audit` over {c['rounds']} committed rounds on anvil, each signed by "
            f"{c['quorum']} members: **{c['chain_part_seconds']:.2f} s** (target <= {c['target_seconds']} s; "
            f"history read {c['read_history_seconds']:.2f} s, checks {c['chain_checks_seconds']:.2f} s; "
            f"items ok {c['items']['ok']}, FAIL {c['items']['FAIL']}). Bit-exact replay per round:"),
            ""] + table(
        ["preset", "replicas x stages", "rounds", "replay per round", "every round reproduced"], rows)


def data_loader(r: dict) -> list[str]:
    rows = [[size, f"{d['open_verify_s']:.2f} s", f"{d['after_loading']['VmRSS']:.1f} MiB",
             f"{d['after_loading']['VmHWM']:.1f} MiB", f"{d['loader_batches_per_s']:,.0f}",
             f"{d['train_step_s']:.1f}"]
            for size, d in r["datasets"].items()]
    m = r["model"]
    extra = []
    for size, d in (r.get("without_page_release") or {}).items():
        extra = [(f"Without releasing the pages it read, the {size} loader alone held "
                 f"{d['after_loading']['RssFile']:.0f} MiB of file pages."), ""]
    return [(f"A `{m['preset']}` replica (vocabulary {m['vocab_size']}, batch {m['batch_size']} x "
            f"{m['block_size']}) trains, then reads {r['rounds_read']} rounds of batches by memory map, one "
            "process per dataset."), ""] + table(
        ["dataset", "open + check every shard", "RSS after", "peak RSS", "loader batches/s",
         f"{m['preset']} s/step"],
        rows) + extra


def diloco_llama(r: dict) -> list[str]:
    return diloco(r, check_defaults=False)
