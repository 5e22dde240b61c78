"""The sections of docs/RESULTS.md on contributors that differ: heterogeneous hardware (time-bounded rounds),
CPU platforms (re-execution across instruction sets) and screening under the one-step delay.

Split from :mod:`results_sections`, whose formatting helpers these renderers share.
"""

from __future__ import annotations

from results_sections import load_text, num, pct, table


def heterogeneous(r: dict) -> list[str]:
    s, c = r["settings"], r["comparison"]
    rows = []
    for name, label in (("fixed", f"fixed H = {s['fixed_h']}"),
                        ("budget",
                         f"time-bounded: {s['budget_s']:g} s, {s['min_steps']}..{s['max_steps']} steps")):
        run = r[name]
        rows.append([label, run["rounds"], num(run["wall_s_per_round"], 1)]
                    + [f"{x['steps_per_round']:.1f} / {1000 * x['s_per_step']:.0f} ms / "
                       f"{pct(x['compute_share_reaching_outer_step'], 1).lstrip('+')}"
                       for x in run["replicas"]]
                    + [num(run["final_eval_loss"])])
    factors = [f"{x['factor']:g}x (steps/round, s/step, share)" for x in r["fixed"]["replicas"]]
    wall, tokens = c["loss_at_equal_wall"], c["loss_at_equal_tokens"]
    quotas = (f"cgroup v1 cpu quotas of {s['quota']:g} CPU / factor (factors "
              f"{', '.join(f'{f:g}' for f in s['factors'])})")
    if s.get("node"):
        delay = ("the one-step delay (the exchange of round t overlaps round t+1)"
                 if s.get("no_delay") is False
                 else "no one-step delay")
        how = (f"Three replicas of `{s['preset']}` (batch {s['batch_size']}), each a real `dlx-node start` "
               f"process (a local anvil, libp2p on loopback, the full exchange, {delay}, the "
               "chain's records) whose "
               + ("training thread (a slow accelerator: the node's other threads, its encode, attestation, "
                  "libp2p and chain work, run at the machine's pace)" if s.get("throttle") == "training" else
                  "whole process") + f" runs under {quotas}. Wall s/round = the mean over the nodes of their "
                                     "periods (from the end "
               "of one round's inner steps to the end of the next one's, the nodes' `timing.jsonl`); tokens "
               "= the records' (what the contributions declared); held-out = each round's checkpoint (the "
               "global weights) evaluated after the run. Share = the wall seconds of the replica's inner "
               "steps whose contribution reached the outer step / the wall seconds of its periods (idle: its "
               "waits for others, its own work around the steps, steps whose contribution was lost).")
    else:
        how = (f"Three replicas of `{s['preset']}` (batch {s['batch_size']}) whose inner steps "
               f"run under {quotas}, "
               "one process per replica; contributions over pipes, the parent replays the aggregation and "
               "evaluates (not the libp2p node). Share = the replica's seconds of inner steps that reached "
               "the outer step / the run's wall time.")
    rule = s.get("screen_rule", "auto")
    versions = {"auto": "version 1", "one_sided": "version 1", "two_sided": "version 2",
                "paired": "version 3"}
    how += (
        f" The time-bounded run screens by {versions.get(rule, rule)} (`diloco.screen_rule = \"{rule}\"`) on "
        f"{s.get('screen_batch', 16)} windows; the fixed-H run by version 1 on 16.")
    idle = []
    if "cpu_share_in_inner_steps" in r["budget"]["replicas"][0]:
        idle_rows = [[name, f"{x['factor']:g}x", pct(x["compute_share_reaching_outer_step"], 1).lstrip("+"),
                      num(x["idle_per_round"]["waits_s"], 2), num(x["idle_per_round"]["own_work_s"], 2),
                      num(x["idle_per_round"]["lost_inner_s"], 2), num(x["idle_per_round"]["lane_s"], 1),
                      pct(x["cpu_share_in_inner_steps"], 1).lstrip("+")]
                     for name in ("fixed", "budget") for x in r[name]["replicas"]]
        idle = ["Where each replica's periods went (seconds per round): its waits for others (closes, "
                "contributions, commits), its own work on the training thread around the steps, inner steps "
                "whose contribution was lost; the lane's work beside the steps (encode, start state, eval, a "
                "round's seal and attestation); and the CPU share: the CPU seconds of the inner steps that "
                "reached the outer step / the CPU seconds of the whole node process (here "
                "the node's host work "
                "shares the throttled CPU with its steps; on a GPU it would run beside them).", ""] + table(
            ["run", "replica", "share", "waits s", "own work s", "lost steps s", "lane s", "CPU share"],
            idle_rows)
    return [how, ""] + table(
        ["run", "rounds", "wall s/round", *factors, "held-out at the end"], rows) + idle + [
        f"Held-out loss at equal wall time ({c['equal_wall_s']:.0f} s): fixed {num(wall['fixed'])}, "
        f"time-bounded {num(wall['budget'])} ({pct(wall['budget_vs_fixed'], 2)}); at equal tokens "
        f"({c['equal_tokens']:,}): fixed {num(tokens['fixed'])}, time-bounded {num(tokens['budget'])} "
        f"({pct(tokens['budget_vs_fixed'], 2)}).", ""]


