"""The trust fuzzer's I7 actors (tests/trust_machine.py): an outsider proves the machine's right rounds wrong
(a chunk's aggregation, the clip scales, a sum-tree chunk, over the real commitments or tampered ones) and
challenges their committed leaves, which the live honest members answer; every proof and every expiry must be
refused. Mixed into :class:`tests.trust_machine.TrustMachine`, which keeps the counters."""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ledger.availability import (FACTORS, MOMENTUM, PAYLOAD, WEIGHTS, availability_answer,
                                 availability_target,
                                 sums_which)
from ledger.chunkproof import build_proof
from ledger.normproof import scale_proof, sum_proof
from tests.fraud_fixtures import changed, lied_sum, with_scale
from tests.trust_params import HONEST, OUTSIDER, REFUSED, WINDOW
from training.chunks import float64_bits


class RightRoundProofs:
    """The prover's and the challenger's rules (see the module docstring)."""

    proofs_refused = 0  # fraud proofs against right rounds the prover refused (I7)
    norm_proofs_refused = 0  # norm proofs (clip scales, sum trees) against right rounds refused (I7)
    challenges_answered = 0  # availability challenges the honest members answered (I7)
    finality_reads = 0  # times pull's and audit's finality were read against isFinal (F)
    finality_reads_open = 0  # of those, with a challenge of the latest round open

    def proof_of(self, round_: int, chunk: int, *, tampered: bool):
        """The proof of ``chunk`` of ``round_`` with its real leaves, or over a tampered twin of the state."""
        prev, new = self.state_of(round_ - 1), self.state_of(round_)
        claimed = changed(new, chunk, 0) if tampered else new
        return build_proof(self.records[round_ - 1], self.records[round_], [prev.leaf()], [claimed.leaf()],
                           prev, claimed, chunk)

    @precondition(lambda self: len(getattr(self, "records", {})) >= 2)
    @rule(data=st.data())
    def anyone_proves(self, data) -> None:
        """An outsider proves a committed (right) round wrong, with its real leaves or tampered ones:
        refused."""
        round_ = data.draw(st.integers(1, max(self.records)))
        chunk = data.draw(st.integers(0, len(self.state_of(round_).weight_leaves) - 1))
        proof = self.proof_of(round_, chunk, tampered=data.draw(st.booleans()))
        try:
            self.client(OUTSIDER).prove_wrong_aggregation(proof, attesters=self.attesters_of(round_),
                                                           commit=False)  # refused: nothing to commit to
        except REFUSED:
            RightRoundProofs.proofs_refused += 1
            return
        raise AssertionError(f"I7: a proof invalidated round {round_}, which is right")

    @precondition(lambda self: len(getattr(self, "records", {})) >= 1)
    @rule(data=st.data())
    def anyone_proves_a_norm(self, data) -> None:
        """An outsider proves a committed (right) round's clip scales, or one chunk of a contribution's sum
        tree, wrong, over the real commitment or a tampered one (a scale or a chunk sum changed): refused."""
        round_ = data.draw(st.sampled_from(sorted(self.records)))
        state = self.state_of(round_)
        chunk = data.draw(st.integers(0, len(state.weight_leaves) - 1))
        kinds = ["real", "version 2"] + (["scale", "sum"] if state.sum_trees else [])
        tamper = data.draw(st.sampled_from(kinds))
        claimed = {"real": lambda: state, "scale": lambda: with_scale(state, 0, float64_bits(0.5)),
                   "sum": lambda: lied_sum(state, 0, chunk),
                   # the same round's factors without the norm commitment: what the run's version refuses
                   "version 2": lambda: dataclasses.replace(state, factors=dataclasses.replace(state.factors,
                                                                                               norms=None),
                                                            sum_trees=[])}[tamper]()
        leaves = [claimed.leaf().encode()]
        if not claimed.sum_trees or data.draw(st.booleans()):
            proof = scale_proof(self.records[round_], leaves, 0, claimed.factors.encode())
        else:
            proof = sum_proof(self.records[round_], leaves, 0, claimed.factors.encode(),
                              claimed.weight_leaves, claimed.payload_leaves[0], claimed.sum_trees[0], 0,
                              chunk)
        try:
            self.client(OUTSIDER).prove_wrong_norm(proof, attesters=self.attesters_of(round_), commit=False)
        except REFUSED:
            RightRoundProofs.norm_proofs_refused += 1
            return
        raise AssertionError(f"I7: a norm proof invalidated round {round_}, which is right")

    @precondition(lambda self: len(getattr(self, "records", {})) >= 1)
    @rule(data=st.data())
    def anyone_challenges_and_the_honest_answer(self, data) -> None:
        """An outsider challenges a committed leaf (a weights, momentum, payload or sum-tree chunk, or the
        factors); a live honest member answers at once (any account may)."""
        round_ = data.draw(st.sampled_from(sorted(self.records)))
        state = self.state_of(round_)
        accepted = len(state.payload_leaves)
        which = data.draw(
            st.sampled_from([WEIGHTS, MOMENTUM, FACTORS] + [PAYLOAD + j for j in range(accepted)]
                            + [sums_which(accepted, j) for j in range(len(state.sum_trees))]))
        chunk = 0 if which == FACTORS else data.draw(st.integers(0, len(state.weight_leaves) - 1))
        target = availability_target(self.records[round_], [state.leaf()], state.factors, 0, which, chunk)
        try:
            challenge = self.client(OUTSIDER).challenge_availability(target)
        except REFUSED:  # the same leaf challenged before
            return
        self.client(HONEST[0]).answer_challenge(challenge, *availability_answer(state, which, chunk))
        self.challenges.append(challenge)
        RightRoundProofs.challenges_answered += 1

    @precondition(lambda self: bool(getattr(self, "challenges", [])))
    @rule(data=st.data())
    def anyone_expires_a_challenge(self, data) -> None:
        challenge = data.draw(st.sampled_from(self.challenges))
        try:
            self.client(OUTSIDER).expire_challenge(challenge, attesters=())
        except REFUSED:
            return
        raise AssertionError("I7: an answered challenge was expired")


    # ------------------------------------------------------------------ F (issue 79 point 6)
    @precondition(lambda self: len(getattr(self, "records", {})) >= 1)
    @rule(challenge=st.booleans(), waits=st.lists(st.integers(0, WINDOW - 2), max_size=2))
    def anyone_reads_finality_while_a_challenge_is_open(self, challenge: bool, waits) -> None:
        """An outsider challenges the latest committed round's weights leaf (or not), and a reader reads what
        ``pull`` and ``audit`` call final while the challenge is open, blocks passing between reads; a live
        honest member answers before its deadline. F: nothing counts as final before the chain's isFinal."""
        round_ = max(self.records)
        state = self.state_of(round_)
        opened = None
        if challenge:
            target = availability_target(self.records[round_], [state.leaf()], state.factors, 0, WEIGHTS, 0)
            try:
                opened = self.client(OUTSIDER).challenge_availability(target)
            except REFUSED:  # the same leaf challenged before, or the round's dispute window closed
                opened = None
        waited = 0
        for blocks in (0, *waits):
            blocks = min(blocks, WINDOW - 2 - waited)  # the live honest answer comes within its window
            waited += blocks
            self.blocks_pass(blocks) if blocks else None  # the walker live meanwhile (W)
            self.finality_agrees()
            RightRoundProofs.finality_reads_open += opened is not None
        if opened is not None:
            self.client(HONEST[0]).answer_challenge(opened, *availability_answer(state, WEIGHTS, 0))
            self.challenges.append(opened)
            RightRoundProofs.challenges_answered += 1
        self.finality_agrees()

    def finality_agrees(self) -> None:
        """F: every round ``pull`` would install as final (node/tools/standing.py's ``round_standing``, final
        only) and every round ``audit`` and the explorer call final (``last_final_on_chain``) is final by the
        chain's ``isFinal`` at the same block."""
        from node.tools.pull import cleared_disputes
        from node.tools.standing import chain_finality, last_final_on_chain, round_standing

        reader = self.client(HONEST[0])
        history = reader.history(self.run_id, with_registrations=False)
        standing = round_standing(history, reader.chain_id, reader.ledger_address,
                                  cleared_disputes(reader, history, []), final_only=True,
                                  is_final=chain_finality(reader, self.run_id))
        for round_, problem in standing.items():
            assert problem is not None or reader.is_final(self.run_id, round_), \
                f"F: pull would install round {round_} as final while the chain's isFinal is false"
        last = last_final_on_chain(reader, history)
        for round_ in range(last + 1):
            assert reader.is_final(self.run_id, round_), \
                f"F: audit calls round {round_} final (up to {last}) while the chain's isFinal is false"
        RightRoundProofs.finality_reads += 1
