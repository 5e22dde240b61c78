"""TrainingLedger round commits through LedgerClient: quorum signatures, round rules, attacks, history.

Every test runs on py-evm and on a real anvil (the ``deployment`` fixture). Each attack must fail with its
named custom error.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from ledger_fixtures import deploy, digest, make_record

from ledger import errors
from ledger.account import dev_account
from ledger.attest import record_struct_hash, sign_record
from ledger.checks import check_attesters, check_hash_chain
from ledger.hashchain import next_head
from ledger.runparams import DEFAULT_MAX_GAME_STEPS

SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141


@pytest.fixture
def run(deployment):
    """A run with quorum 3 and members dev accounts 1-4."""
    return deployment.member_run((1, 2, 3, 4), quorum=3)


def test_create_run_records_its_shape(deployment):
    client = deployment.client(3)  # creating a run needs no registration
    first = client.create_run(digest("a"), 1, 10)
    second = client.create_run(
        digest("b"), 4, 500, "ipfs://config", min_stake=70, quorum=5, quorum_bps=6000, bond=3,
        unbonding_blocks=800, accusation_blocks=100, dispute_blocks=200, inactivity_rounds=4, max_rounds=100,
        max_game_steps=2,
    )
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
    assert (info.min_stake, info.quorum, info.unbonding_blocks, info.max_rounds) == (70, 5, 800, 100)
    assert info.max_game_steps == 2
    assert (info.quorum_bps, info.bond, info.accusation_blocks, info.dispute_blocks, info.inactivity_rounds) \
        == (
        6000, 3, 100, 200, 4)
    # The defaults: the security model's floor (k 2, half the counted members), a tenth of the stake as bond,
    # unbonding at its floor: the longest proof window (issue 62), dispute + (2 steps + 2) accusation windows.
    first_info = client.run_info(first)
    assert (first_info.quorum, first_info.quorum_bps, first_info.bond) == (2, 5000, 0)
    assert first_info.tenure_rounds == 4
    assert first_info.max_game_steps == DEFAULT_MAX_GAME_STEPS
    assert first_info.unbonding_blocks == first_info.min_unbonding_blocks \
        == 64 + (2 * DEFAULT_MAX_GAME_STEPS + 2) * 64
    assert [run.run_id for run in client.find_runs(digest("a"))] == [first]
    assert client.last_round(first) is None and client.commit_count(first) == 0
    with pytest.raises(errors.LedgerBadRunShape):
        client.create_run(digest("c"), 0, 10)
    with pytest.raises(errors.LedgerWeakParams):  # below the model's floor: refused before any transaction
        client.create_run(digest("c"), 1, 10, quorum=1)
    with pytest.raises(errors.LedgerWeakParams):
        client.create_run(digest("c"), 1, 10, quorum_bps=4999)
    with pytest.raises(errors.LedgerBadQuorum):
        client.create_run(digest("c"), 1, 10, quorum=0, allow_weak_quorum=True)
    with pytest.raises(errors.LedgerBadTenure):
        client.create_run(digest("c"), 1, 10, tenure_rounds=0)
    with pytest.raises(errors.LedgerBadQuorum):
        client.create_run(digest("c"), 1, 10, quorum_bps=10_001)
    with pytest.raises(errors.LedgerBadInactivityRounds):
        client.create_run(digest("c"), 1, 10, inactivity_rounds=0)
    with pytest.raises(errors.LedgerZeroHash):
        client.create_run(bytes(32), 1, 10)
    with pytest.raises(errors.LedgerBadGameSteps):
        client.create_run(digest("c"), 1, 10, max_game_steps=0, unbonding_blocks=300)
    # (issue 62) a stake must outlive every proof of a round its member attested: one block short is refused
    with pytest.raises(errors.LedgerUnbondingBelowProofWindow):
        client.create_run(digest("c"), 1, 10, unbonding_blocks=first_info.min_unbonding_blocks - 1)
    with pytest.raises(errors.LedgerError):
        client.run_info(99)


def test_happy_path_three_of_four_members(run):
    client = run.client(2)  # any member may submit
    records = []
    for round in range(3):
        record = run.next_record()
        signers = ((1, 2, 3), (2, 3, 4), (4, 1, 3))[round]  # any 3 of the 4, in any order
        client.commit_round(record, run.sign(record, signers))
        records.append(record)
    assert client.last_round(run.run_id) == 2 and client.commit_count(run.run_id) == 3
    assert [client.commit_of(run.run_id, r) for r in range(3)] == records
    assert client.commit_of(run.run_id, 3) is None
    assert client.record_hash_of(run.run_id, 1) == record_struct_hash(records[1])
    history = client.history(run.run_id)
    addresses = {i: run.client(i).address for i in range(1, 5)}
    expected = [sorted((addresses[i] for i in s), key=lambda a: int(a, 16))
                for s in ((1, 2, 3), (2, 3, 4), (1, 3, 4))]
    assert [list(c.attesters) for c in history.commits] == expected
    assert all(c.submitter == client.address for c in history.commits)
    assert all(item.ok for item in check_attesters(history))
    assert client.member_count(run.run_id) == 4


def test_commit_is_idempotent_and_conflicts_are_named(run):
    client = run.client(1)
    record, first = run.commit()
    block = run.deployment.w3.eth.block_number
    assert client.commit_round(record, run.sign(record)) == first  # nothing sent
    # another member, same record
    assert run.client(3).commit_round(record, run.sign(record, (2, 3, 4))) == first
    assert run.deployment.w3.eth.block_number == block
    other = replace(record, weights_root=digest("other"))
    with pytest.raises(errors.CommitConflict) as conflict:
        client.commit_round(other, run.sign(other))
    assert conflict.value.on_chain == record and conflict.value.attempted == other


def test_round_rules(deployment):
    run = deployment.member_run((1, 2), quorum=2, max_rounds=2)
    client = run.client(1)
    head = client.head_of(run.run_id)
    jump = make_record(run.run_id, 1, head)
    with pytest.raises(errors.LedgerRoundNotNext) as raised:
        client.commit_round(jump, run.sign(jump))
    assert raised.value.values == {"expected": 0, "got": 1}
    huge = replace(jump, round=2**64 - 1)  # the freeze attack of issue 11
    with pytest.raises(errors.LedgerRoundNotNext):
        client.commit_round(huge, run.sign(huge))
    run.commit()
    run.commit()
    beyond = run.next_record()
    with pytest.raises(errors.LedgerRoundBeyondMax) as raised:
        client.commit_round(beyond, run.sign(beyond))
    assert raised.value.values == {"maxRounds": 2, "got": 2}
    unknown = make_record(run.run_id + 1, 0, head)
    with pytest.raises(errors.LedgerUnknownRun):
        client.commit_round(unknown, run.sign(unknown))
    with pytest.raises(errors.LedgerInputError):
        make_record(run.run_id, -1, head)
    assert client.commit_count(run.run_id) == 2


def test_zero_roots_are_refused(run):
    record = replace(run.next_record(), contributions_root=bytes(32))
    with pytest.raises(errors.LedgerZeroHash):
        run.client(1).commit_round(record, run.sign(record))


def test_signatures_cannot_be_replayed_on_a_later_round(run):
    client = run.client(1)
    record, _ = run.commit()
    # The same signed content moved to the next round keeps its old prevHead: the head has moved on.
    moved = replace(record, round=1)
    with pytest.raises(errors.LedgerStaleHead) as raised:
        client.commit_round(moved, run.sign(moved))
    assert raised.value.values["head"] == client.head_of(run.run_id)
    # The very signatures of round 0 over a round-1 record recover to strangers.
    fresh = run.next_record()
    with pytest.raises(errors.LedgerSignerNotMember):
        client.commit_round(fresh, run.sign(record))


def test_an_outsider_cannot_commit(run):
    outsider = run.deployment.register(5)  # registered, but not a member of the run
    record = run.next_record()
    with pytest.raises(errors.LedgerNotMember) as raised:
        outsider.commit_round(record, run.sign(record))
    assert raised.value.values["account"] == outsider.address
    assert outsider.commit_of(run.run_id, 0) is None


def test_fewer_than_quorum_signatures_fail(run):
    record = run.next_record()
    with pytest.raises(errors.LedgerQuorumNotMet) as raised:
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
    assert raised.value.values == {"quorum": 3, "signers": 2}
    with pytest.raises(errors.LedgerQuorumNotMet):
        run.client(1).commit_round(record, [])


def test_non_member_signatures_fail(run):
    deployment = run.deployment
    deployment.register(5)
    record = run.next_record()
    signatures = run.sign(record, (1, 2)) + [deployment.client(5).sign_record(record)]
    with pytest.raises(errors.LedgerSignerNotMember) as raised:
        run.client(1).commit_round(record, signatures)
    assert raised.value.values["signer"] == deployment.client(5).address


def test_signatures_of_another_run_chain_or_ledger_fail(run):
    deployment = run.deployment
    client = run.client(1)
    record = run.next_record()
    other_run = replace(record, run_id=run.run_id + 1)
    other_ledger = deploy(deployment.w3)
    accounts = [run.client(i).account for i in (1, 2, 3)]
    forgeries = {
        "another run": run.sign(other_run),
        "another chain id": [sign_record(a, record, client.chain_id + 1, client.ledger_address)
                             for a in accounts],
        "another ledger": [sign_record(a, record, client.chain_id, other_ledger.ledger) for a in accounts],
    }
    for what, signatures in forgeries.items():
        with pytest.raises(errors.LedgerSignerNotMember):
            client.commit_round(record, signatures)
            pytest.fail(f"signatures of {what} were accepted")
    assert client.commit_count(run.run_id) == 0


def test_duplicate_signer_and_malleable_signatures_fail(run):
    client = run.client(1)
    record = run.next_record()
    [one, two, three] = run.sign(record)
    with pytest.raises(errors.LedgerSignersNotAscending):
        client.commit_round(record, [one, two, two])
    # The high-s twin of a valid signature recovers the same signer; the contract refuses it.
    s = int.from_bytes(three[32:64], "big")
    twin = three[:32] + (SECP256K1_N - s).to_bytes(32, "big") + bytes([55 - three[64]])
    with pytest.raises(errors.LedgerInvalidSignature):
        client.commit_round(record, [one, two, twin])
    with pytest.raises(errors.LedgerInvalidSignature):
        client.commit_round(record, [one, two, three[:64] + b"\x05"])
    with pytest.raises(errors.LedgerInputError):
        client.commit_round(record, [one, two, three[:64]])  # not 65 bytes: refused before sending


def test_commit_gas_with_three_signers_is_bounded(run):
    client = run.client(1)
    run.commit()  # the run's first commit is measured in the bench
    gas = {}
    for contributors in (4, 64, 4096):
        _, tx = run.commit(contributors=contributors)
        gas[contributors] = run.deployment.w3.eth.get_transaction_receipt(tx)["gasUsed"]
    _, tx = run.commit(checkpoint_hash=digest("ckpt"))
    with_checkpoint = run.deployment.w3.eth.get_transaction_receipt(tx)["gasUsed"]
    # The signatures, the record's hash, the head, and the attesters' hash a round verdict slashes by
    # (docs/LEDGER.md, "Gas"); a checkpoint adds its hash.
    assert max(gas.values()) <= 170_000 and with_checkpoint <= 195_000
    assert max(gas.values()) - min(gas.values()) <= 200  # a few calldata bytes differ, nothing else
    assert client.commit_count(run.run_id) == 5


def test_hash_chain_head_matches_replay(run):
    client = run.client(1)
    genesis = client.head_of(run.run_id)
    records = [run.commit()[0] for _ in range(3)]
    history = client.history(run.run_id)
    assert history.run.genesis_head == genesis == records[0].prev_head
    assert records[1].prev_head == next_head(genesis, records[0]) == history.commits[0].head_hash
    assert history.head_hash == client.head_of(run.run_id) == history.commits[-1].head_hash
    sound = check_hash_chain(history, client.chain_id, client.ledger_address)
    assert sound.ok and sound.problems == [] and len(sound.links) == 3
    # Dropping or altering a commit breaks the replay at the first link after the change.
    dropped = replace(history, commits=history.commits[:1] + history.commits[2:])
    broken = check_hash_chain(dropped, client.chain_id, client.ledger_address)
    assert [link.ok for link in broken.links] == [True, False] and not broken.ok
    altered_record = replace(history.commits[1], commit=replace(history.commits[1].commit, tokens=1))
    altered = replace(history, commits=[history.commits[0], altered_record, history.commits[2]])
    broken = check_hash_chain(altered, client.chain_id, client.ledger_address)
    assert [link.ok for link in broken.links] == [True, False, True] and broken.head.ok
    assert "round 1" in broken.problems[0]


def test_checkpoints_are_published_only_with_an_attested_record(run):
    client = run.client(1)
    assert client.latest_checkpoint(run.run_id) is None
    run.commit()
    run.commit(checkpoint_hash=digest("ckpt1"))
    run.commit()
    assert client.checkpoint_of(run.run_id, 1) == digest("ckpt1")
    assert client.checkpoint_of(run.run_id, 0) is None and client.checkpoint_of(run.run_id, 2) is None
    latest = client.latest_checkpoint(run.run_id)
    assert (latest.round, latest.content_hash, latest.uri, latest.publisher) == (
        1,
        digest("ckpt1"),
        f"dlx://blob/{digest('ckpt1').hex()}",
        client.address,
    )
    assert [(c.round, c.content_hash) for c in client.history(run.run_id).checkpoints] \
        == [(1, digest("ckpt1"))]


def test_history_reads_everything_back_page_by_page(run):
    deployment = run.deployment
    client = run.client(1)
    other = deployment.member_run((1, 2, 3), quorum=2, label="other config")
    records = []
    for _ in range(4):
        records.append(run.commit()[0])
        other.commit(label="other")
    history = client.history(run.run_id)
    paged = deployment.client(1, log_page_blocks=8).history(run.run_id)
    assert paged == history
    assert history.run.run_id == run.run_id and history.run.num_stages == 2 and history.run.inner_steps == 50
    assert [record.commit for record in history.commits] == records
    blocks = [record.block_number for record in history.commits]
    assert blocks == sorted(blocks)
    assert [m.account for m in history.memberships] == [run.client(i).address for i in run.members]
    assert {r.account for r in history.registrations} == {run.client(i).address for i in (1, 2, 3, 4)}
    assert history.last_round == 3


def test_read_only_client_cannot_sign(deployment):
    from ledger.client import LedgerClient

    reader = LedgerClient(deployment.w3, None, deployment.registry, deployment.ledger)
    with pytest.raises(errors.AccountError):
        reader.sign_record(make_record(1, 0, bytes(32)))
    assert dev_account(1, deployment.w3.eth.chain_id).address != reader.address
