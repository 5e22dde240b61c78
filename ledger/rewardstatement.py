"""What one account earned from a run's reward pool, round by round (issue 77; docs/REWARDS.md, "dlx-node
rewards"): each credit's amount by the rule (ledger.rewards), its state (pending, claimable, claimed,
forfeited, ...) and how it is claimed.

An attester's credit is known from the chain alone (the round's ``RoundCommitted`` attesters). A listed
contribution's credit needs the round's stage leaves and version-3 factors (``sources``: they are not on
chain); without them a contribution credit is known only once claimed (its ``RewardClaimed`` event).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eth_utils import to_checksum_address

from ledger.rewards import (ATTESTER, attester_share, contribution_share, listed_contributions,
                            stage_claim_args)

#: A credit's states: the round is not final yet (or never will be: overturned); it can be claimed now;
#: the round waits for someone to fund the pool; paid; lost (a convicted account, or the round swept); the
#: round is before the pool's first round (the pool pays none of it).
STATES = ("pending", "claimable", "unfunded", "claimed", "forfeited", "before-pool")


@dataclass(frozen=True)
class Credit:
    """One share of one round: ``stage`` None for an attestation; ``index`` the account's place in the
    attesters or the stage's factors (None: known only from its claim)."""

    round: int
    stage: int | None
    amount: int
    state: str
    index: int | None = None


@dataclass
class Statement:
    """An account's credits in a run's pool, and the totals by state."""

    run_id: int
    account: str
    pool: str
    convicted: bool
    credits: list[Credit] = field(default_factory=list)
    token: str | None = None  # the pool's ERC-20 (amounts in its smallest units); None: ETH (wei)

    def total(self, *states: str) -> int:
        return sum(c.amount for c in self.credits if c.state in states)

    def to_json(self) -> dict:
        """The statement as ``dlx-node rewards --json`` prints it: every amount in the pool's ``unit``, wei
        for an ETH pool, else the smallest units of its ``token`` (docs/REWARDS.md)."""
        earned = self.total("pending", "claimable", "unfunded", "claimed")
        return {"run_id": self.run_id, "account": self.account, "pool": self.pool,
                "convicted": self.convicted, "unit": "wei" if self.token is None else "token units",
                "token": self.token,
                "earned_amount": earned, "final_amount": self.total("claimable", "unfunded", "claimed"),
                "claimable_amount": self.total("claimable"), "claimed_amount": self.total("claimed"),
                "forfeited_amount": self.total("forfeited"), "pending_amount": self.total("pending"),
                "credits": [asdict(c) for c in self.credits]}


class RunBooks:
    """What every account's statement of one run reads alike, read once: the pool's view and events, each
    round's attesters (``attesters``: round -> list, where the caller has them, e.g. from a history) and each
    round's state for an unconvicted account."""

    def __init__(self, pool, ledger, run_id: int, attesters: dict | None = None):
        self.pool, self.ledger, self.run_id = pool, ledger, run_id
        self.view = pool.pool_of(run_id)
        self.events = pool.pool_events(run_id)
        self.rounds = ledger.commit_count(run_id)
        self._attesters = {r: [to_checksum_address(a) for a in v] for r, v in (attesters or {}).items()}
        self._states: dict[int, str] = {}

    def attesters(self, r: int) -> list[str]:
        if r not in self._attesters:
            record = self.ledger.commit_record(self.run_id, r)
            self._attesters[r] = [] if record is None else [to_checksum_address(a) for a in record.attesters]
        return self._attesters[r]

    def state(self, r: int, convicted: bool) -> str:
        """The state of an unclaimed credit of round ``r``."""
        if r not in self._states:
            self._states[r] = _round_state(self.pool, self.ledger, self.view, self.run_id, r, False)
        state = self._states[r]
        return "forfeited" if convicted and state != "before-pool" else state


