"""``dlx-node rewards``: what a member (or any account) earned from its run's reward pool, round by round,
what is claimable now, and ``--claim`` to claim it (issue 77; docs/REWARDS.md, "dlx-node rewards").

The member is the account of a node directory's ``node.toml`` (its chain and run too); ``--account`` shows
another account's credits (read-only). The pool is a RewardPool contract beside the run's ledger:
``--pool``. Credits come from ledger.rewardstatement: attestations from the chain alone, listed contributions
from the stage leaves and factors the node directory kept (node/store/rewardsources.py; checked against the
chain), else once claimed.
"""

from __future__ import annotations

import argparse
import json

from ledger.poolunit import ETH
from node.commands.chainops import Spend, add_fee_args, agree, check_funds
from node.errors import ConfigError

_STAGE_LABEL = "attestation"


def add_parser(sub) -> None:
    p = sub.add_parser("rewards", help="a member's credits in its run's reward pool per round, what is "
                                       "claimable, and --claim to claim it")
    p.add_argument("--config", "-c", default="node.toml",
                   help="the member's node.toml (its account, chain and run), written by join or create-run")
    p.add_argument("--pool", required=True, metavar="ADDRESS", help="the run's RewardPool contract")
    p.add_argument("--account", default="", metavar="ADDRESS",
                   help="show this account's credits instead of the member's (read-only: no --claim)")
    p.add_argument("--all", action="store_true",
                   help="every account's unclaimed credits (final, not claimed) and what the pool holds "
                        "against them, checked (read-only; exit 8 on a mismatch)")
    p.add_argument("--json", action="store_true", help="print the statement as JSON")
    p.add_argument("--claim", action="store_true",
                   help="claim every claimable credit (one transaction each; listed and agreed first)")
    p.add_argument("--fund", default="", metavar="AMOUNT",
                   help="top the run's pool up by AMOUNT (ETH, or whole tokens of a token pool) from this "
                        "account first (anyone may; listed and agreed first)")
    p.add_argument("--prune", action="store_true",
                   help="remove the node directory's kept reward sources no claim can use any more (also "
                        "done after --claim)")
    add_fee_args(p)


def run_rewards(args: argparse.Namespace) -> int:
    """``dlx-node rewards``."""
    from ledger.rewardstatement import statement
    from node.commands.member import member_chain
    from node.tools.audit_pool import pool_client

    if args.claim and args.account:
        raise ConfigError("--claim claims the member's own credits: drop --account (nothing was sent)")
    if args.all and (args.claim or args.account or args.fund):
        raise ConfigError("--all shows every account, read-only: drop --claim, --account and --fund")
    if args.fund:
        _fund_amount(args.fund)  # refused before connecting
    chain, run_id, _seat = member_chain(args)
    try:
        client = chain.client
        pool = pool_client(client, args.pool)
        if not pool.has_pool(run_id):
            raise ConfigError(f"run {run_id} has no reward pool at {pool.address} (its creator opens one: "
                              "docs/REWARDS.md)")
        if args.fund:
            _fund(pool, client, run_id, args.fund, args.yes)
        if args.all:
            from node.commands.rewardsall import show_unclaimed

            return show_unclaimed(pool, client, run_id, _sources(args.config, client, run_id),
                                  _unit(pool, run_id), args.json)
        account = args.account or client.address
        if args.account and not client.w3.is_address(args.account):
            raise ConfigError(f"--account {args.account!r}: not an address")
        sources = _sources(args.config, client, run_id)
        result = statement(pool, client, run_id, account, sources)
        unit = _unit(pool, run_id)
        if args.json and not args.claim:
            print(json.dumps({**result.to_json(), **unit.to_json()}, indent=2))
        else:
            _print_statement(result, unit.show)
        if args.claim:
            sent = _claim(pool, client, run_id, result, args.yes, sources, unit.show)
            result = statement(pool, client, run_id, account, sources)
            if args.json:
                print(json.dumps({**result.to_json(), **unit.to_json(), "claims_sent": sent}, indent=2))
        if args.prune or args.claim:
            _prune(args.config, pool, client, run_id, quiet=args.json)
    finally:
        chain.close()
    return 0


def _prune(config: str, pool, client, run_id: int, quiet: bool) -> None:
    """Remove the kept sources no claim can use any more (node/store/rewardsources.py prune_sources)."""
    from node.config import load_config
    from node.store.rewardsources import prune_sources

    removed = prune_sources(load_config(config).path("."), pool, client, run_id)
    if not quiet:
        print(f"pruned {len(removed)} reward source file(s) no claim can use any more")


def _sources(config: str, client, run_id: int) -> dict:
    """The stage leaves and factors the node directory of ``config`` kept (node/store/rewardsources.py),
    those the chain vouches for: what proves its listed contributions."""
    from node.config import load_config
    from node.store.rewardsources import read_sources

    return read_sources([load_config(config).path(".")], client, run_id)


def _fund_amount(text: str, decimals: int = 18, unit: str = "ETH") -> int:
    """--fund AMOUNT in the smallest unit: ConfigError unless a positive number of ``unit`` with at most
    ``decimals`` decimals."""
    from decimal import Decimal, InvalidOperation

    try:
        value = Decimal(text) * 10**decimals
    except InvalidOperation:
        raise ConfigError(f"--fund {text!r}: not a number of {unit}") from None
    if not value.is_finite() or value <= 0 or value != value.to_integral_value():
        raise ConfigError(f"--fund {text!r}: a positive amount of {unit}, at most {decimals} decimals")
    return int(value)


