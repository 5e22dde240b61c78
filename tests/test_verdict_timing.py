"""The verdict timing rule (``LedgerCore.requireCountedAt``, docs/TRUST.md G3) with real transactions mined in
one block, on py-evm and on anvil (tests/chain_backends.py).

A verdict's signer must be counted before the block its quorum was counted in (a round's commit, an
accusation's opening) and, if gone, gone after it: within one block the chain cannot tell whether a seat was
counted, or left, before or after the transaction that counted the quorum. The forge campaign found both
orders as counterexamples (contracts/forge/test/VerdictTiming.t.sol replays them with ``vm.roll``); here the
transactions are real, sent unmined and mined together (anvil: ``evm_setAutomine`` off, then ``evm_mine``;
py-evm: eth-tester's auto-mine off, then ``mine_blocks``), each in the order its tip gives it.

Run shape: six founders, k = 2, quorumBps 5000 (quorum 3 of 6); 1-4 honest, 5 and 6 the coalition, 8 the
coalition's joiner (tenure 2 rounds).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ledger import errors
from ledger.attest import order_signatures, pack_signatures
from ledger.hashchain import next_head
from ledger.records import Verdict
from tests.chain_backends import chain, each_on_both, in_one_block
from tests.ledger_fixtures import deploy, digest, make_record, mine
from tests.test_trust_attacks import BOND, STAKE, six_member_run

JOINER = 8
class Block:
    """The calldata of a run's transactions, built ahead of the chain (records on a head not yet mined)."""

    def __init__(self, run):
        self.run = run
        self.reader = run.client(1)
        self.ledger = self.reader.ledger_contract
        self.head = self.reader.head_of(run.run_id)
        self.round = self.reader.commit_count(run.run_id)

    def _call(self, name: str, args: tuple) -> tuple[str, bytes]:
        return self.ledger.address, bytes.fromhex(self.ledger.encode_abi(name, args=args)[2:])

    def commit(self, signers: tuple[int, ...], label: str = "honest"):
        """The next round's record signed by ``signers``: the record and the commitRound call."""
        record = make_record(self.run.run_id, self.round, self.head, label)
        signatures = order_signatures(self.reader.record_digest(record),
                                      [self.run.client(i).sign_record(record) for i in signers])
        self.head, self.round = next_head(self.head, record), self.round + 1
        return record, self._call("commitRound", (record.fields(), pack_signatures(signatures)))

    def leave(self) -> tuple[str, bytes]:
        return self._call("leaveRun", (self.run.run_id,))

    def accuse(self, accused: int, evidence: bytes) -> tuple[str, bytes]:
        return self._call("accuse", (self.run.run_id, self.run.client(accused).address, evidence))


def _dispute(run, committed, disputer: int = 5):
    """``disputer`` disputes ``committed`` with its own signature over another record of the round."""
    other = replace(committed, weights_root=digest("the coalition's weights"))
    run.client(disputer).dispute(other, run.client(disputer).sign_record(other))


def _attesters(run, round_: int) -> tuple[str, ...]:
    return run.client(1).commit_record(run.run_id, round_).attesters


def _overturn(run, committed, signers, sender: int = 6):
    return run.client(sender).resolve_dispute(
        committed, False, [run.client(i).sign_round_verdict_for(committed, False) for i in signers],
        _attesters(run, committed.round))


def _convict(run, accused: int, evidence: bytes, signers, sender: int = 6, guilty: bool = True):
    verdict = Verdict(run.run_id, run.client(accused).address, evidence, guilty)
    signatures = [run.client(i).sign_verdict(verdict) for i in signers]
    return run.client(sender).resolve_accusation(verdict, signatures)


def _refused(raised, run, signer: int, block: int) -> None:
    assert raised.value.values == {"runId": run.run_id, "signer": run.client(signer).address,
                                   "openedBlock": block}, raised.value.values


def _stakes(run, indexes) -> dict[int, tuple[str, int]]:
    reader = run.client(1)
    return {i: (reader.member(run.run_id, run.client(i).address).status,
                reader.member(run.run_id, run.client(i).address).stake) for i in indexes}