def reexec_isa(r: dict) -> list[str]:
    """bench/bench_reexec_isa.py: honest distances across ATen capabilities and thread counts, cheats per
    rule."""
    a = r["args"]

    def g(x):
        return "-" if x is None else f"{x:.3g}"

    def zones(z: dict) -> str:
        cell = (f"{z.get('exact', 0) + z.get('within_tolerance', 0)} / {z.get('undecided', 0)} / "
                f"{z.get('mismatch', 0)}")
        return cell + (f" ({z['other_result']} other_result)" if z.get("other_result") else "")
    runs = {(doc.get("rounds", a["rounds"]), doc.get("inner_steps", a["inner_steps"]))
                for doc in r["presets"].values()}
    what = (f"{a['rounds']} rounds of H = {a['inner_steps']}" if len(runs) == 1 else
            "the rounds of H the table's run column gives (presets measured in separate invocations)")
    lines = [(f"Claimants train {what} under each ATen capability of this "
              f"CPU ({', '.join(r['capabilities'])}) on 1 thread; every contribution is rerun "
              "under each on 1 and 2 "
              "threads. Honest: the largest relative distance by what differs, and what issue 42's rule "
              "makes of every honest rerun on other kernels or threads judged as a claim of a platform "
              "nobody can emulate (passed / undecided / mismatch)."), ""]
    for preset, doc in r["presets"].items():
        if doc.get("platforms"):  # bench_reexec_isa --arm-python
            lines[-1:-1] = ["", (f"`{preset}`: claimants and verifiers on {', '.join(doc['platforms'])} (the "
                             "`aarch64:` ones are PyPI's aarch64 torch under qemu-user, "
                             "scripts/setup-arm-emulation.sh: every instruction's floating-point result as "
                             "an ARM CPU gives it, timings meaningless), "
                             "every contribution rerun on every platform on "
                             f"{doc.get('rerun_threads', '1,2')} "
                             "thread(s).")]
        if doc.get("note"):  # measured on another machine (its own recorded block)
            lines[-1:-1] = ["", f"`{preset}`: {doc['note']}."]
    honest_rows, cheat_rows = [], []
    for preset, doc in r["presets"].items():
        s = doc["summary"]
        pairs = ", ".join(f"{k}: {g(v['min'])}..{g(v['max'])}"
                          for k, v in s["honest_by_capability_pair"].items())
        run = f"{doc.get('rounds', a['rounds'])} x H = {doc.get('inner_steps', a['inner_steps'])}"
        honest_rows.append([f"`{preset}`", run, g(s["honest_same_kernels_max"]),
                            g(s["honest_other_threads_max"]), pairs or "-",
                            zones(s["honest_rule_other_kernels"])])
        for role, c in s["cheats"].items():
            cheat_rows.append([f"`{preset}`", role, g(c["min_distance_same_kernels"]),
                               g(c["min_distance_other_capability"]),
                               f"{c['pass_old_tolerance_other_kernels']} of {c['reruns_other_kernels']}",
                               f"{c['pass_emulated']} of {c['checks']}", zones(c["rule_other_kernels"])])
    s0 = next(iter(r["presets"].values()))["summary"]
    return lines + table(["preset", "rounds", "same kernels and threads", "other thread count",
                          "other instruction set (claimant->rerun: min..max)", "rule, other kernels"],
                         honest_rows) + [
        ("Cheats: smallest distance; how many the tolerance before issue 42 let through (<= "
         f"{g(s0['old_tolerance'])}) "
         "on other kernels or threads; under the rule, rerun under the claimant's own kernels (emulated: "
         f"bit-exact demanded), and judged as another platform's claim (passed <= {g(s0['pass_bound'])} / "
         f"undecided / mismatch > {g(s0['mismatch_bound'])})."), ""] + table(
        ["preset", "cheat", "smallest, same kernels", "smallest, other instruction set",
         "passed the old tolerance", "passed, emulated", "rule, other kernels"], cheat_rows)

