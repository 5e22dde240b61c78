"""A run whose data windows are keyed by account (``training.data_windows = "account"``, issue 78): the node
draws its batches, binds its data commitment, and a spot check reruns it, by the CONTRIBUTOR's 20-byte
account, with the windows the chain's data dispute recomputes (training/data_binding.py,
rulebook/data_windows.py).

Real workers (the node's ReplicaWorker, its trainer and engines), the real rerun (verify_contribution), and on
py-evm a data dispute of a claim whose batches are the node's own draw.
"""

from __future__ import annotations

import pytest
import torch

from node.config import load_config
from node.runconfig import config_hash, node_config_from_run, run_document
from rulebook.data_windows import window_offset
from training.data import corpus_from_ids, round_batches, window_offsets, windows_key
from training.data_binding import claim_batches, key_window_offsets
from training.errors import DataError, TrainingConfigError
from training.reexec import DATA_MISMATCH, EXACT, ContributionClaim, data_commitment, verify_contribution
from training.replica_state import parse_stage_state

ALICE, BOB = bytes(range(1, 21)), b"\xb0" * 20
ROUNDS = 2
SETTINGS = ["model.preset=tiny", "diloco.inner_steps=3", "training.batch_size=2", f"rounds={ROUNDS}",
            "torch_threads=1", "pipeline.num_stages=2"]


def _cfg(*extra: str):
    return load_config(None, [*SETTINGS, *extra])


def test_the_switch_is_a_run_setting_bound_by_the_config_hash_and_a_bad_value_is_refused_by_name():
    replica, account = _cfg(), _cfg("training.data_windows=account")
    assert replica.training.data_windows == "replica"
    # "replica" (the default) leaves the run document, and its hash, as they were before the setting
    assert "data_windows" not in run_document(replica)["training"]
    assert run_document(account)["training"]["data_windows"] == "account"
    assert config_hash(run_document(account)) != config_hash(run_document(replica))
    # a joiner's configuration from the document draws as the creator's did
    assert node_config_from_run(run_document(account)).training.data_windows == "account"
    assert node_config_from_run(run_document(replica)).training.data_windows == "replica"
    for bad in ("acount", "Account", "seat", ""):
        with pytest.raises(TrainingConfigError, match=r"training.data_windows=.*must be one of \['replica', "
                                                      r"'account'\]"):
            _cfg(f"training.data_windows={bad}")


def _corpus():
    ids = torch.randint(0, 50, (3000,), generator=torch.Generator().manual_seed(3))
    return corpus_from_ids(ids, "00" * 32)


def test_round_batches_keyed_by_an_account_are_the_chains_windows():
    corpus, block, rows, steps = _corpus(), 7, 3, 5
    n_start = corpus.split_tokens("train") - block
    for seed, key, outer_round in ((0, ALICE, 0), (11, BOB, 9), (2**64 - 1, ALICE, 2**64 - 1)):
        offsets = window_offsets(seed, key, outer_round, steps, rows, n_start)
        assert offsets == key_window_offsets(seed, key, outer_round, steps, rows, n_start)
        assert offsets[3][2] == window_offset(seed, key, outer_round, 3, 2, n_start)
        batches = round_batches(corpus, seed, key, outer_round, steps, rows, block)
        bound = claim_batches(corpus, seed, key, outer_round, steps, rows, block)
        for (x, y), batch in zip(batches, bound, strict=True):
            assert torch.equal(x, batch[:, :-1]) and torch.equal(y, batch[:, 1:])
        # a later first step gives the same batches of the steps it covers (a time-bounded run's chunks)
        later = round_batches(corpus, seed, key, outer_round, steps, rows, block, first_step=2)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(later, batches[2:], strict=True))
    # another account, and the replica index, draw other windows
    assert window_offsets(0, ALICE, 0, 2, 2, n_start) != window_offsets(0, BOB, 0, 2, 2, n_start)
    assert window_offsets(0, ALICE, 0, 2, 2, n_start) != window_offsets(0, 0, 0, 2, 2, n_start)
    with pytest.raises(DataError, match="20-byte account, not 19 bytes"):
        window_offsets(0, ALICE[:19], 0, 2, 2, n_start)


