"""The reward pool (issue 77) as a stateful fuzzer on py-evm: members commit rounds listing any subset of
contributions (sybils and a dropping coalition included) with any quorum of signatures, claimers claim (their
own shares, others' places, twice), funders top up, anyone opens and sweeps, a member is convicted
(equivocation) or a round overturned (a dispute's verdict), and blocks pass, in any order. The pool is in ETH
or in an ERC-20 (contracts/src/test/QuirkyToken.sol: plain, fee-on-transfer or returning nothing), whose token
is an actor too: it turns to returning false for a while, and, armed, re-enters the pool in the middle of its
next transfer (a fund, a claim, an open or a sweep by the token). After every step:

* P1 (solvency): the pool's balance (in its currency) is what was funded (what arrived) minus what was
  claimed, and its free funds plus every open round's unpaid budget are exactly that too.
* P2 (budget): no round pays past its budget (credits never exceed the pool).
* P3 (finality): no overturned round is ever opened; every paid claim was of a final round.
* P4 (once): a claim pays once; the contract's claimedOf agrees with the claims that paid.
* P5 (forfeit): no claim pays a convicted member; each paid claim is its share by the rule (ledger.rewards),
  and the claimer received it (less a fee-on-transfer token's fee).
* P6 (re-entry): a call the token made into the pool from inside one of its transfers never succeeded.

Each assertion names its property, so bench/fuzz_pool_mutations.py can say which one caught a seeded bug.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ledger import errors
from ledger.chain import connect_pyevm
from ledger.rewards import ATTESTER
from tests.ledger_fixtures import deploy, mine
from ledger.reverts import revert_from_data
from tests.reward_fixtures import (
    AMOUNT,
    FEE_ON_TRANSFER,
    PLAIN,
    RETURNS_FALSE,
    RETURNS_NOTHING,
    params,
    reward_run,
    token_run,
)

MEMBERS = (1, 2, 3, 4, 5, 6)
FUNDERS = (8, 9)
OUTSIDER = 7
MAX_ROUNDS = 5
#: The pool's currency: None for ETH, else a QuirkyToken mode.
CURRENCIES = (None, PLAIN, FEE_ON_TRANSFER, RETURNS_NOTHING)
FEE_BPS = 1_000  # a fee-on-transfer token's


class RewardMachine(RuleBasedStateMachine):
    @initialize(timed=st.booleans(), funding=st.sampled_from([1, 2, 10]),
                currency=st.sampled_from(CURRENCIES), data=st.data())
    def start(self, timed: bool, funding: int, currency: int | None, data) -> None:
        deployment = deploy(connect_pyevm())
        self.mode, self.token = currency, None
        if currency is None:
            self.rr = reward_run(deployment, members=MEMBERS, pool=params(), funding=funding * AMOUNT)
        else:  # sent so that what arrives covers the rounds asked for, a fee or not
            sent = funding * AMOUNT * 10_000 // (10_000 - self._fee_bps()) + 10
            self.rr, self.token = token_run(deployment, currency, self._fee_bps(), funding=sent,
                                            minted=1_000 * AMOUNT, members=MEMBERS)
        self.token_false = False
        self.timed = timed
        self.funded = self.rr.pool(0).pool_of(self.rr.run_id)["funded"]
        assert self.funded >= funding * AMOUNT
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
        self._claim(data, r, wait=data.draw(st.integers(0, 3)) != 0)  # mostly after its finality

    @precondition(lambda self: self.rr.rounds)
    @rule(data=st.data())
    def claim_early(self, data) -> None:
        """An early claimer: the last round's share claimed at once, nobody mining to its finality first."""
        self._claim(data, len(self.rr.rounds) - 1, wait=False)

    def _claim(self, data, r: int, wait: bool) -> None:
        entry = self.rr.rounds[r]
        stage = data.draw(st.integers(0, 1))
        listed = entry.listed[stage]
        if not listed:
            return
        position = data.draw(st.integers(0, len(listed) - 1))
        owner = listed[position][0]
        claimer = data.draw(st.sampled_from([owner] * 14 + [OUTSIDER, *MEMBERS]))  # mostly its own
        client = self.rr.pool(claimer)
        if wait:  # else claims rarely pay
            self.rr.mine_to_final(r)
        final = self.rr.is_final(r)
        try:
            receipt = client.claim_contribution(entry.record, entry.leaves, stage, entry.factors[stage],
            position)
        except errors.RewardError as exc:
            self._refused(exc, r, stage, claimer, claimer == owner)
            return
        assert claimer == owner, "P5 forfeit: a claim paid an account not listed"
        assert claimer not in self.slashed, "P5 forfeit: a claim paid a convicted member"
        key = (r, stage, self.rr.address(claimer))
        assert key not in self.claimed, "P4 once: a claim paid twice"
        assert final or self.rr.is_final(r), "P3 finality: a claim paid before its round was final"
        self.claimed[key] = self._paid(receipt, claimer)
        assert self.claimed[key] == self.rr.expected_share(r, stage, claimer), \
            "P5 forfeit: not the rule's share"
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
        final = self.rr.is_final(r)
        try:
            receipt = client.claim_attestation(self.rr.run_id, r, list(entry.attesters), position)
        except errors.RewardError as exc:
            self._refused(exc, r, ATTESTER, claimer, self.rr.address(claimer) == owner)
            return
        assert self.rr.address(claimer) == owner, "P5 forfeit: an attestation paid an account not listed"
        assert claimer not in self.slashed, "P5 forfeit: an attestation paid a convicted member"
        key = (r, ATTESTER, owner)
        assert key not in self.claimed, "P4 once: an attestation claim paid twice"
        assert final or self.rr.is_final(r), "P3 finality: an attestation paid before its round was final"
        self.claimed[key] = self._paid(receipt, claimer)
        assert self.claimed[key] == self.rr.expected_attester_share(r), "P5 forfeit: not the rule's share"
        self._refused_again(lambda: client.claim_attestation(self.rr.run_id, r, list(entry.attesters),
                                                             position), key)

    @precondition(lambda self: self.slashed and self.rr.rounds)
    @rule(data=st.data())
    def claim_convicted(self, data) -> None:
        """A convicted member claims an attestation of its own, once final: refused (P5)."""
        self._claim_convicted(data, data.draw(st.sampled_from(sorted(self.slashed))))

    def _claim_convicted(self, data, member: int) -> None:
        address = self.rr.address(member)
        places = [(r, p) for r, entry in enumerate(self.rr.rounds) for p, a in enumerate(entry.attesters)
                  if a == address]
        if not places:
            return
        r, position = data.draw(st.sampled_from(places))
        self.rr.mine_to_final(r)
        attesters = list(self.rr.rounds[r].attesters)
        try:
            receipt = self.rr.pool(member).claim_attestation(self.rr.run_id, r, attesters, position)
        except errors.RewardError as exc:
            self._refused(exc, r, ATTESTER, member, True)
            return
        raise AssertionError(f"P5 forfeit: convicted member {member} was paid {self._paid(receipt, member)}")

    @staticmethod
    def _refused_again(claim, key) -> None:
        """The claim that just paid, sent again at once by its owner: refused as claimed (P4)."""
        try:
            claim()
        except (errors.RewardAlreadyClaimed, errors.RewardTokenFailed):
            return
        raise AssertionError(f"P4 once: {key}: a claim paid twice")

    def _refused(self, exc, r: int, stage: int, claimer: int, own: bool) -> None:
        """A refused claim is refused for a reason the model knows."""
        key = (r, stage, self.rr.address(claimer))
        if isinstance(exc, errors.RewardTokenFailed):
            assert self.token_false, f"a claim refused by a token that behaves: {exc}"
        elif isinstance(exc, errors.RewardAlreadyClaimed):
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

    def _fee_bps(self) -> int:
        return FEE_BPS if self.mode == FEE_ON_TRANSFER else 0

    def _paid(self, receipt, claimer: int) -> int:
        """What the claim's receipt paid (RewardClaimed), checked against what the claimer received."""
        events = self.rr.pool(0).events
        claims = [e for e in map(events.decode, receipt["logs"])
                  if e is not None and e.name == "RewardClaimed"]
        assert len(claims) == 1, "P4 once: one claim, one payment"
        amount = claims[0].args["amount"]
        if self.token is not None:
            transfer = self.token.contract.events.Transferred()
            moved = [transfer.process_log(log)["args"] for log in receipt["logs"]
                     if log["address"] == self.token.address]
            got = sum(args["amount"] for args in moved if args["to"] == self.rr.address(claimer))
            assert got == amount - amount * self._fee_bps() // 10_000, \
                "P5 forfeit: the claimer received another amount"
        return amount

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
        except (errors.RewardAlreadyClaimed, errors.RewardConvicted, errors.RewardClaimClosed,
                errors.RewardTokenFailed):
            return
        raise AssertionError(f"P4 once: round {r} stage {stage}: {account} was paid twice")

    @rule(funder=st.sampled_from(FUNDERS), amount=st.sampled_from([1, AMOUNT // 3, AMOUNT]))
    def fund(self, funder: int, amount: int) -> None:
        client = self.rr.pool(funder)
        if self.token is None:
            client.fund(self.rr.run_id, amount, self.rr.params.token)
            self.funded += amount
            return
        client.approve(self.token.address, amount)
        try:
            client.fund(self.rr.run_id, amount, self.token.address)
        except errors.RewardTokenFailed:
            assert self.token_false, "a funding refused by a token that behaves"
            return
        self.funded += amount - amount * self._fee_bps() // 10_000

    # the token as an actor ----------------------------------------------------------------------------------
    @precondition(lambda self: self.token is not None)
    @rule(fails=st.booleans())
    def token_turns(self, fails: bool) -> None:
        """The token returns false (moving nothing) from now on, or behaves again."""
        self.token.set_mode(RETURNS_FALSE if fails else self.mode, self._fee_bps())
        self.token_false = fails

    # a token that returns false fails the top-up, whose revert undoes the re-entry's trace too
    @precondition(lambda self: self.token is not None and not self.token_false)
    @rule(call=st.sampled_from(["fund", "claimAttestation", "open", "sweep"]), data=st.data())
    def token_reenters(self, call: str, data) -> None:
        """Armed: the token calls the pool back in the middle of its next transfer, which a funder's top-up
        (its transferFrom) then makes at once."""
        pool = self.rr.pool(0).contract
        run_id = self.rr.run_id
        if call == "fund":
            args = [run_id, AMOUNT]
        elif call == "claimAttestation" and self.rr.rounds:
            entry = self.rr.rounds[data.draw(st.integers(0, len(self.rr.rounds) - 1))]
            args = [run_id, entry.record.round, list(entry.attesters), 0]
        else:
            call, args = ("open", [run_id, 0]) if call == "open" else ("sweep", [run_id, 0])
        self.token.send(0, "arm", self.rr.pool_address, bytes.fromhex(pool.encode_abi(call, args=args)[2:]))
        self.fund(FUNDERS[1], AMOUNT)
        assert self.token.outcome()[1], "the armed token did not re-enter"

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
        if not alive or data.draw(st.integers(0, 1)):  # rarer than the other moves
            return
        member = data.draw(st.sampled_from(alive))
        client = self.rr.deployment.client(member)
        other = dataclasses.replace(entry.record, weights_root=b"\x22" * 32)
        self.rr.deployment.client(OUTSIDER).report_equivocation(
            entry.record, client.sign_record(entry.record), other, client.sign_record(other))
        self.slashed.add(member)
        self._claim_convicted(data, member)  # and at once claims what it attested

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
        assert pool["funded"] == self.funded, "P1 solvency: funded is not what arrived"
        assert pool["claimed"] == claimed, "P1 solvency: claimed is not what the claims paid"
        balance = pool_client.balance(self.rr.params.token)
        assert balance == self.funded - claimed, "P1 solvency: balance != funded - claimed"
        held = pool["free"]
        invalid_from = self.rr.run.reader.run_struct(self.rr.run_id)["invalidFrom"]
        for r in range(pool["firstRound"], pool["nextRound"]):
            budget = pool_client.round_of(self.rr.run_id, r)
            assert budget["paid"] <= budget["budget"] == AMOUNT, "P2 budget: a round paid past its budget"
            paid = sum(v for (q, _s, _a), v in self.claimed.items() if q == r)
            assert budget["paid"] == paid, "P2 budget: a round's paid is not its claims"
            if not budget["swept"]:
                held += budget["budget"] - budget["paid"]
            assert invalid_from == 0 or r + 1 < invalid_from, "P3 finality: an overturned round was opened"
        assert held == self.funded - claimed, "P1 solvency: free + open budgets != funded - claimed"
        for (r, stage, account) in self.claimed:
            assert pool_client.claimed_of(self.rr.run_id, r, stage, account), "P4 once: claimedOf disagrees"
        if self.token is not None:
            _armed, reentered, ok, returned = self.token.outcome()
            assert not (reentered and ok), "P6 re-entry: the token's call into the pool succeeded"
            refused = revert_from_data(returned, "re-entry") if reentered else None
            assert not reentered or isinstance(refused, errors.RewardReentered), \
                f"P6 re-entry: refused for another reason than RewardReentered ({refused})"
