"""Renderers of docs/RESULTS.md for verification: re-execution and its cross-platform calibration, the
byzantine and split spot checks, the trust fuzzer and the fraud proof. Split from :mod:`results_sections`,
whose formatting helpers these share; numbers come only from the JSON."""

from __future__ import annotations

from results_sections import mb, num, pct, table


def reexec(r: dict) -> list[str]:
    h, c = r["honest"], r["costs"]
    exact = sum(1 for x in h["checks"] if x["threads"] == 1 and x["verdict"] == "exact")
    one = sum(1 for x in h["checks"] if x["threads"] == 1)
    d2 = h["distance_2_threads"]
    rows = [["honest reruns on the member's thread count", f"{exact}/{one} bit-exact"],
            ["honest reruns on 2 threads: distance min / median / max",
             f"{d2['min']:.1e} / {d2['median']:.1e} / {d2['max']:.1e} (tolerance {r['args']['tolerance']})"],
            ["false accusations", h["false_accusations"]]]
    for name, cheat in r["cheats"].items():
        rows.append([f"cheat: {name.replace('_', ' ')}", f"caught {cheat['caught']}/{cheat['checks']}"])
    rows += [["a rerun against the member's own round", f"{c['rerun_over_round']:.2f}x"],
             ["capturing and hashing the start state", f"{100 * c['capture_share']:.1f}% of a round"],
             ["start state per replica and round", mb(c["state_bytes_per_replica_round"])]]
    sampling = [[m, f"{s['rate']:.4f}", f"{s['p_detect_per_round']:.3f}",
                 f"{s['expected_rounds_to_ejection_triggered']:.1f}",
                 f"{100 * s['verifier_overhead_share']:.1f}%"]
                for m, s in r["sampling"].items()]
    a = r["args"]
    return [(f"`{a['preset']}`, {a['stages']} stages, H = {a['inner_steps']}, {a['replicas']} replicas x "
            f"{a['rounds']} rounds, every contribution re-executed (training/reexec_sim.py)."), ""] + table(
        ["measure", "value"], rows) + [f"At {a['checks_per_contribution']} expected checks per contribution:",
                                       ""] + table(
        ["members", "rate per verifier", "P(detect) per round", "expected rounds to an accusation",
         "verifier overhead"], sampling)


def byzantine(r: dict) -> list[str]:
    runs = r["runs"]
    honest = next((x["held_out"] for x in runs if x["attack"] == "honest"), None)
    s = r["settings"]
    sliced = s.get("exchange") == "sliced"
    rows = []
    for x in runs:
        text = str(x.get("audit", ""))
        verdict = next((w for w in ("PASSED", "INCOMPLETE", "FAILED") if w in text), "see JSON")
        arch = x.get("archive") or {}
        row = [x["attack"], x.get("attest_quorum", "1"), len(x.get("honest_exits_nonzero", [])),
               f"{arch.get('rounds_with_attacker', '-')}/{arch.get('rounds_sealed', '-')}"
               f" ({arch.get('rounds_attacker_excluded', '-')} excluded)" if arch else "-",
               num(x.get("held_out")), pct(x["held_out"] / honest - 1) if honest and x.get("held_out")
               else "",
               verdict]
        if sliced:  # the audit may name the attacker (a wrong partial), and the spot checks accuse it
            charged = x.get("accusations") or {}
            row += [{True: "yes", False: "no"}.get((x.get("audit") or {}).get("names_attacker"), "-"),
                    f"{charged['opened']}/{charged['guilty']}" if "opened" in charged else "-"]
        if s.get("reexecute"):  # --reexecute: reruns by status, and each guilty ejection's judgement
            found = (x.get("audit") or {}).get("reexecution") or {}
            row += [", ".join(f"{n} {status}" for status, n in sorted(found.get("reruns", {}).items()))
                    or "-",
                    ", ".join(e["status"] for e in found.get("ejections", [])) or "-"]
        rows.append(row)
    adversary = "sliced_adversary" if sliced else "adversary"
    if sliced:
        note = (
            f" `diloco.exchange = \"sliced\"`, `spot_checks = {s.get('spot_checks')}` (of partials and of "
            f"contributions), `p2p.transfer_timeout = {s.get('transfer_timeout')}`; the "
            "close and hello attacks "
            "are `tests/adversary.py`'s; the audit reads every node's archive. A wrong partial is applied "
            "alike by every holder and caught after the fact: the audit FAILs naming its signer, and the "
            "holders' spot checks of partials accuse it on chain. A sliced run leaves a bad slice out per "
            "slice (the aggregator's report), so `excluded` stays 0. Accusations opened near the end of "
            "these 3-round runs mostly stay open: the nodes stop with the run before enough "
            "verdicts are signed.")
        if s.get("reexecute"):
            note += (f" The audit ran with `--reexecute {s['reexecute']}`: it reruns "
                     "contributions from the archives "
                     "(a rerun that does not reproduce FAILs unless its member was found guilty on chain) "
                     "and judges every guilty accusation's evidence, a sliced proof (wrong partial, bad "
                     "bundle) by the members' rule (node/tools/audit_slicedproof.py): ok = the "
                     "ejection is justified.")
    else:
        note = (" Rows without k ran at the script's default of the time, k = 1 (one member alone can "
                "commit; the censoring coordinator then commits its own record and the audit fails it); with "
                "k = 2, the default now, that attack is refused.")
    return [(f"A real local run per attack (anvil, {s['replicas']} one-node replicas of `{s['preset']}`, H = "
            f"{s['inner_steps']} x {s['rounds']} rounds), the last replica `tests/{adversary}"
            ".py` with that attack; "
            "held-out loss of the final checkpoint, then `dlx-node audit`." + note), ""] + table(
        [f"attack (1 of {s['replicas']} replicas)", "k", "honest nodes exiting non-zero",
         "attacker in the close (excluded)", "held-out", "vs honest", "audit",
         *(["audit names the attacker", "accusations of it (guilty)"] if sliced else []),
         *([f"reruns (--reexecute {s['reexecute']})", "ejections judged"] if s.get("reexecute") else [])],
        rows)


