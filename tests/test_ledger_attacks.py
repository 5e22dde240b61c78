"""Issue 28's attacks on the ledger, each tried as an attacker would, each refused with its named error.

Items 2 (one member locks every stake), 3 (anyone blocks every pull), 5 (slashes dodged), 6 (k bought seats
are a quorum) and the registry half of 7 (one bogus registration fails every run's audit); every test runs on
py-evm and on a real anvil (the ``deployment`` fixture). docs/LEDGER.md's attacker table lists the outcomes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from ledger_fixtures import SHORT_WINDOWS, digest, mine, node_key, raw_public_key

from ledger import errors
from ledger.attest import Verdict
from ledger.checks import check_chain_record
from ledger.runparams import MAX_UNBONDING_BLOCKS, MIN_WINDOW_BLOCKS

#: The platform a joiner declares (docs/DILOCOX.md section 11): any 32 bytes serve the membership rules here.
PLATFORM = b"\x5a" * 32

STAKE = 10**15
BOND = 10**14


def balance_change(w3, address: str, before: int, tx: str | None = None) -> int:
    """``address``'s balance now minus ``before``, adding back the gas ``tx`` cost it (if it sent it)."""
    spent = 0
    if tx is not None:
        receipt = w3.eth.get_transaction_receipt(tx)
        spent = receipt["gasUsed"] * receipt["effectiveGasPrice"]
    return w3.eth.get_balance(address) - before + spent


# ---------------------------------------------------------------------- item 2: accusations lock stakes
def test_attack_accusing_for_free_is_refused(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND)
    accuser, accused = run.client(1), run.client(3)
    for bond in (0, BOND - 1, BOND + 1):
        with pytest.raises(errors.LedgerBondMismatch) as raised:
            accuser.accuse(run.run_id, accused.address, digest("no evidence"), bond=bond)
        assert raised.value.values == {"required": BOND, "sent": bond}
    accuser.accuse(run.run_id, accused.address, digest("no evidence"))  # the run's bond
    assert deployment.w3.eth.get_balance(deployment.ledger) == 3 * STAKE + BOND
    state = accuser.accusation(run.run_id, accused.address, digest("no evidence"))
    assert (state.status, state.accuser, state.bond, state.quorum) == ("open", accuser.address, BOND, 2)
    assert state.deadline == state.opened_block + accuser.run_info(run.run_id).accusation_blocks


def test_attack_an_accusation_that_nobody_decides_lapses_and_frees_the_stake(deployment):
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND,
                                accusation_blocks=MIN_WINDOW_BLOCKS, dispute_blocks=MIN_WINDOW_BLOCKS,
                                max_game_steps=1)  # SHORT_WINDOWS: an unbonding of 40 blocks
    accuser, accused = run.client(1), run.client(3)
    evidence = digest("evidence never served")
    accuser.accuse(run.run_id, accused.address, evidence)
    state = accuser.accusation(run.run_id, accused.address, evidence)
    accused.leave_run(run.run_id)
    with pytest.raises(errors.LedgerAccusationNotExpired) as raised:
        accused.expire_accusation(run.run_id, accused.address, evidence)
    assert raised.value.values["deadline"] == state.deadline
    mine(w3, state.deadline - w3.eth.block_number)
    # At the deadline a verdict is too late, of either kind ...
    cleared = Verdict(run.run_id, accused.address, evidence, False)
    with pytest.raises(errors.LedgerAccusationExpired):
        accuser.resolve_accusation(cleared, [run.client(i).sign_verdict(cleared) for i in (1, 2)])
    # ... and anyone, here the accused itself, lapses it: the bond is forfeited, the stake is free of it.
    accused.expire_accusation(run.run_id, accused.address, evidence)
    assert accused.accusation_status(run.run_id, accused.address, evidence) == "expired"
    assert accused.member(run.run_id, accused.address).open_accusations == 0
    assert accused.forfeited_total() == BOND and accused.slashed_total() == 0
    with pytest.raises(errors.LedgerAccusationNotOpen):
        accused.expire_accusation(run.run_id, accused.address, evidence)
    mine(w3, accused.member(run.run_id, accused.address).unbonding_end - w3.eth.block_number)
    before = w3.eth.get_balance(accused.address)
    tx = accused.withdraw_stake(run.run_id)
    assert balance_change(w3, accused.address, before, tx) == STAKE
    [record] = accused.history(run.run_id).accusations
    assert record.expired_block is not None and not record.open and record.bond == BOND


