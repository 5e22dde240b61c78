"""Renderers of docs/RESULTS.md for the contracts' arithmetic: the Float32 soft-float fuzzed against torch
(bench/fuzz_float32.py). Numbers come only from the JSON."""

from __future__ import annotations

from results_sections import table


def float32_fuzz(r: dict) -> list[str]:
    """bench/fuzz_float32.py: operands and mismatches per operation and class, and the gas of each."""
    classes = r["classes"]
    rows = []
    for name, op in r["ops"].items():
        gas = op["gas"]
        rows.append([f"`{name}`", f"{op['operands']:,}"] + [f"{op['by_class'].get(kind, 0):,}"
                                                            for kind in classes]
                    + [op["mismatches"], gas["typical_median"], gas["typical_max"], gas["all_classes_mean"],
                       gas["max"]])
    lines = [(f"Every operation of `contracts/src/Float32.sol` on **{r['operands']:,} operands** through "
              f"`Float32Harness` on {r['backend'].split(' ')[0]}, each result compared with the reference "
              f"({r['reference']}) bit for bit, NaN class only for a NaN result: **{r['mismatches']} "
              f"mismatches** in {r['seconds'] / 60:.0f} min. Gas: {r['gas_method']}; `typical` operands "
              "are normal values of "
              "2^-24 .. 2^2 of either sign and the decoder's integers (below 2^53 for `fromInt`, 32767 for "
              "`fromInt32`): what the outer step sees."), ""]
    lines += table(["operation", "operands"] + classes + ["mismatches", "gas typical (median)", "typical max",
                                                          "mean over random, biased, ties", "max"], rows)
    found = [(name, m) for name, op in r["ops"].items() for m in op["first_mismatches"]]
    if found:
        lines += ["First mismatches:", ""] + [
            f"- `{name}` ({m['class']}): a = {m['a']}" + (f", b = {m['b']}" if m["b"] else "")
            + f" gave {m['got']}"
            for name, m in found] + [""]
    return lines


def chunk_state(r: dict) -> list[str]:
    """bench/bench_chunk_state.py: a stage's chunk state built vs. its aggregation, CPU seconds, before and
    after."""
    before = {(row["stage"], row["contributions"]): row for row in r.get("before", {}).get("rows", [])}
    rows = []
    for row in r["rows"]:
        prior = before.get((row["stage"], row["contributions"]))
        rows.append([row["stage"], f"{row['elements']:,}", row["contributions"], f"{row['aggregate_s']:.3f}",
                     f"{prior['state_and_leaf_s']:.3f}" if prior else "-", f"{row['state_and_leaf_s']:.3f}",
                     f"{row['state_over_aggregate']:g}", f"{row['check_fetched_s']:.3f}",
                     {True: "yes", False: "**no**"}.get(row.get("same_stage_leaf_as_before"), "-"),
                     *([f"{row['normed_state_and_leaf_s']:.3f}", f"{row['normed_over_chunked']:g}",
                        f"{row['normed_served_bytes']:,}"] if "normed_state_and_leaf_s" in row
                       else ["-"] * 3)])
    lines = [(f"`{r['preset']}` in {r['stages']} stages, contributions coded by the default encoder at the "
              f"auto byte budget (H = {r['inner_steps']}); CPU seconds of one thread, the least of the "
              "repeats: the aggregation "
              "(training/diloco.py), the stage's chunk state and its stage leaf "
              "(node.commitments.stage_state: chunk leaves, payload pieces, Merkle roots), and a prover's "
              "check of a fetched state against a leaf's roots; the state is version 2's (diloco.commitments "
              "= \"chunked\"), and version 3's (\"normed\", the default: also each contribution's exact sums "
              "of squares and sum tree) beside it, with the norm blob it serves."),
             ""]
    lines += table(["stage", "elements", "contributions", "aggregate s", "state + leaf s (before)",
                    "state + leaf s", "state / aggregate", "check fetched s", "same stage leaf as before",
                    "v3 state + leaf s", "v3 / v2", "v3 norm blob bytes"], rows)
    if r.get("before", {}).get("recorded"):
        rec = r["before"]["recorded"]
        load = (rec.get("load_average") or {}).get("end") or ["?"]
        lines += [f"Before: {r['before'].get('label') or rec.get('commit') or 'an older tree'}, run "
                  f"{rec.get('date', '?')} at load {load[0]:.1f}." if isinstance(load[0], float) else
                  f"Before: {r['before'].get('label') or rec.get('commit') or 'an older tree'}, run "
                  f"{rec.get('date', '?')}.", ""]
    return lines


