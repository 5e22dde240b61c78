"""The security model of docs/TRUST.md as a stateful fuzzer of the real TrainingLedger on py-evm.

Honest founders, a coalition below the quorum fraction and outsiders take any valid action in any order
(commit with any subset of signatures, split the honest members' records of a round by what a stage holder
serves, attest, eject, accuse, verdicts, dispute, settle, join, leave, withdraw, advance blocks); every
invariant of the model is checked after every step:

* I1 (safety): every committed record is the honest record of its round, so a run never changes hands.
* I2 (no harm): no honest member is ever slashed, ejected, or has a round it disputed overturned against it.
* I3 (credit): an honest active member is never ejectable (its own attest credits every round it signed, the
  committed record or the committed result with other figures or checkpoint hash).
* I4 (stake back): an honest member that left withdraws its whole stake by unbondingEnd + accusationBlocks.
* I5 (finality): a final round has its dispute window closed and no dispute case open before its deadline;
  no round is ever overturned (honest records are right).
* I6 (solvency): the contract holds at least every bonded stake plus every open dispute bond.
* I7 (fraud proof, docs/FRAUD_PROOF.md): a right round is never invalidated by a proof (a chunk's or the clip
  scales', over its real commitments or tampered ones, its factors' norm commitment dropped included) nor by a
  data-availability challenge (the live honest members answer it). Its other half, a wrong round can always be
  proven: under the assumption the coalition commits no round here (I1), so it commits lied sum trees in a run
  of its own, where it is the quorum, and the live prover walks them (tests/trust_sums.py, mixed in: S1-S3
  below); tests/test_fraud_proof.py proves other committed wrong rounds.
* S1-S3 (sum-tree walks, tests/trust_sums.py): a lied sum never stands once its walk completes or a challenge
  of it expires; no honest round or stake is harmed by a walk; the walker's reward is G7's, min(the run's
  proof fund, half the stake slashed), paid from the fund (the slash burned whole).
* Issue 79: H, no honest attester of a committed round is ever slashed (a listed contributor's leave racing
  the commit, ``contributor_leaves_before_the_commit``, included); F, nothing counts as final before the
  chain's ``isFinal`` (pull's ``round_standing`` and audit's ``last_final_on_chain``, node/tools/standing.py,
  read while an availability challenge is open: ``anyone_reads_finality_while_a_challenge_is_open``); W, an
  honest walk completes within its proof window although a squatter copies each of its challenges into a game
  of its own and answers the copies in their last block (tests/trust_game.py).

Honest records commit chunked weights roots with the norm commitment (version 3) of a real aggregation chain
(two raw contributions per round on one 2 x 40 stage) in a run created as version 3
(``RunParams.commitments``: the prover holds every round's factors to it), so the provers (of a chunk and of
the clip scales) and the challenger (an outsider) act on real commitments.

The model's assumption, kept by the rules' preconditions: the coalition's active members are fewer than
half of the counted members (``quorum_bps`` 5000), and honest members are live (they attest every commit
that left them out before anyone can call them silent).
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ledger import errors
from ledger.attest import record_struct_hash
from ledger.chain import connect_pyevm
from ledger.chunkproof import chunked_weights_root
from ledger.records import RoundRecord
from node.commitments import scheme_named
from tests.fraud_fixtures import bound, honest_chain
from tests.ledger_fixtures import deploy, mine, node_key, raw_public_key
from tests.pyevm_logs import index_logs
from tests.trust_params import (
    BOND,
    COALITION,
    COALITION_JOINER,
    HONEST,
    HONEST_JOINER,
    INACTIVITY,
    REFUSED,
    STAKE,
    TENURE,
    WINDOW,
    digest,
)
from tests.trust_coalition import CoalitionMoves
from tests.trust_game import GameMoves
from tests.trust_pool import PoolMoves
from tests.trust_proofs import RightRoundProofs
from tests.trust_sums import SumWalks


class TrustMachine(CoalitionMoves, GameMoves, SumWalks, RightRoundProofs, PoolMoves,
                   RuleBasedStateMachine):
    """See module docstring. ``chain`` makes the Web3 each example deploys on (py-evm; the bench may use
    anvil)."""

    chain = staticmethod(connect_pyevm)
    examples = 0  # examples started in this process (the bench reports them)

    def __init__(self) -> None:
        super().__init__()
        every_rule_enabled(self)
    checks = 0  # times every invariant was checked: once after each example's set-up and after every step
    leave_races = 0  # honest rounds committed after a listed contributor left (issue 79)
    log_index = True  # answer getLogs from tests/pyevm_logs.py's index (bench/fuzz_trust.py --no-log-index)

    @initialize(first_round=st.just(True), pools=st.just(True))
    def deploy_run(self, first_round: bool = False, pools: bool = False) -> None:
        """Deploy, register and create the run. Every fuzzed example also opens the run's reward pools
        (``pools``: tests/trust_pool.py; the step-by-step tests of other moves skip their set-up) and commits
        round 0 at once (``first_round``): else the moves that act on a committed round (the leave race, F,
        the proofs and challenges, the pools' claims) wait for a commit that a short example rarely drew
        (issue 79: a seeded run of 396 steps drew none of them)."""
        self.deployment = deploy(self.chain())
        self.w3 = self.deployment.w3
        if self.log_index:  # each block's logs read once (tests/pyevm_logs.py; py-evm only)
            index_logs(self.w3)
        for index in (*HONEST, *COALITION, HONEST_JOINER, COALITION_JOINER):
            client = self.deployment.client(index)
            key = node_key(index + 1)
            client.register(raw_public_key(key), key.sign(client.my_binding_message()))
        self.run_id = self.client(HONEST[0]).create_run(
            digest("trust"), 1, 10, min_stake=STAKE, bond=BOND, quorum=2, quorum_bps=5000,
            accusation_blocks=WINDOW, dispute_blocks=WINDOW, inactivity_rounds=INACTIVITY,
            tenure_rounds=TENURE,
            commitments=scheme_named("normed").version,  # its honest records carry version-3 factors
            proof_fund=(len(HONEST) + len(COALITION)) * STAKE,  # a proof's reward (issue 79)
        )
        for index in (*HONEST, *COALITION):
            self.client(index).join_run(self.run_id)
        self.left_at: dict[int, int] = {}  # honest index -> block its unbonding ends
        self.ejected_honest: list[int] = []
        self.honest_hashes: dict[int, bytes] = {}  # round -> struct hash of the honest record of that round
        self.records: dict[int, RoundRecord] = {}  # committed rounds' records
        self.bound_states: dict[int, object] = {}  # round -> its honest state, bound (state_of)
        self.challenges: list[bytes] = []
        self.attesters_read: dict[int, list[int]] = {}  # round -> its honest attesters (H)
        self.verified_rounds = 0  # rounds whose committed record I1 has checked
        self.steps = 0
        if pools:  # the run's reward pools, in ETH and in a token (tests/trust_pool.py, R1-R5)
            self.setup_pools()
        self.setup_sum_walks()  # after the deployer's set-up: the walker is the deployer
        TrustMachine.examples += 1
        if first_round:
            assert self.commit(HONEST[0], self.honest_record(), list(HONEST))

    # ------------------------------------------------------------------ helpers
    def client(self, index: int):
        return self.deployment.client(index)

    def status(self, index: int) -> str:
        seat = self.client(index).member(self.run_id, self.client(index).address)
        return "none" if seat is None else seat.status

    def active(self, group) -> list[int]:
        return [i for i in group if self.status(i) == "active"]

    def honest_group(self) -> tuple[int, ...]:
        return (*HONEST, HONEST_JOINER)

    def coalition_group(self) -> tuple[int, ...]:
        return (*COALITION, COALITION_JOINER)

    def state_of(self, round_: int):
        """The honest state of ``round_`` as this run commits it: honest_chain's, its contributions bound
        (issue 62) to two members active when the round was (last) about to be committed (an honest one and a
        coalition one where both are)."""
        if round_ not in self.records or round_ not in self.bound_states:
            # one honest and one coalition contributor where both are active: a coalition contributor can then
            # race the commit (contributor_leaves_before_the_commit) without leaving the honest members short
            honest, coalition = self.active(self.honest_group()), self.active(self.coalition_group())
            chosen = (honest[:1] + coalition[:1] + honest[1:] + list(HONEST))[:2]
            signers = [self.client(index) for index in chosen]
            self.bound_states[round_] = bound(honest_chain(round_, normed=True), signers, self.run_id, round_)
        return self.bound_states[round_]

    def honest_record(self) -> RoundRecord:
        reader = self.client(HONEST[0])
        round_ = reader.commit_count(self.run_id)
        weights = chunked_weights_root([self.state_of(round_).leaf()])
        record = RoundRecord(self.run_id, round_, reader.head_of(self.run_id), weights,
                             digest(f"honest contributions {round_}"), 3_000_000, 3_100_000, 4096, 4,
                             bytes(32))
        self.honest_hashes[round_] = record_struct_hash(record)
        return record

    def assumption_holds(self, honest_counted: int, coalition: int) -> bool:
        """The model's assumption at one half: the coalition's active seats (counted or not, the worst case)
        stay fewer than the honest counted ones, so fewer than half of the counted members."""
        return coalition < honest_counted

    def honest_counted(self, leaving: int | None = None) -> int:
        reader = self.client(HONEST[0])
        return sum(1 for i in self.active(self.honest_group()) if i != leaving
                   and reader.member(self.run_id, self.client(i).address).counted)

    def attest_left_out(self, record: RoundRecord, attesters, signed=None) -> None:
        """Live honest members put their own signature on chain when a commit left it out
        (node/live/chain/readback.py): over the committed record, or over the record of its result they
        signed with other figures or checkpoint hash (``signed``: member -> that record)."""
        signed = signed or {}
        named = {a.lower() for a in attesters}
        for index in self.active(self.honest_group()):
            client = self.client(index)
            if client.address.lower() in named:
                continue
            seat = client.member(self.run_id, client.address)
            if seat.join_round > record.round:
                continue
            own = signed.get(index, record)
            client.attest(own, client.sign_record(own), record)

    def attesters_of(self, round_: int):
        return self.client(HONEST[0]).commit_record(self.run_id, round_).attesters

    def commit(self, submitter: int, record: RoundRecord, signers, signed=None) -> bool:
        signatures = [self.client(i).sign_record(record) for i in signers]
        try:
            self.client(submitter).commit_round(record, signatures)
        except REFUSED:
            return False
        self.records[record.round] = record
        self.attest_left_out(record, self.attesters_of(record.round), signed)
        return True

    # ------------------------------------------------------------------ honest behaviour
    @rule(data=st.data())
    def honest_commit(self, data) -> None:
        """An honest member commits the round's honest record with every honest signature it holds."""
        honest = self.active(self.honest_group())
        if not honest:
            return
        submitter = data.draw(st.sampled_from(honest))
        extra = data.draw(st.lists(st.sampled_from(self.active(self.coalition_group()) or [0]), unique=True))
        signers = honest + [i for i in extra if i]
        self.commit(submitter, self.honest_record(), signers)

    @rule(data=st.data())
    def honest_leaves(self, data) -> None:
        honest = self.active(self.honest_group())
        coalition = self.active(self.coalition_group())
        if len(honest) < 2:
            return
        index = data.draw(st.sampled_from(honest))
        if not self.assumption_holds(self.honest_counted(leaving=index), len(coalition)):
            return  # the model's assumption: leaving must keep the coalition below half
        client = self.client(index)
        client.leave_run(self.run_id)
        self.left_at[index] = client.member(self.run_id, client.address).unbonding_end

    @rule(data=st.data())
    def contributor_leaves_before_the_commit(self, data) -> None:
        """Issue 79: the round's honest record binds two active members' contributions; one of them (the
        coalition's or an honest one) leaves after the close and before the honest commit lands (on a real
        chain in its very block, by a higher tip: tests/test_leave_race.py). The round stays right: I2 and
        I7."""
        if len(self.active(self.honest_group())) < 2:
            return
        record = self.honest_record()  # binds the round's contributions to members active now (state_of)
        listed = {a.lower() for a in self.bound_states[record.round].factors.norms.contributors}
        leavers = [i for i in (*self.honest_group(), *self.coalition_group())
                   if self.status(i) == "active" and self.client(i).address.lower() in listed]
        if not leavers:
            return
        index = data.draw(st.sampled_from(leavers))
        honest = index in self.honest_group()
        if honest and not self.assumption_holds(self.honest_counted(leaving=index),
                                                len(self.active(self.coalition_group()))):
            return
        client = self.client(index)
        client.leave_run(self.run_id)
        if honest:
            self.left_at[index] = client.member(self.run_id, client.address).unbonding_end
        signers = self.active(self.honest_group())
        if signers and self.commit(signers[0], record, signers):
            TrustMachine.leave_races += 1

    @precondition(lambda self: self.status(HONEST_JOINER) == "none")
    @rule()
    def honest_joiner_joins(self) -> None:
        if self.status(HONEST_JOINER) == "none":
            self.client(HONEST_JOINER).join_run(self.run_id)

    @precondition(lambda self: bool(self.left_at))
    @rule()
    def honest_withdraw_when_due(self) -> None:
        """I4: at unbondingEnd + accusationBlocks an honest leaver's stake comes back, whatever was filed."""
        for index, end in list(self.left_at.items()):
            if self.w3.eth.block_number < end + WINDOW:
                continue
            client = self.client(index)
            for accusation in client.history(self.run_id).accusations:
                if accusation.accused == client.address and accusation.open:
                    client.expire_accusation(self.run_id, client.address, accusation.evidence_hash)
            before = client.balance()
            tx = client.withdraw_stake(self.run_id)
            receipt = self.w3.eth.get_transaction_receipt(tx)
            returned = client.balance() - before + receipt["gasUsed"] * receipt["effectiveGasPrice"]
            assert returned == STAKE, f"I4: {returned} of the stake {STAKE} came back"
            del self.left_at[index]

    @rule(data=st.data())
    def honest_settle_dispute(self, data) -> None:
        """The honest counted members uphold a disputed honest round (or let it lapse past its deadline)."""
        reader = self.client(HONEST[0])
        count = reader.commit_count(self.run_id)
        if count == 0:
            return
        round_ = data.draw(st.integers(0, count - 1))
        status, deadline, _ = reader.dispute_case(self.run_id, round_)
        if status != "open":
            return
        record = reader.commit_of(self.run_id, round_)
        if self.w3.eth.block_number >= deadline:
            reader.expire_dispute(self.run_id, round_)
            return
        signers = [i for i in self.honest_group() if self.status(i) in ("active", "unbonding")]
        try:
            reader.resolve_dispute(record, True, [self.client(i).sign_round_verdict_for(record, True)
                                                  for i in signers], self.attesters_of(round_))
        except (errors.LedgerQuorumNotMet, errors.LedgerSignerNotInForce, errors.LedgerSignerNotMember):
            pass  # too few honest members counted at that commit: the case lapses instead
        except errors.LedgerDisputeExpired:
            # The verdict's transaction is mined in the next block, which may be the deadline's: the case
            # lapsed meanwhile (the fuzzer met this once the prover and challenger sent transactions too).
            reader.expire_dispute(self.run_id, round_)

    @rule()
    def a_block_passes(self) -> None:
        """One block passes. Hypothesis' first example of every run is its simplest: the first valid rule of
        its sorted list at every step; this rule (no argument, first by name) makes that example a cheap
        100 blocks instead of 100 challenges of the same leaf."""
        self.blocks_pass(1)

    @rule(blocks=st.integers(1, 2 * WINDOW))
    def blocks_pass(self, blocks: int) -> None:
        mine(self.w3, blocks)
        self.walker_stays_live()  # the walker is live: it acts once blocks passed (tests/trust_game.py)

    # ------------------------------------------------------------------ invariants
    def honest_attesters_unslashed(self, seats) -> None:
        """H (issue 79): no honest attester of a committed round is ever slashed, whoever left, raced the
        commit, challenged or proved (the attesters of a round are read once, at the first check after it)."""
        honest = {self.client(i).address.lower(): i for i in self.honest_group()}
        for round_ in sorted(self.records):
            if round_ not in self.attesters_read:
                self.attesters_read[round_] = [honest[a.lower()] for a in self.attesters_of(round_)
                                               if a.lower() in honest]
            for index in self.attesters_read[round_]:
                seat = seats[index]
                assert seat is None or seat.status != "slashed", \
                    f"H: honest attester {index} of round {round_} was slashed"

    @invariant()
    def the_model_holds(self) -> None:
        if not hasattr(self, "run_id"):
            return
        TrustMachine.checks += 1
        reader = self.client(HONEST[0])
        run = reader.run_struct(self.run_id)
        count = run["commitCount"]
        # I1: every committed record is the honest one (the honest members sign no other); a committed round's
        # hash never changes, so each is read once.
        for round_ in range(self.verified_rounds, count):
            assert reader.record_hash_of(self.run_id, round_) == self.honest_hashes.get(round_), \
                f"I1: round {round_} holds a record the honest members did not sign"
        self.verified_rounds = count
        # I2, I5: no honest member ejected or slashed; no honest round overturned.
        seats = {i: reader.member(self.run_id, self.client(i).address)
                 for i in (*self.honest_group(), *self.coalition_group())}
        self.honest_attesters_unslashed(seats)  # H, named first where an attester is the one slashed
        assert not self.ejected_honest, f"I2/I3: honest member(s) {self.ejected_honest} ejected"
        assert run["invalidFrom"] == 0, "I5: an honest round was overturned"
        for index in self.honest_group():
            seat = seats[index]
            assert seat is None or seat.status != "slashed", f"I2: honest member {index} slashed"
            # I3: a live honest member is never behind enough to be ejected.
            if seat is not None and seat.status == "active":
                assert count - seat.active_round < INACTIVITY, \
                    f"I3: live honest member {index} is {count - seat.active_round} rounds behind"
        # I5: a final round is out of its window and has no dispute open before its deadline.
        block = self.w3.eth.block_number
        open_bonds = 0
        for round_ in range(max(0, count - 4), count):
            status, deadline, disputers = reader.dispute_case(self.run_id, round_)
            if status == "open":
                open_bonds += disputers * BOND
            if reader.is_final(self.run_id, round_):
                assert block >= reader.commit_block_of(self.run_id, round_) + WINDOW, \
                    "I5: final inside its window"
                assert status != "open" or block >= deadline, "I5: final with an open dispute"
        # I6: solvency (older open cases only add to what the contract must hold).
        staked = sum(seat.stake for seat in seats.values()
                     if seat is not None and seat.status in ("active", "unbonding"))
        assert self.w3.eth.get_balance(reader.ledger_address) >= staked + open_bonds, "I6: insolvent"
        # S1-S3: the sum-tree walks (tests/trust_sums.py).
        self.sum_walks_hold()
        # R1-R5: the reward pools (tests/trust_pool.py).
        self.pools_hold()


class _EveryRule:
    """Hypothesis' swarm-testing flags (its ``FeatureFlags.is_enabled``) with every rule on."""

    @staticmethod
    def is_enabled(name) -> bool:
        return True


def every_rule_enabled(machine: RuleBasedStateMachine) -> None:
    """Turn hypothesis' swarm testing off for ``machine``: every rule may be drawn at every step of every
    example, each as often as it is listed (:data:`MOVE_WEIGHTS`). Swarm testing turns a random part of the
    rules off for a whole example, by function name (``RuleStrategy._rule_is_enabled``), so every copy of a
    weighted move went off together, and in a short run the moves that pay or catch a bug (the pool's claim
    once final) were drawn in none of 3 examples. Hypothesis has no setting for it: this replaces the
    machine's rule strategy's flags. Where a hypothesis version draws rules otherwise (the strategy is
    hypothesis' private part) it warns and leaves swarm testing on: the machine's checks still hold, its
    rules are drawn less evenly; ``DLX_TRUST_STRICT_RULES=1`` (the mutation bench's runs) makes that an
    error."""
    import os
    import warnings

    import hypothesis

    strategy = getattr(machine, "_rules_strategy", None)
    if not hasattr(strategy, "enabled_rules_strategy"):
        why = (f"hypothesis {hypothesis.__version__} draws a machine's rules without the "
               "RuleStrategy.enabled_rules_strategy tests/trust_machine.every_rule_enabled replaces: swarm "
               "testing stays on")
        if os.environ.get("DLX_TRUST_STRICT_RULES") == "1":
            raise RuntimeError(why)
        warnings.warn(why, stacklevel=2)
        return
    strategy.enabled_rules_strategy = st.just(_EveryRule())


#: Moves drawn more often than the others (hypothesis draws a rule uniformly among the enabled ones, every
#: one here (:func:`every_rule_enabled`), so a move listed w times is drawn about w times as often): the
#: honest commit, on which most moves act, issue 79's leave race and finality read (F), and the pool's
#: claims. A seeded run's counts are
#: bench/fuzz_trust.py's ``moves_drawn``.
MOVE_WEIGHTS = {"honest_commit": 3, "contributor_leaves_before_the_commit": 2,
                "anyone_reads_finality_while_a_challenge_is_open": 2, "member_claims": 2}


def _weigh(machine: type, weights: dict[str, int]) -> None:
    """List each move of ``weights`` w times among ``machine``'s rules (aliases of the same rule: hypothesis
    collects a rule once per attribute name that holds it)."""
    for name, weight in weights.items():
        for copy in range(1, weight):
            setattr(machine, f"{name}_x{copy + 1}", getattr(machine, name))


_weigh(TrustMachine, MOVE_WEIGHTS)