def test_attack_members_that_left_still_clear_the_accused(deployment):
    """Before: only Active members could sign a verdict, so once the honest members left, nobody could."""
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=STAKE, bond=BOND, **SHORT_WINDOWS)
    accuser, accused = run.client(1), run.client(4)
    evidence = digest("a grudge")
    accuser.accuse(run.run_id, accused.address, evidence)
    for index in (2, 3):
        run.client(index).leave_run(run.run_id)  # the honest members leave: they are unbonding
    cleared = Verdict(run.run_id, accused.address, evidence, False)
    accused.resolve_accusation(cleared, [run.client(i).sign_verdict(cleared) for i in (2, 3)])
    assert accused.accusation_status(run.run_id, accused.address, evidence) == "cleared"
    assert accused.forfeited_total() == BOND  # not guilty: the accuser's bond is gone
    events = accused.history(run.run_id)
    assert [a.signers for a in events.accusations] == [
        tuple(sorted((run.client(2).address, run.client(3).address), key=lambda a: int(a, 16)))
    ]
    accused.leave_run(run.run_id)
    mine(w3, accused.run_info(run.run_id).unbonding_blocks)
    accused.withdraw_stake(run.run_id)


def test_attack_seats_bought_after_the_accusation_cannot_decide_it(deployment):
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND)
    accuser, accused = run.client(1), run.client(3)
    evidence = digest("re-execution differs")
    accuser.accuse(run.run_id, accused.address, evidence)
    opened = accuser.accusation(run.run_id, accused.address, evidence).opened_block
    for index in (5, 6):  # the accused's friends buy seats afterwards to clear it
        deployment.register(index)
        deployment.client(index).join_run(run.run_id)
    cleared = Verdict(run.run_id, accused.address, evidence, False)
    with pytest.raises(errors.LedgerSignerNotInForce) as raised:
        accused.resolve_accusation(cleared, [deployment.client(i).sign_verdict(cleared) for i in (5, 6)])
    assert raised.value.values["openedBlock"] == opened
    # A member that left before the accusation was opened cannot decide it either.
    run.client(2).leave_run(run.run_id)
    late = digest("second accusation")
    accuser.accuse(run.run_id, accused.address, late)
    guilty = Verdict(run.run_id, accused.address, late, True)
    with pytest.raises(errors.LedgerSignerNotInForce):
        accuser.resolve_accusation(guilty, [run.client(i).sign_verdict(guilty) for i in (1, 2)])


def test_a_guilty_verdict_returns_the_bond(deployment):
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND)
    accuser, accused = run.client(1), run.client(3)
    evidence = digest("the rerun differs")
    accuser.accuse(run.run_id, accused.address, evidence)
    guilty = Verdict(run.run_id, accused.address, evidence, True)
    before = w3.eth.get_balance(accuser.address)
    run.client(2).resolve_accusation(guilty, [run.client(i).sign_verdict(guilty) for i in (1, 2)])
    assert balance_change(w3, accuser.address, before) == BOND
    assert accused.member(run.run_id, accused.address).status == "slashed"
    assert (accused.slashed_total(), accused.forfeited_total()) == (STAKE, 0)


# ---------------------------------------------------------------------- item 3: disputes block every pull
def test_attack_an_outsider_stakes_into_a_finished_run_and_disputes_it(deployment):
    """Before: anyone bonded could dispute any round, differing only in eval loss, at no cost."""
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, bond=BOND)
    committed = [run.commit()[0] for _ in range(3)]
    deployment.register(6)
    outsider = deployment.client(6)
    outsider.join_run(run.run_id)  # stakes into the run after its rounds were committed
    for record in committed:
        loss_only = replace(record, eval_loss_micro=record.eval_loss_micro + 1)
        with pytest.raises(errors.LedgerDisputeOnlyMetrics):
            outsider.dispute(loss_only, outsider.sign_record(loss_only))
        weights = replace(record, weights_root=digest("a back door"))
        with pytest.raises(errors.LedgerNotInForce) as raised:
            outsider.dispute(weights, outsider.sign_record(weights))
        assert raised.value.values == {"runId": run.run_id, "round": record.round,
                                       "account": outsider.address}
    assert all(outsider.dispute_count(run.run_id, r) == 0 for r in range(3))