def forge_invariants(r: dict) -> list[str]:
    """bench/fuzz_forge.py: forge's invariant campaigns over contracts/forge's TrustHandler."""
    rows = [[c["seed"], c["runs"], c["depth"], f"{c['calls']:,}", f"{c['seconds']:.0f}",
             "pass" if c["passed"] else f"FAIL: {c['failure']}"] for c in r["campaigns"]]
    projected = r.get("projected_seconds_for_target")
    ran_on = ([f"Sources: sha256 `{r['sources_digest'][:16]}` over {len(r['sources'])} files (contracts/src "
               "and the campaign's handlers and invariants, each hashed in the JSON); `python "
               "bench/fuzz_forge.py --stale` lists those changed since.", ""]
              if r.get("sources_digest") else [])
    if "merged_from" in r:  # campaigns run apart, a chunk at a time (bench/fuzz_forge.py --merge)
        lines = [(f"forge's invariant campaign (`{r['forge']}`) in the EVM: **{r['calls']:,} calls** "
                  f"({r['runs']} sequences of {'/'.join(map(str, r['depth']))} in {len(r['campaigns'])} "
                  f"campaigns run a chunk at a time on the handlers of {r['campaigns_ran_on']}, "
                  f"{r['campaign_seconds']:.0f} s of campaigns, {r['calls_per_second']} calls/s each), every "
                  f"invariant checked after every call: {'; '.join(r['invariants'])}. "
                  f"**{r['violations']} violations.**"
                  + (f" Short of the {r['target_calls']:,}-call target: at this rate it takes about "
                     f"{projected / 3600:.1f} h of one process's campaign time." if projected else "")), ""]
        return lines + ran_on + table(["seed", "runs", "depth", "calls", "seconds", "verdict"], rows) + [""]
    lines = [(f"forge's invariant campaign (`{r['forge']}`) in the EVM: **{r['calls']:,} calls** "
              f"({r['runs']} sequences of {r['depth']}, {r['jobs']} process(es)) in {r['seconds']:.0f} s "
              f"({r['calls_per_second']} calls/s), every invariant checked after every call: "
              f"{'; '.join(r['invariants'])}. **{r['violations']} violations.**"
              + (f" At this rate {r['target_calls']:,} calls take about {projected / 3600:.1f} h on this "
                 f"machine with {r['jobs']} process(es)." if projected else "")), ""]
    return lines + ran_on + table(["seed", "runs", "depth", "calls", "seconds", "verdict"], rows) + [""]


def forge_pool_invariants(r: dict) -> list[str]:
    """bench/fuzz_forge_pool.py: forge's invariant campaign over contracts/forge's PoolHandler (issue 77)."""
    actors = ", ".join(f"{name} {calls:,}" for name, calls in r["calls_by_actor"].items())
    seeds = ", ".join(c["seed"] for c in r["campaigns"])
    how = (f"{len(r['campaigns'])} campaigns run apart on {r['campaigns_ran_on']}, merged"
           if "merged_from" in r else f"{r['jobs']} process(es) side by side, {r['wall_seconds']:.0f} s wall")
    ran_on = ([f"Sources: sha256 `{r['sources_digest'][:16]}` over {len(r['sources'])} files (contracts/src "
               "and the pool campaign's handler, rounds and invariants, each hashed in the JSON); `python "
               "bench/fuzz_forge_pool.py --stale` lists those changed since.", ""]
              if r.get("sources_digest") else [])
    return [(f"forge's invariant campaign of the reward pool (`{r['forge']}`, seeds {seeds}): "
             f"**{r['calls']:,} calls** ({r['runs']} sequences of {'/'.join(map(str, r['depth']))}; {how}; "
             f"{r['campaign_seconds']:.0f} s of campaigns, {r['calls_per_second']} calls/s a process), every "
             f"invariant checked after every call: {'; '.join(r['invariants'])}. "
             f"**{r['violations']} violations**" + "".join(f" ({f})" for f in r["failures"])
             + f". Calls by actor: {actors}." + _pool_tally(r.get("tally"))), ""] + ran_on


