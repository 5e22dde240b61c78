"""Benchmark: re-execution spot checks (issue 13) on a simulated run.

Three in-memory runs (training/reexec_sim.py; the node's round order, default
node.toml DiLoCoX settings: one-step delay "rebase", error-budget codec 0.4
with error feedback), every contribution of every round re-executed:

(a) honest: M replicas trained on 1 torch thread; each (replica, round) rerun on
    1 thread (expected bit-exact) and on 2 threads (not bit-exact: the
    distribution of honest distances sets the tolerance); plus a replica trained
    as a split 2-stage pipeline (GPipe, 2 micro-batches) rerun chained, with and
    without the pipeline's micro-batch arithmetic;
(b) cheaters (other data, half the inner steps, 1% perturbation of the update
    norm, a forged start state): each rerun; detection per check, then the
    detection probability per round and expected rounds until ejection at the
    chosen sampling rate;
(c) cost: rerun time against a member's own round time, the always-on cost of
    capturing and hashing the start state, and the state's size.

    PYTHONPATH=. .venv/bin/python bench/bench_reexec.py            # mini, M=3, H=20, 3 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.benchio import default_corpus  # noqa: E402
from training.config import DilocoConfig, ModelConfig, TrainingConfig  # noqa: E402
from training.config_compression import CompressionConfig  # noqa: E402
from training.data import load_corpus  # noqa: E402
from training.model import count_params  # noqa: E402
from training.reexec import (  # noqa: E402
    DEFAULT_TOLERANCE,
    EXACT,
    MISMATCH,
    STATE_MISMATCH,
    check_state_chain,
    contribution_distance,
    reexecute,
    verify_contribution,
)
from training.reexec_sim import (  # noqa: E402
    ForgedStateReplica,
    HalfStepsReplica,
    OtherDataReplica,
    PerturbedReplica,
    SimConfig,
    SimReplica,
    run_with_states,
)
from training.replica_state import ReplicaStartState  # noqa: E402
from training.stages import split_stages, stage_param_shapes  # noqa: E402

CHEATS = {"other_data": OtherDataReplica, "half_steps": HalfStepsReplica, "perturbed_1pct": PerturbedReplica,
          "forged_start_state": ForgedStateReplica}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None,
                        help="corpus, relative to the repository root (default: tinyshakespeare as "
                             "'dlx-node data fetch tinyshakespeare' keeps it, fetched if missing)")
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--replicas", type=int, default=3, help="honest replicas of run (a)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--inner-steps", type=int, default=20, help="H (node.toml default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--checks-per-contribution", type=float, default=0.1,
                        help="expected verifiers per contribution per round: rate = this / (members - 1)")
    parser.add_argument("--confirmations", type=int, default=2, help="k: verifiers that must agree to eject")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "reexec.json"))
    args = parser.parse_args()
    if args.data is None:
        args.data = default_corpus()
    return args


def check_all(sim, records, replicas, threads, tolerance):
    """verify_contribution of every (replica, round), plus the chain check into the next round."""
    out = []
    for record in records:
        previous = records[record.outer_round - 1].contributions if record.outer_round > 0 else None
        for replica in replicas:
            check = verify_contribution(
                [p.to_bytes() for p in record.states[replica].stages], record.claims[replica], sim.corpus,
                sim.model, sim.training, sim.diloco, sim.compression, outer_round=record.outer_round,
                replica=replica, run_rounds=sim.rounds, previous_contributions=previous, threads=threads,
                tolerance=tolerance,
            )
            chain = None
            if record.outer_round + 1 < len(records) and check.next_state_hashes is not None:
                claimed = [c.state_hash for c in records[record.outer_round + 1].claims[replica]]
                chain = check_state_chain(check.next_state_hashes, claimed)
            out.append({"round": record.outer_round, "replica": replica, "threads": threads,
                        "verdict": check.verdict, "chain": chain,
                        "distance": max(check.distances.values(), default=None),
                        "seconds": check.reexec_seconds})
            print(f"  round {record.outer_round} replica {replica} threads {threads}: {check.verdict:<16} "
                  f"distance {out[-1]['distance']!s:<24} chain {chain}", flush=True)
    return out


def detection(rate: float, verifiers: int, per_check: float, k: int) -> dict:
    """Per-round detection and expected rounds to ejection of a member cheating every round."""
    p_one = rate * per_check  # a given verifier samples and catches it
    p_any = 1 - (1 - p_one) ** verifiers
    p_k = sum(math.comb(verifiers, j) * p_one ** j * (1 - p_one) ** (verifiers - j)
              for j in range(k, verifiers + 1))
    return {
        "verifiers": verifiers, "rate": rate, "p_detect_per_round": p_any,
        # Rule A: the first verifier's signed evidence triggers a rerun by the others (k agree that round).
        "expected_rounds_to_ejection_triggered": 1 / p_any if p_any else math.inf,
        # Rule B: k verifiers must have sampled it independently in the same round.
        f"p_{k}_independent_per_round": p_k,
        "expected_rounds_to_ejection_independent": 1 / p_k if p_k else math.inf,
    }


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    started_all = time.perf_counter()
    model = ModelConfig(preset=args.preset)
    training = TrainingConfig(data_path=args.data, batch_size=args.batch_size, warmup_steps=args.warmup_steps)
    corpus = load_corpus(REPO / args.data, training.eval_fraction, model.block_size)

    def sim_for(replicas: int, rounds: int, micro_batches: int = 0) -> SimConfig:
        return SimConfig(corpus, model, training,
                         DilocoConfig(inner_steps=args.inner_steps, num_replicas=replicas),
                         CompressionConfig(), args.stages, rounds, micro_batches)

    # (a) honest
    print(f"(a) honest: {args.replicas} replicas x {args.rounds} rounds, claimants on 1 thread", flush=True)
    sim = sim_for(args.replicas, args.rounds)
    honest_records = run_with_states([SimReplica(r, sim) for r in range(args.replicas)], sim)
    honest = [check for threads in (1, 2)
              for check in check_all(sim, honest_records, range(args.replicas), threads, args.tolerance)]
    print("(a) split pipeline: 2 replicas x 2 rounds with 2 micro-batches, rerun chained", flush=True)
    split_sim = sim_for(2, 2, micro_batches=2)
    split_records = run_with_states([SimReplica(r, split_sim) for r in range(2)], split_sim)
    split = check_all(split_sim, split_records, range(2), 1, args.tolerance)
    split_plain = []
    for record in split_records:  # the same start states, rerun as if the replica had not been split
        previous = split_records[record.outer_round - 1].contributions if record.outer_round > 0 else None
        for replica, state in record.states.items():
            plain = ReplicaStartState(tuple(
                dataclasses.replace(part, meta=dataclasses.replace(part.meta, micro_batches=0))
                for part in state.stages))
            rerun = reexecute(plain, corpus, model, training, split_sim.diloco, split_sim.compression,
                              previous_contributions=previous)
            specs = split_stages(model.n_layer, args.stages)
            split_plain.append({"round": record.outer_round, "replica": replica, "distance": max(
                contribution_distance(claim.payload, rerun.payloads[claim.stage_index],
                                      stage_param_shapes(model, specs[claim.stage_index]),
                                      stage_index=claim.stage_index, outer_round=record.outer_round)
                for claim in record.claims[replica])})

    # (b) cheaters, all cheating every round
    print(f"(b) cheaters {list(CHEATS)} x {args.rounds} rounds", flush=True)
    cheat_sim = sim_for(len(CHEATS), args.rounds)
    cheaters = [cls(index, cheat_sim) for index, cls in enumerate(CHEATS.values())]
    cheat_records = run_with_states(cheaters, cheat_sim)
    cheat_checks = [check for threads in (1, 2)
                    for check in check_all(cheat_sim, cheat_records, range(len(CHEATS)), threads,
                                           args.tolerance)]

    # Summaries
    honest_2 = [c["distance"] for c in honest if c["threads"] == 2]
    false_accusations = sum(1 for c in honest + split if c["verdict"] in (MISMATCH, STATE_MISMATCH)
                            or c["chain"] == STATE_MISMATCH)
    cheats = {}
    for index, name in enumerate(CHEATS):
        mine = [c for c in cheat_checks if c["replica"] == index]
        caught = [c for c in mine if c["verdict"] == MISMATCH or c["chain"] == STATE_MISMATCH]
        # The forged state is seen through the chain, which
        # needs round t+1's claim: the last round cannot tell.
        checkable = [c for c in mine if name != "forged_start_state" or c["chain"] is not None]
        cheats[name] = {
            "checks": len(checkable), "caught": len([c for c in caught if c in checkable]),
            "min_distance": min((c["distance"] for c in mine if c["verdict"] == MISMATCH), default=None),
            "verdicts": sorted({c["verdict"] for c in mine}),
            "chain": sorted({str(c["chain"]) for c in mine}),
        }
    per_check = min(c["caught"] / c["checks"] for c in cheats.values())

    train_per_replica_round = sum(r.train_seconds + r.encode_seconds for r in honest_records) / (
        args.replicas * args.rounds)
    capture_per_replica_round = sum(r.capture_seconds for r in honest_records) / (args.replicas * args.rounds)
    rerun_1 = statistics.mean(c["seconds"] for c in honest if c["threads"] == 1)
    state_bytes = honest_records[-1].states[0].num_bytes
    costs = {
        "member_round_seconds": train_per_replica_round, "rerun_seconds": rerun_1,
        "rerun_over_round": rerun_1 / train_per_replica_round,
        "capture_and_hash_seconds": capture_per_replica_round,
        "capture_share": capture_per_replica_round / train_per_replica_round,
        "state_bytes_per_replica_round": state_bytes,
    }
    sampling = {}
    for members in sorted({args.replicas, 8, 16, 32}):
        rate = min(1.0, args.checks_per_contribution / (members - 1))
        expected_reruns = rate * (members - 1)
        sampling[members] = {
            **detection(rate, members - 1, per_check, args.confirmations),
            "reruns_per_verifier_per_round": expected_reruns,
            "verifier_overhead_share": expected_reruns * costs["rerun_over_round"] + costs["capture_share"],
        }

    print()
    print(f"model {args.preset} ({count_params(model):,} params), S={args.stages}, H={args.inner_steps}, "
          f"batch {args.batch_size}x{model.block_size}, rounds {args.rounds}, tolerance {args.tolerance:g}")
    exact_1 = sum(1 for c in honest if c["threads"] == 1 and c["verdict"] == EXACT)
    print(f"honest, rerun on 1 thread (same as claimant): {exact_1}/{len(honest_2)} bit-exact; chain "
          f"{sum(1 for c in honest if c['chain'] == EXACT)}/{sum(1 for c in honest if c['chain'])} exact")
    print(f"honest, rerun on 2 threads: distance min {min(honest_2):.3g} median "
          f"{statistics.median(honest_2):.3g} max {max(honest_2):.3g}; verdicts "
          f"{sorted({c['verdict'] for c in honest if c['threads'] == 2})}")
    print(f"split pipeline rerun chained with micro-batches: {[c['verdict'] for c in split]}; "
          f"without: max distance {max(c['distance'] for c in split_plain):.3g}")
    print(f"false accusations: {false_accusations}")
    print(f"{'cheat':<20} {'caught':>8} {'min distance':>14}  verdicts / chain")
    for name, row in cheats.items():
        distance = f"{row['min_distance']:.3g}" if row["min_distance"] is not None else "-"
        print(f"{name:<20} {row['caught']:>3}/{row['checks']:<4} {distance:>14}  "
              f"{row['verdicts']} {row['chain']}")
    print(f"member round {costs['member_round_seconds']:.2f} s, rerun {costs['rerun_seconds']:.2f} s "
          f"({costs['rerun_over_round']:.2f}x), capture+hash {costs['capture_and_hash_seconds']:.3f} s "
          f"({100 * costs['capture_share']:.1f}%), state {state_bytes / 1e6:.1f} MB per replica-round")
    print(f"{'members':>7} {'rate':>7} {'P(detect)/round':>16} {'E[rounds] triggered':>20} "
          f"{'E[rounds] k=' + str(args.confirmations) + ' indep.':>20} {'overhead':>9}")
    for members, row in sampling.items():
        print(f"{members:>7} {row['rate']:>7.4f} {row['p_detect_per_round']:>16.3f} "
              f"{row['expected_rounds_to_ejection_triggered']:>20.1f} "
              f"{row['expected_rounds_to_ejection_independent']:>20.0f} "
              f"{100 * row['verifier_overhead_share']:>8.1f}%")

    out = {
        "args": vars(args),
        "platform": {"python": platform.python_version(), "torch": torch.__version__,
                     "machine": platform.machine(), "cpus": os.cpu_count()},
        "num_params": count_params(model),
        "honest": {"checks": honest, "split_pipeline": split,
                   "split_pipeline_without_microbatches": split_plain,
                   "distance_2_threads": {"min": min(honest_2), "median": statistics.median(honest_2),
                                          "max": max(honest_2)},
                   "false_accusations": false_accusations},
        "cheats": cheats, "cheat_checks": cheat_checks, "costs": costs, "sampling": sampling,
        "wall_seconds": time.perf_counter() - started_all,
    }
    path = REPO / args.out
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1, default=str))
    os.replace(tmp, path)
    print(f"wrote {path} in {out['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