def test_disputes_need_the_bond_the_window_and_a_replayable_field(deployment):
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3, 4), quorum=2, min_stake=STAKE, bond=BOND,
                                dispute_blocks=MIN_WINDOW_BLOCKS, max_game_steps=1)  # unbonding: 8 + 4 x 64
    leaver, disputer = run.client(4), run.client(3)
    leaver.leave_run(run.run_id)  # left before round 0 was committed: not in force at it
    committed, _ = run.commit(signers=(1, 2))
    mine_ = replace(committed, checkpoint_hash=digest("the checkpoint I assembled"))
    for bond in (0, BOND - 1, BOND + 1):  # the run's bond only: a wei over refused too (dispute-bond-short)
        with pytest.raises(errors.LedgerBondMismatch) as raised:
            disputer.dispute(mine_, disputer.sign_record(mine_), bond=bond)
        assert raised.value.values == {"required": BOND, "sent": bond}
    with pytest.raises(errors.LedgerNotInForce):
        leaver.dispute(mine_, leaver.sign_record(mine_))
    with pytest.raises(errors.LedgerNotCommittedRecord):  # the comparison is against the committed record
        disputer.dispute(mine_, disputer.sign_record(mine_), committed=replace(committed, tokens=1))
    tokens_only = replace(committed, tokens=1, num_contributors=9, train_loss_micro=1)
    with pytest.raises(errors.LedgerDisputeOnlyMetrics):
        disputer.dispute(tokens_only, disputer.sign_record(tokens_only))
    disputer.dispute(mine_, disputer.sign_record(mine_))  # a checkpoint hash differs: decided by replay
    # The bond is held by the dispute case, apart from the
    # stake: forfeited unless a verdict overturns the round.
    assert disputer.member(run.run_id, disputer.address).stake == STAKE
    assert disputer.dispute_case(run.run_id, 0)[0] == "open"
    assert disputer.disputers_of(run.run_id, 0) == [disputer.address]
    assert [d.record for d in disputer.disputes(run.run_id, 0)] == [mine_]
    # A member in force at the round that left since may still dispute, within the window.
    run.client(2).leave_run(run.run_id)
    theirs = replace(committed, weights_root=digest("member 2's weights"))
    # a member's signature is its dispute only by its own tx
    with pytest.raises(errors.LedgerDisputerNotSender):
        run.client(1).dispute(theirs, run.client(2).sign_record(theirs))
    run.client(2).dispute(theirs, run.client(2).sign_record(theirs))
    end = disputer.dispute_window_end(run.run_id, 0)
    assert end == disputer.commit_block_of(run.run_id, 0) + MIN_WINDOW_BLOCKS
    mine(w3, end - w3.eth.block_number)
    late = replace(committed, contributions_root=digest("late"))
    with pytest.raises(errors.LedgerDisputeWindowClosed) as raised:
        run.client(1).dispute(late, run.client(1).sign_record(late))
    assert raised.value.values["closedAt"] == end
    assert disputer.dispute_count(run.run_id, 0) == 2
    # No verdict by the case's deadline: the disputes lapse, the record stands and both bonds are forfeited
    # (a dispute costs its bond unless a verdict overturns the round); the stake comes back whole.
    status, deadline, count = disputer.dispute_case(run.run_id, 0)
    assert (status, count) == ("open", 2)
    assert not disputer.is_final(run.run_id, 0)
    with pytest.raises(errors.LedgerDisputeNotExpired):
        disputer.expire_dispute(run.run_id, 0)
    mine(w3, deadline - w3.eth.block_number)
    forfeited = disputer.forfeited_total()
    disputer.expire_dispute(run.run_id, 0)
    assert disputer.dispute_case(run.run_id, 0)[0] == "lapsed" and disputer.is_final(run.run_id, 0)
    assert disputer.forfeited_total() - forfeited == 2 * BOND
    disputer.leave_run(run.run_id)
    mine(w3, disputer.run_info(run.run_id).unbonding_blocks)
    before = w3.eth.get_balance(disputer.address)
    tx = disputer.withdraw_stake(run.run_id)
    assert balance_change(w3, disputer.address, before, tx) == STAKE