def statement(pool, ledger, run_id: int, account: str, sources: dict | None = None,
              books: RunBooks | None = None) -> Statement:
    """``account``'s credits in run ``run_id``'s pool: ``pool`` a ledger.rewards.RewardPoolClient, ``ledger``
    a LedgerClient (the record), ``sources``: round -> (stage leaves, factors per stage, None where not known)
    where known (node/store/rewardsources.py reads them from node directories); ``books``: what several
    accounts' statements share (read here when not given)."""
    account = to_checksum_address(account)
    books = books or RunBooks(pool, ledger, run_id)
    view = books.view
    params = view["params"]
    seat = ledger.member(run_id, account)
    result = Statement(run_id, account, pool.address, seat is not None and seat.status == "slashed",
                       token=params.token if params.is_token else None)
    claimed_events = {(e.args["round"], e.args["stage"]): e.args["amount"] for e in books.events
                      if e.name == "RewardClaimed" and e.args["account"] == account}
    for r in range(books.rounds):
        attesters = books.attesters(r)
        shares = [(None, attester_share(params, len(attesters)), attesters.index(account))] \
            if account in attesters else []
        shares += _contribution_credits(view, r, account, (sources or {}).get(r), claimed_events)
        if not shares:
            continue
        state = books.state(r, result.convicted)
        for stage, amount, index in shares:
            key = ATTESTER if stage is None else stage
            if (r, key) in claimed_events:
                amount, credit_state = claimed_events[(r, key)], "claimed"
            else:
                credit_state = state
            result.credits.append(Credit(r, stage, amount, credit_state, index))
    return result


def _contribution_credits(view: dict, r: int, account: str, source, claimed_events: dict) -> list:
    """(stage, amount, index) of each listed contribution of ``account`` in round ``r``: from the round's
    factors where known, else from its claims."""
    found = {}
    if source is not None:
        _leaves, factors = source
        for stage, stage_factors in enumerate(factors):
            if stage_factors is None:  # a stage whose factors are not known here
                continue
            listed = listed_contributions(stage_factors)
            for index, (member, steps) in enumerate(listed):
                if to_checksum_address(member) == account:
                    found[stage] = (stage, contribution_share(view["params"], view["numStages"],
                                                              view["innerSteps"], len(listed), steps), index)
    for (round_, stage), amount in claimed_events.items():
        if round_ == r and stage != ATTESTER and stage not in found:
            found[stage] = (stage, amount, None)
    return [found[s] for s in sorted(found)]


def _round_state(pool, ledger, view: dict, run_id: int, r: int, convicted: bool) -> str:
    """The state of an unclaimed credit of round ``r``."""
    if r < view["firstRound"]:
        return "before-pool"
    if convicted:
        return "forfeited"
    if r < view["nextRound"]:  # opened: claimable until swept
        return "forfeited" if pool.round_of(run_id, r)["swept"] else "claimable"
    if not ledger.is_final(run_id, r):
        return "pending"
    opening = view["params"].amount_per_round * (r + 1 - view["nextRound"])
    return "claimable" if view["free"] >= opening else "unfunded"


def claim_call(ledger, run_id: int, credit: Credit, sources: dict | None = None) -> tuple[str, tuple] | None:
    """(RewardPool function, arguments) claiming ``credit``; None where it cannot be claimed from here: not
    claimable, or a contribution whose round's stage leaves and factors are not known."""
    if credit.state != "claimable" or credit.index is None:
        return None
    if credit.stage is None:
        record = ledger.commit_record(run_id, credit.round)
        attesters = [to_checksum_address(a) for a in record.attesters]
        return "claimAttestation", (run_id, credit.round, attesters, credit.index)
    if not sources or credit.round not in sources:
        return None
    leaves, factors = sources[credit.round]
    record = ledger.commit_of(run_id, credit.round)
    return "claimContribution", stage_claim_args(record, leaves, credit.stage, factors[credit.stage],
                                                 credit.index)