def _pool_tally(tally: dict | None) -> str:
    """What the pool campaign's calls did (bench/fuzz_forge_pool.py's tally), as a sentence."""
    if not tally:
        return ""
    t = {key: f"{value:,}" for key, value in tally.items()}
    return (f" What they did: {t['attestations_paid']} attestations and {t['contributions_paid']} "
            f"contributions paid, {t['contributions_refused']} contribution claims refused (of them "
            f"{t['forged_refused']} of forged entries), {t['overturned_refused']} claims of an overturned "
            f"round and {t['convicted_refused']} of convicted members refused, {t['reentries_refused']} "
            f"token re-entries refused; a round overturned in {t['sequences_overturned']} of "
            f"{t['sequences']} sequences.")


def fraud_proof_bounds(r: dict) -> list[str]:
    """bench/bench_fraud_proof_bounds.py: the worst chunk proof per codec against createRun's bound."""
    rows = [[row["codec"] + (f" rank {row['rank']}" if "rank" in row else ""), row["contributions"],
             f"{row['gas']:,}", f"{row['gas_bound']:,}", f"{row['calldata_bytes']:,}",
             f"{row['calldata_bound']:,}", "yes" if row["bound_holds"] else "**no**"] for row in r["rows"]]
    most = ", ".join(f"rank {rank}: {count}" for rank, count in r["most_contributions"].items())
    lines = [(f"The worst chunk proof (all {r['chunk_elements']} elements of the chunk recomputed) per codec "
              f"on anvil, against the bound `createRun` enforces (at most {r['max_gas']:,} gas and "
              f"{r['max_calldata']:,} bytes of calldata; docs/FRAUD_PROOF.md, \"Bounded proofs\"): the bound "
              f"holds in every row: **{r['bound_holds']}**. Most contributions a run may list: {most}."), ""]
    header = ["codec", "contributions", "gas", "bound", "calldata (B)", "bound (B)", "within"]
    return lines + table(header, rows)


def binding_gas(r: dict) -> list[str]:
    """bench/bench_binding_gas.py: the proofs' gas with each listed contribution bound to a member."""
    rows = [[row["contributions"], f"{row['chunk_gas']:,}", f"{row['scale_gas']:,}",
             f"{row['binding_gas']:,}"] for row in r["rows"]]
    lines = ["Gas on anvil of a version-3 round's proofs once every listed contribution carries its member's "
             "signature (docs/FRAUD_PROOF.md, \"The binding\"): a wrong chunk, a wrong clip scale, and a "
             "contribution signed by no member of the round (the last one listed).", ""]
    return lines + table(["contributions", "chunk proof", "scale proof", "binding proof"], rows)


def step_proof(r: dict) -> list[str]:
    """bench/bench_step_proof.py: the contribution proof's bottom legs (issue 78)."""
    rows, games = [], []
    for preset, entry in r["models"].items():
        trace, game = entry["trace"], entry["games"]
        phases = trace["ops_by_phase"]
        rows.append([preset, trace["ops_per_step"], phases.get("forward", 0), phases.get("backward", 0),
                     phases.get("optimizer", 0), trace["step_seconds"], trace["traced_step_seconds"],
                     "yes" if trace["traced_bits_equal_untraced"] else "NO"])
        product = game["product"]
        proven = product["one_ulp_cheat_proven"] and game["elementwise_add"]["one_ulp_cheat_proven"]
        games.append([preset, product["k"], product["honest_game_moves"], product["move_bound"],
                      "yes" if product["honest_upheld"] else "NO", "yes" if proven else "NO",
                      f"{game['max_gas_any_move']:,}", f"{game['max_calldata_bytes_any_move']:,}"])
    lines = ["One reproducible inner step (kernel version 3) traced: the ops recorded per step (forward "
             "torch functions, autograd nodes' gradients, the optimizer's outputs) and a step's seconds "
             "untraced and traced.", ""]
    lines += table(["model", "ops/step", "forward", "backward", "optimizer", "step s", "traced s",
                    "traced bits = untraced"], rows)
    lines += ["", "StepProver on py-evm: one element of the model's widest product (`k` its inner width), an "
              "honest claim against a challenger that disputes everything, and one-ulp cheats (product and "
              "add) against an honest challenger.", ""]
    lines += table(["model", "k", "moves (honest game)", "bound 2+2ceil(log2 k)+1", "honest upheld",
                    "cheats proven", "max gas / move", "max calldata B / move"], games)
    lines += _tree_sums(r["models"])
    level = r.get("steps_level")
    if level:
        lines += ["", f"All three levels on py-evm on {level['program']} run H = {level['steps']} times "
                  f"(a model's step is not mapped to a program yet): a one-ulp cheat in step "
                  f"{level['cheat_step']} proven: {'yes' if level['one_ulp_cheat_proven'] else 'NO'} "
                  f"({level['cheat_game_moves']} moves); the honest run upheld against a challenger that "
                  f"disputes everything: {'yes' if level['honest_upheld'] else 'NO'} "
                  f"({level['honest_game_moves']} moves, {level['step_halvings']} halvings over the steps); "
                  f"at most {level['max_gas_any_move']:,} gas and {level['max_calldata_bytes_any_move']:,} "
                  "bytes of calldata a move."]
    start = r.get("start_dispute")
    if start:
        moves = start["moves"]
        upheld, refuted = start["honest_upheld"], start["other_start_refuted"]
        lines += ["", "A claim's start disputed element by element (the ledger's StepProver, py-evm): an "
                  f"honest claim upheld: {'yes' if upheld else 'NO'}; a claim from another start refuted by "
                  f"the clock: {'yes' if refuted else 'NO'}; `challengeStart` "
                  f"{moves['challengeStart']['max_gas']:,} gas, `proveStart` "
                  f"{moves['proveStart']['max_gas']:,} gas "
                  f"({moves['proveStart']['max_calldata_bytes']:,} bytes of calldata)."]
    return lines + _end_dispute(r.get("end_dispute")) + _data_dispute(r.get("data_dispute"))