# ---------------------------------------------------------------------- item 5: slashes dodged
def test_attack_zero_unbonding_is_refused(deployment):
    client = deployment.client(1)
    with pytest.raises(errors.LedgerUnbondingTooShort) as raised:
        client.create_run(digest("c"), 1, 1, unbonding_blocks=0)
    assert raised.value.values == {"unbondingBlocks": 0, "minimum": 128}
    with pytest.raises(errors.LedgerUnbondingTooShort):
        client.create_run(digest("c"), 1, 1, accusation_blocks=8, dispute_blocks=8, unbonding_blocks=15)
    for accusation_blocks, dispute_blocks in ((0, 8), (8, 0), (7, 8), (MAX_UNBONDING_BLOCKS + 1, 8)):
        with pytest.raises(errors.LedgerBadWindow):
            client.create_run(
                digest("c"), 1, 1, accusation_blocks=accusation_blocks, dispute_blocks=dispute_blocks,
                unbonding_blocks=MAX_UNBONDING_BLOCKS,
            )


def test_attack_an_equivocator_leaves_and_withdraws_before_the_report(deployment):
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, accusation_blocks=8, dispute_blocks=8)
    cheat = run.client(3)
    honest = run.next_record()
    forked = replace(honest, weights_root=digest("forked"))
    signatures = (cheat.sign_record(honest), cheat.sign_record(forked))
    cheat.leave_run(run.run_id)
    mine(w3, 1)
    with pytest.raises(errors.LedgerStillUnbonding) as raised:
        cheat.withdraw_stake(run.run_id)  # the next block: 15 blocks too early
    assert raised.value.values["unbondingEnd"] >= w3.eth.block_number + 14
    run.client(1).report_equivocation(honest, signatures[0], forked, signatures[1])
    assert cheat.member(run.run_id, cheat.address).status == "slashed"


def test_attack_an_absurd_unbonding_cannot_trap_stakes(deployment):
    client = deployment.client(1)
    with pytest.raises(errors.LedgerUnbondingTooLong) as raised:
        client.create_run(digest("c"), 1, 1, unbonding_blocks=2**64 - 1)
    assert raised.value.values == {"unbondingBlocks": 2**64 - 1, "maximum": MAX_UNBONDING_BLOCKS}
    # The longest allowed unbonding cannot overflow leaveRun.
    run = deployment.member_run((1, 2), quorum=1, unbonding_blocks=MAX_UNBONDING_BLOCKS)
    run.client(2).leave_run(run.run_id)
    seat = run.client(2).member(run.run_id, run.client(2).address)
    assert seat.unbonding_end == deployment.w3.eth.block_number + MAX_UNBONDING_BLOCKS


# ---------------------------------------------------------------------- item 6: bought seats
def test_attack_k_fresh_stakes_are_not_a_quorum_of_a_large_run(deployment):
    run = deployment.member_run((1, 2, 3, 4, 5, 6), quorum=2, quorum_bps=6666, min_stake=STAKE)
    client = run.client(1)
    assert client.quorum_of(run.run_id) == 4  # ceil(0.6666 x 6)
    for index in (7, 8):  # two fresh stakes
        deployment.register(index)
        deployment.client(index).join_run(run.run_id)
    assert client.quorum_of(run.run_id) == 6  # ceil(0.6666 x 8): they raised the bar they must clear
    backdoored = run.next_record("back door")
    with pytest.raises(errors.LedgerQuorumNotMet) as raised:
        deployment.client(7).commit_round(backdoored,
                                          [deployment.client(i).sign_record(backdoored) for i in (7, 8)])
    assert raised.value.values == {"quorum": 6, "signers": 2}
    # The honest members' record commits; the audit recomputes the quorum each commit needed.
    run.commit(signers=(1, 2, 3, 4, 5, 6))
    history = client.history(run.run_id)
    checks = check_chain_record(client, history, check_code=False)
    assert checks.ok, checks.problems
    too_few = replace(history,
                      commits=[replace(history.commits[0], attesters=history.commits[0].attesters[:5])])
    assert "quorum is 6 (k 2, 6666 bps of 8 counted members)" in check_chain_record(
        client, too_few, check_code=False
    ).attesters[0].reason
    # A verdict's quorum is fixed when the accusation opens, over every counted member, the accused included.
    client.accuse(run.run_id, run.client(6).address, digest("evidence"))
    # ceil(.6666 x 8)
    assert client.accusation(run.run_id, run.client(6).address, digest("evidence")).quorum == 6


