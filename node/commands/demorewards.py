"""The demo's reward pool in its summary (issue 77): each member's earnings read from the chain, with the
contributions' credits proven by the factors its nodes kept (node/store/rewardsources.py).

Each member's statement is ledger.rewardstatement's, as ``dlx-node rewards`` prints it: ``earned`` (pending
and final), ``final`` (its rounds final: claimable, waiting for funds, or claimed) and ``claimable`` now.
"""

from __future__ import annotations

#: Each member's totals in the summary (ledger.rewardstatement.Statement.to_json's ``*_amount``; the demo's
#: pool is in ETH, so wei).
TOTALS = ("earned_wei", "final_wei", "claimable_wei", "claimed_wei", "pending_wei", "forfeited_wei")


def rewards_summary(run) -> dict | None:
    """The run's pool and each node's member's earnings (None: the run has no pool)."""
    if not run.reward_pool:
        return None
    from ledger.account import dev_account
    from ledger.rewards import RewardPoolClient
    from ledger.rewardstatement import RunBooks, statement
    from node.store.rewardsources import read_sources

    client = run.client()
    pool = RewardPoolClient(client.w3, None, run.reward_pool)
    books = RunBooks(pool, client, run.run_id)  # read once for every member
    view = books.view
    sources = read_sources([slot.data_dir for slot in run.nodes], client, run.run_id)
    members = []
    for slot in run.nodes:
        account = dev_account(slot.account, run.chain_id).address
        data = statement(pool, client, run.run_id, account, sources, books).to_json()
        kinds = [c["stage"] for c in data["credits"]]
        totals = {key: data[key.replace("_wei", "_amount")] for key in TOTALS}
        members.append({"node": slot.name, "account": account, **totals,
                        "attestations": kinds.count(None), "contributions": len(kinds) - kinds.count(None)})
    return {"pool": pool.address, "per_round_wei": view["params"].amount_per_round,
            "attester_bps": view["params"].attester_bps, "funded_wei": view["funded"],
            "free_wei": view["free"], "claimed_wei": view["claimed"],
            "rounds_opened": view["nextRound"] - view["firstRound"], "rounds_with_factors": sorted(sources),
            "members": members}


def _eth(wei: int) -> str:
    return f"{wei / 1e18:.6f}"


def rewards_lines(s: dict) -> list[str]:
    """The summary's lines of :func:`rewards_summary`'s ``s``."""
    lines = [f"reward pool {s['pool']}: {s['per_round_wei'] / 1e18:g} ETH a final round "
             f"({s['attester_bps'] / 100:g}% to its attesters, the rest to its listed contributions), "
             f"{s['funded_wei'] / 1e18:g} ETH funded, {s['claimed_wei'] / 1e18:g} ETH claimed; "
             f"each member's earnings from the chain (ETH; contributions proven by the factors the nodes "
             f"kept for {len(s['rounds_with_factors'])} rounds):",
             "  node      account      attested  contributed      earned       final   claimable"]
    for m in s["members"]:
        lines.append(f"  {m['node']:<8}  {m['account'][:10]}  {m['attestations']:>8}  "
                     f"{m['contributions']:>11}  {_eth(m['earned_wei']):>10}  {_eth(m['final_wei']):>10}  "
                     f"{_eth(m['claimable_wei']):>10}")
    if not any(m["final_wei"] for m in s["members"]):
        lines.append("  (earned, not final yet: a round pays once its proof window closes on chain; then "
                     "'dlx-node rewards --claim' claims it)")
    return lines
