"""The demo's reward pool in its summary (issue 77): each member's earnings read from the chain, with the
contributions' credits proven by the factors its nodes kept (node/store/rewardsources.py).

Each member's statement is ledger.rewardstatement's, as ``dlx-node rewards`` prints it: ``earned`` (pending
and final), ``final`` (its rounds final: claimable, waiting for funds, or claimed) and ``claimable`` now.
"""

from __future__ import annotations

#: Each member's totals in the summary (ledger.rewardstatement.Statement.to_json's, as ``dlx-node rewards
#: --json`` names them), in the pool's ``unit`` (wei, or a token pool's smallest units: ledger/poolunit.py).
TOTALS = ("earned_amount", "final_amount", "claimable_amount", "claimed_amount", "pending_amount",
          "forfeited_amount")


def rewards_summary(run) -> dict | None:
    """The run's pool and each node's member's earnings (None: the run has no pool)."""
    if not run.reward_pool:
        return None
    from ledger.account import dev_account
    from ledger.poolunit import pool_unit
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
        totals = {key: data[key] for key in TOTALS}
        members.append({"node": slot.name, "account": account, **totals,
                        "attestations": kinds.count(None), "contributions": len(kinds) - kinds.count(None)})
    unit = pool_unit(client.w3, view["params"].token)
    return {"pool": pool.address, **unit.to_json(), "per_round_amount": view["params"].amount_per_round,
            "attester_bps": view["params"].attester_bps, "funded_amount": view["funded"],
            "free_amount": view["free"], "claimed_amount": view["claimed"],
            "rounds_opened": view["nextRound"] - view["firstRound"], "rounds_with_factors": sorted(sources),
            "members": members}


def rewards_lines(s: dict) -> list[str]:
    """The summary's lines of :func:`rewards_summary`'s ``s``, its amounts in the pool's unit (ETH or the
    token's symbol)."""
    from ledger.poolunit import PoolUnit

    unit = PoolUnit(s["token"], s["decimals"], s["symbol"])
    token = f" (token {s['token']})" if s["token"] else ""
    lines = [f"reward pool {s['pool']}{token}: {unit.show(s['per_round_amount'], 6)} a final round "
             f"({s['attester_bps'] / 100:g}% to its attesters, the rest to its listed contributions), "
             f"{unit.show(s['funded_amount'], 6)} funded, {unit.show(s['claimed_amount'], 6)} claimed; "
             f"each member's earnings from the chain ({unit.symbol}; contributions proven by the factors the "
             f"nodes kept for {len(s['rounds_with_factors'])} rounds):",
             "  node      account      attested  contributed      earned       final   claimable"]
    for m in s["members"]:
        earned, final, claimable = (unit.whole(m[key], 6) for key in TOTALS[:3])
        lines.append(f"  {m['node']:<8}  {m['account'][:10]}  {m['attestations']:>8}  "
                     f"{m['contributions']:>11}  {earned:>10}  {final:>10}  {claimable:>10}")
    if not any(m["final_amount"] for m in s["members"]):
        lines.append("  (earned, not final yet: a round pays once its proof window closes on chain; then "
                     "'dlx-node rewards --claim' claims it)")
    return lines
