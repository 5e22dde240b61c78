"""The trust model's stateful fuzzer at length (issue 41): tests/trust_machine.py for a time budget.

Honest founders, a coalition below the quorum fraction and outsiders act in any order against the real
TrainingLedger; every invariant of docs/TRUST.md is checked after every step. Runs batches of examples until
``--seconds`` have passed (or ``--examples``), then writes ``bench/results/trust_fuzz.json``: examples, steps
(invariant checks after a step), steps per second, and any counterexample (exit 1 if one was found).

    nice -n 10 python bench/fuzz_trust.py --seconds 3600 --backend anvil

A counterexample is shrunk before it is reported, which can take many minutes; ``--no-shrink`` reports it as
found (longer, but the result is written at once).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from bench.benchio import default_out, write_result  # noqa: E402
from tests.trust_machine import MOVE_WEIGHTS, TrustMachine  # noqa: E402


def count_moves(machine) -> Counter:
    """Count every rule hypothesis draws and runs (its name -> times), wrapping each rule's function once:
    the seeded run's step statistics, which show a move never drawn (issue 79: the leave race and F were not,
    before their weights)."""
    drawn: Counter = Counter()
    # a weighted move is one Rule listed several times (tests/trust_machine.py MOVE_WEIGHTS): wrap it once
    for rule in {id(rule): rule for rule in machine.setup_state().rules}.values():
        function = rule.function

        @functools.wraps(function)
        def counted(self, *args, _function=function, **kwargs):
            drawn[_function.__name__] += 1
            return _function(self, *args, **kwargs)

        rule.function = counted
    return drawn


def result_of(args, batches: int, steps: int, seconds: float, cpu_seconds: float, counterexample: str,
              drawn: Counter) -> dict:
    """The run's result: its size and speed, counterexample, the machine's tallies and the moves drawn."""
    return {
        "backend": args.backend, "log_index": not args.no_log_index, "seed": args.seed, "batches": batches,
        "examples": TrustMachine.examples,
        "steps": steps, "steps_per_example_max": args.steps, "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),  # this process's: comparable across loads, where seconds is not
        "steps_per_second": round(steps / seconds, 2) if seconds else 0.0,
        "counterexamples": [counterexample] if counterexample else [], "shrunk": not args.no_shrink,
        "invariants": ["I1 safety", "I2 no harm", "I3 credit", "I4 stake back", "I5 finality", "I6 solvency",
                       "I7 fraud proof", "S1 a lied sum falls once walked", "S2 no harm in a captured run",
                       "S3 the walker's reward", "G1-G3 the walk's game (issue 62)",
                       "H no honest attester slashed", "F nothing final before the chain's isFinal",
                       "W an honest walk completes within its proof window",
                       "R1 credits within the pool",
                       "R2 no credit for an overturned round or a convicted member",
                       "R3 a claim pays once", "R4 the pool's balance is funded minus claimed",
                       "R5 a re-entrant token's calls refused"],
        "proofs_refused": TrustMachine.proofs_refused,
        "norm_proofs_refused": TrustMachine.norm_proofs_refused,
        "challenges_answered": TrustMachine.challenges_answered,
        # the sum-tree walks (tests/trust_sums.py, S1-S3)
        "sum_walks_proven": TrustMachine.sum_walks_proven,
        "sum_walks_expired": TrustMachine.sum_walks_expired, "sum_walks_cut": TrustMachine.sum_walks_cut,
        "junk_answers_refused": TrustMachine.junk_answers_refused,
        "mistaken_walks": TrustMachine.mistaken_walks,
        # issue 79's moves: a contributor's leave racing the commit, a squatter copying the walk's challenges,
        # pull's and audit's finality read while a challenge is open
        "leave_races": TrustMachine.leave_races, "squats": TrustMachine.squats,
        "squats_refused": TrustMachine.squats_refused,
        "squats_answered_in_the_last_block": TrustMachine.squats_answered_late,
        "finality_reads": TrustMachine.finality_reads,
        "finality_reads_open": TrustMachine.finality_reads_open,
        # how often hypothesis drew each move (rule), every rule named, 0 included
        "moves_drawn": {name: drawn[name] for name in
                        sorted({rule.function.__name__ for rule in TrustMachine.setup_state().rules})},
        "move_weights": MOVE_WEIGHTS,
        # the reward pools' actors (tests/trust_pool.py, R1-R5)
        "pool_claims_paid": TrustMachine.pool_claims_paid,
        "pool_claims_refused": TrustMachine.pool_claims_refused,
        "pool_convicted_claims_refused": TrustMachine.pool_convicted_refused,
        "pool_overturned_claims_refused": TrustMachine.pool_overturned_refused,
        "pool_reentries_refused": TrustMachine.pool_reentries_refused,
        "pool_funds": TrustMachine.pool_funds, "pool_sweeps": TrustMachine.pool_sweeps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0,
                        help="time budget (batches start until it is spent)")
    parser.add_argument("--examples", type=int, default=0,
                        help="stop after this many examples (0: time only)")
    parser.add_argument("--steps", type=int, default=100, help="steps per example")
    parser.add_argument("--batch", type=int, default=5,
                        help="examples per hypothesis run (at least 2: a run's first example is hypothesis' "
                             "simplest, every step the first rule by name)")
    parser.add_argument("--backend", choices=("pyevm", "anvil"), default="pyevm")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report a counterexample as found, unshrunk (hypothesis may shrink one for many "
                             "minutes; with this, a run under a wall-clock limit still writes its result)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed hypothesis (batch i draws with seed + i), so that runs are comparable; "
                             "default: random")
    parser.add_argument("--no-log-index", action="store_true",
                        help="let py-evm's getLogs read its whole range at every query (tests/pyevm_logs.py: "
                             "by default each block's logs are read once), to compare")
    parser.add_argument("--out", default=default_out("trust_fuzz.py"))
    args = parser.parse_args()
    if args.batch < 2:
        parser.error(f"--batch {args.batch}: at least 2 (a hypothesis run's first example is its simplest, "
                     "every step the first rule by name, a_block_passes: such batches fuzz nothing)")
    # The walker is the live node's prover: it logs each step of a walk at ERROR, thousands of times here.
    logging.basicConfig(level=logging.CRITICAL)
    TrustMachine.log_index = not args.no_log_index
    load = list(os.getloadavg())
    anvil = None
    if args.backend == "anvil":
        from ledger.chain import connect_rpc
        from ledger.anvil import AnvilProcess

        anvil = AnvilProcess()
        url = anvil.start()
        TrustMachine.chain = staticmethod(lambda: connect_rpc(url, timeout=30.0))
    drawn = count_moves(TrustMachine)
    started, cpu_started = time.monotonic(), time.process_time()
    counterexample = ""
    batches = 0
    try:
        while time.monotonic() - started < args.seconds \
                and (not args.examples or TrustMachine.examples < args.examples):
            TrustMachine.TestCase.settings = settings(
                max_examples=args.batch, stateful_step_count=args.steps, deadline=None, database=None,
                suppress_health_check=list(HealthCheck),
                phases=[p for p in Phase if p not in ((Phase.shrink, Phase.explain) if args.no_shrink
                                                      else ())])
            # a fixed seed per batch (hypothesis' @seed): the same examples in every run with this seed
            TrustMachine._hypothesis_internal_use_seed = None if args.seed is None else args.seed + batches
            batches += 1
            try:
                TrustMachine.TestCase().runTest()
            except Exception as exc:  # a counterexample: hypothesis shrank it and printed the steps
                counterexample = f"{type(exc).__name__}: {exc}"
                break
    finally:
        if anvil is not None:
            anvil.stop()
    seconds, cpu_seconds = time.monotonic() - started, time.process_time() - cpu_started
    steps = TrustMachine.checks - TrustMachine.examples
    result = result_of(args, batches, steps, seconds, cpu_seconds, counterexample, drawn)
    path = write_result(args.out, result, load)
    print(f"{TrustMachine.examples} examples, {steps} steps in {seconds:.0f} s ({result['steps_per_second']}"
          f"/s), {len(result['counterexamples'])} counterexample(s) -> {path}")
    return 1 if counterexample else 0


if __name__ == "__main__":
    sys.exit(main())
