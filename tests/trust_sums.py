"""The sum-tree walk's actors of the trust fuzzer (tests/trust_machine.py; issue 43, docs/FRAUD_PROOF.md, "The
clip scales" and gap 2 (iii)), mixed into :class:`tests.trust_machine.TrustMachine`.

G7 holds whatever the coalition holds, so here it holds a quorum: below the quorum fraction of the machine's
run (I1) it cannot commit a lie there, so it creates a *captured run* of its own (its two founders and one
honest member, k = 2: the coalition alone is the quorum) and commits in it a version-3 round whose sum tree
lies, withholding its state, factors and sum trees (nobody serves them):

* one chunk's sum of one contribution off (the tree and its total consistent with the lie, the scales the
  rule's: only a sum proof shows it), or
* a contribution the norm rule clips aggregated unclipped (scale 1.0), behind a tree of another contribution's
  lower sums (every leaf a lie, the weights other than the honest ones).

The walker (the deployer's account: a member of no run) is the live node's own prover
(node/live/fraud/prover.py, ``FraudProver`` and its ``SumWalk``, node/live/fraud/walks.py) without libp2p: its
own states, the attestations it heard, and nothing served to it, so it challenges the factors, then the lied
contribution's sum tree leaf by leaf (``2 + M + j``), then, where the weights differ, the lied chunk's weights
leaf, and proves the lie. At each level the coalition answers with the truthful leaves of its lied tree, with
junk (another leaf, the honest state's, a cut path: the contract must refuse it) or not at all (then, past the
answer window, the walker expires the challenge: the round falls). The walker also walks a right round of the
machine's run mistakenly (its own sums off), answered at once by the honest members
(node/live/fraud/answerer.py answers from its state the same way): the proof it ends in is refused and nobody
is slashed.

Invariants (checked by ``the_model_holds`` after every step):

* S1: a captured round whose walk sent its proof or expired a challenge is invalid (from round 1), its two
  attesters slashed; a walk never ends without either (issue 62: the chess clock; tests/trust_game.py's G1),
  and no captured run is ever invalidated by anything but its walk.
* S2: the honest round 0 of a captured run is never invalidated and its honest member never slashed (the
  machine's I2, I5 and I7 cover the mistaken walks of the machine's run).
* S3: the walker's reward is G7's (issue 79): what it received (its balance's change plus its gas and the
  bonds it sent) is exactly min(the run's proof fund, half the stake slashed) for each captured round it
  overturned, paid from that run's proof fund (the fund is down by exactly that; the slash itself is burned
  whole), plus every bond of its walk.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ledger.availability import FACTORS, availability_answer
from ledger.chunkproof import StageState, chunked_weights_root
from ledger.normproof import SumTree
from ledger.records import RoundRecord
from node import protocol
from node.commitments import scheme_named, stage_state
from node.live.chain.onchain import NodeChain
from node.live.fraud.prover import FraudProver
from node.live.state.roundbook import RoundBook
from tests.fraud_fixtures import DILOCO, bound, contribution, lied_sum, normed_start, tensors
from tests.ledger_fixtures import mine
from tests.trust_params import (BOND, CAPTURED_FUND, CAPTURED_REWARD, CAPTURED_STAKE, COALITION, HONEST,
                                REFUSED, digest)
from training.chunks import float64_bits
from training.diloco import aggregate_with_report

WALKER = 0  # the deployer: a member of no run, the only account that walks sum trees
SUM_SHAPES = {"w": (4, 100)}  # 400 elements: 7 chunks, a tree with promoted odd nodes at two levels
#: The captured run's dispute window: a walk starts in it (the walker checks the round at once) and goes on
#: past it as long as each step is answered in time (issue 62, the chess clock): short, so that last-block
#: answers (tests/trust_game.py) carry walks past it.
CAPTURED_DISPUTE_BLOCKS = 48
#: Its answer window: longer than one blocks_pass step, so a coalition may answer late and still in time.
CAPTURED_ANSWER_BLOCKS = 24
#: The lies about one chunk's sum, in units of 2**-298:
#: far below a half ulp of any total, the scales unchanged.
DELTAS = (1, -1, 1 << 200, -(1 << 200))
#: How the coalition meets each level of a walk: truthfully most often (so that walks get to their end within
#: an example), else with junk or not at all.
ANSWERS = ("truthful", "truthful", "late", "relay", "junk", "silent")


def lies():
    """A lie of the captured round: ("unclipped",) or ("chunk", contribution, chunk, delta)."""
    return st.one_of(st.just(("unclipped",)),
                     st.tuples(st.just("chunk"), st.integers(0, 2), st.integers(0, 6),
                               st.sampled_from(DELTAS)))


def walk_levels():
    """How the coalition meets the next levels of a walk, one answer each."""
    return st.lists(st.sampled_from(ANSWERS), max_size=10)


@functools.cache
def captured_states() -> tuple[StageState, StageState, StageState]:
    """The captured run's stage 0 (one stage): round 0's state, round 1's honest state (three raw
    contributions, the third ten times larger: the norm rule clips it) and round 1 aggregated unclipped behind
    lower sums."""
    diloco = dataclasses.replace(DILOCO, commitments="normed")
    weights, momentum = tensors(11, SUM_SHAPES), tensors(12, SUM_SHAPES, scale=0.0)
    blobs = [contribution(SUM_SHAPES, "raw", 2000 + i, scale=scale, outer_round=1)
             for i, scale in enumerate((1e-2, 1e-2, 1e-1))]

    def aggregated(cfg):
        aggregation = aggregate_with_report(weights, momentum, blobs, cfg, stage_index=0, outer_round=1)
        return stage_state(0, aggregation, blobs, cfg, 1, decode_args={"stage_index": 0, "outer_round": 1})

    honest = aggregated(diloco)
    assert honest.factors.scale_bits[2] != float64_bits(1.0), \
        "the fixture's third contribution must be clipped"
    loose = aggregated(dataclasses.replace(diloco, norm_clip=0.0))
    # The scales stay the rule's if the third contribution's
    # committed sums are those of the larger of the others.
    larger = max((0, 1), key=lambda j: loose.sum_trees[j].total)
    lower = SumTree.of(loose.sum_trees[larger].sums)
    norms = dataclasses.replace(loose.factors.norms, clip_bits=float64_bits(diloco.norm_clip),
                                roots=(*loose.factors.norms.roots[:2], lower.root),
                                sums=(*loose.factors.norms.sums[:2], lower.total))
    unclipped = dataclasses.replace(loose, factors=dataclasses.replace(loose.factors, norms=norms),
                                    sum_trees=[*loose.sum_trees[:2], lower])
    return normed_start(weights, momentum, diloco), honest, unclipped


class HeldStates:
    """The walker's own stage states by round, as node/live/fraud/chunkstate.ChunkedStates holds them; nobody
    serves it the committed ones (the coalition withholds them), so it opens them on chain."""

    scheme = scheme_named("normed")

    def __init__(self, states: dict[int, StageState]) -> None:
        self._states = states

    def state(self, outer_round: int, stage: int) -> StageState | None:
        return self._states.get(outer_round) if stage == 0 else None

    def committed_state(self, outer_round, stage, leaf, providers):
        return None

    def committed_norms(self, outer_round, stage, leaf, providers):
        return None

    def pieces_of(self, outer_round: int, stage: int, payload_root: bytes) -> list[bytes] | None:
        """As ChunkedStates.pieces_of, for a walker that left nothing out: an aggregated one's pieces."""
        state = self.state(outer_round, stage)
        roots = state.factors.payload_roots if state is not None else ()
        return state.payload_leaves[roots.index(payload_root)] if payload_root in roots else None


