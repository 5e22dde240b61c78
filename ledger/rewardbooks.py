"""The reward pool's books recomputed from the chain's events and the record (issue 77; docs/REWARDS.md):
what an auditor checks of a pool without trusting its views.

:func:`check_pool` reads the pool's events (PoolCreated, PoolFunded, RoundOpened, RewardClaimed,
RoundClosed), the ledger's RoundCommitted attesters and its slashings, and returns every mismatch as a line:
the funded and claimed totals against ``poolOf`` and the pool's balance; each round's claims against its
budget; each attester claim against the rule's share of its round; each claim against finality (its round
opened), a conviction before it, and a second claim of the same share. Where node directories' kept factors
give every stage of an opened round, every credit of that round (each listed contribution's and attester's
share by the rule, claimed or not) is recomputed, and their sum must fit the round's budget.
"""

from __future__ import annotations

from ledger.rewards import ATTESTER, PoolParams, attester_share, contribution_share, listed_contributions


def check_pool(pool, ledger, run_id: int, sources: dict | None = None) -> list[str]:
    """Mismatches between ``pool``'s (a RewardPoolClient) events and views and the record of ``ledger`` (a
    LedgerClient) for run ``run_id``; empty when the books hold. ``sources``: round -> (stage leaves, factors
    per stage or None), checked against the chain (node/store/rewardsources.py): each contribution claim of a
    stage whose factors are given is checked against them (listed, and its share by the rule)."""
    events = pool.pool_events(run_id)
    views = pool.pool_of(run_id)
    balance = pool.balance(views["params"].token)
    listed = _listed(sources)
    return check_events(events, views, balance, _attesters(ledger, run_id, events, {r for r, _ in listed}),
                        _slashed_at(ledger, run_id), listed)


def _listed(sources: dict | None) -> dict[tuple[int, int], list]:
    """(round, stage) -> [(contributor, steps)] of each stage whose factors ``sources`` hold."""
    return {(r, stage): listed_contributions(factors) for r, (_leaves, all_factors) in (sources or {}).items()
            for stage, factors in enumerate(all_factors) if factors is not None}


def check_events(events: list, views: dict, balance: int, attesters: dict[int, tuple[str, ...]],
                 slashed_at: dict[str, int], contributions: dict | None = None) -> list[str]:
    """:func:`check_pool` on given inputs: the pool's decoded events in chain order, its ``poolOf`` fields,
    its balance, each round's attesters, the block each convicted account was slashed in and the listed
    contributions of the stages whose factors are known."""
    problems: list[str] = []
    created = [e for e in events if e.name == "PoolCreated"]
    if len(created) != 1:
        return [f"the run has {len(created)} PoolCreated events (one expected)"]
    params = PoolParams.from_fields(created[0].args["params"])
    funded = created[0].args["funding"] + sum(e.args["amount"] for e in events if e.name == "PoolFunded")
    claims = [e for e in events if e.name == "RewardClaimed"]
    claimed = sum(e.args["amount"] for e in claims)
    if funded != views["funded"]:
        problems.append(f"funded: events say {funded} wei, poolOf {views['funded']}")
    if claimed != views["claimed"]:
        problems.append(f"claimed: events say {claimed} wei, poolOf {views['claimed']}")
    if balance < funded - claimed:
        problems.append(f"balance {balance} wei is below funded - claimed = {funded - claimed}")
    opened = {e.args["round"]: e for e in events if e.name == "RoundOpened"}
    closed = {e.args["round"]: e for e in events if e.name == "RoundClosed"}
    seen: set[tuple] = set()
    paid: dict[int, int] = {}
    for claim in claims:
        r, stage, account, amount = (claim.args["round"], claim.args["stage"], claim.args["account"],
                                     claim.args["amount"])
        key = (r, stage, account)
        if key in seen:
            problems.append(f"round {r} stage {stage}: {account} was paid twice")
        seen.add(key)
        paid[r] = paid.get(r, 0) + amount
        start = opened.get(r)
        if start is None or (start.block_number, start.log_index) > (claim.block_number, claim.log_index):
            problems.append(f"round {r}: {account} was paid before the round opened (final)")
        end = closed.get(r)
        if end is not None and (end.block_number, end.log_index) < (claim.block_number, claim.log_index):
            problems.append(f"round {r}: {account} was paid after the round was swept")
        if account in slashed_at and slashed_at[account] <= claim.block_number:
            problems.append(f"round {r}: {account} was paid after its conviction "
                            f"(block {slashed_at[account]})")
        if stage == ATTESTER:
            listed = attesters.get(r, ())
            if account not in listed:
                problems.append(f"round {r}: {account} was paid as an attester it is not")
            elif amount != attester_share(params, len(listed)):
                problems.append(f"round {r}: attester {account} paid {amount} wei, the rule gives "
                                f"{attester_share(params, len(listed))}")
        elif (r, stage) in (contributions or {}):
            problems += _contribution_claim(contributions[r, stage], params, views, r, stage, account, amount)
    for r, total in sorted(paid.items()):
        budget = opened[r].args["budget"] if r in opened else 0
        if total > budget:
            problems.append(f"round {r}: paid {total} wei past its budget {budget}")
    problems += _credits_within_budgets(opened, params, views, attesters, contributions or {})
    for r, event in sorted(closed.items()):
        budget = opened[r].args["budget"] if r in opened else 0
        if event.args["returned"] != budget - paid.get(r, 0):
            problems.append(f"round {r}: swept {event.args['returned']} wei, budget - paid is "
                            f"{budget - paid.get(r, 0)}")
    return problems


