"""The audit's reward pool item (issue 77; docs/REWARDS.md, "The books, recomputed"): a run's pool books
recomputed from its events and the record by :func:`ledger.rewardbooks.check_pool` (funded and claimed
against ``poolOf`` and the pool's balance, i.e. solvency; each round's claims against its budget; each claim
after its round became final, by no convicted account, once; each attester's amount by the rule; each sweep's
return; with archives, each contribution claim against the kept factors and every credit of a round they
hold whole within its budget), reported as one general item of the audit: FAIL naming the mismatches, else
OK with the totals. Then the unclaimed credits (ledger/rewardunclaimed.py; docs/REWARDS.md, "Unclaimed
credits, per account"): an item of their totals against what the pool holds (FAIL on a mismatch) and one
item per account holding any."""

from __future__ import annotations

from typing import Any

from node.errors import ConfigError
from node.tools.report import FAIL, OK, Check

POOL_BOOKS = "reward pool books"
POOL_UNCLAIMED = "reward pool unclaimed credits"
#: An account's item: ``POOL_ACCOUNT`` + its address.
POOL_ACCOUNT = "reward pool unclaimed: "
#: Mismatches named in the item's reason (the rest counted).
SHOWN = 5


def pool_check(client: Any, run_id: int, address: str, archives=()) -> Check:
    """The item for run ``run_id``'s pool at ``address`` (``client``: the audit's LedgerClient); ConfigError
    when ``address`` is no RewardPool of this ledger. ``archives``: node directories whose kept stage leaves
    and factors (node/store/rewardsources.py) check the contribution claims of their rounds."""
    from ledger.rewardbooks import check_pool
    from node.store.rewardsources import read_sources

    pool = pool_client(client, address)
    sources = read_sources(archives, client, run_id) if archives else {}
    problems = check_pool(pool, client, run_id, sources)
    if problems:
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        return Check(POOL_BOOKS, FAIL, "; ".join(problems[:SHOWN]) + more)
    view = pool.pool_of(run_id)
    token = view["params"].token
    unit = f"units of token {token}" if view["params"].is_token else "wei"
    return Check(POOL_BOOKS, OK, f"pool {pool.address}: funded {view['funded']} {unit}, claimed "
                                 f"{view['claimed']} {unit}, balance {pool.balance(token)} {unit}, rounds "
                                 f"{view['firstRound']}..{view['nextRound'] - 1} opened; every claim and "
                                 "sweep matches the record" + (f" (contribution claims checked against the "
                                 f"factors of {len(sources)} rounds the archives kept; every credit of each "
                                 "opened round they hold whole recomputed within its budget)"
                                 if sources else ""))


def pool_checks(client: Any, run_id: int, address: str, archives=(), named: bool = True) -> list[Check]:
    """The audit's pool items: the books (:func:`pool_check`), then the unclaimed credits
    (:func:`unclaimed_checks`). A run the pool holds no pool of: the books' FAIL naming it when the pool was
    ``named`` (``--pool``), else (deployment.json's pool, a run created without one) one OK item saying so."""
    if not pool_client(client, address).has_pool(run_id):
        if not named:
            return [Check(POOL_BOOKS, OK, f"run {run_id} has no reward pool in the deployment's RewardPool "
                                          f"{address}: nothing is paid through it, nothing to check")]
        return [pool_check(client, run_id, address, archives)]
    return [pool_check(client, run_id, address, archives),
            *unclaimed_checks(client, run_id, address, archives)]


def unclaimed_checks(client: Any, run_id: int, address: str, archives=()) -> list[Check]:
    """The unclaimed credits (ledger.rewardunclaimed): one item of the totals against what the pool holds
    (FAIL naming each mismatch), then one OK item per account holding an unclaimed credit (claimable or
    unfunded), the largest first."""
    from ledger.rewardunclaimed import unclaimed
    from node.store.rewardsources import read_sources

    pool = pool_client(client, address)
    sources = read_sources(archives, client, run_id) if archives else {}
    found = unclaimed(pool, client, run_id, sources)
    unit = f"units of token {found.token}" if found.token else "wei"
    if found.problems:
        more = f" (and {len(found.problems) - SHOWN} more)" if len(found.problems) > SHOWN else ""
        return [Check(POOL_UNCLAIMED, FAIL, "; ".join(found.problems[:SHOWN]) + more)]
    owing = [a for a in found.accounts if a.claimable or a.unfunded]
    unknown = found.rounds_without_factors
    summary = (f"{len(owing)} account(s) hold {found.total('claimable')} {unit} claimable and "
               f"{found.total('unfunded')} {unit} unfunded; the run's pool holds {found.held} {unit} "
               f"(funded - claimed = free {found.free} + opened rounds' unpaid {found.open_unpaid}), the "
               f"contract's balance {found.balance} covers its pools' {found.contract_held}"
               + (f" (+{found.balance - found.contract_held} sent outside fund)"
                  if found.balance > found.contract_held else "")
               + (f"; contributions of {len(unknown)} round(s) not counted (no factors kept: --archive)"
                  if unknown else ""))
    return [Check(POOL_UNCLAIMED, OK, summary)] + [
        Check(POOL_ACCOUNT + a.account, OK, f"claimable {a.claimable} {unit}, unfunded {a.unfunded} {unit} "
                                            f"(claimed {a.claimed}, pending {a.pending}, forfeited "
                                            f"{a.forfeited})") for a in owing]


def pool_client(client, address: str):
    """A RewardPoolClient of ``address`` sending as ``client`` (a LedgerClient): ConfigError when it is not an
    address, holds no contract, is not a RewardPool or is the pool of another ledger."""
    from eth_utils import is_address

    from ledger.rewards import RewardPoolClient

    if not is_address(address):
        raise ConfigError(f"--pool {address!r}: not an address (0x and 40 hex digits)")
    w3 = client.w3
    address = w3.to_checksum_address(address)
    if not w3.eth.get_code(address):
        raise ConfigError(f"--pool {address}: no contract there on chain {w3.eth.chain_id}")
    pool = RewardPoolClient(w3, client.account, address, from_block=client.from_block)
    pool.sender = client.sender  # the member's: its fee options, confirmations and nonces
    try:
        ledger = pool.sender.call(pool.contract, "ledger")
    except Exception as exc:  # noqa: BLE001 - any failure means: not a RewardPool
        raise ConfigError(f"--pool {address}: not a RewardPool ({type(exc).__name__})") from None
    if w3.to_checksum_address(ledger) != w3.to_checksum_address(client.ledger_address):
        raise ConfigError(f"--pool {address}: a pool of ledger {ledger}, not of this run's "
                          f"{client.ledger_address}")
    return pool