def _tree_sums(models: dict) -> list[str]:
    """The tree sum game's table of the step proof's section (absent in a JSON from before it)."""
    rows = []
    for preset, entry in models.items():
        tree = entry.get("tree_sum")
        if tree:
            proven = tree["one_ulp_node"]["proven"] and tree["wrong_leaf"]["proven"]
            rows.append([preset, tree["rows"], tree["n"], tree["honest_game_moves"], tree["move_bound"],
                         "yes" if tree["honest_upheld"] else "NO", "yes" if proven else "NO",
                         f"{tree['max_gas_any_move']:,}", f"{tree['max_calldata_bytes_any_move']:,}"])
    if not rows:
        return []
    return ["", "The tree sum (`TREESUM`, `training.exact_math.tree_sum`'s tree) of a norm's statistic, the "
            "sum of squares over the model's width of each row of the batch: an honest claim against a "
            "challenger that disputes everything, a one-ulp cheat in one node of the tree and a misread "
            "element against an honest challenger (py-evm; the descent posts a node's two children, checks "
            "their float32 sum and ends at one element).", ""] + table(
        ["model", "rows", "n", "moves (honest game)", "bound 3+2ceil(log2 n)", "honest upheld",
         "cheats proven", "max gas / move", "max calldata B / move"], rows)


def _end_dispute(end: dict | None) -> list[str]:
    """The end dispute's line of the step proof's section (absent in a JSON from before it)."""
    if not end:
        return []
    moves = end["moves"]
    upheld = end["raw_honest_upheld"] and end["quant_honest_upheld"]
    return ["", "A claim's end disputed element by element in a run with the plain end rule (the ledger's "
            f"StepProver, py-evm): honest raw and quant ({end['quant_bits'][0]}-bit) claims upheld: "
            f"{'yes' if upheld else 'NO'}; a true run whose payload is one element off refuted by the clock: "
            f"{'yes' if end['payload_one_element_off_refuted'] else 'NO'}; `challengeEnd` "
            f"{moves['raw']['challengeEnd']['max_gas']:,} gas, `proveEnd` "
            f"{moves['raw']['proveEnd']['max_gas']:,} gas raw and {moves['quant']['proveEnd']['max_gas']:,} "
            f"quant (at most {end['max_calldata_bytes_any_move']:,} bytes of calldata)."]


