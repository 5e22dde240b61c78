"""TrainingLedger rules through LedgerClient (runs, round commits, checkpoints, disputes, history), on both chains."""

from __future__ import annotations

import pytest
from ledger_fixtures import digest, make_commit

from ledger import errors
from ledger.checks import check_hash_chain
from ledger.records import RoundCommit


@pytest.fixture
def run(deployment):
    """(deployment, registered client of dev account 1, a fresh run id)."""
    client = deployment.register(1)
    run_id = client.create_run(digest("config"), num_stages=2, inner_steps=50, config_uri="file:///run.toml")
    return deployment, client, run_id


def test_create_run_records_its_shape(deployment):
    client = deployment.client(3)  # creating a run needs no registration
    first = client.create_run(digest("a"), 1, 10)
    second = client.create_run(digest("b"), 4, 500, "ipfs://config")
    assert (first, second) == (1, 2)
    assert client.run_count() == 2
    info = client.run_info(second)
    assert (info.config_hash, info.num_stages, info.inner_steps, info.config_uri, info.creator) == (
        digest("b"),
        4,
        500,
        "ipfs://config",
        client.address,
    )
    assert [run.run_id for run in client.find_runs(digest("a"))] == [first]
    assert client.last_round(first) is None and client.commit_count(first) == 0
    with pytest.raises(errors.LedgerBadRunShape):
        client.create_run(digest("c"), 0, 10)
    with pytest.raises(errors.LedgerZeroHash):
        client.create_run(bytes(32), 1, 10)
    with pytest.raises(errors.LedgerError):
        client.run_info(99)


def test_only_registered_nodes_commit(run):
    deployment, _, run_id = run
    outsider = deployment.client(2)
    with pytest.raises(errors.LedgerNotRegistered) as raised:
        outsider.commit_round(make_commit(run_id, 0))
    assert raised.value.values["account"].lower() == outsider.address.lower()
    with pytest.raises(errors.LedgerNotRegistered):
        outsider.publish_checkpoint(run_id, 0, digest("ckpt"), "file:///c")
    assert outsider.commit_of(run_id, 0) is None


def test_commit_rules(run):
    deployment, client, run_id = run
    first = client.commit_round(make_commit(run_id, 0))
    client.commit_round(make_commit(run_id, 1))
    client.commit_round(make_commit(run_id, 5))  # rounds may skip, never go back
    assert client.last_round(run_id) == 5 and client.commit_count(run_id) == 3
    assert client.commit_of(run_id, 1) == make_commit(run_id, 1)
    assert client.commit_of(run_id, 2) is None

    # Identical resubmission is a no-op returning the original transaction.
    block = deployment.w3.eth.block_number
    assert client.commit_round(make_commit(run_id, 0)) == first
    assert deployment.w3.eth.block_number == block
    # Different data for a committed round conflicts; a round never committed below the last one is a rewind.
    with pytest.raises(errors.CommitConflict) as conflict:
        client.commit_round(make_commit(run_id, 5, label="other"))
    assert conflict.value.on_chain == make_commit(run_id, 5)
    with pytest.raises(errors.LedgerRoundNotIncreasing) as rewind:
        client.commit_round(make_commit(run_id, 3))
    assert rewind.value.values == {"last": 5, "got": 3}
    # Another registered node resubmitting the same data also counts as committed.
    assert deployment.register(2).commit_round(make_commit(run_id, 1)) != first

    with pytest.raises(errors.LedgerUnknownRun):
        client.commit_round(make_commit(run_id + 1, 0))
    with pytest.raises(errors.LedgerZeroHash):
        client.commit_round(RoundCommit(run_id, 6, bytes(32), digest("x"), 0, 0, 0, 0))
    with pytest.raises(errors.LedgerInputError):
        RoundCommit(run_id, -1, digest("w"), digest("c"), 0, 0, 0, 0)
    assert client.commit_count(run_id) == 3


def test_commit_gas_does_not_grow_with_contributors(run):
    deployment, client, run_id = run
    client.commit_round(make_commit(run_id, 0))  # the run's first commit is measured in the bench
    gas = {}
    for round, contributors in ((1, 4), (2, 64), (3, 4096)):
        tx = client.commit_round(make_commit(run_id, round, contributors=contributors))
        gas[contributors] = deployment.w3.eth.get_transaction_receipt(tx)["gasUsed"]
    assert max(gas.values()) <= 130_000
    assert max(gas.values()) - min(gas.values()) <= 100  # a few calldata bytes differ, nothing else