def screening_delay(r: dict) -> list[str]:
    names = {"honest": "honest", "flip": "sign flip", "x": "scaled 4x", "noise": "noise of an honest norm"}
    if "version_3" not in r["total"]["honest"]:  # the JSON of the script before version 3
        rules = {"version_1": "version 1", "version_2": "version 2", "version_2_excess": "v2, excess form",
                 "curvature_per_step": "curvature per step"}
    else:
        wide = r["settings"].get("windows", 64)
        rules = {"version_1": "version 1", "version_2": "version 2", "version_2_start": "v2 at theta^{t-2}",
                 "version_3": "version 3", "version_2_wide": f"version 2, {wide} windows",
                 "version_3_wide": f"version 3, {wide} windows"}
    rows = [[names.get(kind, kind), str(entry["n"]), *(str(entry[rule]) for rule in rules)]
            for kind, entry in r["total"].items()]
    runs = "; ".join(f"{' / '.join(map(str, run['counts']))} steps, {run['rounds']} rounds"
                     for run in r["runs"])
    return [
        (f"The simulation (one-step delay, overlap 0, compression on, `tiny`, outer lr 0.7 / momentum 0.5), "
         f"replicas held at fixed counts ({runs}); every contribution aggregated; per round from 1, the "
         "contributions excluded by each rule (`training.screening.judge`, on the round's screening batch of "
         "16 windows unless a column says more) among the honest ones (a round of the three) and attacks "
         "built from them (each in a round of the three and it: sign flip and 4x of the longest and "
         "shortest, noise of the median and of the longest norm)."), ""] + table(
        ["contributions", "n", *rules.values()], rows)


def gpu(r: dict) -> list[str]:
    """bench/bench_gpu.py on a GPU: (a) tokens/s and MFU of llama-124m per setting, (b) the node's share of a
    round."""
    e, m = r["environment"], r["model"]
    rows = [[name, str(t["batch"]), t["precision"], "yes" if t.get("compiled") else "no",
             "yes" if t.get("fused_adamw") else "no", f"{t['tokens_per_second']:,.0f}",
             f"{t['achieved_tflops']:.0f}", f"{t['mfu']:.1%}" if t.get("mfu") is not None else "-"]
            for name, t in r["throughput"].items()]
    lines = [(f"On {e['device']} (torch {e['torch']}, CUDA {e['cuda']}, {e['cpus']} CPUs): one `{m['preset']}"
              f"` replica ({m['params']:,} parameters, vocabulary {m['vocab_size']}, sequences of 1024) "
              "on random ids; MFU = "
              "(6 N + 12 L T C) x tokens/s over the dense bf16 peak. Goal: MFU >= 40% in bf16 (best here: "
              f"{r['goals']['mfu_best']:.1%}, `{r['goals']['mfu_best_setting']}`)."), ""]
    lines += table(["setting", "batch", "precision", "torch.compile", "fused AdamW", "tokens/s", "TFLOP/s",
                    "MFU"], rows)
    share_rows = []
    for name in ("round_share_first", "round_share"):
        b = r.get(name)
        if not b or "blocking" not in b:
            continue
        parts = ", ".join(f"{k} {v:.2f}" for k, v in {**b["blocking"], **b["lanes"]}.items())
        share_rows.append([name, f"{b['inner_steps']}", f"{b['train_seconds']:.2f}",
                           f"{b['blocking_seconds']:.2f}", f"{b['node_share']:.1%}",
                           f"{b['lane_seconds']:.2f}", "yes" if b["lanes_fit_in_round"] else "no", parts])
    lines += ["", ("The node's share of a round (H inner steps in bf16, batch "
                   f"{r['round_share']['batch']}): what blocks "
                   "the training thread, and the lanes that overlap the next round's "
                   "training (seconds). Goal: "
                   f"node share <= 3% (here {r['goals']['node_share']:.1%}). The first round "
                   "allocates the pinned "
                   "host buffers the copies land in; later rounds reuse them."), ""]
    lines += table(["round", "H", "train s", "blocking s", "node share", "lanes s", "lanes fit", "parts (s)"],
                   share_rows)
    if r.get("provenance"):
        lines += ["", f"How it was run: {r['provenance']}"]
    return lines + [""]