def split_spotchecks(r: dict) -> list[str]:
    rows = [[name, d["sampled"], len(d["checks"]), len(d["not_done"]), ", ".join(sorted(set(d["verdicts"])))
             or "-",
             f"{d['check_s_per_round']:.0f} s", f"{d['round_wall_s_mean']:.0f} s"]
            for name, d in sorted(r["nodes"].items())]
    a = r["audit"]
    return [(f"Re-execution spot checks on a split cluster (one stage per node): a `dlx-node demo` of "
             f"{r['rounds_committed']} committed rounds; each check fetches the other stages' "
             "envelopes and reruns "
             "the whole pipeline. Checks run in a worker process beside training, so seconds per round are "
             "the time spent checking, not a slowdown."), ""] + table(
        ["node", "drawn", "done", "not done", "verdicts", "checking per round", "round wall time"], rows) + [
        (f"`dlx-node audit --reexecute all` over the four archives: **{a['verdict']}**, "
         f"{a['by_status'].get('ok', 0)} of {a['reexecution_items']} reruns reproduced; accusations in the "
         f"run: {r['accusations']}."), ""] + ([
        ("Drawn: `node.live.checks.routing.draw_checks`, the node's own draw, over each round's recorded "
         f"signers and their platforms as declared on chain ({len(set(r['declared_platforms'].values()))} "
         f"platform(s) among {len(r['declared_platforms'])} members; "
         f"{sum(d['sampled_routed'] for d in r['nodes'].values())} checks "
         "drawn by the routed draw alone)."), ""] if "declared_platforms" in r else [])


def gpu_calibration(r: dict) -> list[str]:
    e, a = r["environment"], r["args"]

    def g(x):  # distances span 0 to 1e-7 to 0.1: three significant digits
        return "-" if x is None else f"{x:.3g}"
    rows = []
    for precision, d in r["summary"].items():
        rows.append([precision, g(d["same_platform_max"]), g(d["other_threads_max"]),
                     g(d["other_device_max"]), g(d["other_precision_max"]), g(d["cheat_min"]),
                     f"{d['cheats_below_tolerance']} of {d['cheats']}", "none"
                     if d["tolerance_in_force"] is None else g(d["tolerance_in_force"]),
                     _zones_cell(d.get("rule_cheats")),
                     _zones_cell(d.get("rule_honest_cross"))])
    return [
        (f"Largest relative distance between a contribution and its honest rerun, by what differs, and the "
         f"smallest a 1% cheat reached: `{a['preset']}` ({r['model_params']:,} parameters), {a['seeds']} "
         f"seeds x {a['rounds']} rounds of H = {a['inner_steps']}, devices measured: {e['device']} "
         f"(GPUs: {e['gpus']})."), ""] + table(
        ["precision", "same platform", "other threads", "other device", "other precision", "smallest cheat",
         "cheats within the mismatch bound", "mismatch bound", "cheats under the three zones",
         "honest cross-platform under the three zones"], rows) + [
        "Three zones (issue 42, training.fingerprint.compare_rerun): a rerun on another platform passes up "
        "to the pass bound (1e-4), is a mismatch beyond the mismatch bound, and is undecided between (no "
        "verdict, nobody accused, needs a verifier of the claimant's platform). Cells: passed / undecided / "
        "mismatch.", ""]


