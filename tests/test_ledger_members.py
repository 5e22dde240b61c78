"""Run membership, unbonding, equivocation slashing, disputes and accusations, on py-evm and anvil."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ledger_fixtures import SHORT_WINDOWS, digest, mine

from ledger import errors
from ledger.attest import Verdict, record_struct_hash
from ledger.checks import check_attesters, check_chain_record

STAKE = 10**15


def test_joining_needs_registration_and_stake_and_copies_the_node_key(deployment):
    run = deployment.member_run((1, 2), quorum=2, min_stake=STAKE)
    client = run.client(1)
    seat = client.member(run.run_id, client.address)
    assert (seat.status, seat.stake, seat.node_key) == ("active", STAKE, client.key_of(client.address))
    assert deployment.w3.eth.get_balance(deployment.ledger) == 2 * STAKE
    stranger = deployment.client(5)
    with pytest.raises(errors.LedgerNotRegistered):
        stranger.join_run(run.run_id)
    deployment.register(5)
    with pytest.raises(errors.LedgerStakeTooLow) as raised:
        stranger.join_run(run.run_id, stake=STAKE - 1)
    assert raised.value.values == {"required": STAKE, "sent": STAKE - 1}
    assert client.join_run(run.run_id) == client.history(run.run_id).memberships[0].joined_tx  # idempotent
    # The seat keeps the key it joined with, whatever the registry says later.
    client.unregister()
    assert client.member(run.run_id, client.address).node_key == seat.node_key
    with pytest.raises(errors.LedgerUnknownRun):
        stranger.join_run(run.run_id + 1)


def test_leave_unbond_withdraw(deployment):
    w3 = deployment.w3
    run = deployment.member_run(
        (1, 2, 3), quorum=2, min_stake=STAKE, unbonding_blocks=40, accusation_blocks=8, dispute_blocks=8,
        max_game_steps=1,  # the floor: 8 + (2 + 2) x 8
    )
    leaver = run.client(3)
    run.commit(signers=(2, 3))
    leaver.leave_run(run.run_id)
    left_block = w3.eth.block_number
    assert leaver.member(run.run_id, leaver.address).status == "unbonding"
    assert leaver.member_count(run.run_id) == 2
    # Out of the signing set at once.
    record = run.next_record()
    with pytest.raises(errors.LedgerSignerNotMember):
        run.client(1).commit_round(record, run.sign(record, (2, 3)))
    with pytest.raises(errors.LedgerNotMember):
        leaver.commit_round(record, run.sign(record, (1, 2)))
    with pytest.raises(errors.LedgerStillUnbonding) as raised:
        leaver.withdraw_stake(run.run_id)
    assert raised.value.values["unbondingEnd"] == left_block + 40
    with pytest.raises(errors.LedgerAlreadyMember):
        leaver.join_run(run.run_id)  # withdraw first
    mine(w3, 38)
    with pytest.raises(errors.LedgerStillUnbonding):
        leaver.withdraw_stake(run.run_id)  # one block short
    mine(w3, 2)
    balance = w3.eth.get_balance(leaver.address)
    tx = leaver.withdraw_stake(run.run_id)
    receipt = w3.eth.get_transaction_receipt(tx)
    assert w3.eth.get_balance(leaver.address) == balance + STAKE - receipt["gasUsed"] \
        * receipt["effectiveGasPrice"]
    assert leaver.member(run.run_id, leaver.address) is None
    with pytest.raises(errors.LedgerNotUnbonding):
        leaver.withdraw_stake(run.run_id)
    leaver.join_run(run.run_id)  # a member that withdrew may come back: a second membership period
    # The members in force at any block, from the events alone.
    periods = leaver.memberships(run.run_id)
    assert [(m.account, m.withdrawn_block is not None) for m in periods] == [
        (run.client(1).address, False),
        (run.client(2).address, False),
        (leaver.address, True),
        (leaver.address, False),
    ]
    assert {m.account for m in leaver.members_at(run.run_id, left_block)} == {
        run.client(1).address,
        run.client(2).address,
    }
    assert {m.account for m in leaver.members_at(run.run_id, left_block - 1)} == {
        run.client(i).address for i in (1, 2, 3)
    }
    assert len(leaver.members_at(run.run_id)) == 3


def test_equivocation_slashes_and_removes_the_member(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, unbonding_blocks=400, max_game_steps=1)
    cheat = run.client(2)
    honest = run.next_record()
    forked = replace(honest, weights_root=digest("forked weights"))
    run.client(1).commit_round(honest, run.sign(honest, (1, 2)))
    reporter = deployment.client(7)  # anyone may report, member or not
    with pytest.raises(errors.LedgerNotEquivocation):
        reporter.report_equivocation(honest, cheat.sign_record(honest), honest, cheat.sign_record(honest))
    with pytest.raises(errors.LedgerDifferentSigners):
        reporter.report_equivocation(honest, cheat.sign_record(honest), forked,
                                     run.client(3).sign_record(forked))
    reporter.report_equivocation(honest, cheat.sign_record(honest), forked, cheat.sign_record(forked))
    assert cheat.member(run.run_id, cheat.address).status == "slashed"
    assert cheat.member(run.run_id, cheat.address).stake == 0
    assert cheat.slashed_total() == STAKE
    assert deployment.w3.eth.get_balance(deployment.ledger) == 3 * STAKE  # kept by the ledger for good
    assert cheat.member_count(run.run_id) == 2
    with pytest.raises(errors.LedgerNotBonded):  # nothing left to slash twice
        reporter.report_equivocation(honest, cheat.sign_record(honest), forked, cheat.sign_record(forked))
    with pytest.raises(errors.LedgerMemberSlashed):
        cheat.join_run(run.run_id)
    record = run.next_record()
    with pytest.raises(errors.LedgerSignerNotMember):
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
    with pytest.raises(errors.LedgerNotUnbonding):
        cheat.withdraw_stake(run.run_id)

    history = cheat.history(run.run_id)
    [equivocation] = history.equivocations
    assert (equivocation.account, equivocation.round, equivocation.reporter) == (cheat.address, 0,
                                                                                 reporter.address)
    assert {equivocation.record_hash_a, equivocation.record_hash_b} == {
        record_struct_hash(honest),
        record_struct_hash(forked),
    }
    assert [(s.account, s.stake) for s in history.slashings] == [(cheat.address, STAKE)]
    assert [m.slashed is not None for m in history.memberships] == [False, True, False]
    checks = check_chain_record(cheat, history, check_code=False)
    assert checks.ok, checks.problems
    assert list(checks.equivocations) == [0] and len(checks.slashings) == 1


def test_an_unbonding_member_is_still_slashable(deployment):
    run = deployment.member_run((1, 2), quorum=1, min_stake=STAKE)
    cheat = run.client(2)
    record = run.next_record()
    cheat.leave_run(run.run_id)
    other = replace(record, tokens=1)
    run.client(1).report_equivocation(record, cheat.sign_record(record), other, cheat.sign_record(other))
    assert cheat.member(run.run_id, cheat.address).status == "slashed"


def test_disputes_carry_the_disputers_signed_record(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2)
    committed, _ = run.commit(signers=(1, 2))
    disputer = run.client(3)
    mine = replace(committed, weights_root=digest("what I computed"))
    with pytest.raises(errors.LedgerRoundNotCommitted):
        disputer.dispute(replace(mine, round=1), disputer.sign_record(replace(mine, round=1)))
    with pytest.raises(errors.LedgerDisputeMatchesCommit):
        disputer.dispute(committed, disputer.sign_record(committed))
    deployment.register(5)
    outsider = deployment.client(5)
    with pytest.raises(errors.LedgerNotBonded):
        outsider.dispute(mine, outsider.sign_record(mine))
    signature = disputer.sign_record(mine)
    with pytest.raises(errors.LedgerDisputerNotSender):  # nobody files a member's gossiped signature for it
        run.client(1).dispute(mine, signature)
    disputer.dispute(mine, signature)
    with pytest.raises(errors.LedgerAlreadyDisputed):
        disputer.dispute(mine, signature)
    assert disputer.dispute_count(run.run_id, 0) == 1
    # A dispute stays on chain: nothing withdraws it, not even leaving the run.
    disputer.leave_run(run.run_id)
    history = disputer.history(run.run_id)
    [dispute] = history.disputes
    assert (dispute.disputer, dispute.round, dispute.record, dispute.signature) == (
        disputer.address,
        0,
        mine,
        signature,
    )
    assert disputer.dispute_count(run.run_id, 0) == 1
    checks = check_chain_record(disputer, history, check_code=False)
    assert checks.disputed_rounds == [0] and checks.disputes[0] == [dispute]


def test_accusation_blocks_withdrawal_and_a_guilty_verdict_slashes(deployment):
    # An accusation window of 32 blocks, past the 10 blocks it must outlast; the unbonding, 8 + 4 x 32 blocks.
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=STAKE, **{**SHORT_WINDOWS,
                                                                             "accusation_blocks": 32})
    accused = run.client(4)
    evidence = digest("re-execution of round 0 differs")
    with pytest.raises(errors.LedgerNotMember):
        deployment.client(6).accuse(run.run_id, accused.address, evidence)
    accused.leave_run(run.run_id)  # an unbonding member is still accusable (and slashable)
    mine(deployment.w3, accused.run_info(run.run_id).unbonding_blocks - 10)
    run.client(1).accuse(run.run_id, accused.address, evidence)  # late in its unbonding
    with pytest.raises(errors.LedgerAccusationExists):
        run.client(2).accuse(run.run_id, accused.address, evidence)
    assert accused.accusation_status(run.run_id, accused.address, evidence) == "open"
    mine(deployment.w3, 10)
    with pytest.raises(errors.LedgerAccusationPending) as raised:
        accused.withdraw_stake(run.run_id)  # unbonding is over, the accusation is not
    assert raised.value.values["openAccusations"] == 1

    guilty = Verdict(run.run_id, accused.address, evidence, True)
    with pytest.raises(errors.LedgerQuorumNotMet):  # the accused's own signature does not count
        run.client(1).resolve_accusation(guilty,
                                         [run.client(1).sign_verdict(guilty), accused.sign_verdict(guilty)])
    with pytest.raises(errors.LedgerSignerNotMember):
        stranger = deployment.client(6).sign_verdict(guilty)
        run.client(1).resolve_accusation(guilty, [run.client(1).sign_verdict(guilty), stranger])
    run.client(2).resolve_accusation(guilty, [run.client(i).sign_verdict(guilty) for i in (1, 3)])
    assert accused.accusation_status(run.run_id, accused.address, evidence) == "guilty"
    assert accused.member(run.run_id, accused.address).status == "slashed"
    assert accused.slashed_total() == STAKE
    with pytest.raises(errors.LedgerAccusationNotOpen):
        run.client(1).resolve_accusation(guilty, [run.client(i).sign_verdict(guilty) for i in (1, 3)])
    history = accused.history(run.run_id)
    [accusation] = history.accusations
    assert (accusation.accuser, accusation.guilty, accusation.open) == (run.client(1).address, True, False)
    assert set(accusation.signers) == {run.client(1).address, run.client(3).address}
    assert [s.account for s in history.slashings] == [accused.address]


def test_a_not_guilty_verdict_clears_and_frees_the_stake(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, **SHORT_WINDOWS)
    accused = run.client(3)
    evidence = digest("suspicion")
    run.client(1).accuse(run.run_id, accused.address, evidence)
    cleared = Verdict(run.run_id, accused.address, evidence, False)
    # A guilty verdict's signatures do not resolve it as not guilty (and vice versa).
    guilty = replace(cleared, guilty=True)
    with pytest.raises(errors.LedgerSignerNotMember):
        run.client(1).resolve_accusation(cleared, [run.client(i).sign_verdict(guilty) for i in (1, 2)])
    run.client(2).resolve_accusation(cleared, [run.client(i).sign_verdict(cleared) for i in (1, 2, 3)])
    assert accused.accusation_status(run.run_id, accused.address, evidence) == "cleared"
    seat = accused.member(run.run_id, accused.address)
    assert (seat.status, seat.open_accusations, seat.stake) == ("active", 0, STAKE)
    accused.leave_run(run.run_id)
    mine(deployment.w3, accused.run_info(run.run_id).unbonding_blocks)
    accused.withdraw_stake(run.run_id)
    assert accused.member(run.run_id, accused.address) is None
    [accusation] = accused.history(run.run_id).accusations
    assert accusation.guilty is False and len(accusation.signers) == 2  # the accused's signature not counted


def test_audit_rechecks_attesters_from_membership_events(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2)
    run.commit(signers=(1, 2))
    run.client(2).leave_run(run.run_id)
    run.commit(signers=(1, 3))
    client = run.client(1)
    history = client.history(run.run_id)
    assert all(item.ok for item in check_attesters(history))
    # An attester who was not a member at the commit's block is flagged (here: the history is doctored).
    doctored = replace(
        history,
        commits=[history.commits[0], replace(history.commits[1], attesters=tuple(sorted(
            (run.client(1).address, run.client(2).address), key=lambda a: int(a, 16))))],
    )
    results = check_attesters(doctored)
    assert [item.ok for item in results] == [True, False]
    assert run.client(2).address in results[1].reason
    too_few = replace(history,
                      commits=[replace(history.commits[0], attesters=history.commits[0].attesters[:1])])
    assert "quorum is 2" in check_attesters(too_few)[0].reason