def test_silent_members_are_ejected_and_the_run_commits_without_them(deployment):
    w3 = deployment.w3
    run = deployment.member_run((1, 2, 3, 4, 5), quorum=2, quorum_bps=5000, inactivity_rounds=2,
                                **SHORT_WINDOWS)
    client = run.client(1)
    assert client.quorum_of(run.run_id) == 3
    with pytest.raises(errors.LedgerMemberNotInactive):  # a fresh member is not silent yet
        client.eject_inactive(run.run_id, run.client(5).address)
    # Members 4 and 5 go silent; 1, 2 and 3 are still a quorum and commit two rounds.
    for _ in range(2):
        run.commit(signers=(1, 2, 3))
    with pytest.raises(errors.LedgerMemberNotInactive) as raised:
        client.eject_inactive(run.run_id, run.client(3).address)  # signed the last round
    assert raised.value.values["missedRounds"] == 0
    # Member 3 goes silent too: two signatures are not a quorum of five members.
    record = run.next_record()
    with pytest.raises(errors.LedgerQuorumNotMet):
        client.commit_round(record, run.sign(record, (1, 2)))
    # Anyone ejects the silent ones (here an outsider): they stop counting, and 1 and 2 commit.
    outsider = deployment.client(7)
    for index in (4, 5):
        outsider.eject_inactive(run.run_id, run.client(index).address)
    assert client.member_count(run.run_id) == 3 and client.quorum_of(run.run_id) == 2
    client.commit_round(record, run.sign(record, (1, 2)))
    seat = client.member(run.run_id, run.client(4).address)
    assert seat.status == "unbonding" and seat.left_round == 2 and seat.active_round == 0
    ejected = [m for m in client.history(run.run_id).memberships if m.ejected is not None]
    assert [m.account for m in ejected] == [run.client(4).address, run.client(5).address]
    assert all(m.left is not None for m in ejected)  # the period ended like a leave
    # An ejected member is not slashed: it withdraws after unbonding, and may join again.
    mine(w3, client.run_info(run.run_id).unbonding_blocks)
    run.client(4).withdraw_stake(run.run_id)
    run.client(4).join_run(run.run_id)


# ---------------------------------------------------------------------- item 7: the registry
def test_attack_a_bogus_registration_elsewhere_does_not_fail_the_run(deployment):
    run = deployment.member_run((1, 2), quorum=2)
    run.commit()
    squatter = deployment.client(6)
    squatter.register(raw_public_key(node_key(99)), bytes(range(64)))  # a key it never proved control of
    client = run.client(1)
    checks = check_chain_record(client, client.history(run.run_id), check_code=False)
    assert checks.ok, checks.problems  # not the run's: a note
    assert len(checks.registrations) == 2
    [note] = checks.notes
    assert squatter.address in note and "not used by run" in note and "forged registration" in note
    # Once the squatter takes a seat with that key, the run uses it: a failure.
    squatter.join_run(run.run_id)
    checks = check_chain_record(client, client.history(run.run_id), check_code=False)
    assert not checks.ok and not checks.notes
    assert any(squatter.address in problem and "forged registration" in problem
               for problem in checks.problems)


# ---------------------------------------------------------------------- the node side
def test_a_node_refuses_to_join_a_run_below_the_unbonding_floor(deployment):
    """The contract refuses such runs; a node checks again before staking (a run of another ledger build)."""
    from node.errors import NotRegistered
    from node.live.chain.onchain import NodeChain

    class ZeroUnbonding(NodeChain):  # a run as an older ledger would have recorded it
        def run_info(self, run_id):
            return replace(super().run_info(run_id), unbonding_blocks=0)

    run = deployment.member_run((1,), quorum=1)
    joiner = deployment.register(5)
    with pytest.raises(NotRegistered, match="unbonds stakes in 0 blocks"):
        ZeroUnbonding(joiner).ensure_member(run.run_id, PLATFORM)
    assert joiner.member(run.run_id, joiner.address) is None  # nothing staked
    NodeChain(joiner).ensure_member(run.run_id, PLATFORM)
    assert joiner.member(run.run_id, joiner.address).active