def _fund(pool, client, run_id: int, text: str, yes: bool) -> None:
    """Top the pool of ``run_id`` up by ``text`` (ETH, or whole tokens of a token pool) after listing it (gas
    and balance checked; a token pool's approve first)."""
    token = pool.pool_of(run_id)["params"].token
    if int(token, 16):
        _fund_token(pool, client, run_id, token, text, yes)
        return
    amount = _fund_amount(text)
    what = f"fund the reward pool of run {run_id}"
    check_funds(client.balance(), client.address, [Spend(what, 0, 0, amount)])  # before the chain's estimate
    data = pool.contract.encode_abi("fund", args=[run_id, amount])
    gas, fees = pool.sender.estimate({"to": pool.address, "value": amount, "data": data}, what)
    plan = [Spend(what, gas, fees["maxFeePerGas"], amount)]
    check_funds(client.balance(), client.address, plan)
    agree(plan, yes, "funding")
    pool.sender.transact(pool.contract, "fund", (run_id, amount), what, amount)
    free = pool.pool_of(run_id)["free"]
    print(f"funded the pool of run {run_id} with {ETH.show(amount)}; it holds {ETH.show(free)} free")


def _fund_token(pool, client, run_id: int, token: str, text: str, yes: bool) -> None:
    """--fund of a token pool: ``text`` whole tokens (the token's decimals), refused before anything is sent
    when the account holds fewer; then approve and fund, both listed and agreed."""
    from node.commands.runpool import POOL_FUND_GAS, token_facts

    decimals, held = token_facts(pool.w3, token, client.address)
    amount = _fund_amount(text, decimals, f"token {token}")
    if held < amount:
        raise ConfigError(f"--fund: {client.address} holds {held} units of token {token}, not the {amount} "
                          "asked (nothing was sent)")
    what = f"allow the pool {amount} units of token {token}"
    data = pool.token(token).encode_abi("approve", args=[pool.address, amount])
    gas, fees = pool.sender.estimate({"to": pool.token(token).address, "value": 0, "data": data}, what)
    plan = [Spend(what, gas, fees["maxFeePerGas"]),
            Spend(f"fund the reward pool of run {run_id} with {amount} units of token {token}",
                  POOL_FUND_GAS, fees["maxFeePerGas"])]
    check_funds(client.balance(), client.address, plan)
    agree(plan, yes, "funding")
    pool.approve(token, amount)
    pool.fund(run_id, amount, token)
    free, unit = pool.pool_of(run_id)["free"], _unit(pool, run_id)
    print(f"funded the pool of run {run_id} with {unit.show(amount)} ({amount} units of token {token}); it "
          f"holds {unit.show(free)} free")


def _unit(pool, run_id: int):
    """The run's pool's unit (ledger/poolunit.py): its amounts print in ETH, or whole tokens of a token pool
    named by the token's symbol."""
    from ledger.poolunit import pool_unit

    return pool_unit(pool.w3, pool.pool_of(run_id)["params"].token)


def _print_statement(result, amount=ETH.show) -> None:
    print(f"run {result.run_id}, pool {result.pool}, account {result.account}"
          + (" (convicted: its unclaimed credits are forfeited)" if result.convicted else ""))
    if not result.credits:
        print("no credits: the account attested no committed round and no claim of a contribution of it "
              "is recorded")
    for credit in result.credits:
        what = _STAGE_LABEL if credit.stage is None else f"contribution, stage {credit.stage}"
        print(f"  round {credit.round:>4}  {what:<24} {amount(credit.amount):>18}  {credit.state}")
    data = result.to_json()
    print(f"earned {amount(data['earned_amount'])} (final {amount(data['final_amount'])}), claimable "
          f"{amount(data['claimable_amount'])}, claimed {amount(data['claimed_amount'])}, forfeited "
          f"{amount(data['forfeited_amount'])}")
    unclaimed = [c for c in result.credits if c.state == "claimable"]
    if unclaimed:
        print("claim them: dlx-node rewards --claim (same options)")


def _claim(pool, client, run_id: int, result, yes: bool, sources: dict | None = None, amount=ETH.show) -> int:
    """Send a claim for each claimable credit after listing them (gas and balance checked); the claims
    sent."""
    from ledger.rewardstatement import claim_call

    calls = [(credit, claim_call(client, run_id, credit, sources)) for credit in result.credits]
    calls = [(credit, call) for credit, call in calls if call is not None]
    if not calls:
        print("nothing to claim now")
        return 0
    plan = []
    for credit, (name, call_args) in calls:
        what = f"claim round {credit.round}'s {_STAGE_LABEL if credit.stage is None else 'contribution'} " \
               f"({amount(credit.amount)})"
        data = pool.contract.encode_abi(name, args=list(call_args))
        gas, fees = pool.sender.estimate({"to": pool.address, "value": 0, "data": data}, what)
        plan.append(Spend(what, gas, fees["maxFeePerGas"]))
    check_funds(client.balance(), client.address, plan)
    agree(plan, yes, "claiming")
    for (credit, (name, call_args)), step in zip(calls, plan, strict=True):
        pool.sender.transact(pool.contract, name, call_args, step.what)
        print(f"claimed round {credit.round}: {amount(credit.amount)} to {client.address}")
    return len(calls)
