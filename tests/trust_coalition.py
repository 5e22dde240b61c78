"""The trust fuzzer's coalition (below the quorum fraction) and anyone's moves against the machine's run
(tests/trust_machine.py): commits that leave honest signatures out, split honest records (issue 63), back
doors, ejections, accusations with coalition verdicts, disputes with coalition verdicts, a joiner, leaving and
withdrawing. Mixed into :class:`tests.trust_machine.TrustMachine` (its helpers: ``commit``, ``honest_record``,
``active``, ...)."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ledger.records import RoundRecord, Verdict
from tests.trust_params import COALITION_JOINER, HONEST, REFUSED, digest


class CoalitionMoves:
    """The coalition's and anyone's rules (see the module docstring)."""

    @rule(data=st.data())
    def coalition_commits_leaving_honest_out(self, data) -> None:
        """The takeover's first step: commit the honest record with as few honest signatures as the quorum
        needs."""
        coalition = self.active(self.coalition_group())
        honest = self.active(self.honest_group())
        if not coalition or not honest:
            return
        chosen = data.draw(st.lists(st.sampled_from(honest), unique=True, max_size=len(honest)))
        self.commit(data.draw(st.sampled_from(coalition)), self.honest_record(), coalition + chosen)

    @rule(data=st.data())
    def coalition_splits_the_honest_records(self, data) -> None:
        """Issue 63: a coalition stage holder serves other outer momentum (or attests to some members only),
        so some honest members sign the round's honest result with another checkpoint hash or loss figure; the
        coalition commits the record of the others, which leaves the split members' signatures out, and each
        attests its own record of the committed result."""
        coalition = self.active(self.coalition_group())
        honest = self.active(self.honest_group())
        if not coalition or len(honest) < 2:
            return
        split = data.draw(st.lists(st.sampled_from(honest), unique=True, min_size=1,
                                   max_size=len(honest) - 1))
        self.split_commit(data.draw(st.sampled_from(coalition)), split, data.draw(st.booleans()))

    def split_commit(self, submitter: int, split, checkpoint: bool) -> bool:
        """Commit the round's honest record signed by the coalition and the active honest members not in
        ``split``; those in ``split`` signed it with another checkpoint hash (``checkpoint``), else another
        loss figure."""
        record = self.honest_record()
        if checkpoint:
            variant = dataclasses.replace(record, checkpoint_hash=digest(f"checkpoint {record.round}"))
        else:
            variant = dataclasses.replace(record, eval_loss_micro=record.eval_loss_micro + 1)
        signers = [i for i in self.active(self.honest_group()) if i not in split] + \
            self.active(self.coalition_group())
        return self.commit(submitter, record, signers, {i: variant for i in split})

    @rule(data=st.data())
    def coalition_commits_a_back_door(self, data) -> None:
        coalition = self.active(self.coalition_group())
        if not coalition:
            return
        honest = self.honest_record()
        backdoor = RoundRecord(self.run_id, honest.round, honest.prev_head,
                               digest(f"back door {honest.round}"), honest.contributions_root, 1, 1, 1, 1,
                               bytes(32))
        signers = data.draw(st.lists(st.sampled_from(coalition), unique=True, min_size=1))
        committed = self.commit(data.draw(st.sampled_from(coalition)), backdoor, signers)
        assert not committed, "I1: the coalition committed a back-doored record alone"

    @rule(data=st.data())
    def anyone_ejects(self, data) -> None:
        target = data.draw(st.sampled_from((*self.honest_group(), *self.coalition_group())))
        caller = data.draw(st.sampled_from(self.coalition_group()))
        try:
            self.client(caller).eject_inactive(self.run_id, self.client(target).address)
        except REFUSED:
            return
        if target in self.honest_group():
            self.ejected_honest.append(target)

    @rule(data=st.data())
    def coalition_accuses_and_convicts(self, data) -> None:
        """Accuse an honest member (active or unbonding) and try a guilty verdict signed by the coalition."""
        coalition = self.active(self.coalition_group())
        if not coalition:
            return
        accuser = data.draw(st.sampled_from(coalition))
        target = data.draw(st.sampled_from(self.honest_group()))
        evidence = digest(f"made up {self.steps} {target}")
        self.steps += 1
        try:
            self.client(accuser).accuse(self.run_id, self.client(target).address, evidence)
        except REFUSED:
            return
        verdict = Verdict(self.run_id, self.client(target).address, evidence, True)
        signers = [i for i in self.coalition_group() if self.status(i) != "none"]
        try:
            self.client(accuser).resolve_accusation(verdict,
                                                    [self.client(i).sign_verdict(verdict) for i in signers])
        except REFUSED:
            pass

    @rule(data=st.data())
    def coalition_disputes_and_overturns(self, data) -> None:
        """Dispute an honest round (own signature, or an honest member's gossiped one) and try to overturn
        it."""
        coalition = [i for i in self.coalition_group() if self.status(i) in ("active", "unbonding")]
        reader = self.client(HONEST[0])
        count = reader.commit_count(self.run_id)
        if not coalition or count == 0:
            return
        round_ = data.draw(st.integers(max(0, count - 3), count - 1))
        committed = reader.commit_of(self.run_id, round_)
        disputed = RoundRecord(committed.run_id, committed.round, committed.prev_head,
                               digest(f"other {round_}"), committed.contributions_root, 1, 1, 1, 1, bytes(32))
        sender = data.draw(st.sampled_from(coalition))
        signer = data.draw(st.sampled_from([sender, *self.honest_group()]))
        try:
            self.client(sender).dispute(disputed, self.client(signer).sign_record(disputed))
        except REFUSED:
            pass
        status, _, _ = reader.dispute_case(self.run_id, round_)
        if status != "open":
            return
        signers = [i for i in self.coalition_group() if self.status(i) in ("active", "unbonding")]
        try:
            reader.resolve_dispute(committed, False, [self.client(i).sign_round_verdict_for(committed, False)
                                                      for i in signers], self.attesters_of(round_))
        except REFUSED:
            pass

    @precondition(lambda self: self.status(COALITION_JOINER) == "none")
    @rule()
    def coalition_joiner_joins(self) -> None:
        coalition = self.active(self.coalition_group())
        if self.status(COALITION_JOINER) == "none" and self.assumption_holds(self.honest_counted(),
                                                                              len(coalition) + 1):
            try:
                self.client(COALITION_JOINER).join_run(self.run_id)
            except REFUSED:
                pass

    @rule(data=st.data())
    def coalition_leaves_or_withdraws(self, data) -> None:
        index = data.draw(st.sampled_from(self.coalition_group()))
        try:
            if self.status(index) == "active":
                self.client(index).leave_run(self.run_id)
            elif self.status(index) == "unbonding":
                self.client(index).withdraw_stake(self.run_id)
        except REFUSED:
            pass

