"""Every account's unclaimed credits in a run's reward pool, against what the pool holds (issue 77;
docs/REWARDS.md, "Unclaimed credits, per account").

A credit is **unclaimed** when its round is final and it is neither claimed nor forfeited: ``claimable`` (its
round opened, or the free funds cover opening it) or ``unfunded`` (final, but the free funds do not cover
opening its round: it waits for a ``fund``). The pool has reserved, or can reserve, the claimable ones, so
they must fit what the run's pool holds; the unfunded ones were never reserved and are listed apart.

:func:`unclaimed` lists them per account (every round's attesters, the listed contributors of the rounds
whose factors ``sources`` hold, every claimant) with ledger.rewardstatement, and checks, each a line when it
fails:

* the run's books: ``funded - claimed`` (its holding) equals ``free`` plus the unpaid budgets of its opened
  rounds not swept (``roundOf``);
* each opened round not swept: its claimable credits fit its unpaid budget (``budget - paid``);
* the claimable credits together fit the run's holding;
* the pool contract's balance in the run's currency covers what every run's pool in that currency holds
  (``funded - claimed`` summed over the contract's ``PoolCreated`` runs). More than that is no mismatch:
  anyone can send the contract tokens, or ETH by a self-destruct, outside ``fund``; an audit that failed on
  it could be failed by anyone at will. The surplus is reported.

A listed contribution's credit is known only where ``sources`` hold its round's factors, or once claimed:
the rounds where neither tells are counted in ``rounds_without_factors``, their unclaimed contributions not
in the table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eth_utils import to_checksum_address

from ledger.events import scan_logs
from ledger.rewards import listed_contributions
from ledger.rewardstatement import RunBooks, statement


@dataclass(frozen=True)
class AccountUnclaimed:
    """One account's credits by state, in the pool's unit."""

    account: str
    claimable: int
    unfunded: int
    pending: int
    claimed: int
    forfeited: int
    convicted: bool


@dataclass
class Unclaimed:
    """The run's unclaimed credits per account and the pool's holding against them (module docstring)."""

    run_id: int
    pool: str
    token: str | None  # None: ETH (wei)
    funded: int
    claimed: int
    free: int
    open_unpaid: int  # budget - paid over the opened rounds not swept
    balance: int  # the pool contract's, in the run's currency (every run's pool in it together)
    contract_held: int  # funded - claimed over every run's pool of the contract in that currency
    accounts: list[AccountUnclaimed] = field(default_factory=list)
    rounds_without_factors: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def held(self) -> int:
        return self.funded - self.claimed

    def total(self, state: str) -> int:
        return sum(getattr(a, state) for a in self.accounts)

    def to_json(self) -> dict:
        return {"run_id": self.run_id, "pool": self.pool,
                "unit": "wei" if self.token is None else "token units", "token": self.token,
                "funded_amount": self.funded, "claimed_amount": self.claimed, "held_amount": self.held,
                "free_amount": self.free, "open_unpaid_amount": self.open_unpaid,
                "balance_amount": self.balance, "contract_held_amount": self.contract_held,
                "unclaimed_amount": self.total("claimable") + self.total("unfunded"),
                "claimable_amount": self.total("claimable"), "unfunded_amount": self.total("unfunded"),
                "rounds_without_factors": self.rounds_without_factors, "problems": self.problems,
                "accounts": [asdict(a) for a in self.accounts]}


def unclaimed(pool, ledger, run_id: int, sources: dict | None = None) -> Unclaimed:
    """Run ``run_id``'s unclaimed credits in ``pool`` (a RewardPoolClient) by the record of ``ledger`` (a
    LedgerClient), per account, and the checks of the module docstring; ``sources``: round -> (stage
    leaves, factors per stage or None), as node/store/rewardsources.read_sources gives them."""
    books = RunBooks(pool, ledger, run_id)
    view, sources = books.view, sources or {}
    params = view["params"]
    result = Unclaimed(run_id, pool.address, params.token if params.is_token else None, view["funded"],
                       view["claimed"], view["free"], 0, pool.balance(params.token),
                       contract_held(pool, params.token))
    by_round: dict[int, int] = {}
    for account in _accounts(books, sources):
        shown = statement(pool, ledger, run_id, account, sources, books)
        totals = {state: shown.total(state) for state in ("claimable", "unfunded", "pending", "claimed",
                                                          "forfeited")}
        for credit in shown.credits:
            if credit.state == "claimable":
                by_round[credit.round] = by_round.get(credit.round, 0) + credit.amount
        if any(totals.values()):
            result.accounts.append(AccountUnclaimed(shown.account, convicted=shown.convicted, **totals))
    result.accounts.sort(key=lambda a: (-(a.claimable + a.unfunded), a.account.lower()))
    if params.attester_bps < 10_000:  # a contributors' part: its credits need the rounds' factors
        result.rounds_without_factors = [r for r in range(view["firstRound"], books.rounds)
                                         if r not in sources or None in sources[r][1]]
    for r in range(view["firstRound"], view["nextRound"]):
        state = pool.round_of(run_id, r)
        if state["swept"]:
            continue
        unpaid = state["budget"] - state["paid"]
        result.open_unpaid += unpaid
        if by_round.get(r, 0) > unpaid:
            result.problems.append(f"round {r}: its claimable credits {by_round[r]} exceed its unpaid budget "
                                   f"{unpaid} (budget {state['budget']} - paid {state['paid']})")
    if result.held != result.free + result.open_unpaid:
        result.problems.append(f"the run's pool holds funded - claimed = {result.held}, but free + the "
                               f"opened rounds' unpaid budgets = {result.free + result.open_unpaid}")
    if result.total("claimable") > result.held:
        result.problems.append(f"claimable credits {result.total('claimable')} exceed what the run's pool "
                               f"holds ({result.held} = funded - claimed)")
    if result.balance < result.contract_held:
        result.problems.append(f"the pool contract's balance {result.balance} is below what its pools in "
                               f"that currency hold ({result.contract_held}: funded - claimed of its runs)")
    return result


def _accounts(books: RunBooks, sources: dict) -> list[str]:
    """Every account that may hold a credit: each round's attesters, the contributors the known factors
    list, and every claimant."""
    found = {to_checksum_address(e.args["account"]) for e in books.events if e.name == "RewardClaimed"}
    for r in range(books.rounds):
        found.update(books.attesters(r))
    for _leaves, factors in sources.values():
        for stage_factors in factors:
            if stage_factors is not None:
                listed = listed_contributions(stage_factors)
                found.update(to_checksum_address(member) for member, _steps in listed)
    return sorted(found, key=str.lower)


def contract_held(pool, token: str) -> int:
    """``funded - claimed`` summed over every run's pool of ``pool``'s contract paying in ``token`` (its
    ``PoolCreated`` events, any run)."""
    topics = [pool.events.topic("PoolCreated")]
    logs = scan_logs(pool.w3, pool.address, topics, pool.from_block, pool.w3.eth.block_number,
                     pool.log_page_blocks, pool.sender.rpc)
    held = 0
    runs = {event.args["runId"] for event in map(pool.events.decode, logs) if event is not None}
    for run_id in sorted(runs):
        view = pool.pool_of(run_id)
        if int(view["params"].token, 16) == int(token, 16):
            held += view["funded"] - view["claimed"]
    return held