def test_windows_key_follows_the_setting_and_refuses_a_missing_account():
    assert windows_key(_cfg().training, 3, ALICE) == 3  # "replica": the account is not used
    assert windows_key(_cfg("training.data_windows=account").training, 3, ALICE) == ALICE
    for missing in (None, ALICE[:10]):
        with pytest.raises(DataError, match='data_windows = "account": the windows of replica 3 need'):
            windows_key(_cfg("training.data_windows=account").training, 3, missing)


def _worker(cfg, key: bytes | None, replica: int = 1):
    from node.live.worker.replica import ReplicaWorker

    worker = ReplicaWorker(cfg, replica, (0, 1), 0, data_key=key)
    worker.start(10, 10)
    return worker


def _round(worker, outer_round: int, seen: list) -> list[ContributionClaim]:
    """Train and encode ``outer_round`` as the node does; the claims its envelopes would sign."""
    states = worker.capture_start_states(outer_round)
    step = worker.trainer.train_step
    worker.trainer.train_step = lambda x, y, *rest: (seen.append((x.clone(), y.clone())),
                                                     step(x, y, *rest))[1]
    try:
        worker.train_round(outer_round)
    finally:
        worker.trainer.train_step = step
    data = worker.data_commitment(outer_round)
    return states, [ContributionClaim(stage, parse_stage_state(states[stage]).state_hash(), data,
                                      worker.encode(stage, outer_round)[0]) for stage in worker.stages]


def test_the_node_trains_on_its_accounts_windows_and_a_spot_check_reruns_them_with_the_contributors_key():
    cfg = _cfg("training.data_windows=account")
    worker = _worker(cfg, ALICE)
    seen: list = []
    states, claims = _round(worker, 0, seen)
    h, rows, block = cfg.diloco.inner_steps, cfg.training.batch_size, cfg.model.block_size
    # the batches the trainer got are training.data_binding's windows of ALICE (not replica 1's)
    bound = claim_batches(worker.corpus, cfg.training.seed, ALICE, 0, h, rows, block)
    assert len(seen) == h
    for (x, y), batch in zip(seen, bound, strict=True):
        assert torch.equal(x, batch[:, :-1]) and torch.equal(y, batch[:, 1:])
    by_replica = round_batches(worker.corpus, cfg.training.seed, 1, 0, h, rows, block)
    assert not torch.equal(seen[0][0], by_replica[0][0])
    # the data commitment binds ALICE's windows
    assert claims[0].data_commitment == data_commitment(worker.corpus, cfg.training, cfg.model, cfg.diloco, 1,
                                                        0, None, ALICE)
    assert claims[0].data_commitment != data_commitment(worker.corpus, cfg.training, cfg.model, cfg.diloco, 1,
                                                        0, None, BOB)

    def check(key):
        return verify_contribution([states[s] for s in worker.stages], claims, worker.corpus, cfg.model,
                                   cfg.training, cfg.diloco, cfg.compression, outer_round=0, replica=1,
                                   run_rounds=ROUNDS, data_key=key)

    # the verifier reruns with the contributor's key: bit for bit
    honest = check(ALICE)
    assert honest.verdict == EXACT, honest.reason
    # with another account (e.g. the verifier's own) the round's data is not the commitment's
    assert check(BOB).verdict == DATA_MISMATCH
    with pytest.raises(DataError, match="need its 20-byte member account"):
        check(None)


def test_a_worker_of_a_run_keyed_by_account_needs_its_key():
    from node.live.worker.replica import ReplicaWorker

    with pytest.raises(DataError, match='training.data_windows = "account"'):
        ReplicaWorker(_cfg("training.data_windows=account"), 0, (0, 1), 0)