def compile_cpu(r: dict) -> list[str]:
    """bench/bench_compile_cpu.py: eager against ``training.compile`` inner steps on this CPU."""
    rows = [[row["preset"], "compiled" if row["compiled"] else "eager", f"{row['batch']} x {row['seq_len']}",
             f"{row['first_step_seconds']:.1f} s", f"{row['tokens_per_second']:,.0f}",
             f"{row['tokens_per_cpu_second']:,.0f}",
             f"x{row['speedup']:.2f}" if row.get("speedup") else "-",
             f"{row['largest_loss_difference']:.1e}" if row.get("largest_loss_difference") is not None
             else "-"]
            for row in r["rows"]]
    return [
        (f"One replica (every stage in one process), float32, {r['threads']} threads, torch {r['torch']}; "
         f"the compiled platform's `compiled` field: `{r['platform'].get('compiled')}`. The first step of a "
         "compiled trainer includes compiling its forward and backward (a fresh inductor cache)."),
        ""] + table(
        ["preset", "mode", "batch x sequence", "first step", "tokens/s", "tokens per CPU second",
         "compiled / eager", "largest loss difference"], rows)


def reproducible(r: dict) -> list[str]:
    """bench/bench_reproducible.py: the reproducible mode's step time, tokens/s, codec time and its bits."""
    versions = [tag for tag in ("", "_v2") if any(f"reproducible{tag}_step_s" in row for row in r["timings"])]

    def cells(row: dict, tag: str) -> list[str]:
        if f"reproducible{tag}_step_s" not in row:
            return ["", "", ""]
        slowdown = row["slowdown" if not tag else f"slowdown{tag}"]
        cpu = row.get(f"slowdown{tag}_cpu")  # the process's CPU time (bench runs since the column exists)
        return [f"{row[f'reproducible{tag}_step_s']:.3f} s",
                str(row.get(f"reproducible{tag}_tokens_per_s", "")),
                f"x{slowdown:.2f}" + (f" (CPU time x{cpu:.2f})" if cpu is not None else "")]

    rows = [[f"{row['preset']}, {row['optimizer']}", f"{row['normal_step_s']:.3f} s",
             str(row.get("normal_tokens_per_s", "")), *(c for tag in versions for c in cells(row, tag))]
            for row in r["timings"]]
    names = {"": "kernels 1", "_v2": "kernels 2"} if "_v2" in versions else {"": "reproducible"}
    versions_note = (" (`training.reproducible_kernels` 1, a run document's without it, and 2, a new run's)."
                     if "_v2" in versions else ".")
    lines = [f"One inner step, batch {r['timings'][0]['batch']}, {r['timings'][0]['threads']} thread(s), the "
             "median of the steps after a warm-up one" + versions_note, ""]
    lines += table(["preset, optimizer", "normal step", "normal tokens/s",
                    *(h for tag in versions for h in (f"{names[tag]} step", f"{names[tag]} tokens/s",
                                                      f"{names[tag]} slowdown"))], rows)
    if r.get("codec"):
        lines += ["", "The codec's encode of fixed inputs (3 rounds under a byte budget and one to the error "
                  "budget), torch's LAPACK and BLAS against the fixed-order codec:", ""]
        lines += table(["encoder", "normal", "reproducible", "slowdown"],
                       [[row["encoder"], f"{row['normal_s']:.2f} s", f"{row['reproducible_s']:.2f} s",
                         f"x{row['slowdown']:.1f}"] for row in r["codec"]])
    grid = r.get("grid")
    if grid:
        same = r["identical_across_grid"]
        cells = ", ".join(f"{row['capability']}/{row['threads']}t" + ("/CBWR" if row["mkl_cbwr"] else "")
                          for row in grid)
        distinct = [[key, "yes" if same[key] else "no", str(len({row['hashes'][key] for row in grid}))]
                    for key in same]
        earlier = r.get("grid_recorded")
        when = f" (recorded {earlier['date']} at {earlier['commit']}: {earlier['note']})" if earlier else ""
        lines += ["", f"Weights after two inner steps in {len(grid)} children ({cells}){when}:", ""]
        lines += table(["case", "identical everywhere", "distinct hashes"], distinct)
    for key in ("audit", "audit_full"):
        if r.get(key):
            lines += [*([""] if lines[-1] else []), *reproducible_audit(r[key])]
    return lines


