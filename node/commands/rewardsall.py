"""``dlx-node rewards --all``: every account's unclaimed credits in the run's reward pool (final, not claimed)
and what the pool holds against them (issue 77; docs/REWARDS.md, "Unclaimed credits, per account"; the
figures and checks of ledger/rewardunclaimed.py)."""

from __future__ import annotations

import json

#: The exit status when a check fails (as the audit's failed item).
MISMATCH_EXIT = 8


def show_unclaimed(pool, client, run_id: int, sources: dict, unit, as_json: bool) -> int:
    """Print the run's unclaimed credits per account and the pool's holding (``unit``: ledger.poolunit's,
    how amounts show); :data:`MISMATCH_EXIT` when a check fails, else 0."""
    from ledger.rewardunclaimed import unclaimed

    found = unclaimed(pool, client, run_id, sources)
    if as_json:
        print(json.dumps({**found.to_json(), **unit.to_json()}, indent=2))
        return MISMATCH_EXIT if found.problems else 0
    show = unit.show
    print(f"run {run_id}, pool {found.pool}: unclaimed credits (final, not claimed) per account")
    owing = [a for a in found.accounts if a.claimable or a.unfunded]
    if not owing:
        print("  none")
    else:
        print(f"  {'account':<42} {'claimable':>18} {'unfunded':>18} {'claimed':>18} {'pending':>18}")
    for a in owing:
        print(f"  {a.account:<42} {show(a.claimable):>18} {show(a.unfunded):>18} {show(a.claimed):>18} "
              f"{show(a.pending):>18}" + ("  convicted" if a.convicted else ""))
    print(f"unclaimed {show(found.total('claimable') + found.total('unfunded'))} (claimable "
          f"{show(found.total('claimable'))}, unfunded {show(found.total('unfunded'))}); the run's pool "
          f"holds {show(found.held)} (funded {show(found.funded)} - claimed {show(found.claimed)}; free "
          f"{show(found.free)}, opened rounds unpaid {show(found.open_unpaid)}); the contract's balance "
          f"{show(found.balance)}, its pools hold {show(found.contract_held)}")
    if found.rounds_without_factors:
        print(f"contributions of {len(found.rounds_without_factors)} round(s) not counted: this node "
              "directory kept no factors of them")
    for problem in found.problems:
        print(f"MISMATCH: {problem}")
    return MISMATCH_EXIT if found.problems else 0