def test_a_data_dispute_of_a_claim_on_the_nodes_own_draw_holds(request):
    """A claim whose batches are what the node draws under "account" (``round_batches`` by
    ``windows_key``, ReplicaWorker._batches' call) answers a data dispute of any token on py-evm: the node's
    batches are the chain's windows of the contribution's member (tests/test_step_data.py's run, its toy
    program reading each step's batch)."""
    from ledger.stepdata import DataClient
    from ledger.stepproof import PHASES
    from tests.step_binding_fixtures import TOY_STEPS, subject_of
    from tests.step_data_fixtures import ROWS, SEED, WINDOW, claim_of, corpus, run_steps, traces_of
    from tests.test_step_case import _address
    from tests.test_step_data import _answer, _claim, _setup, _side
    from tests.test_step_proof import _backend
    from tests.test_step_proof_run import _start_state
    from training.config import TrainingConfig

    w3 = _backend(request, "pyevm")
    client, committed = _setup(w3)
    subject = subject_of(committed, 1)
    account = bytes.fromhex(subject.data_key[2:])  # the member the round's factors list for it
    training = TrainingConfig(seed=SEED, batch_size=ROWS, data_windows="account")
    drawn = round_batches(corpus(), training.seed, windows_key(training, 5, account), 1, TOY_STEPS,
                          training.batch_size, WINDOW)
    batches = [torch.cat([x, y[:, -1:]], dim=1) for x, y in drawn]
    traces = traces_of(run_steps(_start_state(), batches), batches)
    defender = _address(w3, 4)
    claim_id = _claim(client, defender, claim_of(traces, subject, batches), subject)
    side = _side(traces, batches, subject)
    for challenger, (step, row, pos) in zip((5, 6), ((0, 0, 0), (TOY_STEPS - 1, ROWS - 1, WINDOW))):
        game = DataClient(client).challenge(claim_id, step, row, pos, _address(w3, challenger))
        _answer(client, game, side, defender)
        assert client.game(game)["phase"] == PHASES.index("Done")
    assert not client.wrong(claim_id)


def test_a_start_state_rebuild_replays_its_rounds_with_the_replicas_key(tmp_path):
    """The start-state rebuild (node/live/checks/staterebuild.py, the child's ``replay``) reruns a run keyed
    by account with the replica's key its job names: the states it gives are the node's; with another key
    they are not."""
    import hashlib

    from node.live.checks.staterebuild import ReplayRound, replay, write_job
    from training.data import corpus_from_config
    from training.reexec import reexecute, round_meta
    from training.replica_capture import initial_replica_state

    cfg = load_config(None, ["model.preset=tiny", "diloco.inner_steps=2", "training.batch_size=2",
                             "rounds=0", "pipeline.num_stages=1", f"data_dir={tmp_path}",
                             "training.data_windows=account"])
    corpus = corpus_from_config(cfg.training, cfg.model)
    meta = round_meta(0, 0, cfg.model, cfg.diloco, run_rounds=0, num_stages=1, threads=1)
    state = initial_replica_state(meta, cfg.model, cfg.training, cfg.diloco, cfg.compression)
    states, payloads = [state.stages[0].to_bytes()], []
    for outer_round in range(3):  # the node's rounds, as its own rerun gives them
        previous = {0: [payloads[-1]]} if outer_round > 0 else None
        rerun = reexecute(state, corpus, cfg.model, cfg.training, cfg.diloco, cfg.compression,
                          previous_contributions=previous, data_key=ALICE)
        payloads.append(rerun.payloads[0])
        state = rerun.next_state
        states.append(state.stages[0].to_bytes())
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    anchor = hashlib.sha256(states[0]).hexdigest()
    (blobs / anchor).write_bytes(states[0])
    for key, same in ((ALICE, True), (BOB, False)):
        rounds = {r: ReplayRound(previous={0: [payloads[r - 1]]} if r else {}, data_key=key)
                  for r in range(3)}
        job = tmp_path / f"job-{key.hex()[:4]}"
        write_job(job, cfg.to_dict(), blobs, [anchor], 3, rounds)
        assert (replay(job)["hashes"] == [hashlib.sha256(states[3]).hexdigest()]) == same
