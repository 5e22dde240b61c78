"""The reward pool (issue 77) as actors of the trust fuzzer (tests/trust_machine.py): the machine's run has
two pools, one in ETH and one in a fee-on-transfer ERC-20 (contracts/src/test/QuirkyToken.sol, 10% fee), each
in its own RewardPool; every run the coalition captures (tests/trust_sums.py) opens a pool in the ETH one
before its lied round. Funders top any pool up; members claim their attestations and contributions (at once or
once final, some in another's place, again after they were paid); the coalition claims its captured rounds,
the overturned one and, once convicted, the others; anyone sweeps; the token, armed, calls the pool back from
inside a funder's transfer; the founders' accounts delegate (EIP-7702) to a re-entrant receiver
(contracts/src/test/ReentrantClaimer.sol) that, armed, claims again from inside its payment. After every step
(``pools_hold``, from the machine's invariant):

* R1 (credits within the pool): no opened round paid past its budget, each round's paid is what its claims
  paid, and a run's free funds plus its open rounds' unpaid budgets are its funded minus its claimed.
* R2 (no credit where none is due): no round of a run from its overturned one on was ever opened or paid;
  no claim paid a member slashed in that run or a round the chain did not call final, or another amount than
  the rule's share (ledger.rewards).
* R3 (once): a claim pays once: a paid share claimed again is refused, claimedOf agrees, and the receiver's
  re-entered copy of its own claim is refused as claimed.
* R4 (books): each pool contract holds exactly what its runs were funded (what arrived) minus what they
  paid, and each run's funded and claimed are that.
* R5 (re-entry): a call the token made into its pool from inside one of its transfers never succeeded.

Each assertion names its invariant, so bench/fuzz_pool_mutations.py --machine trust says which caught a bug.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import contracts
from ledger import errors
from ledger.account import dev_account, fund_accounts
from ledger.rewards import (ATTESTER, PoolParams, RewardPoolClient, attester_share, contribution_share,
                            stage_claim_args)
from ledger.reverts import revert_from_data
from ledger.tx import TransactionSender
from tests.ledger_fixtures import FAST_RETRY, mine
from tests.reward_fixtures import FEE_ON_TRANSFER, Token
from tests.trust_params import COALITION, HONEST, OUTSIDER, WINDOW

AMOUNT = 10**15  # a round's budget, in wei or token units
FEE_BPS = 1_000  # the token's fee on transfer
#: Rounds the machine's run's pools are funded for at set-up (as create-run funds one round's amount a round):
#: with 3, as before, a claim of a round past the third was refused as unfunded until a funder topped up, so
#: most claims of a short run paid nothing (a claim opens every earlier round first). Funders still top up.
FUNDING_ROUNDS = 64
SPARE_SLOTS = 2  # contribution slots a pool has past the run's maxContributions (open_pool)
#: Funders, and the sender that arms the receivers and the token: generated dev accounts funded at set-up
#: (the deployer, 0, is the walker, whose balance S3 counts; 1-9 are the run's cast).
FUNDERS = (10, 11)
#: Accounts whose code delegates to ReentrantClaimer (EIP-7702): the founders, who attest and contribute.
RECEIVERS = (*HONEST, *COALITION)


@dataclasses.dataclass
class PoolBook:
    """One RewardPool contract and what the model says it holds, run by run."""

    name: str
    address: str
    token: Token | None
    funded: dict = dataclasses.field(default_factory=dict)  # run id -> what arrived
    paid: dict = dataclasses.field(default_factory=dict)  # (run id, round, stage, account) -> amount
    params: dict = dataclasses.field(default_factory=dict)  # run id -> PoolParams

    def arrived(self, amount: int) -> int:
        return amount - amount * FEE_BPS // 10_000 if self.token is not None else amount


class PoolMoves:
    """The pool's actors (module docstring); the machine calls :meth:`setup_pools` when it deploys,
    :meth:`captured_pool` when the coalition creates a run, and :meth:`pools_hold` from its invariant."""

    pool_claims_paid = 0
    pool_claims_refused = 0
    pool_funds = 0
    pool_sweeps = 0
    pool_reentries_refused = 0  # the token's calls from inside a transfer (R5) and the receiver's copies (R3)
    pool_convicted_refused = 0
    pool_overturned_refused = 0  # claims of a captured round from its overturned one on

    # ------------------------------------------------------------------ set-up
    def setup_pools(self) -> None:
        w3, chain_id = self.w3, self.w3.eth.chain_id
        ledger = self.deployment.ledger
        self.pool_clients: dict = {}
        fund_accounts(w3, dev_account(0, chain_id), [dev_account(i, chain_id).address for i in FUNDERS],
                      10**19)
        token = Token(w3)
        for index in (HONEST[0], *FUNDERS):
            token.mint(self.account(index).address, 1_000 * AMOUNT)
        token.set_mode(FEE_ON_TRANSFER, FEE_BPS)
        self.books = [PoolBook(name, RewardPoolClient.deploy(w3, dev_account(0, chain_id), ledger,
                                                             retry=FAST_RETRY), held)
                      for name, held in (("eth", None), ("token", token))]
        for book in self.books:
            self.open_pool(book, self.run_id, HONEST[0], FUNDING_ROUNDS * AMOUNT)
        self.delegate_receivers()

    def open_pool(self, book: PoolBook, run_id: int, creator: int, funding: int) -> None:
        run = self.client(creator).run_struct(run_id)
        values = self.client(creator).run_values(run_id)
        # two slots more than a round may list: a round always leaves some unfilled (the pool's rule pays a
        # slot, never a share of those listed), so a contract paying a share of the listed is seen on every
        # paid contribution (bench/fuzz_pool_mutations.py's share-of-listed)
        params = PoolParams(AMOUNT, attester_bps=2_000,
                            contribution_slots=max(4, values["max_contributions"]) + SPARE_SLOTS,
                            attester_slots=8, claim_blocks=run["unbondingBlocks"],
                            token=book.token.address if book.token else "0x" + "00" * 20)
        client = self.pool_client(book, creator)
        sent = funding if book.token is None else funding * 10_000 // (10_000 - FEE_BPS) + 10
        if book.token is not None:
            client.approve(book.token.address, sent)
        client.create_pool(run_id, params, sent)
        book.params[run_id] = params
        book.funded[run_id] = book.arrived(sent)

    def captured_pool(self, run_id: int) -> None:
        """The coalition's captured run opens a pool in the ETH RewardPool before its rounds."""
        if not hasattr(self, "books"):  # a machine set up without pools
            return
        self.open_pool(self.books[0], run_id, COALITION[0], 2 * AMOUNT)

    def delegate_receivers(self) -> None:
        """One EIP-7702 transaction from dev account 0 sets every receiver's code to ReentrantClaimer."""
        chain_id = self.w3.eth.chain_id
        sender = dev_account(0, chain_id)
        impl = TransactionSender(self.w3, sender, retry=FAST_RETRY).deploy(
            contracts.artifact("ReentrantClaimer"))
        auths = []
        for index in RECEIVERS:
            account = self.account(index)
            nonce = self.w3.eth.get_transaction_count(account.address)
            auths.append(account.sign_authorization({"chainId": chain_id, "address": impl, "nonce": nonce}))
        block = self.w3.eth.get_block("latest")
        tx = {"type": 4, "chainId": chain_id, "nonce": self.w3.eth.get_transaction_count(sender.address),
              "to": sender.address, "value": 0, "gas": 60_000 * len(auths),
              "maxFeePerGas": 2 * block["baseFeePerGas"] + 10**9, "maxPriorityFeePerGas": 10**9, "data": b"",
              "authorizationList": auths}
        tx_hash = self.w3.eth.send_raw_transaction(sender.sign_transaction(tx).raw_transaction)
        assert self.w3.eth.wait_for_transaction_receipt(tx_hash)["status"] == 1
        self.receiver_abi = contracts.artifact("ReentrantClaimer")["abi"]

    # ------------------------------------------------------------------ helpers
    def account(self, index: int):
        return dev_account(index, self.w3.eth.chain_id)

    def pool_client(self, book: PoolBook, index: int) -> RewardPoolClient:
        key = (book.address, index)
        if key not in self.pool_clients:
            self.pool_clients[key] = RewardPoolClient(self.w3, self.account(index), book.address,
                                                      retry=FAST_RETRY)
        return self.pool_clients[key]

    def receiver(self, index: int):
        return self.w3.eth.contract(address=self.client(index).address, abi=self.receiver_abi)

    def arm_receiver(self, index: int, target: str, data: bytes) -> None:
        TransactionSender(self.w3, self.account(FUNDERS[0]), retry=FAST_RETRY).transact(
            self.receiver(index), "arm", (target, data), "arm the receiver")

    def seat_status(self, run_id: int, index: int) -> str:
        seat = self.client(HONEST[0]).member(run_id, self.client(index).address)
        return "none" if seat is None else seat.status

    def claims_of(self, run_id: int, round_: int):
        """The claims of ``round_`` of ``run_id``: [(stage, owner address, claim function(client))]."""
        reader = self.client(HONEST[0])
        if run_id == self.run_id:
            record, state = self.records[round_], self.state_of(round_)
        else:
            case = next(c for c in self.lied_rounds if c.run_id == run_id)
            record = case.records[round_]
            state = case.committed if round_ == 1 else None
        attesters = list(reader.commit_record(run_id, round_).attesters)
        claims = [(ATTESTER, a, i, lambda client, i=i: client.claim_attestation(run_id, round_, attesters, i))
                  for i, a in enumerate(attesters)]
        if state is not None and state.factors.norms is not None:
            leaves, factors = [state.leaf().encode()], state.factors.encode()
            claims += [(0, a, i, lambda client, i=i: client.claim_contribution(record, leaves, 0, factors, i))
                       for i, a in enumerate(state.factors.norms.contributors)]
        return claims, record, state, attesters

    def share(self, book: PoolBook, run_id: int, stage: int, state, attesters, position: int) -> int:
        params = book.params[run_id]
        if stage == ATTESTER:
            return attester_share(params, len(attesters))
        norms = state.factors.norms
        steps = norms.steps[position] if norms.steps else None
        run = self.client(HONEST[0]).run_struct(run_id)
        return contribution_share(params, run["numStages"], run["innerSteps"], len(norms.contributors), steps)

    def index_of(self, address: str) -> int | None:
        for index in range(12):
            if self.account(index).address.lower() == address.lower():
                return index
        return None

    # ------------------------------------------------------------------ claims
    def claim(self, data, book: PoolBook, run_id: int, round_: int, *, claimer_pool=None, when: str = "",
              owned_by: str = "", contribution: bool = False) -> None:
        """A claim of ``round_`` of ``run_id`` in ``book``: a share drawn (``owned_by``: only that account's),
        by its owner or another (``claimer_pool``: who may claim; the owner itself where ``owned_by``), once
        the round is final (``when`` "final": mined to it; "now": at once; "": drawn, mostly once final);
        ``contribution``: a contribution's share only."""
        claims, record, state, attesters = self.claims_of(run_id, round_)
        claims = [c for c in claims if (not owned_by or c[1].lower() == owned_by.lower())
                  and not (contribution and c[0] == ATTESTER)]
        if not claims:
            return
        stage, owner, position, send = data.draw(st.sampled_from(claims))
        owner_index = self.index_of(owner)
        others = [OUTSIDER, *HONEST, *COALITION]
        pool = [owner_index] if owned_by else claimer_pool or [owner_index] * 8 + others
        claimer = data.draw(st.sampled_from(pool))
        if when == "final" or (not when and data.draw(st.integers(0, 2)) != 2):  # mostly once final (else
            # claims rarely pay; 0, the draw hypothesis favours, waits)
            self.mine_to_final(run_id, round_)
        reenter = claimer in RECEIVERS and book.token is None and data.draw(st.integers(0, 3)) == 0
        client = self.pool_client(book, claimer)
        if reenter:  # the receiver claims the same share again from inside its payment
            call = "claimAttestation" if stage == ATTESTER else "claimContribution"
            args = self._claim_args(run_id, round_, stage, attesters, record, state, position)
            self.arm_receiver(claimer, book.address,
                              bytes.fromhex(client.contract.encode_abi(call, args=args)[2:]))
        slashed = self.seat_status(run_id, claimer) == "slashed"
        final = self.client(HONEST[0]).is_final(run_id, round_)
        try:
            receipt = send(client)
        except errors.RewardError as exc:
            PoolMoves.pool_claims_refused += 1
            self.refused_as_modelled(exc, book, run_id, round_, stage, claimer, owner_index, slashed)
            if reenter:  # disarm: its next payment (a stake withdrawn) re-enters a view
                self.arm_receiver(claimer, book.address, bytes.fromhex(
                    client.contract.encode_abi("poolOf", args=[run_id])[2:]))
            return
        key = (run_id, round_, stage, self.client(claimer).address)
        assert claimer == owner_index, "R2: a claim paid an account not listed"
        assert not slashed, f"R2: a claim paid member {claimer}, slashed in run {run_id}"
        assert final or self.client(HONEST[0]).is_final(run_id, round_), "R2: a claim paid a round not final"
        paid = self.payments(book, receipt)
        assert list(paid) == [key], f"R3: one claim, one payment ({paid})"
        assert key not in book.paid, f"R3: {key} paid twice"
        assert paid[key] == self.share(book, run_id, stage, state, attesters, position), \
            "R2: a claim paid another amount than the rule's share"
        book.paid[key] = paid[key]
        PoolMoves.pool_claims_paid += 1
        assert self.pool_client(book, 0).claimed_of(run_id, round_, stage, key[3]), "R3: claimedOf disagrees"
        if reenter:
            _armed, reentered, ok, returned = self.receiver(claimer).functions.outcome().call()
            assert reentered and not ok, "R3: the receiver's copy of its claim, re-entered, was paid"
            assert isinstance(revert_from_data(returned, "re-entered claim"), errors.RewardAlreadyClaimed), \
                "R3: the receiver's re-entered copy refused for another reason than claimed"
            PoolMoves.pool_reentries_refused += 1
        try:  # the same claim again at once
            send(client)
        except (errors.RewardAlreadyClaimed, errors.RewardClaimClosed):
            return
        raise AssertionError(f"R3: {key} paid twice")

    def _claim_args(self, run_id, round_, stage, attesters, record, state, position) -> list:
        if stage == ATTESTER:
            return [run_id, round_, attesters, position]
        return list(stage_claim_args(record, [state.leaf().encode()], 0, state.factors.encode(), position))

    def payments(self, book: PoolBook, receipt) -> dict:
        events = self.pool_client(book, 0).events
        paid = {}
        for log in receipt["logs"]:
            event = events.decode(log) if log["address"] == book.address else None
            if event is not None and event.name == "RewardClaimed":
                key = (event.args["runId"], event.args["round"], event.args["stage"], event.args["account"])
                assert key not in paid, f"R3: {key} paid twice in one transaction"
                paid[key] = event.args["amount"]
        return paid

    def refused_as_modelled(self, exc, book, run_id, round_, stage, claimer, owner, slashed) -> None:
        """A refused claim is refused for a reason the model knows (else it is raised: the fuzzer reports
        it)."""
        pool = self.pool_client(book, 0).pool_of(run_id)
        reader = self.client(HONEST[0])
        invalid_from = reader.run_struct(run_id)["invalidFrom"]
        if isinstance(exc, errors.RewardAlreadyClaimed):
            assert (run_id, round_, stage, self.client(claimer).address) in book.paid, \
                f"refused as claimed: {exc}"
        elif isinstance(exc, errors.RewardConvicted):
            assert slashed, f"refused as convicted: {exc}"
            PoolMoves.pool_convicted_refused += 1
        elif isinstance(exc, errors.RewardNotListed):
            assert claimer != owner, f"the owner's claim refused as not listed: {exc}"
        elif isinstance(exc, errors.RewardRoundNotFinal):
            assert not all(reader.is_final(run_id, r) for r in range(pool["nextRound"], round_ + 1)), \
                f"refused as not final: {exc}"
            PoolMoves.pool_overturned_refused += bool(invalid_from) and round_ + 1 >= invalid_from
        elif isinstance(exc, errors.RewardPoolUnfunded):
            assert pool["free"] < AMOUNT * (round_ + 1 - pool["nextRound"]), f"refused as unfunded: {exc}"
        elif isinstance(exc, errors.RewardClaimClosed):
            assert self.pool_client(book, 0).round_of(run_id, round_)["swept"], f"refused as swept: {exc}"
        else:
            raise exc

    def mine_to_final(self, run_id: int, round_: int) -> None:
        """Mine to the block from which a transaction sent lands where ``round_`` is past its proof window (at
        most 64 blocks; none while a captured round's walk is in flight), a window at a time, the walker live
        after each (tests/trust_game.py)."""
        if self.lied_in_flight() is not None:
            return
        ledger = self.client(HONEST[0]).ledger_contract
        end = max(ledger.functions.proofWindowOf(run_id, r).call()[1] for r in range(round_ + 1))
        blocks = end - self.w3.eth.block_number
        while 0 < blocks <= 64:
            mine(self.w3, min(blocks, WINDOW))
            self.walker_stays_live()
            blocks -= WINDOW

    @precondition(lambda self: hasattr(self, "books") and bool(self.records))
    @rule(data=st.data())
    def member_claims(self, data) -> None:
        """A member (or another account in its place) claims an attestation or a contribution of a round of
        the machine's run, in ETH or in the token."""
        book = data.draw(st.sampled_from(self.books))
        self.claim(data, book, self.run_id, data.draw(st.sampled_from(sorted(self.records))))

    @precondition(lambda self: hasattr(self, "books") and bool(self.records))
    @rule(data=st.data())
    def member_claims_once_final(self, data) -> None:
        """A member claims its own share (a contribution where the round lists any, else an attestation) of
        a round of the machine's run once the round is final, as a member's node does (``dlx-node rewards
        --claim``): the claim that pays, drawn as often as the others together (a short run otherwise draws
        few that pay)."""
        book = data.draw(st.sampled_from(self.books))
        round_ = data.draw(st.sampled_from(sorted(self.records)))
        claims = self.claims_of(self.run_id, round_)[0]
        # a contribution where the round lists any (attestations are paid by the other claims too; a short
        # run otherwise paid few contributions, and a bug in their share went unseen)
        claims = [c for c in claims if c[0] != ATTESTER] or claims
        if claims:
            owner = data.draw(st.sampled_from(claims))[1]
            self.claim(data, book, self.run_id, round_, when="final", owned_by=owner,
                       contribution=claims[0][0] != ATTESTER)

    @precondition(lambda self: hasattr(self, "books") and bool(self.records))
    @rule(data=st.data())
    def member_claims_at_once(self, data) -> None:
        """A member claims its share of the machine's newest round at once, before its proof window closed:
        refused as not final (R2), unless blocks passed enough already."""
        book = data.draw(st.sampled_from(self.books))
        self.claim(data, book, self.run_id, max(self.records), when="now")

    @precondition(lambda self: hasattr(self, "books") and bool(self.records))
    @rule(data=st.data())
    def coalition_attester_equivocates_and_claims(self, data) -> None:
        """A coalition member that attested a round of the machine's run (else the next round, committed with
        the coalition's signatures) signs another record of the same round; an outsider reports it
        (``reportEquivocation``: slashed) and it claims its attestation of the round once final: refused, R2
        (no credit for a convicted member)."""
        active = self.active(self.coalition_group())
        cases = [(r, i) for r in sorted(self.records) for i in active
                 if self.client(i).address.lower() in {a.lower() for a in self.attesters_of(r)}]
        if not cases and active:  # an honest member commits the next round with the coalition's signatures
            signers = list(self.active(self.honest_group())) + active
            if not self.commit(HONEST[0], self.honest_record(), signers):
                return
            cases = [(max(self.records), i) for i in active]
        if not cases:
            return
        round_, index = data.draw(st.sampled_from(cases))
        record, client = self.records[round_], self.client(index)
        other = dataclasses.replace(record, contributions_root=bytes(31) + b"\x01")
        self.client(OUTSIDER).report_equivocation(record, client.sign_record(record), other,
                                                  client.sign_record(other))
        self.claim(data, data.draw(st.sampled_from(self.books)), self.run_id, round_, when="final",
                   owned_by=client.address)

    @precondition(lambda self: hasattr(self, "books")
                  and any(c.run_id in self.books[0].funded for c in self.lied_rounds))
    @rule(data=st.data())
    def coalition_claims_its_captured_round(self, data) -> None:
        """The coalition claims a captured run's rounds: its lied round 1 (in its walk, or overturned) and
        round 0 (once its members were convicted)."""
        case = data.draw(st.sampled_from([c for c in self.lied_rounds if c.run_id in self.books[0].funded]))
        self.claim(data, self.books[0], case.run_id, data.draw(st.integers(0, 1)),
                   claimer_pool=[*COALITION, HONEST[0]])

    # ------------------------------------------------------------------ funders, sweepers, the token
    @precondition(lambda self: hasattr(self, "books"))
    @rule(data=st.data(), amount=st.sampled_from([1, AMOUNT // 3, AMOUNT]), funder=st.sampled_from(FUNDERS))
    def funder_funds(self, data, amount: int, funder: int) -> None:
        book = data.draw(st.sampled_from(self.books))
        run_id = data.draw(st.sampled_from(sorted(book.funded)))
        self.fund(book, run_id, funder, amount)

    def fund(self, book: PoolBook, run_id: int, funder: int, amount: int) -> None:
        client = self.pool_client(book, funder)
        if book.token is not None:
            client.approve(book.token.address, amount)
        client.fund(run_id, amount, book.params[run_id].token)
        book.funded[run_id] += book.arrived(amount)
        PoolMoves.pool_funds += 1

    @precondition(lambda self: hasattr(self, "books"))
    @rule(call=st.sampled_from(["fund", "claimAttestation", "open", "sweep"]))
    def token_reenters(self, call: str) -> None:
        """The token, armed, calls its pool back from inside the next transfer: a funder's top-up."""
        book = self.books[1]
        pool = self.pool_client(book, 0).contract
        args = {"fund": [self.run_id, AMOUNT], "open": [self.run_id, 0], "sweep": [self.run_id, 0],
                "claimAttestation": [self.run_id, 0, [], 0]}[call]
        book.token.send(FUNDERS[0], "arm", book.address, bytes.fromhex(pool.encode_abi(call, args=args)[2:]))
        self.fund(book, self.run_id, FUNDERS[1], AMOUNT)
        _armed, reentered, ok, returned = book.token.outcome()
        assert reentered, "the armed token did not re-enter"
        assert not ok, f"R5: the token's {call} from inside its transfer succeeded"
        assert isinstance(revert_from_data(returned, "re-entry"), errors.RewardReentered), \
            "R5: the token's call refused for another reason than RewardReentered"
        PoolMoves.pool_reentries_refused += 1

    @precondition(lambda self: hasattr(self, "books"))
    @rule(data=st.data())
    def anyone_sweeps(self, data) -> None:
        book = data.draw(st.sampled_from(self.books))
        run_id = data.draw(st.sampled_from(sorted(book.funded)))
        pool = self.pool_client(book, 0).pool_of(run_id)
        if pool["nextRound"] <= pool["firstRound"]:
            return
        round_ = data.draw(st.integers(pool["firstRound"], pool["nextRound"] - 1))
        reader = self.pool_client(book, 0)
        budget = reader.round_of(run_id, round_)
        closes = budget["openedAt"] + book.params[run_id].claim_blocks
        # half the draws wait for the window's close (the run's unbonding, 408 blocks; none while a walk is
        # in flight, whose clock the jump would run out): a run of a few dozen moves otherwise never reaches
        # one, and the sweep's books went unchecked (0 sweeps in the 826 steps of seed 78)
        if budget["openedAt"] and data.draw(st.booleans()) and self.lied_in_flight() is None:
            blocks = closes - 1 - self.w3.eth.block_number  # the sweep lands in the next block
            if blocks > 0:
                mine(self.w3, blocks)
        free = reader.pool_of(run_id)["free"]
        try:
            self.pool_client(book, OUTSIDER).sweep(run_id, round_)
        except errors.RewardClaimClosed:
            assert budget["swept"] or not budget["openedAt"], \
                f"a sweep of round {round_} refused as closed though opened and never swept"
            return
        except errors.RewardClaimOpen:
            assert self.w3.eth.block_number < closes, f"a sweep of round {round_} refused after its close"
            return
        assert self.w3.eth.block_number >= closes and not budget["swept"], \
            f"R4: round {round_} swept before its claim window closed at {closes}, or twice"
        after = reader.round_of(run_id, round_)
        assert after["swept"], f"round {round_} not marked swept"
        assert reader.pool_of(run_id)["free"] == free + after["budget"] - after["paid"], \
            "R4: the sweep returned other than the round's budget less what it paid"
        PoolMoves.pool_sweeps += 1

    # ------------------------------------------------------------------ invariants
    def pools_hold(self) -> None:
        for book in getattr(self, "books", ()):
            reader = self.pool_client(book, 0)
            held = (book.token.balance_of(book.address) if book.token
                    else self.w3.eth.get_balance(book.address))
            assert held == sum(book.funded.values()) - sum(book.paid.values()), \
                f"R4: the {book.name} pool holds {held}, not funded - claimed"
            for run_id, funded in book.funded.items():
                self.run_books_hold(book, reader, run_id, funded)

    def run_books_hold(self, book: PoolBook, reader, run_id: int, funded: int) -> None:
        pool = reader.pool_of(run_id)
        paid = {k: v for k, v in book.paid.items() if k[0] == run_id}
        claimed = sum(paid.values())
        assert pool["funded"] == funded, f"R4: run {run_id}'s funded is not what arrived"
        assert pool["claimed"] == claimed, f"R4: run {run_id}'s claimed is not what its claims paid"
        invalid_from = self.client(HONEST[0]).run_struct(run_id)["invalidFrom"]
        free = pool["free"]
        for r in range(pool["firstRound"], pool["nextRound"]):
            budget = reader.round_of(run_id, r)
            assert budget["paid"] <= budget["budget"] == AMOUNT, "R1: a round paid past its budget"
            assert budget["paid"] == sum(v for k, v in paid.items() if k[1] == r), \
                "R1: a round's paid is not what its claims paid"
            free += 0 if budget["swept"] else budget["budget"] - budget["paid"]
            assert invalid_from == 0 or r + 1 < invalid_from, \
                f"R2: overturned round {r} of run {run_id} opened"
        assert free == funded - claimed, f"R1: run {run_id}'s free + open budgets != funded - claimed"
        assert invalid_from == 0 or all(k[1] + 1 < invalid_from for k in paid), \
            f"R2: an overturned round of run {run_id} was paid"