def _data_dispute(data: dict | None) -> list[str]:
    """The data dispute's line of the step proof's section (absent in a JSON from before it)."""
    if not data:
        return []
    moves, lookup = data["moves"], data["lookup_game"]

    def yes(flag: bool) -> str:
        return "yes" if flag else "NO"

    return ["", "A claim's batches disputed token by token in a run whose data is fixed (the ledger's "
            f"StepProver, py-evm; {data['corpus_tokens']} training ids, batches of {data['rows']} x "
            f"{data['window'] + 1} ids, {data['steps']} steps): an honest claim upheld: "
            f"{yes(data['honest_upheld'])}; a claim on a batch one token off refuted by the clock: "
            f"{yes(data['one_token_off_refuted'])}; a claim committing the run's batches but run on another "
            f"refuted in its step game: {yes(data['other_batch_under_true_root_refuted'])}; `setData` "
            f"{moves['setData']['max_gas']:,} gas, `challengeData` {moves['challengeData']['max_gas']:,}, "
            f"`proveData` {moves['proveData']['max_gas']:,} ({moves['proveData']['max_calldata_bytes']:,} "
            f"bytes of calldata), `openOp` of the batch's lookup {lookup['openOp']['max_gas']:,}; at most "
            f"{data['max_gas_any_move']:,} gas and {data['max_calldata_bytes_any_move']:,} bytes a move."]


_MUTATION_MACHINES = {
    "trust": "the trust machine (tests/trust_machine.py with the pool's actors, tests/trust_pool.py R1-R5, "
             "py-evm)",
    "forge": "the forge pool campaign (contracts/forge PoolInvariants.t.sol, R1-R5)",
    "pool": "the pool's own machine (tests/reward_machine.py P1-P6, py-evm)",
}


def pool_mutations(doc: dict) -> list[str]:
    """bench/fuzz_pool_mutations.py: bugs seeded into RewardPool.sol, each machine's latest run."""
    machines = doc["machines"]
    return [line for machine in sorted(machines) for line in _pool_mutation_run(machines[machine])]


def _pool_mutation_run(r: dict) -> list[str]:
    """One machine's run: each bug against one configuration."""
    size = (f"{r['examples']} sequences x {r['steps']} calls from seed {r['forge_seed']}"
            if r["machine"] == "forge" else f"{r['examples']} examples x {r['steps']} steps, derandomized")
    weights = ", ".join(f"{name} x{weight}" for name, weight in r["weights"].items())
    setting = (f"; moves weighted: {weights}" if weights else "") + (
        f"; pools funded for {r['funding_rounds']} rounds" if r.get("funding_rounds") else "")
    baseline = {"passed": "the unmutated contract passed first", None: "no baseline in this run",
                "failed": "**the unmutated contract FAILED**"}[r["baseline"]]
    verdict = {(True, False): "caught", (False, True): "broken run", (False, False): "**missed**"}
    rows = [[x["mutation"], x["bug"], x["expected"] or "", ", ".join(x["caught_by"]) or "-",
             f"{x['seconds']:.0f}", verdict[x["caught"], x["broken"]] if x["mutation"] != "none"
             else "passed" if verdict[x["caught"], x["broken"]] == "**missed**" else "**FAILED**"]
            for x in r["results"]]
    lines = [(f"Bugs seeded one at a time into a copy of contracts/src/RewardPool.sol, each run against "
              f"{_MUTATION_MACHINES[r['machine']]} in one configuration ({size}{setting}): {baseline}; "
              f"**{r['caught']} of {r['mutants']} caught**, {r['as_expected']} by the invariant meant to "
              f"catch it" + (f"; missed: {', '.join(r['missed'])}" if r["missed"] else "") + "."), ""]
    header = ["mutation", "the bug", "meant to trip", "tripped", "seconds", "verdict"]
    return lines + table(header, rows) + [""]


def step_unary(r: dict) -> list[str]:
    """bench/bench_step_unary.py: the elementwise functions' final step (issue 78)."""
    rows = [[row["kind"], row["function"], row["inputs_tried"], f"{row['worst_input']:.6g}",
             f"{row['function_gas_worst']:,}", f"{row['function_gas_median']:,}",
             f"{row['final_move_gas']:,}", "yes" if row["honest_upheld"] else "NO",
             "yes" if row["one_ulp_cheat_proven"] else "NO"] for row in r["rows"]]
    bound = f"Every move at most {r['max_gas_any_move']:,} gas (bound {r['move_bound']:,})."
    lines = ["StepProver on anvil: per op, the gas of `Float64Functions.unary` (estimated, a direct call) "
             "at each candidate input, the costliest one put in a one-element op, an honest claim of it "
             "upheld and a claim one ulp off proven; `openOutput` is the final move (it recomputes the "
             f"function). {bound}", ""]
    return lines + table(["kind", "function", "inputs", "costliest input", "function gas (costliest)",
                          "function gas (median)", "final move gas", "honest upheld", "cheat proven"], rows)