def test_hash_chain_head_matches_replay(run):
    _, client, run_id = run
    genesis = client.head_of(run_id)
    for round in range(3):
        client.commit_round(make_commit(run_id, round))
    history = client.history(run_id)
    assert history.run.genesis_head == genesis
    assert history.head_hash == client.head_of(run_id) != genesis
    assert history.commits[-1].head_hash == history.head_hash
    sound = check_hash_chain(history, client.chain_id, client.ledger_address)
    assert sound.ok and sound.problems == [] and len(sound.links) == 3
    # Dropping or altering a commit breaks the replay at the first link after the change (the replay then
    # resynchronises on the event's head, so one bad link is reported once).
    dropped = history.__class__(**{**history.__dict__, "commits": history.commits[:1] + history.commits[2:]})
    broken = check_hash_chain(dropped, client.chain_id, client.ledger_address)
    assert [link.ok for link in broken.links] == [True, False] and not broken.ok
    altered_commit = history.commits[1].commit.__class__(
        **{**history.commits[1].commit.__dict__, "tokens": 1}
    )
    altered_record = history.commits[1].__class__(**{**history.commits[1].__dict__, "commit": altered_commit})
    altered = history.__class__(
        **{**history.__dict__, "commits": [history.commits[0], altered_record, history.commits[2]]}
    )
    broken = check_hash_chain(altered, client.chain_id, client.ledger_address)
    assert [link.ok for link in broken.links] == [True, False, True] and broken.head.ok
    assert "round 1" in broken.problems[0]


def test_checkpoints(run):
    _, client, run_id = run
    assert client.latest_checkpoint(run_id) is None
    client.publish_checkpoint(
        run_id, 0, digest("initial"), "file:///ckpt-0"
    )  # initial weights, before commits
    with pytest.raises(errors.LedgerCheckpointAhead) as ahead:
        client.publish_checkpoint(run_id, 1, digest("ckpt1"), "file:///ckpt-1")
    assert ahead.value.values == {"last": 0, "got": 1}
    client.commit_round(make_commit(run_id, 0))
    client.commit_round(make_commit(run_id, 1))
    tx = client.publish_checkpoint(run_id, 1, digest("ckpt1"), "file:///ckpt-1")
    assert client.publish_checkpoint(run_id, 1, digest("ckpt1"), "file:///ckpt-1") == tx  # idempotent
    with pytest.raises(errors.LedgerCheckpointExists) as exists:
        client.publish_checkpoint(run_id, 1, digest("other"), "file:///other")
    assert exists.value.values["contentHash"] == digest("ckpt1")
    assert client.checkpoint_of(run_id, 1) == digest("ckpt1") and client.checkpoint_of(run_id, 2) is None
    latest = client.latest_checkpoint(run_id)
    assert (latest.round, latest.content_hash, latest.uri, latest.publisher) == (
        1,
        digest("ckpt1"),
        "file:///ckpt-1",
        client.address,
    )


def test_disputes(run):
    deployment, client, run_id = run
    client.commit_round(make_commit(run_id, 0))
    auditor = deployment.register(2)
    with pytest.raises(errors.LedgerRoundNotCommitted):
        auditor.dispute(run_id, 1, digest("mine"), digest("c1"))
    committed = make_commit(run_id, 0)
    with pytest.raises(errors.LedgerDisputeMatchesCommit):
        auditor.dispute(run_id, 0, committed.weights_root, committed.contributions_root)
    auditor.dispute(run_id, 0, digest("mine"), committed.contributions_root)
    with pytest.raises(errors.LedgerAlreadyDisputed):
        auditor.dispute(run_id, 0, digest("mine again"), committed.contributions_root)
    with pytest.raises(errors.LedgerNotRegistered):
        deployment.client(3).dispute(run_id, 0, digest("mine"), committed.contributions_root)
    client.dispute(run_id, 0, digest("self"), digest("self"))
    assert client.dispute_count(run_id, 0) == 2
    [first, second] = client.history(run_id).disputes
    assert (first.disputer, first.computed_weights_root, first.round) == (auditor.address, digest("mine"), 0)
    assert second.disputer == client.address


def test_history_reads_everything_back_page_by_page(run):
    deployment, client, run_id = run
    other_run = client.create_run(digest("other config"), 1, 5)
    commits = [make_commit(run_id, round) for round in range(4)]
    for commit in commits:
        client.commit_round(commit)
        client.commit_round(make_commit(other_run, commit.round, label="other"))
    client.publish_checkpoint(run_id, 3, digest("ckpt3"), "file:///3")
    deployment.register(2).dispute(run_id, 2, digest("x"), digest("y"))

    history = client.history(run_id)
    paged = deployment.client(1, log_page_blocks=8).history(run_id)
    assert paged == history
    assert history.run.run_id == run_id and history.run.num_stages == 2 and history.run.inner_steps == 50
    assert [record.commit for record in history.commits] == commits
    assert all(record.committer == client.address for record in history.commits)
    blocks = [record.block_number for record in history.commits]
    assert blocks == sorted(blocks)
    assert [(c.round, c.content_hash) for c in history.checkpoints] == [(3, digest("ckpt3"))]
    assert [(d.round, d.computed_weights_root) for d in history.disputes] == [(2, digest("x"))]
    assert {r.account for r in history.registrations} == {client.address, deployment.client(2).address}
    assert history.last_round == 3