def _zones_cell(zones: dict | None) -> str:
    if not zones:
        return "-"
    return f"{zones['exact'] + zones['within_tolerance']} / {zones['undecided']} / {zones['mismatch']}"


def trust_fuzz(r: dict) -> list[str]:
    found = r["counterexamples"]
    return [(f"The trust model's stateful fuzzer (tests/trust_machine.py) on {r['backend']}: **{r['steps']:,}"
             f" steps** in {r['examples']} examples (at most {r['steps_per_example_max']} steps each), "
             f"{r['seconds']:.0f} s ({r['steps_per_second']} steps/s); invariants checked after every step: "
             f"{', '.join(r['invariants'])}. "
             + ("Counterexamples: " + "; ".join(f"`{c}`" for c in found) if found else "No counterexample.")
             + (f" Sum-tree walks (tests/trust_sums.py): {r['sum_walks_proven']} proven, "
                f"{r['sum_walks_expired']} expired, {r.get('sum_walks_cut', 0)} cut by the dispute window, "
                f"{r['junk_answers_refused']} junk answers refused, {r['mistaken_walks']} mistaken "
                "walks (nobody slashed)."
                if "sum_walks_proven" in r else "")
             + (f" Issue 79's moves: {r['leave_races']} leave races with the commit, {r['squats']} walk "
                f"challenges squatted ({r['squats_answered_in_the_last_block']} copies answered in their "
                f"last block), {r['finality_reads']} finality reads of pull and audit "
                f"({r['finality_reads_open']} with a challenge open)." if "squats" in r else "")
             + (f" Reward pools (tests/trust_pool.py): {r['pool_claims_paid']} claims paid, "
                f"{r['pool_claims_refused']} refused ({r['pool_convicted_claims_refused']} of a convicted "
                f"member, {r['pool_overturned_claims_refused']} of an overturned round), "
                f"{r['pool_reentries_refused']} re-entries refused, {r['pool_funds']} top-ups, "
                f"{r['pool_sweeps']} sweeps."
                if "pool_claims_paid" in r else "")
             + (" Moves drawn (weights: " + ", ".join(f"{k} x{v}" for k, v in r["move_weights"].items())
                + "): " + ", ".join(f"{k} {v}" for k, v in r["moves_drawn"].items()) + "."
                if "moves_drawn" in r else "")
             + (f" Seed {r['seed']} ({r['batches']} batches), {r['cpu_seconds']:.0f} CPU s, getLogs "
                f"{'indexed' if r['log_index'] else 'unindexed'} (tests/pyevm_logs.py)."
                if r.get("seed") is not None else "")), ""]


