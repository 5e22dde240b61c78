"""Re-execution spot checks: an honest contribution reruns bit-exactly (another process, a split
pipeline rerun chained), within the tolerance on another thread count; each cheat of issue 13 is caught.

One run of five tiny replicas (H = 3, 2 rounds, 2 stages, one torch thread) serves most
tests: replica 0 is honest, 1 trains on other data, 2 runs half the inner steps, 3 adds
a 1% perturbation to its update, 4 commits a start state with its error-feedback debt
dropped (from round 1).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from training.config import DilocoConfig, ModelConfig, TrainingConfig
from training.config_compression import CompressionConfig
from training.data import generated_corpus
from training.errors import ReplicaStateError
from training.hashing import stage_weights_hash
from training.reexec import (
    DATA_MISMATCH,
    DEFAULT_TOLERANCE,
    EXACT,
    MISMATCH,
    STATE_MISMATCH,
    WITHIN_TOLERANCE,
    ContributionClaim,
    check_state_chain,
    reexecute,
    restart_state_reason,
    sample_replicas,
    start_global_round,
    verify_contribution,
)
from training.reexec_sim import (
    ForgedStateReplica,
    HalfStepsReplica,
    OtherDataReplica,
    PerturbedReplica,
    SimConfig,
    SimReplica,
    StragglerReplica,
    run_with_states,
)
from training.hashing import stage_weights_hash
from training.replica_state import ReplicaStartState, parse_stage_state
from training.replica_capture import initial_replica_state

ROUNDS = 3
HONEST, OTHER_DATA, HALF_STEPS, PERTURBED, FORGED_STATE, STRAGGLER = range(6)


def _sim() -> SimConfig:
    return SimConfig(
        corpus=generated_corpus(seed=0, n_bytes=30_000),
        model=ModelConfig(preset="tiny"),
        training=TrainingConfig(seed=3, batch_size=4, warmup_steps=2),
        diloco=DilocoConfig(inner_steps=3, num_replicas=6),
        compression=CompressionConfig(min_compress_numel=512),
        num_stages=2,
        rounds=ROUNDS,
    )


@pytest.fixture(scope="module")
def run():
    sim = _sim()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the claimants train on one thread (their start states record it)
    try:
        replicas = [SimReplica(HONEST, sim), OtherDataReplica(OTHER_DATA, sim),
                    HalfStepsReplica(HALF_STEPS, sim), PerturbedReplica(PERTURBED, sim),
                    ForgedStateReplica(FORGED_STATE, sim), StragglerReplica(STRAGGLER, sim)]
        records = run_with_states(replicas, sim)
    finally:
        torch.set_num_threads(threads)
    return sim, records


def _check(sim, records, replica, outer_round, **kwargs):
    record = records[outer_round]
    previous = records[outer_round - 1].contributions if outer_round > 0 else None
    parts = kwargs.pop("parts", None) or [part.to_bytes() for part in record.states[replica].stages]
    claims = kwargs.pop("claims", None) or record.claims[replica]
    return verify_contribution(
        parts, claims, sim.corpus, sim.model, sim.training, sim.diloco, sim.compression,
        outer_round=outer_round, replica=replica, run_rounds=sim.rounds, previous_contributions=previous,
        **kwargs,
    )


def test_start_state_bytes_are_canonical_and_parsed_strictly(run):
    _, records = run
    part = records[1].states[HONEST].stages[1]
    data = part.to_bytes()
    parsed = parse_stage_state(data)
    assert parsed.to_bytes() == data and parsed.state_hash() == part.state_hash()
    assert parsed.meta.outer_round == 1 and parsed.meta.threads == 1 and parsed.meta.micro_batches == 0
    # Every group the rerun reads is there: weights, AdamW moments, engine state, residual, pending snapshot.
    groups = {name.split("/", 1)[0] for name in parsed.tensors}
    assert {"param", "adam.exp_avg", "adam.exp_avg_sq", "adam.step", "global", "momentum", "residual",
            "round_start", "round_end.0"} <= groups
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert parse_stage_state(bytes(flipped)).state_hash() != part.state_hash()
    for bad in (data[:-1], data + b"\0", b"x" + data[1:]):
        with pytest.raises(ReplicaStateError):
            parse_stage_state(bad)


def test_start_state_bytes_serialise_the_engine_in_place_and_captures_are_copies():
    """The node serialises a start state on the spot without copying the engine's tensors (gigabytes at
    llama-124m): the same bytes as a capture; a capture kept for later stays what it was."""
    from training.pipeline import LocalReplicaTrainer
    from training.reexec import round_meta
    from training.replica_capture import capture_engine_part, capture_trainer_part, start_state_bytes
    from training.stage_engine import StageEngine

    model, training = ModelConfig(preset="tiny"), TrainingConfig(seed=3, batch_size=2, warmup_steps=0)
    diloco, compression = DilocoConfig(inner_steps=1), CompressionConfig(min_compress_numel=512)
    trainer = LocalReplicaTrainer(model, training, num_stages=1)
    module, optimizer = trainer.stage_modules[0], trainer.optimizers[0]
    engine = StageEngine(0, dict(module.named_parameters()), diloco, compression)
    x = torch.randint(0, model.vocab_size, (2, model.block_size), generator=torch.Generator().manual_seed(0))
    trainer.train_step(x, x)
    engine.encode_contribution(0)  # the engine now holds a round's snapshots and a residual
    meta = round_meta(1, 0, model, diloco, run_rounds=2, num_stages=1)
    part = capture_trainer_part(module, optimizer)
    captured = capture_engine_part(meta, engine, part)
    before = captured.to_bytes()
    assert start_state_bytes(meta, engine, part) == before
    for tensor in [*engine.global_weights.values(), *engine.compressor.residual.values()]:
        tensor.add_(1.0)  # the engine changes afterwards, in place
    assert captured.to_bytes() == before
    assert start_state_bytes(meta, engine, part) != before


def test_honest_contributions_reexecute_bit_exactly_and_chain(run):
    sim, records = run
    for outer_round in range(ROUNDS):
        check = _check(sim, records, HONEST, outer_round)
        assert check.verdict == EXACT, check.reason
        assert check.distances == {0: 0.0, 1: 0.0}
    first = _check(sim, records, HONEST, 0)
    assert check_state_chain(first.next_state_hashes, [c.state_hash for c in records[1].claims[HONEST]]) \
        == EXACT


REEXEC_IN_SUBPROCESS = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from test_training_reexec import _sim
    from training.reexec import verify_contribution
    case = torch.load(sys.argv[1], weights_only=False)
    sim = _sim()
    check = verify_contribution(case["parts"], case["claims"], sim.corpus, sim.model, sim.training,
                                sim.diloco, sim.compression, outer_round=1, replica=0, run_rounds=sim.rounds,
                                previous_contributions=case["previous"])
    print(check.verdict, max(check.distances.values()))
    """
)


