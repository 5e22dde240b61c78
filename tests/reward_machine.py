"""The reward pool (issue 77) as a stateful fuzzer on py-evm: members commit rounds listing any subset of
contributions (sybils and a dropping coalition included) with any quorum of signatures, claimers claim (their
own shares, others' places, twice), funders top up, anyone opens and sweeps, a member is convicted
(equivocation) or a round overturned (a dispute's verdict), and blocks pass, in any order. After every step:

* P1 (solvency): the pool's balance is what was funded minus what was claimed, and its free funds plus every
  open round's unpaid budget are exactly that too.
* P2 (budget): no round pays past its budget (credits never exceed the pool).
* P3 (finality): no overturned round is ever opened; every paid claim was of a final round.
* P4 (once): a claim pays once; the contract's claimedOf agrees with the claims that paid.
* P5 (forfeit): no claim pays a convicted member; each paid claim is its share by the rule (ledger.rewards).
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.rewards import ATTESTER
from tests.ledger_fixtures import deploy, mine
from tests.reward_fixtures import AMOUNT, params, reward_run

MEMBERS = (1, 2, 3, 4, 5, 6)
FUNDERS = (8, 9)
OUTSIDER = 7
MAX_ROUNDS = 5


class RewardMachine(RuleBasedStateMachine):
    @initialize(timed=st.booleans(), funding=st.sampled_from([1, 2, 10]), data=st.data())
    def start(self, timed: bool, funding: int, data) -> None:
        self.rr = reward_run(deploy(connect_pyevm()), members=MEMBERS, pool=params(),
                             funding=funding * AMOUNT)
        self.timed = timed
        self.funded = funding * AMOUNT
        self.claimed: dict[tuple, int] = {}  # (round, stage, account) -> wei paid
        self.slashed: set[int] = set()
        self.halted = False
        # every example starts with a committed round listing someone: else a short run rarely pays a claim,
        # and a claim that never pays cannot be caught paying twice
        self.commit(data, at_least=1)

    # moves --------------------------------------------------------------------------------------------------
    def _alive(self) -> list[int]:
        return [m for m in MEMBERS if m not in self.slashed]

    @precondition(lambda self: not self.halted and len(self.rr.rounds) < MAX_ROUNDS)
    @rule(data=st.data())
    def commit(self, data, at_least: int = 0) -> None:
        alive = self._alive()
        if len(alive) < 2:
            return
        listed = []
        for _stage in range(2):
            chosen = data.draw(st.lists(st.sampled_from(alive), unique=True, min_size=at_least, max_size=5))
            steps = [data.draw(st.integers(1, 80)) if self.timed else None for _ in chosen]
            listed.append(list(zip(chosen, steps, strict=True)))
        signers = tuple(sorted(data.draw(st.lists(st.sampled_from(alive), unique=True, min_size=2,
                                                  max_size=len(alive)))))
        self.rr.commit(listed, signers=signers, label=f"f{len(self.rr.rounds)}")

    @rule(blocks=st.integers(1, 120))
    def advance(self, blocks: int) -> None:
        mine(self.rr.w3, blocks)

    @precondition(lambda self: self.rr.rounds)
    @rule(data=st.data())
    def claim(self, data) -> None:
        r = data.draw(st.integers(0, len(self.rr.rounds) - 1))
        entry = self.rr.rounds[r]
        stage = data.draw(st.integers(0, 1))
        listed = entry.listed[stage]
        if not listed:
            return
        position = data.draw(st.integers(0, len(listed) - 1))
        owner = listed[position][0]
        claimer = data.draw(st.sampled_from([owner] * 14 + [OUTSIDER, *MEMBERS]))  # mostly its own
        client = self.rr.pool(claimer)
        if data.draw(st.integers(0, 3)):  # mostly wait for its finality (else claims rarely pay)
            self.rr.mine_to_final(r)
        final = self.rr.is_final(r)
        try:
            receipt = client.claim_contribution(entry.record, entry.leaves, stage, entry.factors[stage],
            position)
        except errors.RewardError as exc:
            self._refused(exc, r, stage, claimer, claimer == owner)
            return
        assert claimer == owner and claimer not in self.slashed
        key = (r, stage, self.rr.address(claimer))
        assert key not in self.claimed, "a claim paid twice"
        assert final or self.rr.is_final(r)
        self.claimed[key] = self._paid(receipt)
        assert self.claimed[key] == self.rr.expected_share(r, stage, claimer)
        self._refused_again(lambda: client.claim_contribution(entry.record, entry.leaves, stage,
                                                              entry.factors[stage], position), key)

    @precondition(lambda self: self.rr.rounds)
    @rule(data=st.data())
    def claim_attestation(self, data) -> None:
        r = data.draw(st.integers(0, len(self.rr.rounds) - 1))
        entry = self.rr.rounds[r]
        position = data.draw(st.integers(0, len(entry.attesters) - 1))
        owner = entry.attesters[position]
        owner_index = next(m for m in MEMBERS if self.rr.address(m) == owner)
        claimer = data.draw(st.sampled_from([owner_index] * 14 + [*MEMBERS, OUTSIDER]))
        client = self.rr.pool(claimer)
        if data.draw(st.integers(0, 3)):
            self.rr.mine_to_final(r)
        try:
            receipt = client.claim_attestation(self.rr.run_id, r, list(entry.attesters), position)
        except errors.RewardError as exc:
            self._refused(exc, r, ATTESTER, claimer, self.rr.address(claimer) == owner)
            return
        assert self.rr.address(claimer) == owner and claimer not in self.slashed
        key = (r, ATTESTER, owner)
        assert key not in self.claimed, "an attestation claim paid twice"
        self.claimed[key] = self._paid(receipt)
        assert self.claimed[key] == self.rr.expected_attester_share(r)
        self._refused_again(lambda: client.claim_attestation(self.rr.run_id, r, list(entry.attesters),
                                                             position), key)

    @staticmethod
    def _refused_again(claim, key) -> None:
        """The claim that just paid, sent again at once by its owner: refused as claimed (P4)."""
        try:
            claim()
        except errors.RewardAlreadyClaimed:
            return
        raise AssertionError(f"{key}: a claim paid twice")

    def _refused(self, exc, r: int, stage: int, claimer: int, own: bool) -> None:
        """A refused claim is refused for a reason the model knows."""
        key = (r, stage, self.rr.address(claimer))
        if isinstance(exc, errors.RewardAlreadyClaimed):
            assert key in self.claimed
        elif isinstance(exc, errors.RewardConvicted):
            assert claimer in self.slashed
        elif isinstance(exc, errors.RewardNotListed):
            assert not own
        elif isinstance(exc, errors.RewardRoundNotFinal):
            assert not self.rr.is_final(r) or not all(self.rr.is_final(q) for q in range(r + 1))
        elif isinstance(exc, errors.RewardPoolUnfunded):
            # a claim opens every unopened round up to its own, in order: the pool must hold all their budgets
            # (not only one: a claim of round 2 with round 1 unopened and one budget free is refused)
            pool = self.rr.pool(0).pool_of(self.rr.run_id)
            assert pool["free"] < AMOUNT * (r + 1 - pool["nextRound"])
        elif isinstance(exc, errors.RewardClaimClosed):
            assert self.rr.pool(0).round_of(self.rr.run_id, r)["swept"]
        else:
            raise exc

    def _paid(self, receipt) -> int:
        events = self.rr.pool(0).events
        amounts = [e.args["amount"] for e in map(events.decode, receipt["logs"])
                   if e is not None and e.name == "RewardClaimed"]
        assert len(amounts) == 1
        return amounts[0]

    @precondition(lambda self: self.claimed)
    @rule(data=st.data())
    def claim_again(self, data) -> None:
        """A share already paid is claimed again by its owner: refused (P4)."""
        r, stage, account = data.draw(st.sampled_from(sorted(self.claimed)))
        entry = self.rr.rounds[r]
        index = next(m for m in MEMBERS if self.rr.address(m) == account)
        client = self.rr.pool(index)
        try:
            if stage == ATTESTER:
                client.claim_attestation(self.rr.run_id, r, list(entry.attesters),
                                         list(entry.attesters).index(account))
            else:
                position = [m for m, _ in entry.listed[stage]].index(index)
                client.claim_contribution(entry.record, entry.leaves, stage, entry.factors[stage], position)
        except (errors.RewardAlreadyClaimed, errors.RewardConvicted, errors.RewardClaimClosed):
            return
        raise AssertionError(f"round {r} stage {stage}: {account} was paid twice")

    @rule(funder=st.sampled_from(FUNDERS), amount=st.sampled_from([1, AMOUNT // 3, AMOUNT]))
    def fund(self, funder: int, amount: int) -> None:
        self.rr.pool(funder).fund(self.rr.run_id, amount)
        self.funded += amount

    @precondition(lambda self: self.rr.rounds)
    @rule(data=st.data())
    def sweep(self, data) -> None:
        r = data.draw(st.integers(0, len(self.rr.rounds) - 1))
        budget = self.rr.pool(0).round_of(self.rr.run_id, r)
        try:
            self.rr.pool(FUNDERS[0]).sweep(self.rr.run_id, r)
        except errors.RewardClaimClosed:
            assert budget["openedAt"] == 0 or budget["swept"]
        except errors.RewardClaimOpen:
            assert self.rr.w3.eth.block_number + 1 < budget["openedAt"] + self.rr.params.claim_blocks

    @precondition(lambda self: self.rr.rounds and not self.halted)
    @rule(data=st.data())
    def convict(self, data) -> None:
        """An attester of the last round signs another record for it: reported, slashed."""
        entry = self.rr.rounds[-1]
        alive = [m for m in self._alive() if self.rr.address(m) in entry.attesters]
        if not alive or not data.draw(st.integers(0, 3)) == 0:  # rarer than the other moves
            return
        member = data.draw(st.sampled_from(alive))
        client = self.rr.deployment.client(member)
        other = dataclasses.replace(entry.record, weights_root=b"\x22" * 32)
        self.rr.deployment.client(OUTSIDER).report_equivocation(
            entry.record, client.sign_record(entry.record), other, client.sign_record(other))
        self.slashed.add(member)

    @precondition(lambda self: self.rr.rounds and not self.halted)
    @rule()
    def overturn(self) -> None:
        """A member that did not attest the last round disputes it, and two others overturn it (if its window
        is still open); its attesters are slashed and the run halts."""
        entry = self.rr.rounds[-1]
        reader = self.rr.run.reader
        outside = [m for m in self._alive() if self.rr.address(m) not in entry.attesters]
        if not outside:
            return
        disputer = outside[0]
        client = self.rr.deployment.client(disputer)
        disputed = dataclasses.replace(entry.record, weights_root=b"\x33" * 32)
        try:
            client.dispute(disputed, client.sign_record(disputed), committed=entry.record)
        except errors.LedgerRevert:
            return  # its window closed, or the disputer is not in force
        judges = [m for m in self._alive() if m != disputer][: reader.commit_quorum_of(self.rr.run_id,
                                                                                         entry.record.round)]
        verdicts = [self.rr.deployment.client(m).sign_round_verdict_for(entry.record, False) for m in judges]
        try:
            client.resolve_dispute(entry.record, False, verdicts, entry.attesters)
        except errors.LedgerRevert:
            return  # too few judges in force: the dispute lapses later
        self.halted = True
        self.slashed |= {m for m in MEMBERS if self.rr.address(m) in entry.attesters}

    # invariants ---------------------------------------------------------------------------------------------
    @invariant()
    def books(self) -> None:
        if not hasattr(self, "rr"):
            return
        pool_client = self.rr.pool(0)
        pool = pool_client.pool_of(self.rr.run_id)
        claimed = sum(self.claimed.values())
        assert pool["funded"] == self.funded
        assert pool["claimed"] == claimed
        assert pool_client.balance() == self.funded - claimed  # P1
        held = pool["free"]
        invalid_from = self.rr.run.reader.run_struct(self.rr.run_id)["invalidFrom"]
        for r in range(pool["firstRound"], pool["nextRound"]):
            budget = pool_client.round_of(self.rr.run_id, r)
            assert budget["paid"] <= budget["budget"] == AMOUNT  # P2
            paid = sum(v for (q, _s, _a), v in self.claimed.items() if q == r)
            assert budget["paid"] == paid
            if not budget["swept"]:
                held += budget["budget"] - budget["paid"]
            assert invalid_from == 0 or r + 1 < invalid_from  # P3
        assert held == self.funded - claimed  # P1
        for (r, stage, account) in self.claimed:  # P4
            assert pool_client.claimed_of(self.rr.run_id, r, stage, account)
