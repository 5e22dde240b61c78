"""A run that carries nothing between rounds (issue 78; docs/FRAUD_PROOF.md "The claim's end"):
``training.inner_state = "fresh"`` (each round's inner optimizer new) and ``diloco.put_back = false`` (a
left-out update dropped, not put back into the next round's target).

What is tested, on in-memory runs of the node's own engines and trainers (training/reexec_sim.py) in the
reproducible mode: a fresh-state contribution reruns bit-exactly and its next start state chains (it holds no
inner-optimizer state); a replica that keeps its moments anyway is a mismatch when rerun; a straggler whose
update is dropped reruns and chains, and a verifier that would put it back finds the chain broken. The end
relation (training/end_relation.py) holds for every element of every fresh contribution against
``program_end`` from the committed start alone, under the plain schedule (no delay), and breaks for the
replica that carries its moments and for a run with the one-step delay (why the end rule refuses both). The
node's own worker clears its inner optimizers at a round's start under "fresh" only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import NEW_RUN_COMPRESSION, CompressionConfig
from training.data import generated_corpus, round_batches
from training.end_relation import end_relation, program_end
from training.muon import optimizer_prefixes
from training.reexec import EXACT, MISMATCH, STATE_MISMATCH, check_state_chain, verify_contribution
from training.reexec_sim import (
    CarriedStateReplica,
    SimConfig,
    SimReplica,
    StragglerReplica,
    run_with_states,
)
from training.stages import merge_state_dicts

ROUNDS, H = 3, 3
HONEST, STRAGGLER, CARRIER = range(3)


def _sim(one_step_delay: bool) -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2, reproducible=True, inner_state="fresh"),
        diloco=DilocoConfig(inner_steps=H, num_replicas=3, one_step_delay=one_step_delay, put_back=False),
        # a new run's codec without low-rank pieces (every tensor quantized): what the plain end rule takes
        compression=CompressionConfig(**NEW_RUN_COMPRESSION, min_compress_numel=1 << 30),
        num_stages=2,
        rounds=ROUNDS,
    )


def _run(one_step_delay: bool):
    sim = _sim(one_step_delay)
    replicas = [SimReplica(HONEST, sim), StragglerReplica(STRAGGLER, sim)]
    if not one_step_delay:
        replicas.append(CarriedStateReplica(CARRIER, sim))
    return sim, run_with_states(replicas, sim)


@pytest.fixture(scope="module")
def plain():
    return _run(one_step_delay=False)


@pytest.fixture(scope="module")
def delayed():
    return _run(one_step_delay=True)


def _check(sim, records, replica, outer_round, diloco=None, **kwargs):
    record = records[outer_round]
    previous = records[outer_round - 1].contributions if outer_round > 0 else None
    return verify_contribution(
        [part.to_bytes() for part in record.states[replica].stages], record.claims[replica], sim.corpus,
        sim.model, sim.training, diloco or sim.diloco, sim.compression, outer_round=outer_round,
        replica=replica, run_rounds=sim.rounds, previous_contributions=previous, **kwargs)


def _inner_state(state) -> list[str]:
    prefixes = tuple(optimizer_prefixes())
    return [name for part in state.stages for name in part.tensors if name.startswith(prefixes)]


@pytest.mark.parametrize("schedule", ["plain", "delayed"])
def test_a_fresh_contribution_reruns_exactly_and_its_state_chains(request, schedule):
    sim, records = request.getfixturevalue(schedule)
    for outer_round in range(ROUNDS):
        assert _inner_state(records[outer_round].states[HONEST]) == []  # every round starts fresh
    for outer_round in range(ROUNDS - 1):
        check = _check(sim, records, HONEST, outer_round)
        assert check.verdict == EXACT, check.reason
        # under the delay the rerun names the next state (with no inner-optimizer state), and it chains
        assert (check.next_state_hashes is not None) == (schedule == "delayed")
        if check.next_state_hashes is not None:
            claimed = [c.state_hash for c in records[outer_round + 1].claims[HONEST]]
            assert check_state_chain(check.next_state_hashes, claimed) == EXACT


def test_a_replica_that_keeps_its_moments_in_a_fresh_run_is_a_mismatch(plain):
    sim, records = plain
    assert _check(sim, records, CARRIER, 0).verdict == EXACT  # round 0: nothing carried yet
    for outer_round in range(1, ROUNDS):
        assert _inner_state(records[outer_round].states[CARRIER])  # it commits its moments
    check = _check(sim, records, CARRIER, 1)
    assert check.verdict == MISMATCH, check.reason


def test_a_straggler_whose_update_is_dropped_reruns_and_chains(delayed):
    sim, records = delayed
    both = range(sim.num_stages)
    assert all(len(payloads) == 1 for payloads in records[0].contributions.values())  # its round 0 left out
    for part in records[2].states[STRAGGLER].stages:  # nothing put back: its residual stays zero
        assert all(not torch.any(t) for t in part.group("residual").values())
    claimed = [c.state_hash for c in records[2].claims[STRAGGLER]]
    check = _check(sim, records, STRAGGLER, 1, previous_dropped=both)
    assert check.verdict == EXACT, check.reason
    assert check_state_chain(check.next_state_hashes, claimed) == EXACT
    # a verifier that put the update back (the default) would find the honest straggler's chain broken
    put_back = dataclasses.replace(sim.diloco, put_back=True)
    blind = _check(sim, records, STRAGGLER, 1, diloco=put_back, previous_dropped=both)
    assert check_state_chain(blind.next_state_hashes, claimed) == STATE_MISMATCH


def _committed(state) -> dict[str, torch.Tensor]:
    """The full model's global weights a start state holds (the committed weights of the round they are)."""
    return merge_state_dicts([part.group("global") for part in state.stages])


