"""A node whose weights left the record holds its re-entry while its fraud prover's game on the forked round
is open (issue 62; node/live/peers/lifecycle.py, docs/FRAUD_PROOF.md "The late game"), in process: real libp2p
hosts, a real EVM (py-evm), the node's own prover, answerer and lifecycle.

Members 1 and 2 (the quorum) collude and serve nothing of what they committed; member 3, honest and outside
the quorum, must open it through availability challenges, which the colluders answer truthfully but only in
the last block of each window (the clock's move). Its own aggregate stood, so its weights left the record and
the fork repair tells the lifecycle to re-enter from the chain's checkpoint: a next life would hold neither
the pending challenge nor its state of the round. The re-entry waits for the game: once the round is proven
wrong there is nothing to re-enter into; once the game ends with the round standing (this node was mistaken),
it re-enters.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from ledger.availability import WEIGHTS
from node.live.chain.onchain import NodeChain
from node.live.fraud.prover import FraudProver
from node.live.peers import lifecycle as lifecycle_module
from node.live.peers.lifecycle import Lifecycle
from node.live.state.status import StateFile
from tests.fraud_live_fixtures import (COLLUDERS, PROVER, _normed_world, _one_element_changed, _record,
                                       _setup, _states, colluders_answerer, run_values)
from tests.ledger_fixtures import mine
from tests.test_fraud_live_sums import BLOBS, WithholdingAll
from tests.test_fraud_live_values import _adversary


@pytest.fixture(autouse=True)
def _quick_hold(monkeypatch):
    monkeypatch.setattr(lifecycle_module, "HOLD_POLL_S", 0.05)


def _world(world, tmp_path, colluders_cfg, honest_weights=None):
    """Rounds 0 and 1 on chain, round 1 committed by the colluders (stepped with ``colluders_cfg``, serving
    nothing); the honest prover's own round 1 with ``honest_weights`` (default: the right step). Returns
    (deployment, run, records, prover, the colluders' late answerer, the honest mine record)."""
    colluder_host, prover_host = world.hosts
    honest = _states(world, prover_host)
    _record(world, honest, world.aggregation.new_global if honest_weights is None else honest_weights)
    colluders = _states(dataclasses.replace(world, cfg=colluders_cfg), colluder_host, WithholdingAll)
    from training.diloco import aggregate_with_report

    stepped = aggregate_with_report(world.weights, world.momentum, world.blobs, colluders_cfg.diloco,
                                    stage_index=0, outer_round=1, compression_cfg=colluders_cfg.compression)
    _record(world, colluders, stepped.new_global, stepped.new_momentum)
    prover_host.connect(colluder_host.listen_addrs[0])
    deployment, run, records, prover, mine_record = _setup(
        world, tmp_path, honest, colluders.state(1, 0).leaf().encode(), honest.state(1, 0).leaf().encode(),
        colluder_host.peer_id, values=run_values(world.cfg))
    answerer = colluders_answerer(world, deployment, run.run_id, prover, colluders)
    prover.check(0, records[0], records[0])
    return deployment, run, records, prover, answerer, mine_record


def _lifecycle(tmp_path, run, prover) -> tuple[Lifecycle, StateFile]:
    state = StateFile(tmp_path / "state.json", run.run_id)
    lifecycle = Lifecycle(run_id=run.run_id, peer_id="honest", state=state, membership=None,
                          stop=threading.Event())
    lifecycle.prover = prover
    return lifecycle, state


def _answer_in_the_last_block(deployment, answerer, prover) -> list[int]:
    """Answer every open challenge of the prover in the last block of its window (the colluders' clock move),
    then let the prover follow each answer, until no challenge is open; the blocks the answers landed in,
    each checked to be its window's last."""
    client = deployment.client(PROVER)
    landed = []
    deadline = time.monotonic() + 300
    while prover.open_rounds() and time.monotonic() < deadline:
        with prover._lock:
            open_ids = list(prover._pending)
        for challenge_id in open_ids:
            window_ends = client.challenge_of(challenge_id)["deadline"]
            mine(deployment.w3, window_ends - client.w3.eth.block_number - 2)
            answerer.poll()  # its transaction is the next block: the last one an answer may be in
            assert client.w3.eth.block_number == window_ends - 1, answerer.answered
            landed.append(client.w3.eth.block_number)
        prover.settle_challenges()
    assert not prover.open_rounds(), prover.log.unprovable
    return landed


def _await(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_forked_node_holds_its_reentry_until_its_late_answered_game_proves_the_round(tmp_path, caplog):
    """The colluders step round 1 with lr 7.0 and withhold the factors: the honest node challenges them
    (``FACTORS``), and while the challenge is open a re-entry would lose it, so the lifecycle holds it (a
    later fork joins the hold). The late answer opens the factors, the values proof lands, the colluders are
    slashed; the held re-entry is dropped (the round is overturned) and the node signs nothing on top of round
    1."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, answerer, mine_record = _world(
            world, tmp_path, _adversary(world.cfg, outer_lr=7.0))
        lifecycle, state = _lifecycle(tmp_path, run, prover)
        assert prover.holds_reentry(1) is None  # nothing held wrong yet: a fork would re-enter at once
        with caplog.at_level("WARNING"):
            prover.check(1, records[1], mine_record)
            assert prover.open_rounds() == [1] and 1 in prover.log.wrong, prover.log.unprovable
            (challenge_id,) = prover._pending
            assert deployment.client(PROVER).challenge_of(challenge_id)["chunk"] == 0
            assert prover._factor_opens[challenge_id][0] == 0  # the factors' challenge of stage 0
            lifecycle.diverged(1)
            assert lifecycle.held == 1 and lifecycle.reenter_after is None
            assert not lifecycle.stop_event.is_set()
            assert "the re-entry waits until that game is over" in caplog.text
            lifecycle.diverged(2)  # round 2 forks too (it was trained on this node's round 1): one hold
            assert lifecycle.held == 1
            # a later round is not challenged: its proof would wait for round 1's, and fall with it
            prover.check(2, dataclasses.replace(records[1], round=2),
                         dataclasses.replace(mine_record, round=2))
            assert "round 1 is held wrong here" in prover.log.unprovable[2] and prover.open_rounds() == [1]
            assert "round 1 is wrong" in prover.refuses_to_sign(2)
            time.sleep(0.3)  # the hold's polls see the game open
            assert not lifecycle.stop_event.is_set()
            landed = _answer_in_the_last_block(deployment, answerer, prover)
            _await(lambda: lifecycle.held is None, "the held re-entry was never released")
        client = deployment.client(PROVER)
        assert len(landed) == 1 and client.game_of(run.run_id, 1, 0)["steps"] == 1  # FACTORS, then the proof
        assert set(prover.log.proofs) == {1}, prover.log.unprovable
        assert client.invalid_from(run.run_id) == 1
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
        assert "was overturned on chain: the record this node left is gone" in caplog.text
        assert not lifecycle.stop_event.is_set() and lifecycle.reenter_after is None
        assert state.get("reentered_for") is None
        assert prover.refuses_to_sign(2) is not None


def test_a_held_reentry_goes_ahead_once_the_game_ends_with_the_round_standing(tmp_path, caplog):
    """The honest node's own round 1 is one ulp off (a local fault): it walks the withheld weights down to the
    chunk, every step answered in the last block of its window (each answer a fresh window: the chess clock),
    and its proof is refused (the round is right). The round stands, the node holds nothing wrong any more:
    the held re-entry goes ahead."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, answerer, mine_record = _world(
            world, tmp_path, world.cfg, _one_element_changed(world.aggregation.new_global))
        lifecycle, state = _lifecycle(tmp_path, run, prover)
        with caplog.at_level("WARNING"):
            prover.check(1, records[1], mine_record)
            assert prover.open_rounds() == [1] and 1 in prover.log.wrong, prover.log.unprovable
            assert {w.which for w in prover._walks.values()} == {WEIGHTS}
            lifecycle.diverged(1)
            assert lifecycle.held == 1 and not lifecycle.stop_event.is_set()
            landed = _answer_in_the_last_block(deployment, answerer, prover)
            _await(lifecycle.stop_event.is_set, "the re-entry never went ahead")
        client = deployment.client(PROVER)
        steps = client.game_of(run.run_id, 1, 0)["steps"]
        assert steps == len(landed) >= 2, landed  # one challenge a step, each answered in its last block
        committed = next(c for c in client.history(run.run_id).commits if c.commit.round == 1)
        disputes_end = committed.block_number + client.run_struct(run.run_id)["disputeBlocks"]
        assert landed[-1] > disputes_end and client.invalid_from(run.run_id) is None
        assert not prover.log.proofs and 1 not in prover.log.wrong and 1 in prover.log.unprovable
        assert lifecycle.reenter_after == 1 and lifecycle.held is None
        assert state.get("reentered_for") == [1]
        assert "stopping to re-enter from the chain's latest checkpoint" in caplog.text


def test_a_fork_with_nothing_held_wrong_re_enters_at_once(tmp_path):
    """Without a game on the round (the prover holds nothing wrong) the fork re-enters as before, once per
    round in any life."""
    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, _answerer, _mine = _world(world, tmp_path, world.cfg)
        prover.check(1, records[1], records[1])  # the committed round is this node's
        assert not prover.open_rounds() and prover.holds_reentry(1) is None
        lifecycle, state = _lifecycle(tmp_path, run, prover)
        lifecycle.diverged(1)
        assert lifecycle.stop_event.is_set() and lifecycle.reenter_after == 1 and lifecycle.held is None
        assert state.get("reentered_for") == [1]
        again, _state = _lifecycle(tmp_path, run, prover)
        again.diverged(1)  # a next life that forks at the same round again keeps going
        assert not again.stop_event.is_set() and again.reenter_after is None


def test_a_deferred_proof_is_tried_every_quarter_second_near_the_block_its_window_opens(tmp_path, caplog):
    """A proof refused while its parent round can still be overturned (ProverParentOpen) is kept with the
    block the chain named (``closesAt``); the settlement loop looks every EXPIRE_EVERY_S until that block is
    DUE_BLOCKS away, then every DUE_EVERY_S, so the proof lands in the first blocks it is taken in (a binding
    proof of a non-member's contribution is taken only while its round can be disputed)."""
    from node.live.fraud import challenges
    from tests.test_fraud_live_values import _lied_leaf, _prove

    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        wrong_leaf = _lied_leaf(world, _adversary(world.cfg, outer_lr=7.0), world.hosts[0], world.blobs,
                                world.bindings)
        deployment, run, prover, client = _prove(world, tmp_path, caplog, wrong_leaf, parent_closed=False)
        assert prover.open_rounds() == [1] and not prover.log.proofs
        opens_at = prover._opens_at[1]
        assert opens_at == client.proof_window_of(run.run_id, 1)[0] > client.w3.eth.block_number
        assert prover._settle_every() == challenges.EXPIRE_EVERY_S
        mine(deployment.w3, opens_at - challenges.DUE_BLOCKS - client.w3.eth.block_number)
        assert prover._settle_every() == challenges.DUE_EVERY_S
        mine(deployment.w3, opens_at - client.w3.eth.block_number - 1)
        prover.settle_challenges()  # its transaction is the first block the proof is taken in
        assert set(prover.log.proofs) == {1} and not prover.open_rounds(), prover.log.unprovable
        assert client.invalid_from(run.run_id) == 1


def test_a_factors_challenge_outlives_a_restart_and_its_late_answer_is_proven(tmp_path, caplog):
    """The honest node challenged the withheld factors of round 1 (lr 7.0), then stopped (a crash, not a
    re-entry: nothing held it). Its next life, which holds neither its book of attestations nor its state of
    round 1, resumes the challenge kept in ``proofs/games/`` (node/live/fraud/kept_games.py), refuses to sign
    on top of round 1 meanwhile, follows the answer given in the window's last block to the values proof and
    forgets the game."""
    from node.live.state.roundbook import RoundBook

    with _normed_world(tmp_path, BLOBS) as (world, _chunked, _colluded):
        deployment, run, records, prover, answerer, mine_record = _world(
            world, tmp_path, _adversary(world.cfg, outer_lr=7.0))
        prover.check(1, records[1], mine_record)
        (challenge_id,) = prover._pending
        kept = tmp_path / "proofs" / "games" / f"{challenge_id.hex()}.json"
        assert kept.is_file()
        with prover._lock:  # the first life ends: nothing of it follows the answer
            prover._pending.clear()
            prover.stop = threading.Event()
            prover.stop.set()
        # what a disk or a hand left beside it is logged and skipped, never a crash
        (kept.parent / "not-hex.json").write_text("{}")
        (kept.parent / f"{'ab' * 32}.json").write_text('{"round": 1, "stage": 0, "record": [1, 2]')
        other_stage = {**json.loads(kept.read_text()), "stage": 7}
        (kept.parent / f"{'cd' * 32}.json").write_text(json.dumps(other_stage))
        deep = b"[" * 200_000 + b"]" * 200_000  # decoded as is, a segfault in a process that imported py_ecc
        (kept.parent / f"{'ef' * 32}.json").write_bytes(deep)
        (kept.parent.parent / "round-000009-stage0.json").write_bytes(deep)  # a kept proof's name
        with caplog.at_level("WARNING"):
            next_life = FraudProver(run_id=run.run_id, chain=NodeChain(deployment.client(PROVER)),
                                    book=RoundBook(), states=_states(world, world.hosts[1]),
                                    stages=lambda: (0,), num_stages=2, stop=world.stop,
                                    proofs_dir=tmp_path / "proofs")
        assert caplog.text.count("a kept factors challenge") == 4, caplog.text
        assert "a kept proof round-000009-stage0.json is not read: JSON nested 200000 deep" in caplog.text
        assert next_life.open_rounds() == [1] and "round 1 is wrong" in next_life.refuses_to_sign(2)
        assert next_life.holds_reentry(1) is not None
        with caplog.at_level("WARNING"):
            landed = _answer_in_the_last_block(deployment, answerer, next_life)
        assert len(landed) == 1
        assert set(next_life.log.proofs) == {1}, next_life.log.unprovable
        client = deployment.client(PROVER)
        assert client.invalid_from(run.run_id) == 1
        for index in COLLUDERS:
            assert client.member(run.run_id, deployment.client(index).address).status == "slashed"
        assert "following the factors challenge" in caplog.text and "factors' lr/mu bits" in caplog.text
        assert not kept.exists() and next_life.holds_reentry(1) is None