def fraud_proof(r: dict) -> list[str]:
    def codec(row: dict) -> str:
        rank = f", rank {row['rank']}" if "rank" in row else ""
        return f"{row['codec']}{' ' + str(row['bits']) + '-bit' if 'bits' in row else ''}{rank}"

    rows = [[codec(row), row["contributions"], "" if row.get("clipped") is None else row["clipped"],
             f"{row['gas']:,}" if row["gas"] else row["error"],
             f"{row['calldata_bytes']:,}" if "calldata_bytes" in row else ""] for row in r["rows"]]
    worst = (f" (the worst: element {r['changed_element']} changed, so every element is recomputed, and"
             " every contribution's scale other than 1.0)" if "changed_element" in r else "")
    lines = table(["codec", "contributions", "clipped", "gas", "calldata bytes"], rows) + [
        f"One proof of one {r['chunk_elements']}-element chunk{worst}; at 16 contributions the most is "
        f"**{r['max_gas_at_16']:,} gas** (goal: under {r['goal_gas_at_16']:,}).", ""]
    if r.get("norm_rows"):
        def gas(row: dict, kind: str) -> str:
            return f"{row[kind]:,}" if row.get(kind) else row.get(f"{kind}_error", "")

        with_version = any("version_gas" in row for row in r["norm_rows"])
        norm = [[codec(row), row["contributions"], gas(row, "scale_gas"), gas(row, "sum_gas")]
                + ([gas(row, "version_gas")] if with_version else []) for row in r["norm_rows"]]
        lines += ["The norm proof of a version-3 round (`proveWrongNorm`, docs/FRAUD_PROOF.md \"The clip "
                  "scales\"): a clipped contribution committed with scale 1.0 (the scales recomputed from "
                  "the committed sums), and one chunk's committed sum of squares one unit off (its piece "
                  "decoded and squared)"
                  + (", and version-2 factors committed in a normed run (the run's version, "
                     "`RunParams.commitments`: no sum decoded)" if with_version else "") + ":", ""]
        lines += table(["codec", "contributions", "wrong scale: gas", "wrong chunk sum: gas"]
                       + (["wrong version: gas"] if with_version else []), norm) + [""]
    if r.get("availability_rows"):
        kinds = (("weights", "weights leaf"), ("payload", "payload piece"), ("sums", "sum-tree leaf"),
                 ("factors", "factors"), ("stage_leaf", "stage leaf"))

        def pair(row: dict, kind: str) -> str:
            if f"{kind}_error" in row:
                return row[f"{kind}_error"]
            return (f"{row[kind + '_challenge_gas']:,} / {row[kind + '_answer_gas']:,} "
                    f"({row[kind + '_answer_bytes']:,} B)")

        available = [[codec(row), row["contributions"], *(pair(row, kind) for kind, _name in kinds)]
                     for row in r["availability_rows"]]
        lines += ["The data-availability challenge of a right version-3 round (docs/FRAUD_PROOF.md, \"The "
                  "data-availability challenge\"): `challengeAvailability` / the committers' "
                  "`answerChallenge` gas (and the published leaf's bytes) for each kind of leaf; the "
                  "momentum leaf costs as the weights leaf (in the JSON):", ""]
        lines += table(["codec", "contributions", *(name for _kind, name in kinds)], available) + [""]
        expired = [row["expire_gas"] for row in r["availability_rows"] if row.get("expire_gas")]
        if expired:
            lines += [
                f"A sum-tree leaf's challenge left unanswered and settled (`expireChallenge`: the round "
                f"overturned, its two attesters slashed, the challenger paid): {min(expired):,}"
                + (f" - {max(expired):,}" if max(expired) != min(expired) else "") + " gas.", ""]
    return lines


def exact_triton(r: dict) -> list[str]:
    """bench/bench_exact_triton.py on a lent GPU: the reproducible mode's kernels and steps there against
    its CPU, bit for bit."""
    e = r["environment"]
    kernels = [[name.removesuffix("_kernels"), f"{d['identical']} of {d['calls']}"]
               for name, d in r.items() if name.endswith("_kernels") and "calls" in d]
    passes = [[name.removesuffix("_forward_backward"), "yes" if d["loss_identical"] else "no",
               f"{d['grads_identical']} of {d['grads']}"]
              for name, d in r.items() if name.endswith("_forward_backward") and "grads" in d]
    steps = [[name.rsplit("_two_inner_steps_v", 1)[0], name.rsplit("_v", 1)[1], d["cpu"], d["cuda"],
              "yes" if d["identical"] else "no"]
             for name, d in r.items() if "_two_inner_steps_v" in name and "cpu" in d]
    sqrt = [[dtype, f"{d['cpu_differs']:,} of {d['of']:,}", f"{d['cuda_differs']:,} of {d['of']:,}"]
            for dtype, d in r.get("sqrt_rounding", {}).items()]
    times = [[f"{d['preset']} / {d['optimizer']}", d["tokens_per_step"], f"{d['eager_fp32_s'] * 1e3:.1f}",
              f"{d['exact_v3_s'] * 1e3:.1f}", f"{d['slowdown']:.2f}x"]
             for name, d in r.items() if name.startswith("step_time_") and "slowdown" in d]
    products = [["x".join(map(str, d["shape"])), f"{d['triton_ordered_ms']:.3f}", f"{d['torch_fp32_ms']:.3f}",
                 f"{d['slowdown']:.2f}x"] for d in r.get("timing", [])]
    return [
        (f"{e['device']} (torch {e['torch']}, CUDA {e['cuda']}, Triton {e['triton']}) against its own CPU "
         f"(CPU side: {e['cpu_reference']}; numba {e.get('numba')} installed there). Cases `preset@48`: "
         f"n_embd 48 and batch 3 (means over counts that are not powers of two)."), ""] + table(
        ["kernel calls of", "identical on the GPU"], kernels) + table(
        ["forward and backward", "loss identical", "gradients identical"], passes) + table(
        ["two inner steps", "kernel version", "CPU digest", "GPU digest", "identical"], steps) + table(
        ["square root", "torch on the CPU: not correctly rounded", "torch on the GPU: not correctly rounded"],
        sqrt) + table(
        ["inner step (batch 8)", "tokens", "eager float32 ms", "reproducible v3 ms", "cost"], times) + table(
        ["product", "Triton ordered ms", "torch float32 ms (TF32 off)", "cost"], products) + [""]
