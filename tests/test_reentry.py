"""A survivor re-enters the round the others train from the same state as its restarted partner (issue 30).

A split cluster's surviving node sits rounds out while its partner restarts, finishing every round the
other replicas close. Round t trains from the global weights of round t - 2 (one-step delay): a survivor
that has applied round t - 1 goes back to its held state of round t - 2 (node/live/round/entry.py,
RunEntry.reenter) and absorbs round t - 1 again at the schedule's point from the result it had
(RoundFinisher.replay). Its start state must then be, bit for bit, the one a process restarted from the
checkpoint of round t - 2 holds, so its round reruns as a restart's (training.reexec.restart_state_reason),
and its contribution and weights must be that process's too. Real workers and engines; another replica's
worker makes the rounds the survivor sits out.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from parts_fixtures import loose_base, loose_rooms

from node.config import load_config
from node.live.round.entry import RunEntry
from node.live.round.finisher import RoundFinisher
from node.live.worker.replica import ReplicaWorker
from node.live.state.status import StateFile
from training.reexec import restart_state_reason
from training.replica_state import parse_stage_state

SETTINGS = ["model.preset=tiny", "diloco.inner_steps=3", "training.batch_size=2", "rounds=0",
            "torch_threads=1", "pipeline.num_stages=2", "checkpoint_every=1"]


def _worker(tmp_path, replica: int) -> ReplicaWorker:
    cfg = load_config(None, [*SETTINGS, f"data_dir={tmp_path}"])
    worker = ReplicaWorker(cfg, replica, (0, 1), 0)
    worker.start(10, 10)
    return worker


class Lane:
    """The contributor's lane joins: nothing runs on a lane in this test."""

    def join_start_state(self) -> None:
        pass

    def join_engine_work(self) -> None:
        pass


class Membership:
    def live_training_round(self, last_committed: int, window: int) -> int:
        return 3

    def claimed_rounds(self, last_committed: int, window: int) -> list[tuple[int, int]]:
        return [(0, 3)]


class Chain:
    def last_round(self, run_id: int) -> int:
        return 1


class Book:
    def snapshot_announces(self, outer_round: int, stage: int) -> dict:
        return {}

    def snapshot_closes(self, outer_round: int, stage: int) -> dict:
        return {}


@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """Another replica's rounds 0-3 (train, encode, apply the round before): its blobs and global states."""
    worker = _worker(tmp_path_factory.mktemp("other"), replica=1)
    blobs, states = {}, {}
    for outer_round in range(4):
        worker.train_round(outer_round)
        blobs[outer_round] = {stage: worker.encode(stage, outer_round)[0] for stage in worker.stages}
        if outer_round:
            for stage in worker.stages:
                worker.apply(stage, outer_round - 1, [blobs[outer_round - 1][stage]])
            states[outer_round - 1] = {stage: worker.global_state(stage) for stage in worker.stages}
    return blobs, states


def test_a_survivor_re_enters_the_open_round_as_its_restarted_partner_does(tmp_path, others):
    blobs, states = others
    survivor = _worker(tmp_path / "survivor", replica=0)
    # Its life before the partner died: round 0 trained and encoded (AdamW state, a residual), round 1 begun.
    survivor.train_round(0)
    for stage in survivor.stages:
        survivor.encode(stage, 0)
    survivor.train_round(1, end_step=2)  # the pipeline broke here: abandoned
    # The finisher's replay path needs only these parts (nothing is fetched, sealed or attested again).
    finisher = RoundFinisher(loose_base(cfg=survivor.cfg), loose_rooms(exchange=SimpleNamespace(pool=None)),
                             worker=survivor, recovery=None, contributor=Lane())
    for outer_round in range(3):  # sitting out: rounds 0-2 finished as the others closed them
        finisher.replay(outer_round, states[outer_round])
        finisher.finish(outer_round)
    state = StateFile(tmp_path / "state.json", survivor.cfg.ledger.run_id)
    base = loose_base(cfg=survivor.cfg, book=Book(), state=state, progress=SimpleNamespace(last_finished=2),
                      checkpoint_dir=tmp_path, incoming_dir=tmp_path, stop=threading.Event())
    entry = RunEntry(base, loose_rooms(chain=Chain(), membership=Membership()), worker=survivor,
                     contributor=Lane(), finisher=finisher)
    held = finisher.held_states()
    start = entry.agree_again(3, held)
    assert start == 3  # the round the others train, not round 4
    catch_up = entry.reenter(3, start, held)
    assert catch_up == [2]

    # Its partner (here: the same replica's other process) restarted from the checkpoint of round 1.
    restarted = _worker(tmp_path / "restarted", replica=0)
    for stage in restarted.stages:
        restarted.load_global(stage, *states[1][stage], 1)

    survivor_state, restarted_state = survivor.capture_start_states(3), restarted.capture_start_states(3)
    assert survivor_state == restarted_state
    parts = [survivor_state[stage] for stage in survivor.stages]
    hashes = [parse_stage_state(part).state_hash() for part in parts]
    assert restart_state_reason(parts, hashes) is None

    for worker in (survivor, restarted):
        worker.train_round(3)
    assert all(survivor.encode(s, 3)[0] == restarted.encode(s, 3)[0] for s in survivor.stages)
    finisher.finish(2)  # round 2 at the schedule's point: absorbed again from the survivor's own result
    for stage in restarted.stages:
        restarted.apply(stage, 2, [blobs[2][stage]])
    for stage in survivor.stages:
        assert survivor.global_hash(stage) == restarted.global_hash(stage)
        ours, theirs = survivor.engines[stage].state_dict(), restarted.engines[stage].state_dict()
        for key in ("global_weights", "momentum", "round_start", "error_feedback"):
            assert all(torch.equal(ours[key][n], theirs[key][n]) for n in ours[key]), key