def _contribution_claim(entries: list, params, views: dict, r: int, stage: int, account: str,
                        amount: int) -> list[str]:
    """A contribution claim against its stage's listed contributions: listed, and its share by the rule."""
    steps = [s for member, s in entries if member.lower() == account.lower()]
    if not steps:
        return [f"round {r} stage {stage}: {account} was paid for a contribution its factors do not list"]
    share = contribution_share(params, views["numStages"], views["innerSteps"], len(entries), steps[0])
    if amount != share:
        return [f"round {r} stage {stage}: contributor {account} paid {amount} wei, the rule gives {share}"]
    return []


def _credits_within_budgets(opened: dict, params, views: dict, attesters: dict,
                            contributions: dict) -> list[str]:
    """Every credit of each opened round whose every stage's listed contributions and whose attesters are
    known, recomputed by the rule (claimed or not); a round whose credits sum past its budget is a
    mismatch."""
    problems = []
    for r, event in sorted(opened.items()):
        stages = [contributions.get((r, stage)) for stage in range(views["numStages"])]
        if r not in attesters or any(entries is None for entries in stages):
            continue
        credits = sum(contribution_share(params, views["numStages"], views["innerSteps"], len(entries), steps)
                      for entries in stages for _member, steps in entries)
        credits += attester_share(params, len(attesters[r])) * len(attesters[r])
        if credits > event.args["budget"]:
            problems.append(f"round {r}: its credits by the rule sum to {credits} wei, past its budget "
                            f"{event.args['budget']}")
    return problems


def _attesters(ledger, run_id: int, events: list, also: set[int] = frozenset()) -> dict[int, tuple[str, ...]]:
    """Each round's attesters (RoundCommitted) for the rounds with attester claims and the rounds ``also``."""
    rounds = {e.args["round"] for e in events if e.name == "RewardClaimed" and e.args["stage"] == ATTESTER}
    rounds |= set(also)
    out = {}
    for r in rounds:
        record = ledger.commit_record(run_id, r)
        out[r] = record.attesters if record is not None else ()
    return out


def _slashed_at(ledger, run_id: int) -> dict[str, int]:
    slashed = {}
    for membership in ledger.memberships(run_id):
        if membership.slashed is not None:
            slashed[membership.account] = membership.slashed[0]
    return slashed