def _balances(run, indexes) -> dict[int, int]:
    return {i: run.deployment.w3.eth.get_balance(run.client(i).address) for i in indexes}


def _joined_run(w3):
    """The six founders' run with round 0 committed, the coalition's joiner in (joinRound 1) and round 1
    signed by it (credited, not counted: its tenure ends at round 3)."""
    deployment = deploy(w3)
    run = six_member_run(deployment)
    run.commit(signers=(1, 2, 3, 4))
    deployment.register(JOINER)
    deployment.client(JOINER).join_run(run.run_id)
    run.commit(signers=(1, 2, 3, 4, JOINER))
    assert run.client(1).member(run.run_id, run.client(JOINER).address).counted_block == 0
    return run


def counted_after_the_commit(w3) -> None:
    """(a) One block: round 2 committed by the honest founders (its quorum 3 of the six founders), the
    coalition accuses an honest member (quorum 3 of 6), then round 3 signed by the joiner counts it. The
    joiner, with 5 and 6 three signatures, signs neither round 2's verdict nor the accusation's:
    LedgerSignerNotInForce, and without it the coalition is short of the quorum. The honest members settle
    both: the coalition's bonds are forfeited, nobody honest loses anything."""
    run = _joined_run(w3)
    reader, block, evidence = run.client(1), Block(run), digest("made up")
    two, commit_two = block.commit((1, 2, 3, 4))
    _three, commit_three = block.commit((1, 2, 3, 4, JOINER))
    mined = in_one_block(w3, [(1, commit_two, 0), (5, block.accuse(2, evidence), BOND), (2, commit_three, 0)])
    joiner = reader.member(run.run_id, run.client(JOINER).address)
    assert joiner.counted_block == mined and reader.commit_block_of(run.run_id, 2) == mined
    assert reader.commit_quorum_of(run.run_id, 2) == 3 and reader.counted_count(run.run_id) == 7
    assert reader.accusation(run.run_id, run.client(2).address, evidence).quorum == 3
    _dispute(run, two)
    honest_before = _stakes(run, (1, 2, 3, 4))
    with pytest.raises(errors.LedgerSignerNotInForce) as raised:
        _overturn(run, two, (5, 6, JOINER))
    _refused(raised, run, JOINER, mined)
    with pytest.raises(errors.LedgerSignerNotInForce) as raised:
        _convict(run, 2, evidence, (5, 6, JOINER))
    _refused(raised, run, JOINER, mined)
    with pytest.raises(errors.LedgerQuorumNotMet):
        _overturn(run, two, (5, 6))
    _settle_honestly(run, two, evidence, honest_before)


def left_before_the_commit(w3) -> None:
    """(b) One block: coalition seat 6 and honest founder 4 leave, then round 1 is committed by 1-3 (its
    quorum 2 of the four counted) and 5 accuses honest 2 (quorum 2 of 4). Seat 6 left in that block: with 5
    it would be the quorum; it signs neither verdict (LedgerSignerNotInForce, in that block and any later
    one)."""
    deployment = deploy(w3)
    run = six_member_run(deployment)
    run.commit(signers=(1, 2, 3, 4))
    reader, block, evidence = run.client(1), Block(run), digest("made up")
    one, commit_one = block.commit((1, 2, 3))
    mined = in_one_block(w3, [(6, block.leave(), 0), (4, block.leave(), 0), (1, commit_one, 0),
                              (5, block.accuse(2, evidence), BOND)])
    assert reader.member(run.run_id, run.client(6).address).status == "unbonding"
    assert reader.commit_block_of(run.run_id, 1) == mined and reader.commit_quorum_of(run.run_id, 1) == 2
    assert reader.accusation(run.run_id, run.client(2).address, evidence).quorum == 2
    _dispute(run, one)
    honest_before = _stakes(run, (1, 2, 3, 4))
    for _ in range(2):  # the next block changes nothing: the seat was gone when the quorums were counted
        with pytest.raises(errors.LedgerSignerNotInForce) as raised:
            _overturn(run, one, (5, 6), sender=5)
        _refused(raised, run, 6, mined)
        with pytest.raises(errors.LedgerSignerNotInForce) as raised:
            _convict(run, 2, evidence, (5, 6), sender=5)
        _refused(raised, run, 6, mined)
        mine(w3, 1)
    _settle_honestly(run, one, evidence, honest_before, signers=(1, 2, 3), clearers=(1, 3))