def _relation(sim, records, replica, outer_round, start):
    """Each stage's end relation of ``replica``'s round-``outer_round`` payload against the program's end
    from ``start`` alone."""
    batches = round_batches(sim.corpus, sim.training.seed, replica, outer_round, H, sim.training.batch_size,
                            sim.model.block_size)
    end = program_end(sim.model, sim.training, start, batches, outer_round, H, sim.rounds * H, sim.num_stages)
    relations = []
    for claim, part in zip(records[outer_round].claims[replica], records[outer_round].states[replica].stages):
        names = list(part.group("global"))
        relations.append(end_relation({n: start[n] for n in names}, {n: end[n] for n in names},
                                      claim.payload))
    return relations


def test_the_end_relation_holds_for_every_element_from_the_committed_start(plain):
    sim, records = plain
    for outer_round in range(ROUNDS):
        for replica in (HONEST, STRAGGLER):
            # without the delay a round's start state is taken after round t-1's outer step: its global
            # weights are the committed start (round 0: the initial weights)
            start = _committed(records[outer_round].states[replica])
            for relation in _relation(sim, records, replica, outer_round, start):
                assert relation.holds, (outer_round, replica, relation.broken)
                assert relation.unchecked == 0 and relation.checked.get("quant", 0) > 0


def test_carried_moments_or_the_delay_break_the_relation(plain, delayed):
    sim, records = plain
    start = _committed(records[1].states[CARRIER])
    assert not all(r.holds for r in _relation(sim, records, CARRIER, 1, start))
    sim, records = delayed
    # under the delay round 1 trains from the replica's own end of round 0, not from round 0's committed
    # weights (which round 2's start state holds as its global weights: it is taken before round 1's apply)
    start = _committed(records[2].states[HONEST])
    assert not all(r.holds for r in _relation(sim, records, HONEST, 1, start))


@pytest.mark.parametrize("inner_state", ["fresh", "carry"])
def test_the_node_worker_clears_its_inner_optimizers_at_a_round_start_only_when_fresh(inner_state):
    """node/live/worker/replica.py ``begin_round`` (the contributor calls it before it captures a round's
    start state): every held stage's inner optimizer emptied under "fresh", kept under "carry"."""
    from node.config import load_config
    from node.live.worker.replica import ReplicaWorker

    cfg = load_config(None, ["model.preset=tiny", "pipeline.num_stages=2", "diloco.inner_steps=2",
                             "training.batch_size=2", f"training.inner_state={inner_state}"])
    worker = ReplicaWorker(cfg, replica=0, stages=(0, 1), rank=0)
    worker.start(30.0, 30.0)
    try:
        worker.train_round(0)
        held = [optimizer.state for optimizer in worker.trainer.optimizers]
        assert all(len(state) > 0 for state in held)
        assert worker.begin_round(1) == (inner_state == "fresh")
        assert all((len(state) == 0) == (inner_state == "fresh") for state in held)
    finally:
        worker.close()