def reproducible_audit(a: dict) -> list[str]:
    """bench/bench_reproducible.py --audit: a reproducible demo run audited under other instruction sets."""
    kernels = (a.get("run_training") or {}).get("reproducible_kernels") or 1
    when = a.get("recorded", {})
    lines = [f"`dlx-node demo` in the mode (`--set training.reproducible=true`, kernel version {kernels}): "
             f"`{a['preset']}`, {a['replicas']} replicas x {a['stages']} stage, {a['rounds']} rounds of "
             f"H = {a['inner_steps']}, trained under `ATEN_CPU_CAPABILITY={a['trained_under']}` "
             f"({a['demo_seconds']:.0f} s), then `dlx-node audit --reexecute all` under each capability on "
             f"{a['threads']} thread(s) (recorded {when.get('date', '?')} at {when.get('commit', '?')}, load "
             f"{a['load_average']['start'][0]:.1f} at start):", ""]
    rows = [[row["capability"], f"{row['seconds']:.1f} s", f"x{row['vs_first']:.2f}", str(row["verdict"]),
             str(row["reruns"]), ", ".join(f"{n} {how}" for how, n in sorted(row["judged"].items())),
             "yes" if row["all_exact"] else "no"] for row in a["audits"]]
    lines += table(["audited under", "audit time", "vs the first", "verdict", "reruns", "judged",
                    "every rerun exact"], rows)
    return lines + (reproducible_cheats(a["cheats"]) if a.get("cheats") else [])


def reproducible_cheats(c: dict) -> list[str]:
    """bench/bench_reproducible.py --audit-cheats: one inner step's 1% and one-ulp cheats judged elsewhere."""
    when = c.get("recorded", {})
    lines = [f"The cheats (bench/repro_cheats.py): the demo's settings with {len(c['replicas'])} replicas "
             f"({', '.join(c['replicas'])}) and "
             f"{c['rounds']} rounds, the cheats in inner step {c['cheat_step']} of round {c['cheat_round']}, "
             f"trained under `{c['trained_under']}` ({c['record_seconds']:.0f} s), each round-0 claim rerun "
             "as the audit reruns it and its next state checked against round 1's claims (recorded "
             f"{when.get('date', '?')} at {when.get('commit', '?')}, load "
             f"{load_text((when.get('load_average') or {}).get('start'))} at start):", ""]

    def cell(row: dict, check: dict) -> str:
        wrong = "" if row["right"][check["kind"]] else " (WRONG)"
        chain = f", chain {check['chain']}" if check["chain"] else ""
        return f"{check['verdict']}{chain}{wrong}"

    rows = [[row["capability"], f"{row['rerun_s']:.1f} s", *(cell(row, check) for check in row["checks"])]
            for row in c["reruns"]]
    return lines + table(["rerun under", "reruns", *c["replicas"]], rows)