def test_honest_contribution_reexecutes_bit_exactly_in_another_process(run, tmp_path):
    _, records = run
    case = tmp_path / "case.pt"
    torch.save({"parts": [p.to_bytes() for p in records[1].states[HONEST].stages],
                "claims": records[1].claims[HONEST], "previous": records[0].contributions}, case)
    out = subprocess.run(
        [sys.executable, "-c", REEXEC_IN_SUBPROCESS, str(case), os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()
    assert out == [EXACT, "0.0"]


def test_another_thread_count_stays_within_the_tolerance(run):
    sim, records = run
    check = _check(sim, records, HONEST, 1, threads=2)
    # Measured: not bit-exact (reductions split over threads), ~1e-6..1e-5 on this tiny run.
    assert check.verdict in (EXACT, WITHIN_TOLERANCE), check.reason
    assert max(check.distances.values()) < DEFAULT_TOLERANCE / 10


@pytest.mark.parametrize("cheater", [OTHER_DATA, HALF_STEPS, PERTURBED])
def test_each_training_cheat_is_a_mismatch(run, cheater):
    sim, records = run
    # Rounds 0 and 1 (on this 3-step tiny run the 1% perturbation of round 2 lands at a distance
    # of 0.6%, under the tolerance: below it, only a bit-exact comparison could tell). Since issue 42 the
    # perturbation is drawn by the portable generator: its round-1 distance is 1.8e-2 (it was above 2e-2
    # with torch.randn's draw), so only "above the tolerance" is a property of the cheat, not "twice it".
    for outer_round in range(2):
        check = _check(sim, records, cheater, outer_round)
        assert check.verdict == MISMATCH, (cheater, outer_round, check.reason)
        assert max(check.distances.values()) > DEFAULT_TOLERANCE


def test_a_forged_start_state_breaks_the_chain(run):
    sim, records = run
    # Round 0 was honest: it reruns exactly, and says which state round 1 must start from.
    check = _check(sim, records, FORGED_STATE, 0)
    assert check.verdict == EXACT
    claimed = [c.state_hash for c in records[1].claims[FORGED_STATE]]
    assert check_state_chain(check.next_state_hashes, claimed) == STATE_MISMATCH
    # Trained honestly from the forged state, round 1 itself reruns exactly: only the chain shows it.
    assert _check(sim, records, FORGED_STATE, 1).verdict == EXACT


def test_a_straggler_whose_update_was_left_out_reruns_exactly(run):
    sim, records = run
    # Its round-0 update is not in the close: the node put it back into the residual when it
    # applied round 0 (during round 1; after round 1's encode at this H), so round 2 starts from it.
    assert all(len(payloads) == 5 for payloads in records[0].contributions.values())
    both = range(sim.num_stages)
    check = _check(sim, records, STRAGGLER, 1, previous_dropped=both)
    assert check.verdict == EXACT, check.reason
    claimed = [c.state_hash for c in records[2].claims[STRAGGLER]]
    assert check_state_chain(check.next_state_hashes, claimed) == EXACT
    # A verifier that did not model it would find the honest straggler's chain broken.
    blind = _check(sim, records, STRAGGLER, 1)
    assert check_state_chain(blind.next_state_hashes, claimed) == STATE_MISMATCH


def test_a_restart_from_the_record_is_a_valid_start_but_a_forged_one_is_not(run):
    sim, records = run
    # A node that restarts enters from the chain-verified global weights of the last applied round:
    # fresh optimizer, zero residual, nothing pending (training.stage_engine.StageEngine.rebase).
    state = records[2].states[HONEST]
    restarted = SimReplica(HONEST, sim)
    for engine, part in zip(restarted.engines, state.stages):
        engine.rebase(part.group("global"), part.group("momentum"), part.engine_counters[1] - 1)
    fresh = restarted.start_state(2)
    parts = [p.to_bytes() for p in fresh.stages]
    hashes = fresh.stage_hashes()
    applied = start_global_round(sim.diloco, 2)
    committed = {applied: {p.stage_index: stage_weights_hash(p.group("global")) for p in state.stages}}
    assert restart_state_reason(parts, hashes, committed, applied) is None
    # ... but not with another round's global weights, nor with the chained state of a live replica,
    # nor with the forger's (zero residual, AdamW moments kept).
    wrong = {applied: {s: b"\0" * 32 for s in committed[applied]}}
    assert "on record" in restart_state_reason(parts, hashes, wrong, applied)
    assert "carries state" in restart_state_reason([p.to_bytes() for p in state.stages], state.stage_hashes())
    forged = records[2].states[FORGED_STATE]
    assert "carries state" in restart_state_reason([p.to_bytes() for p in forged.stages],
                                                   forged.stage_hashes())
    assert "not the committed one" in restart_state_reason(parts, list(reversed(hashes)))
    # Live weights moved away from the round start (trained before committing "a restart") are refused.
    moved = SimReplica(HONEST, sim)
    for engine, part in zip(moved.engines, state.stages):
        engine.rebase(part.group("global"), part.group("momentum"), part.engine_counters[1] - 1)
    with torch.no_grad():
        next(iter(moved.engines[0].params.values())).add_(1e-3)
    bad = moved.start_state(2)
    assert "differ from the round-start" in restart_state_reason([p.to_bytes() for p in bad.stages],
                                                                 bad.stage_hashes())


def test_without_the_delay_a_rerun_reproduces_but_names_no_next_state():
    # Round t is applied after its own encode, from round t's close, which a rerun is not given:
    # the contribution is checked, the chain is not (next_state_hashes None, never a false link).
    sim = dataclasses.replace(_sim(), diloco=DilocoConfig(inner_steps=3, num_replicas=2,
                                                          one_step_delay=False))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        records = run_with_states([SimReplica(0, sim), SimReplica(1, sim)], sim)
    finally:
        torch.set_num_threads(threads)
    check = _check(sim, records, 0, 1)
    assert check.verdict == EXACT, check.reason
    assert check.next_state_hashes is None


def test_served_state_and_data_commitment_must_match_the_envelope(run):
    sim, records = run
    state = records[1].states[HONEST]
    other = records[1].states[HALF_STEPS]  # a real state, but not the committed one
    parts = [state.stages[0].to_bytes(), other.stages[1].to_bytes()]
    assert _check(sim, records, HONEST, 1, parts=parts).verdict == STATE_MISMATCH
    wrong_data = [dataclasses.replace(c, data_commitment=b"\0" * 32) for c in records[1].claims[HONEST]]
    assert _check(sim, records, HONEST, 1, claims=wrong_data).verdict == DATA_MISMATCH
    garbage = [dataclasses.replace(c, payload=b"\x80") if c.stage_index == 1 else c
               for c in records[1].claims[HONEST]]
    check = _check(sim, records, HONEST, 1, claims=garbage)
    assert check.verdict == MISMATCH and check.distances[1] == float("inf")


def test_sampling_is_a_public_function_at_the_rate():
    record = bytes(range(32))
    picks = [sample_replicas(record, b"peer-a", r, range(10), 0.2, own_replica=3) for r in range(400)]
    share = sum(len(p) for p in picks) / (400 * 9)
    assert 0.16 < share < 0.24
    assert all(3 not in p for p in picks)
    assert picks[7] == sample_replicas(record, b"peer-a", 7, range(10), 0.2, own_replica=3)
    others = [sample_replicas(record, b"peer-b", r, range(10), 0.2, own_replica=3) for r in range(400)]
    assert others != picks
    assert sample_replicas(record, b"peer-a", 1, range(10), 0.0) == []
    assert sample_replicas(record, b"peer-a", 1, range(10), 1.0) == list(range(10))


PIPELINE_STAGE = textwrap.dedent(
    """
    import dataclasses, sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, sys.argv[5])
    from test_training_reexec import _pipeline_cfgs
    from training.data import round_batches
    from training.stage_engine import StageEngine
    from training.pipeline_group import init_pipeline_group
    from training.pipeline_stage import PipelineStageTrainer
    from training.reexec import round_meta
    from training.replica_capture import capture_stage_state
    from training.schedule import inner_lr, set_lr
    from training.stages import split_stages

    rank, port, out, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    corpus, model, training, diloco, compression = _pipeline_cfgs(steps)
    group = init_pipeline_group(rank, 2, "127.0.0.1", port, timeout_s=30)
    spec = split_stages(model.n_layer, 2)[rank]
    trainer = PipelineStageTrainer(model, spec, rank, 2, micro_batches=2, training_cfg=training, group=group)
    engine = StageEngine(rank, dict(trainer.module.named_parameters()), diloco, compression)
    meta = round_meta(0, 0, model, diloco, run_rounds=1, num_stages=2, micro_batches=2)
    state = capture_stage_state(meta, engine, trainer.module, trainer.optimizer)
    for step, (x, y) in enumerate(round_batches(corpus, training.seed, 0, 0, steps, 4, model.block_size)):
        set_lr([trainer.optimizer], inner_lr(training, step, steps))
        trainer.train_step(x, y)
    payload, _ = engine.encode_contribution(0)
    following = capture_stage_state(dataclasses.replace(meta, outer_round=1), engine, trainer.module,
                                    trainer.optimizer)
    torch.save({"state": state.to_bytes(), "payload": payload, "next": following.state_hash()}, out)
    trainer.close()
    """
)


def _pipeline_cfgs(steps: int):
    return (generated_corpus(seed=0, n_bytes=20_000), ModelConfig(preset="tiny"),
            TrainingConfig(seed=5, batch_size=4, warmup_steps=2), DilocoConfig(inner_steps=steps),
            CompressionConfig(min_compress_numel=512))


@pytest.mark.timeout(300)
def test_split_pipeline_replica_reexecutes_chained_bit_exactly(tmp_path):
    steps = 4
    script = tmp_path / "stage.py"
    script.write_text(PIPELINE_STAGE)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port),
                               str(tmp_path / f"s{rank}.pt"), str(steps), os.path.dirname(__file__)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    stages = [torch.load(tmp_path / f"s{rank}.pt") for rank in range(2)]
    state = ReplicaStartState(tuple(parse_stage_state(s["state"]) for s in stages))
    claims = [ContributionClaim(rank, state.stages[rank].state_hash(), b"", s["payload"])
              for rank, s in enumerate(stages)]
    corpus, model, training, diloco, compression = _pipeline_cfgs(steps)
    # Both stages rerun chained in this one process, with the pipeline's micro-batch arithmetic.
    rerun = reexecute(state, corpus, model, training, diloco, compression)
    assert [rerun.payloads[c.stage_index] for c in claims] == [c.payload for c in claims]
    # ... and yields the start state each stage's process holds for round 1 (the chain check).
    assert rerun.next_state.stage_hashes() == [s["next"] for s in stages]
    # Chained without the micro-batches, the same replica is only close (float summation order).
    plain = ReplicaStartState(tuple(
        dataclasses.replace(p, meta=dataclasses.replace(p.meta, micro_batches=0)) for p in state.stages))
    assert reexecute(plain, corpus, model, training, diloco, compression).payloads[0] != stages[0]["payload"]


def test_round_zero_state_is_public_and_global_weights_bind_to_the_record(run):
    sim, records = run
    meta = records[0].states[HONEST].meta
    initial = initial_replica_state(meta, sim.model, sim.training, sim.diloco, sim.compression)
    assert initial.stage_hashes() == [c.state_hash for c in records[0].claims[HONEST]]
    # Round 1 starts from the initial global weights (round 0 is applied after round 1's encode).
    state = records[1].states[HONEST]
    on_record = {-1: {p.stage_index: stage_weights_hash(p.group("param")) for p in initial.stages}}
    assert _check(sim, records, HONEST, 1, committed_weights=on_record).verdict == EXACT
    forged = {-1: {0: b"\0" * 32, 1: on_record[-1][1]}}
    assert _check(sim, records, HONEST, 1, committed_weights=forged).verdict == STATE_MISMATCH
    assert state.stages[0].engine_counters[1] == 0  # last applied round -1, stored + 1


def test_restart_check_refuses_garbage_with_a_reason_not_an_exception():
    # The state parts come from the accused peer: anything it serves ends in a reason.
    assert "malformed" in restart_state_reason([b"garbage"], [b"\0" * 32])
    assert "malformed" in restart_state_reason([b""], [b"\0" * 32])
    assert "state parts" in restart_state_reason([b"a", b"b"], [b"\0" * 32])
