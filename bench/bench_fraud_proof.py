"""Gas of the on-chain fraud proof of a wrong aggregation (issue 43; docs/FRAUD_PROOF.md), on a real anvil.

For 4, 16 and 64 aggregated contributions, and the most a run may list at the codec's rank
(``ledger.runparams.most_contributions``: createRun refuses a run whose worst proof could exceed 10M gas or
128 KiB of calldata, docs/FRAUD_PROOF.md "Bounded proofs"), for each codec (raw, quant 8-bit, low-rank 8-bit
at ranks 8 and 32), a stage (a 256 x 256 matrix and a bias) is aggregated by training/diloco.py listing
every contribution (:func:`aggregated`: an honest node lists at most 6, a quorum's round as many as the run
allows), round 1 is committed with the worst proof's change, and the successful ``proveWrongAggregation`` of
that chunk is sent; its ``gasUsed`` (and calldata bytes) go to ``bench/results/fraud_proof.json``. The worst
proof (:func:`worst_case`, bench/fraud_proof_setup.py, shared with bench/bench_fraud_proof_bounds.py): the
chunk's last element changed, so all 64 elements are recomputed (the rows before issue 62's review changed
the eighth: the contract stops at the first element that differs, so they understated the worst case 3 to
4.2 times, bench/results/fraud_proof.json's history), and every contribution's scale other than 1.0 (every
fourth is made large so the norm rule clips it; the others are committed with 1 + 2^-52, which changes no
value), so the float64 product is taken for every element of every piece. Each run is created with
``maxContributions`` the count and ``maxRank`` the codec's rank; a count createRun refuses is recorded as
refused (with the bound's gas and bytes), not sent.

The norm proof (``proveWrongNorm``, docs/FRAUD_PROOF.md "The clip scales") of the same stage in a version-3
run (``diloco.commitments = "normed"``): ``norm_rows`` holds, for each codec and count, the gas of a proof
that a committed clip scale is not the norm rule of the committed sums (a clipped contribution committed with
1.0; the scales of every contribution are recomputed) and of a proof that one chunk's committed sum of squares
is not its piece's (a low leaf of the clipped contribution, its tree consistent with it), and ``version_gas``:
the proof that a normed run's round committed version-2 factors (the run's version, ``RunParams.commitments``;
the same round with its norm commitment dropped: no sum is decoded, only the factors' layout is read).

The data-availability challenge (docs/FRAUD_PROOF.md, "The data-availability challenge") of a right version-3
round of the same stage: ``availability_rows`` holds, for each codec and count, the gas of
``challengeAvailability`` and of the committers' ``answerChallenge`` for each kind of leaf: a weights leaf
(``which = 0``), a contribution's payload piece (``2 + j``), a leaf of its sum tree (``2 + M + j``), the
stage's factors (``FACTORS``) and the stage leaf (``STAGE_LEAF``); ``j`` is the clipped contribution, the
chunk 5. Then
``expire_gas``: a sum-tree leaf's challenge left unanswered past ``accusationBlocks`` and settled with
``expireChallenge`` (the round overturned, its two attesters slashed, the challenger paid).

    nice -n 10 python bench/bench_fraud_proof.py
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, write_result  # noqa: E402
from bench.fraud_proof_setup import (CHUNK_ELEMENTS, LAST_ELEMENT, ONE, STAKE, aggregated,  # noqa: E402
                                     anvil_url, blobs_of, prove_chunk, rank_of, refusal, run_values,
                                     worst_case)
from ledger.chain import connect_rpc  # noqa: E402
from ledger.availability import (FACTORS, MOMENTUM, PAYLOAD, STAGE_LEAF, WEIGHTS,  # noqa: E402
                                 availability_answer, availability_target, stage_leaf_answer,
                                 stage_leaf_target, sums_which)
from ledger.runparams import most_contributions  # noqa: E402
from node.commitments import scheme_named  # noqa: E402
from tests.fraud_fixtures import DILOCO, commit, lied_sum, with_scale  # noqa: E402
from tests.ledger_fixtures import deploy, mine  # noqa: E402

SHAPES = {"a.weight": (256, 256), "b.bias": (256,)}
CODECS = (("raw", {}), ("quant", {"bits": 8}), ("lowrank", {"bits": 8, "rank": 8}),
          ("lowrank", {"bits": 8, "rank": 32}))
GOAL = 10_000_000  # the goal at 16 contributions
NORMED = dataclasses.replace(DILOCO, commitments="normed")


def measure(url: str, codec: str, options: dict, count: int) -> dict:
    row = {"codec": codec, **options, "contributions": count}
    refused = refusal(options, count)
    if refused:
        return {**row, "clipped": None, **refused}
    round_ = aggregated(SHAPES, blobs_of(SHAPES, codec, options, count))
    chunk = 5  # a full chunk of a.weight
    row["clipped"] = sum(bits != ONE for bits in round_.honest.factors.scale_bits)
    wrong = worst_case(round_.honest, chunk)
    return {**row, **prove_chunk(url, round_, wrong, chunk, run_values(options, count))}


def measure_norm(url: str, codec: str, options: dict, count: int) -> dict:
    row = {"codec": codec, **options, "contributions": count}
    round_ = aggregated(SHAPES, blobs_of(SHAPES, codec, options, count), NORMED)
    clipped, values = 3, run_values(options, count)  # the first large one
    assert round_.honest.factors.scale_bits[clipped] != ONE
    for kind, wrong, proof_of in (
            ("scale_gas", with_scale(round_.honest, clipped, ONE), lambda c: c.scale_proof()),
            ("sum_gas", lied_sum(round_.honest, clipped, 5, -1), lambda c: c.sum_proof(clipped, 5))):
        committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, wrong,
                           stake=STAKE, values=values)
        try:
            row[kind] = committed.prover().prove_wrong_norm(proof_of(committed))["gasUsed"]
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            row[kind], row[f"{kind}_error"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    version_two = dataclasses.replace(round_.honest, factors=dataclasses.replace(round_.honest.factors,
                                                                                 norms=None),
                                      sum_trees=[])
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, version_two,
                       stake=STAKE, commitments=scheme_named("normed").version, values=values)
    try:
        row["version_gas"] = committed.prover().prove_wrong_norm(committed.scale_proof())["gasUsed"]
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        row["version_gas"], row["version_gas_error"] = None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def _last_gas(w3) -> int:
    """The gas of the transaction just mined (anvil mines one a block; ``challenge_availability`` returns an
    id)."""
    block = w3.eth.get_block("latest")
    return w3.eth.get_transaction_receipt(block["transactions"][-1])["gasUsed"]


def measure_availability(url: str, codec: str, options: dict, count: int) -> dict:
    round_ = aggregated(SHAPES, blobs_of(SHAPES, codec, options, count), NORMED)
    clipped, chunk = 3, 5
    committed = commit(deploy(connect_rpc(url, timeout=60.0), min_stake=STAKE), round_, round_.honest,
                       stake=STAKE, values=run_values(options, count))
    state = committed.states[1]  # as committed: its factors bound to the members (issue 62)
    challenger, committer = committed.prover(), committed.deployment.client(2)
    w3 = committed.deployment.w3
    row = {"codec": codec, **options, "contributions": count}
    accepted = len(state.payload_leaves)
    kinds = (("weights", WEIGHTS, chunk), ("momentum", MOMENTUM, chunk),
             ("payload", PAYLOAD + clipped, chunk), ("sums", sums_which(accepted, clipped), chunk),
             ("factors", FACTORS, 0), ("stage_leaf", STAGE_LEAF, 0))
    for name, which, leaf_chunk in kinds:
        try:
            if which == STAGE_LEAF:
                target = stage_leaf_target(committed.records[1], 0)
                answer = stage_leaf_answer(committed.stages[1], 0)
            else:
                target = availability_target(committed.records[1], committed.stages[1], state.factors, 0,
                                             which, leaf_chunk)
                answer = availability_answer(state, which, leaf_chunk)
            challenge = challenger.challenge_availability(target)
            row[f"{name}_challenge_gas"] = _last_gas(w3)
            row[f"{name}_answer_gas"] = committer.answer_challenge(challenge, *answer)["gasUsed"]
            row[f"{name}_answer_bytes"] = len(answer[0])
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    # every answered challenge leaves the round standing
    assert challenger.invalid_from(committed.run_id) is None
    try:
        challenge = challenger.challenge_availability(availability_target(
            committed.records[1], committed.stages[1], state.factors, 0, sums_which(accepted, clipped),
            chunk + 1))
        mine(w3, challenger.run_info(committed.run_id).accusation_blocks)
        row["expire_gas"] = challenger.expire_challenge(challenge)["gasUsed"]
        assert challenger.invalid_from(committed.run_id) == 1
    except Exception as exc:  # noqa: BLE001 - recorded, not hidden
        row["expire_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def counts_of(counts: list[int], options: dict) -> list[int]:
    """The asked counts and the most a run of the codec may list."""
    return sorted({*counts, most_contributions(rank_of(options))})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="4,16,64", help="aggregated contributions per case (4 or more)")
    parser.add_argument("--out", default=default_out(__file__))
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    started = time.monotonic()
    kinds = {"rows": measure, "norm_rows": measure_norm, "availability_rows": measure_availability}
    result = {name: [] for name in kinds}
    with anvil_url() as url:
        for name, measure_ in kinds.items():
            for codec, options in CODECS:
                for count in counts_of(counts, options):
                    if name != "rows" and refusal(options, count):  # the chunk proof's rows record it
                        continue
                    result[name].append(measure_(url, codec, options, count))
                    print(result[name][-1], flush=True)
    at16 = [row["gas"] for row in result["rows"] if row["contributions"] == 16 and row["gas"] is not None]
    result = {"chunk_elements": CHUNK_ELEMENTS, "changed_element": LAST_ELEMENT,
              "shapes": {k: list(v) for k, v in SHAPES.items()}, **result,
              "most_contributions": {str(rank_of(options)): most_contributions(rank_of(options))
                                     for _codec, options in CODECS},
              "goal_gas_at_16": GOAL, "max_gas_at_16": max(at16) if at16 else None,
              "seconds": round(time.monotonic() - started, 1)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