def _settle_honestly(run, committed, evidence, honest_before, signers=(1, 2, 3, 4), clearers=(1, 3, 4)):
    """The round's counted members uphold it and clear the accused: the coalition's disputer and accuser (5)
    forfeit their bonds; no honest stake moves; 5 pays nothing else (the verdicts are others' transactions).
    """
    reader = run.client(1)
    forfeited, coalition_balance = reader.forfeited_total(), _balances(run, (5,))
    reader.resolve_dispute(committed, True,
                           [run.client(i).sign_round_verdict_for(committed, True) for i in signers],
                           _attesters(run, committed.round))
    _convict(run, 2, evidence, clearers, sender=3, guilty=False)
    assert reader.dispute_case(run.run_id, committed.round)[0] == "upheld"
    assert reader.accusation_status(run.run_id, run.client(2).address, evidence) == "cleared"
    assert reader.forfeited_total() - forfeited == 2 * BOND
    assert _balances(run, (5,)) == coalition_balance
    assert _stakes(run, (1, 2, 3, 4)) == honest_before
    assert all(stake == STAKE for _, stake in honest_before.values())
    assert not reader.invalid_from(run.run_id)  # no round overturned


def counted_a_block_before(w3) -> None:
    """(c) The joiner counted by round 3's commit, one block before round 4's and an accusation of coalition
    seat 5 (both quorums 4 of the seven counted): its signature counts toward both. Without it the honest
    signers are one short; with it round 4 is upheld (the disputer's bond forfeited) and 5 is convicted: its
    stake slashed, the accuser's bond returned to it."""
    run = _joined_run(w3)
    run.commit(signers=(1, 2, 3, 4))  # round 2
    reader, evidence, block = run.client(1), digest("5 equivocated off chain"), Block(run)
    _three, commit_three = block.commit((1, 2, 3, 4, JOINER))
    counted = in_one_block(w3, [(1, commit_three, 0)])
    four, commit_four = block.commit((1, 2, 3, 4))
    mined = in_one_block(w3, [(2, commit_four, 0), (4, block.accuse(5, evidence), BOND)])
    assert mined == counted + 1
    assert reader.member(run.run_id, run.client(JOINER).address).counted_block == counted
    assert reader.commit_quorum_of(run.run_id, 4) == 4
    assert reader.accusation(run.run_id, run.client(5).address, evidence).quorum == 4
    _dispute(run, four)
    upheld = {i: run.client(i).sign_round_verdict_for(four, True) for i in (1, 2, 3, JOINER)}
    with pytest.raises(errors.LedgerQuorumNotMet):
        reader.resolve_dispute(four, True, [upheld[i] for i in (1, 2, 3)], _attesters(run, 4))
    forfeited, attesters_before = reader.forfeited_total(), _stakes(run, (1, 2, 3, 4))
    reader.resolve_dispute(four, True, list(upheld.values()), _attesters(run, 4))
    assert reader.dispute_case(run.run_id, 4)[0] == "upheld"
    assert reader.forfeited_total() - forfeited == BOND  # the disputer (5) pays its bond
    assert _stakes(run, (1, 2, 3, 4)) == attesters_before
    slashed, accuser = reader.slashed_total(), _balances(run, (4,))
    with pytest.raises(errors.LedgerQuorumNotMet):
        _convict(run, 5, evidence, (1, 2, 3), sender=3)
    _convict(run, 5, evidence, (1, 2, 3, JOINER), sender=3)
    assert _stakes(run, (5,)) == {5: ("slashed", 0)}
    assert reader.slashed_total() - slashed == STAKE
    assert _balances(run, (4,))[4] - accuser[4] == BOND  # the accuser's bond back; it sent nothing meanwhile


CASES = (counted_after_the_commit, left_before_the_commit, counted_a_block_before)


@pytest.mark.parametrize(("backend", "case"), each_on_both(CASES, [c.__name__ for c in CASES]))
def test_the_verdict_timing_rule_in_one_block(request, backend, case):
    case(chain(request, backend))
