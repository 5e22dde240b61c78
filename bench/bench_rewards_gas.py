"""Gas of the reward pool (issue 77; docs/REWARDS.md) on a real anvil: what a pool adds to a commit
(nothing is
written there: a run with a pool and one without commit the same record shape for the same gas), and what its
calls cost: createPool, fund, a claim of a listed contribution at 1, 4 and 8 contributions listed in its stage
(the first claim of a round also opens it: reads isFinal and writes the round's budget), an attester's
claim at
3 and 8 attesters, and a sweep; and the same calls of a pool in an ERC-20 (a plain test token: its
transferFrom or transfer and the pool's two balanceOf reads around it). Figures go to
``bench/results/rewards_gas.json``.

    nice -n 10 python bench/bench_rewards_gas.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchio import default_out, write_result  # noqa: E402
from ledger.anvil import AnvilProcess  # noqa: E402
from ledger.chain import connect_rpc  # noqa: E402
from tests.ledger_fixtures import deploy, mine  # noqa: E402
from tests.reward_fixtures import Token, params, reward_run, token_run  # noqa: E402

MEMBERS = tuple(range(1, 10))  # the funded dev accounts


def _gas(w3, tx_hash: str) -> int:
    return w3.eth.get_transaction_receipt(tx_hash)["gasUsed"]


def commit_gas(url: str, signers: int) -> dict:
    """The gas of a run's second commit (steady state), the same record shape with and without a pool."""
    row = {"signers": signers}
    for name, pool in (("without_pool", None), ("with_pool", params(contribution_slots=8))):
        rr = reward_run(deploy(connect_rpc(url, timeout=60.0)), members=MEMBERS, pool=pool,
                        max_contributions=8)
        listed = [[(m, None) for m in MEMBERS[:4]], [(m, None) for m in MEMBERS[4:8]]]
        rr.commit(listed, signers=MEMBERS[:signers])
        entry = rr.commit(listed, signers=MEMBERS[:signers], label="second")
        row[f"commit_gas_{name}"] = _gas(rr.w3, entry.tx)
    return row


def claim_gas(url: str) -> dict:
    rr = reward_run(deploy(connect_rpc(url, timeout=60.0)), members=MEMBERS,
                    pool=params(contribution_slots=8, attester_slots=8), max_contributions=8)
    receipt = rr.pool(0).fund(rr.run_id, 10**15)
    out = {"fund_gas": receipt["gasUsed"]}
    for count in (1, 4, 8):
        rr.commit([[(m, None) for m in MEMBERS[:count]], []], signers=MEMBERS[:3 if count < 8 else 8],
                  label=f"c{count}")
    rounds = {1: 0, 4: 1, 8: 2}
    rr.mine_to_final(2)
    rr.pool(0).open(rr.run_id, 0)  # rounds 1 and 2 are opened by their first claims
    out["claim_contribution_gas"] = {}
    for count, r in rounds.items():
        first = rr.claim(1, r, 0)["gasUsed"]
        row = {"first_claim_of_the_round": first}
        if count > 1:
            row["later_claim"] = rr.claim(2, r, 0)["gasUsed"]
        out["claim_contribution_gas"][str(count)] = row
    out["claim_contribution_gas"]["note"] = ("round 0 opened by `open` first; rounds 1 and 2 by their first "
                                             "claim (isFinal read, budget written)")
    out["claim_attestation_gas"] = {str(len(rr.rounds[r].attesters)): rr.claim_attestation(1, r)["gasUsed"]
                                    for r in (0, 2)}
    opened = rr.pool(0).round_of(rr.run_id, 0)["openedAt"]
    mine(rr.w3, max(0, opened + rr.params.claim_blocks - rr.w3.eth.block_number))
    out["sweep_gas"] = rr.pool(0).sweep(rr.run_id, 0)["gasUsed"]
    fresh = reward_run(deploy(connect_rpc(url, timeout=60.0)), members=MEMBERS[:3], pool=None)
    out["create_pool_gas"] = fresh.pool(1).create_pool(fresh.run_id, params(), 10**16)["gasUsed"]
    return out


def token_gas(url: str) -> dict:
    """createPool, fund, a contribution's claim (4 listed: the round's first, then a later one) and an
    attester's claim (3 attesters) of a pool in a plain ERC-20."""
    rr, token = token_run(deploy(connect_rpc(url, timeout=60.0)), members=MEMBERS)
    rr.pool(8).approve(token.address, 10**15)
    out = {"fund_gas": rr.pool(8).fund(rr.run_id, 10**15, token.address)["gasUsed"]}
    rr.commit([[(m, None) for m in MEMBERS[:4]], []], signers=MEMBERS[:3])
    rr.mine_to_final(0)
    out["claim_contribution_gas"] = {"first_claim_of_the_round": rr.claim(1, 0, 0)["gasUsed"],
                                     "later_claim": rr.claim(2, 0, 0)["gasUsed"]}
    out["claim_attestation_gas"] = rr.claim_attestation(1, 0)["gasUsed"]
    fresh = reward_run(rr.deployment, members=MEMBERS[:3], pool=None)
    Token(rr.w3, token.address).mint(fresh.address(1), 10**16)
    fresh.pool(1).approve(token.address, 10**16)
    out["create_pool_gas"] = fresh.pool(1).create_pool(fresh.run_id, params(token=token.address),
                                                       10**16)["gasUsed"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out(__file__))
    args = parser.parse_args()
    anvil = AnvilProcess()
    url = anvil.start()
    try:
        commits = [commit_gas(url, signers) for signers in (3, 8)]
        print(commits, flush=True)
        calls = claim_gas(url)
        print(calls, flush=True)
        calls["token_pool"] = token_gas(url)
        print(calls["token_pool"], flush=True)
    finally:
        anvil.stop()
    write_result(args.out, {"commits": commits, **calls})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
