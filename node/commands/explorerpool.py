"""The explorer's reward pool (issue 77): the run's pool and each member's credits, read from the chain.

Each member's credits are ledger.rewardstatement's (as ``dlx-node rewards`` shows them): attestations from the
chain alone (the history's attesters), contributions once claimed (their factors are the nodes', not the
chain's: docs/REWARDS.md). The books every statement shares are read once a snapshot (``RunBooks``).
"""

from __future__ import annotations

from ledger.poolunit import pool_unit
from ledger.rewardstatement import RunBooks, statement

#: A member's totals in the explorer (ledger.rewardstatement.Statement.to_json's, as ``dlx-node rewards
#: --json`` names them), in the pool's ``unit``: wei, or a token pool's smallest units (ledger/poolunit.py).
TOTALS = ("earned_amount", "final_amount", "claimable_amount", "claimed_amount", "pending_amount",
          "forfeited_amount")


def pool_snapshot(pool, client, run_id: int, history) -> dict:
    """The pool ``pool`` (a RewardPoolClient) of run ``run_id``: its schedule and books, and a row per member
    of ``history`` (ledger.history) with its credits' totals; ``{"address", "missing"}`` where the run has no
    pool there."""
    if not pool.has_pool(run_id):
        return {"address": pool.address, "missing": f"run {run_id} has no reward pool at {pool.address}"}
    attesters = {c.commit.round: list(c.attesters) for c in history.commits}
    books = RunBooks(pool, client, run_id, attesters)
    view, params = books.view, books.view["params"]
    members = []
    for account in dict.fromkeys(m.account for m in history.memberships):
        data = statement(pool, client, run_id, account, books=books).to_json()
        members.append({"account": data["account"], "convicted": data["convicted"],
                        **{key: data[key] for key in TOTALS},
                        "credits": len(data["credits"])})
    unit = pool_unit(pool.w3, params.token)
    return {"address": pool.address, **unit.to_json(), "per_round_amount": params.amount_per_round,
            "attester_bps": params.attester_bps, "contribution_slots": params.contribution_slots,
            "attester_slots": params.attester_slots, "claim_blocks": params.claim_blocks,
            "first_round": view["firstRound"], "next_round": view["nextRound"],
            "funded_amount": view["funded"], "free_amount": view["free"], "claimed_amount": view["claimed"],
            "balance_amount": pool.balance(params.token), "members": members}
