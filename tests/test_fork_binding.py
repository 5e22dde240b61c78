"""A forked member's round binds the result it applied mid-round: holders leave it out, checks do not accuse
it.

docs/PROTOCOL.md, "When a node's weights leave the record". With the overlap, round t+1 trains tau
steps, applies round t, then trains on: a member whose round t forked trains the rest of round t+1
on its own result. Its contribution binds that result's stage hash (``applied_hash``); every honest
holder compares it with the record's result of round t at its apply and leaves it out
(node.binding.other_result_exclusions); a re-execution from its start state with the record's round t
says "built on another result" (not a mismatch to accuse), while an honest member's round reruns
exactly and a member that binds the record's hash to a round trained on its own is a mismatch.
Real tiny-model reruns (training.reexec), no mocks.
"""

from __future__ import annotations

import pytest

from node import protocol as msg
from node.binding import other_result_exclusions
from node.config import load_config
from node.live.state.roundstate import RoundState
from node.store.archive import Archive, ArchivedContribution
from training.data import corpus_from_config
from training.diloco import aggregate_with_report
from training.reexec import (
    EXACT,
    MISMATCH,
    OTHER_RESULT,
    ContributionClaim,
    data_commitment,
    reexecute,
    round_meta,
    verify_contribution,
)
from training.replica_capture import initial_replica_state
from training.robust import SCREENED
from training.schedule import applies_before_encode


def test_the_contribution_body_binds_the_applied_result_and_refuses_the_old_layout():
    body = msg.ContributionBody(b"s" * 32, b"d" * 32, b"codec blob", b"a" * 32)
    data = msg.encode_contribution_body(body)
    assert data.startswith(b"dlx-contribution/3") and msg.decode_contribution_body(data) == body
    assert msg.ContributionBody(b"s" * 32, b"d" * 32, b"blob").applied_hash == msg.NO_APPLY == bytes(32)
    old = b"dlx-contribution/2" + b"s" * 32 + b"d" * 32 + b"codec blob"  # the layout before the binding
    for bad in (old, data[:len(msg.CONTRIBUTION_MAGIC) + 96], data[:60]):
        with pytest.raises(msg.ProtocolError):
            msg.decode_contribution_body(bad)
    with pytest.raises(msg.ProtocolError):
        msg.encode_contribution_body(msg.ContributionBody(b"s" * 32, b"d" * 32, b"blob", b"a" * 31))


def test_the_schedule_says_which_rounds_apply_the_round_before_their_encode(tmp_path):
    def diloco(*settings):
        return load_config(None, ["diloco.inner_steps=4", f"data_dir={tmp_path}", *settings]).diloco

    overlap = diloco("diloco.overlap_steps=2")
    assert [applies_before_encode(overlap, r) for r in range(3)] == [False, True, True]
    assert not any(applies_before_encode(diloco("diloco.overlap_steps=0"), r) for r in range(3))  # rebase
    lookahead = diloco("diloco.overlap_steps=0", "diloco.delay_correction=lookahead")
    assert [applies_before_encode(lookahead, r) for r in range(3)] == [False, True, True]
    assert not any(applies_before_encode(diloco("diloco.one_step_delay=false"), r) for r in range(3))