def _attestation(leaf: bytes) -> protocol.Attestation:
    return protocol.Attestation(b"\x01" * 32, b"\x02" * 32, 2, float("nan"), float("nan"), 0, b"", b"", leaf)


@dataclasses.dataclass
class LiedRound:
    """A captured run whose round 1 lies, and the walk over it."""

    run_id: int
    records: list[RoundRecord]  # rounds 0 and 1
    committed: StageState  # round 1's state as committed (the lie)
    commit_block: int
    prover: FraudProver | None = None  # the walker's, once it walks
    counted: bool = False  # its end counted in SumWalks' tallies
    copier: bool = False  # issue 62 (tests/trust_game.py): a front-runner copies the walker's proof
    squatter: bool = False  # issue 79: a squatter copies the walker's challenges into its own game first
    squats: list[bytes] = dataclasses.field(default_factory=list)  # the squatter's copies' ids
    left: bool = False  # its attesters left the run at once
    copier_checked: bool = False
    copier_gain: int = 0  # what the copier's copy and claims netted it (gas counted)
    paid: int = 0  # the walk's gas and bonds

    def ended(self) -> bool:
        log = self.prover.log if self.prover is not None else None
        return log is not None and bool(log.proofs or log.expired or log.unprovable)


class SumWalks:
    """The sum-tree walk's rules and invariants (module docstring); mixed into the trust machine, which calls
    :meth:`setup_sum_walks` when it deploys and :meth:`sum_walks_hold` from its invariant."""

    sum_walks_proven = 0  # captured rounds a walk proved wrong (S1)
    sum_walks_expired = 0  # captured rounds overturned by an unanswered challenge of their walk (S1)
    sum_walks_cut = 0  # walks the dispute window ended (gap 7)
    junk_answers_refused = 0  # junk answers to a walk's challenge the contract refused
    mistaken_walks = 0  # walks of right rounds, answered by the honest members, that proved nothing (I7)

    def setup_sum_walks(self) -> None:
        self.lied_rounds: list[LiedRound] = []
        self.walker_start = self.w3.eth.get_balance(self.client(WALKER).address)
        self.walker_paid = 0  # gas and bonds the walker's transactions cost it
        self.challenge_logs: dict[int, list] = {}  # run id -> [first, next block, events] (challenges_since)

    # ------------------------------------------------------------------ helpers
    def walker(self, run_id: int, attested: dict[int, list[bytes]],
               own: dict[int, StageState], case: LiedRound | None = None) -> FraudProver:
        """The walker's prover for ``run_id``: it heard ``attested[round]`` stage leaves and holds ``own``
        states. Its expirer thread ends at once (its stop is set): the machine settles its challenges as a
        step."""
        book = RoundBook()
        for outer_round, leaves in attested.items():
            for peer, leaf in enumerate(leaves):
                book.add_attestation(outer_round, 0, f"peer-{peer}", _attestation(leaf))
        stop = threading.Event()
        stop.set()
        return FraudProver(run_id=run_id, chain=NodeChain(self.walker_client(case)), book=book,
                           states=HeldStates(own), stages=lambda: (0,), num_stages=1, stop=stop)

    def walker_acts(self, action, case: LiedRound | None = None) -> None:
        """Run ``action`` (the walker's), adding what its mined transactions cost it to ``walker_paid`` (and
        to ``case``'s)."""
        since = self.w3.eth.block_number
        try:
            action()
        finally:
            address = self.client(WALKER).address.lower()
            for number in range(since + 1, self.w3.eth.block_number + 1):
                for tx in self.w3.eth.get_block(number, full_transactions=True)["transactions"]:
                    if tx["from"].lower() != address:
                        continue
                    receipt = self.w3.eth.get_transaction_receipt(tx["hash"])
                    cost = receipt["gasUsed"] * receipt["effectiveGasPrice"]
                    cost += tx["value"] if receipt["status"] == 1 else 0
                    self.walker_paid += cost
                    if case is not None:
                        case.paid += cost

    def open_challenge(self, prover: FraudProver, run_id: int, outer_round: int, since: int) -> dict | None:
        """The walk's open challenge (its event's fields: which, chunk), or None if it has none open."""
        challenge_id = prover.log.challenges.get(outer_round)
        if challenge_id is None or self.client(WALKER).challenge_of(challenge_id)["settled"]:
            return None
        return next(event for event in self.challenges_since(run_id, since)
                    if bytes(event["id"]) == challenge_id)

    def challenges_since(self, run_id: int, since: int) -> list[dict]:
        """The availability challenges of ``run_id`` opened from block ``since`` on, read incrementally: each
        block's logs once per run. eth-tester's getLogs reads every block of its range and its receipts, so a
        scan from the round's commit at every step made a long example quadratic in its chain (most of a
        batch's time at the default five examples of 100 steps)."""
        scanned = self.challenge_logs.get(run_id)
        if scanned is None or since < scanned[0]:
            scanned = self.challenge_logs[run_id] = [since, since, []]  # [first, next block, events]
        head = self.w3.eth.block_number
        if scanned[1] <= head:
            found = self.client(WALKER).availability_challenges(run_id, scanned[1])
            scanned[2].extend(event for event in found if event["block"] <= head)
            scanned[1] = head + 1
        return [event for event in scanned[2] if event["block"] >= since]

    def lied_in_flight(self) -> LiedRound | None:
        case = self.lied_rounds[-1] if getattr(self, "lied_rounds", None) else None
        return case if case is not None and not case.ended() else None

    # ------------------------------------------------------------------ the coalition and the walker
    @precondition(lambda self: hasattr(self, "lied_rounds") and self.lied_in_flight() is None)
    @rule(lie=lies(), answers=walk_levels(), moves=st.tuples(st.booleans(), st.booleans(), st.booleans()))
    def coalition_commits_a_lied_sum(self, lie, answers, moves=(False, False, False)) -> None:
        """The coalition, the quorum of a run of its own, commits a round whose sum tree lies and serves
        nothing; the walker reads it back and starts its walk, and its first levels follow
        (``the_walk_goes_on``)."""
        start, honest, unclipped = captured_states()
        committed = unclipped if lie[0] == "unclipped" else lied_sum(honest, *lie[1:])
        creator = self.client(COALITION[0])
        run_id = creator.create_run(
            digest(f"captured {len(self.lied_rounds)}"), 1, 10, min_stake=CAPTURED_STAKE, bond=BOND,
            quorum=2, quorum_bps=5000, accusation_blocks=CAPTURED_ANSWER_BLOCKS,
            dispute_blocks=CAPTURED_DISPUTE_BLOCKS, commitments=scheme_named("normed").version,
            proof_fund=CAPTURED_FUND)  # pays the reward (issue 79: the slash is burned whole)
        for index in (*COALITION, HONEST[0]):
            self.client(index).join_run(run_id)
        self.captured_pool(run_id)  # a reward pool the coalition then claims from (tests/trust_pool.py)
        # its contributions bound to the run's members (issue 62): the coalition signs its own lie
        committed = bound(committed, [self.client(index) for index in (*COALITION, HONEST[0])], run_id, 1)
        records = []
        for outer_round, state in enumerate((start, committed)):
            if outer_round:  # round 0's window closes first: round 1's proof is taken at once (issue 62)
                mine(self.w3, CAPTURED_DISPUTE_BLOCKS)
            record = RoundRecord(run_id, outer_round, creator.head_of(run_id),
                                 chunked_weights_root([state.leaf()]),
                                 digest(f"captured contributions {outer_round}"), 3_000_000, 3_100_000, 4096,
                                 3, bytes(32))
            creator.commit_round(record, [self.client(i).sign_record(record) for i in COALITION])
            records.append(record)
        self.lied_rounds.append(LiedRound(run_id, records, committed, self.w3.eth.block_number,
                                          copier=moves[1], squatter=len(moves) > 2 and moves[2]))
        if moves[0]:
            self.coalition_leaves(self.lied_rounds[-1])
        self.walker_checks(self.lied_rounds[-1])
        self.the_walk_goes_on(answers)

    def walker_checks(self, case: LiedRound) -> None:
        """The walker checks the captured round as the live node does each round it reads back, against its
        own (the honest) state: the committed factors differ and nobody serves them, so it challenges them on
        chain, the first step of its walk."""
        start, honest, _unclipped = captured_states()
        committed_leaf, own_leaf = case.committed.leaf().encode(), honest.leaf().encode()
        case.prover = self.walker(case.run_id, {0: [start.leaf().encode()], 1: [committed_leaf, own_leaf]},
                                  {0: start, 1: honest}, case)
        mine = dataclasses.replace(case.records[1], weights_root=chunked_weights_root([honest.leaf()]))
        self.walker_acts(lambda: case.prover.check(1, case.records[1], mine), case)
        self.count_end(case)

    @precondition(lambda self: hasattr(self, "lied_rounds") and self.lied_in_flight() is not None)
    @rule(answers=walk_levels())
    def the_walk_goes_on(self, answers) -> None:
        """At each level the coalition answers the walk's open challenge (truthfully from its lied state, with
        junk, or not at all), then the walker follows: the next challenge, the proof, or the unanswered one
        expired."""
        case = self.lied_in_flight()
        if case is None:  # its walk ended at its first step (or gave up there: W/G1 reports that)
            return
        for how in answers:
            if case.ended():
                break
            self.squatter_answers(case)  # issue 79: the squatter's copies, in their last block
            event = self.open_challenge(case.prover, case.run_id, 1, case.commit_block)
            if event is not None and how != "silent":
                self.coalition_answers(case, event, how)
            self.walker_acts(case.prover.settle_challenges, case)
        self.count_end(case)
        self.after_walk(case)

    @staticmethod
    def count_end(case: LiedRound) -> None:
        if case.counted or not case.ended():
            return
        case.counted = True
        log = case.prover.log
        SumWalks.sum_walks_proven += bool(log.proofs)
        SumWalks.sum_walks_expired += bool(log.expired)
        SumWalks.sum_walks_cut += not (log.proofs or log.expired)

    def coalition_answers(self, case: LiedRound, event: dict, how: str) -> None:
        """The coalition answers the challenge ``event`` with the truthful leaf and path of its lied state
        (``how``: at once, ``late`` or through a ``relay``), or tries junk: the honest state's leaf and path
        (where they differ), the leaf with a bit flipped, a path cut short; the contract must refuse each."""
        which, chunk = event["which"], event["chunk"]
        leaf, path = availability_answer(case.committed, which, chunk)
        answerer = self.client(COALITION[1])
        if how != "junk":  # truthful: at once, in the last block or through a relay (tests/trust_game.py)
            try:
                self.answer_as_coalition(event, leaf, path, how)
            except REFUSED:  # too late to answer: only past the challenge's deadline
                deadline = answerer.challenge_of(bytes(event["id"]))["deadline"]
                assert self.w3.eth.block_number + 1 >= deadline, "a truthful answer in time was refused"
            return
        _start, honest, _unclipped = captured_states()
        for other_leaf, other_path in (availability_answer(honest, which, chunk),  # the truth behind the lie
                                       (leaf[:-1] + bytes([leaf[-1] ^ 1]), path),
                                       (leaf, path[:-1] if path else [bytes(32)])):
            if (other_leaf, other_path) == (leaf, path) or (which == FACTORS and other_leaf == leaf):
                # not junk: the same answer (a tree the lie left alone), or a path the factors have not
                continue
            try:
                answerer.answer_challenge(bytes(event["id"]), other_leaf, other_path)
            except REFUSED:
                SumWalks.junk_answers_refused += 1
                continue
            raise AssertionError(f"a junk answer to a challenge of tree {which} leaf {chunk} was accepted")

    @precondition(lambda self: len(getattr(self, "records", {})) >= 2)
    @rule(contribution=st.integers(0, 1), chunk=st.integers(0, 1), delta=st.sampled_from(DELTAS))
    def anyone_walks_a_right_round_mistakenly(self, contribution: int, chunk: int, delta: int) -> None:
        """The walker, its own sum of one chunk off, walks the machine's latest (right) round; the honest
        members answer every challenge at once from their state. The proof it ends in is refused (or the
        window or an earlier challenge of the same leaf stops it): nothing invalidated, nobody slashed (I7,
        I2)."""
        round_ = max(self.records)
        honest, prev = self.state_of(round_), self.state_of(round_ - 1)  # as committed: bound (issue 62)
        own = lied_sum(honest, contribution, chunk, delta)
        prover = self.walker(self.run_id, {round_ - 1: [prev.leaf().encode()],
                                           round_: [honest.leaf().encode(), own.leaf().encode()]},
                             {round_ - 1: prev, round_: own})
        since = self.w3.eth.block_number
        mine = dataclasses.replace(self.records[round_], weights_root=chunked_weights_root([own.leaf()]))
        self.walker_acts(lambda: prover.check(round_, self.records[round_], mine))
        while (event := self.open_challenge(prover, self.run_id, round_, since)) is not None:
            self.client(HONEST[0]).answer_challenge(bytes(event["id"]),
                                                    *availability_answer(honest, event["which"],
                                                                         event["chunk"]))
            self.walker_acts(prover.settle_challenges)
        assert not prover.log.proofs and not prover.log.expired, \
            f"I7: a walk proved right round {round_} wrong"
        why = prover.log.unprovable.get(round_, "")
        ends = ("ProverNormCorrect", "ProverChallengeTooLate", "ProverChallengeExists")
        assert any(end in why for end in ends), \
            f"a mistaken walk of round {round_} ended unexpectedly: {why!r}"
        SumWalks.mistaken_walks += 1

    # ------------------------------------------------------------------ invariants
    def sum_walks_hold(self) -> None:
        """S1-S3 (module docstring)."""
        reader = self.client(HONEST[0])
        rewards = returned = 0
        for case in self.lied_rounds:
            invalid = reader.invalid_from(case.run_id)
            assert invalid in (None, 1), f"S2: captured run {case.run_id}'s honest round 0 was invalidated"
            honest_seat = reader.member(case.run_id, reader.address)
            assert honest_seat is not None and honest_seat.status == "active", \
                "S2: an honest member was harmed"
            log = case.prover.log if case.prover is not None else None
            completed = log is not None and bool(log.proofs or log.expired)
            if invalid is None:
                assert not completed, f"S1: run {case.run_id}'s lied round stands after its walk completed"
                continue
            assert completed, f"S1: run {case.run_id} was invalidated by something other than its walk"
            slashed = [i for i in COALITION
                       if reader.member(case.run_id, self.client(i).address).status == "slashed"]
            assert len(slashed) == len(COALITION), \
                f"S1: only {slashed} of the lied round's attesters were slashed"
            rewards += CAPTURED_REWARD
            assert reader.proof_fund_of(case.run_id) == CAPTURED_FUND - CAPTURED_REWARD, \
                f"S3/G7: run {case.run_id}'s reward was not paid from its proof fund"
            # (issue 62) every bond of the walk comes back once the round falls: the answered steps' from the
            # game's escrow (with the expiry, or reclaimed after the proof), the expired step's with it
            walker = self.client(WALKER).address
            challenges = self.challenges_since(case.run_id, case.commit_block)
            returned += BOND * sum(1 for event in challenges if event["challenger"] == walker)
        received = self.w3.eth.get_balance(self.client(WALKER).address) - self.walker_start + self.walker_paid
        assert received == rewards + returned, \
            (f"S3: the walker received {received} wei; min(fund, half the slash) is {rewards}, all its "
             f"bonds back {returned}")
        self.game_bounds_hold()  # issue 62 (tests/trust_game.py)
