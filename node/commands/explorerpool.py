"""The explorer's reward pool (issue 77): the run's pool and each member's credits, read from the chain.

Each member's credits are ledger.rewardstatement's (as ``dlx-node rewards`` shows them): attestations from the
chain alone (the history's attesters), contributions once claimed (their factors are the nodes', not the
chain's: docs/REWARDS.md). The books every statement shares are read once a snapshot (``RunBooks``).
"""

from __future__ import annotations

from ledger.rewardstatement import RunBooks, statement

#: A member's totals in the explorer (ledger.rewardstatement.Statement.to_json's ``*_amount``, in the pool's
#: unit: wei, or a token pool's units, which ``token`` and ``token_decimals`` name).
TOTALS = ("earned_wei", "final_wei", "claimable_wei", "claimed_wei", "pending_wei", "forfeited_wei")


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
                        **{key: data[key.replace("_wei", "_amount")] for key in TOTALS},
                        "credits": len(data["credits"])})
    return {"address": pool.address, "per_round_wei": params.amount_per_round,
            "attester_bps": params.attester_bps, "contribution_slots": params.contribution_slots,
            "attester_slots": params.attester_slots, "claim_blocks": params.claim_blocks,
            "first_round": view["firstRound"], "next_round": view["nextRound"], "funded_wei": view["funded"],
            "free_wei": view["free"], "claimed_wei": view["claimed"],
            "balance_wei": pool.balance(params.token), "token": params.token if params.is_token else None,
            "token_decimals": _decimals(pool, params),
            "members": members}


def _decimals(pool, params) -> int | None:
    """A token pool's token's decimals (its amounts are the token's units); None for ETH."""
    if not params.is_token:
        return None
    from node.commands.runpool import token_facts

    return token_facts(pool.w3, params.token, None)[0]