def test_a_forked_members_round_is_left_out_by_honest_holders_and_never_judged_a_cheat(tmp_path):
    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=4", "diloco.overlap_steps=2",
                             "training.batch_size=2", "rounds=3", "diloco.num_replicas=2",
                             f"data_dir={tmp_path}"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    run = dict(model_cfg=cfg.model, training_cfg=cfg.training, diloco_cfg=cfg.diloco,
               compression_cfg=cfg.compression)

    # Round 0 of both replicas: the record's round 0 holds both contributions.
    round0 = []
    for replica in (0, 1):
        meta = round_meta(0, replica, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=1, threads=1)
        state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
        round0.append(reexecute(state, corpus, **run))
    record = {0: [round0[0].payloads[0], round0[1].payloads[0]]}
    forked = {0: [round0[1].payloads[0]]}  # replica 1's view: its sum left the close's first entry out
    start = round0[1].next_state  # replica 1's start state of round 1
    assert start is not None

    # Round 1 of replica 1, as an honest member trains it and as the forked member did (mid-round apply).
    honest = reexecute(start, corpus, previous_contributions=record, **run)
    fork = reexecute(start, corpus, previous_contributions=forked, **run)
    assert honest.applied_hashes[0] != fork.applied_hashes[0] != msg.NO_APPLY
    record_result = honest.applied_hashes[0]

    def check(payload: bytes, applied: bytes):
        claim = ContributionClaim(0, start.stages[0].state_hash(),
                                  data_commitment(corpus, cfg.training, cfg.model, cfg.diloco, 1, 1), payload,
                                  applied)
        return verify_contribution([start.stages[0].to_bytes()], [claim], corpus, **run, outer_round=1,
                                   replica=1, run_rounds=cfg.rounds, previous_contributions=record, threads=1)

    assert check(honest.payloads[0], record_result).verdict == EXACT
    elsewhere = check(fork.payloads[0], fork.applied_hashes[0])
    assert elsewhere.verdict == OTHER_RESULT and not elsewhere.honest, elsewhere.reason
    assert "another result of round 0" in elsewhere.reason and elsewhere.failed_stages == (0,)
    # Claiming the record's result for a round trained on
    # its own is not a binding: the rerun does not reproduce.
    assert check(fork.payloads[0], record_result).verdict == MISMATCH
    # the overlap's binding is not optional
    assert check(fork.payloads[0], msg.NO_APPLY).verdict == OTHER_RESULT

    # An honest holder (the record's round 0) leaves exactly the forked one out of round 1, with its reason;
    # the same rule at a holder that still held the fork would leave the honest one out instead.
    closed = [honest.applied_hashes[0], fork.applied_hashes[0]]
    left_out = other_result_exclusions(cfg.diloco, 1, closed, record_result)
    assert list(left_out) == [1] and left_out[1][0] == OTHER_RESULT
    assert list(other_result_exclusions(cfg.diloco, 1, closed, fork.applied_hashes[0])) == [0]
    # round 0 applies nothing
    assert other_result_exclusions(cfg.diloco, 0, [msg.NO_APPLY], record_result) == {}
    contributions = [honest.payloads[0], fork.payloads[0]]
    base = initial_replica_state(round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=cfg.rounds, num_stages=1,
                                            threads=1), cfg.model, cfg.training, cfg.diloco,
                                 cfg.compression).stages[0]
    weights, momentum = base.group("global"), base.group("momentum")
    result = aggregate_with_report(weights, momentum, contributions, cfg.diloco, stage_index=0, outer_round=1,
                                   compression_cfg=cfg.compression, excluded=left_out)
    assert result.excluded == {1: OTHER_RESULT}
    alone = aggregate_with_report(weights, momentum, contributions[:1], cfg.diloco, stage_index=0,
                                  outer_round=1, compression_cfg=cfg.compression)
    assert result.weights_hash == alone.weights_hash
    screened = aggregate_with_report(weights, momentum, contributions, cfg.diloco, stage_index=0,
                                     outer_round=1, compression_cfg=cfg.compression,
                                     excluded={1: "screening"})
    assert screened.excluded == {1: SCREENED} and screened.weights_hash == result.weights_hash


def test_a_re_entering_life_sets_aside_what_it_sealed_off_the_record(tmp_path):
    archive = Archive(tmp_path / "archive", 7)
    assert archive.set_aside_from(0) == []  # nothing sealed: nothing to do
    for r in range(4):
        digest = archive.put(r, f"envelope of round {r}".encode())
        archive.seal_round(r, [ArchivedContribution(0, 1, "peer", digest)],
                           excluded=[[0, 1, "peer", digest.hex(), OTHER_RESULT, "forked"]] if r == 3 else [])
    assert archive.set_aside_from(2) == [2, 3]
    assert [archive.sealed(r) is not None for r in range(4)] == [True, True, False, False]
    assert archive.excluded(3) == []  # no restart, spot check or audit reads the forked seal any more
    assert (archive.sealed_path(3).with_name("round.forked.json")).exists()  # kept beside, as what it did
    assert all(list(archive.sealed_path(r).parent.glob("*.env")) for r in range(4))  # the envelopes stay
    assert archive.set_aside_from(2) == []


def test_a_forked_member_withholds_every_round_whose_start_state_holds_its_forked_result(tmp_path):
    diloco = load_config(None, ["diloco.inner_steps=4", "diloco.overlap_steps=2",
                                f"data_dir={tmp_path}"]).diloco
    rounds = RoundState(station=None)
    # Round 2 forked here. When the chain's verdict of round 2 comes, round 3 is being trained (its start
    # state holds round 1, the record's) and round 4 has not begun.
    rounds.start_states[3] = {0: b"s" * 32}
    rounds.parts[3] = []
    rounds.rebasing.add(2)
    assert rounds.withhold_on(2, diloco) == []  # round 3 binds what it applied: the holders leave it out
    assert rounds.starting(4, diloco) and 4 in rounds.withheld  # begins on the forked round 2
    rounds.rebasing.discard(2)  # the re-base is taken (at the apply of round 3, inside round 4)
    assert not rounds.starting(5, diloco)  # round 5 starts from the record's round 3
    # Without the verdict first, the re-base itself withholds what began on the forked state.
    late = RoundState(station=None)
    late.start_states[4] = {0: b"s" * 32}
    assert late.withhold_on(2, diloco) == [4] and late.withhold_on(2, diloco) == []
    late.forget_before(5)
    assert late.withheld == set()
