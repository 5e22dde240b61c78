"""A run's reward pool as ``dlx-node deploy`` and ``dlx-node create-run`` open it (issue 77; docs/REWARDS.md,
docs/DEPLOY.md): ``deploy`` puts a RewardPool beside the ledger (deployment.json's ``reward_pool``), and a run
file's ``[pool]`` table makes ``create-run`` open the run's pool with its schedule and funding right after
``createRun`` (the pool is a contract of its own: ``createPool`` is the creator's second transaction, listed
and agreed with the first).

Every rule of ``RewardPool.createPool`` is checked here before anything is sent (ledger.rewards
.pool_param_problems), so bad pool parameters are refused with one message and nothing on chain. A pool in an
ERC-20 (``token`` in ``[pool]``, amounts in whole tokens: ``per_round_tokens``, ``funding_tokens``) has its
token checked first too (a contract answering ``decimals`` and ``balanceOf``; the creator holding the
funding), and create-run then sends ``approve`` before ``createPool``. A run whose
``createRun`` went through but whose ``createPool`` did not is finished by the same command again, as
create-run finishes the rest of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from node.commands.chainops import Spend
from node.errors import ConfigError

#: Gas reserved for createPool in create-run's spend plan: it cannot be estimated before the run exists
#: (bench/results/rewards_gas.json: 158,081 on anvil; 222,905 in a token pool).
POOL_GAS = 250_000
#: Gas reserved for a token pool's approve (an ERC-20's approve is about 46,000) and for fund of a token
#: pool (its transferFrom and two balanceOf on top of fund's 35,787).
POOL_APPROVE_GAS = 80_000
POOL_FUND_GAS = 150_000


@dataclass(frozen=True)
class PoolPlan:
    """The pool create-run opens: its schedule and the wei sent with createPool."""

    params: object  # ledger.rewards.PoolParams
    funding: int

    def amount(self, units: int) -> str:
        return f"{units} units of token {self.params.token}" if self.params.is_token else _eth(units)

    def describe(self) -> str:
        p = self.params
        return (f"{self.amount(p.amount_per_round)} per final round ({p.attester_bps / 100:g}% to its "
                f"attesters in {p.attester_slots} shares, the rest to each stage's contributions in "
                f"{p.contribution_slots} slots), claimable for {p.claim_blocks} blocks after a round opens")


def _eth(wei: int) -> str:
    return f"{wei / 1e18:g} ETH"


def _wei(value: float) -> int:
    return int(Decimal(str(value)) * 10**18)


def pool_plan(run, params, where: str, w3=None) -> PoolPlan | None:
    """The pool of a checked run file ``run`` (node.commands.runfile.RunFile) for a run created with
    ``params`` (RunParams), its defaults filled in; None when the run file has no ``[pool]``. ConfigError
    naming every reason createPool would refuse it, before anything is sent. A token pool's token is read on
    ``w3`` (its decimals scale the whole-token amounts)."""
    if run.pool is None:
        return None
    table = dict(run.pool)
    token = table.pop("token", None)
    if token is None:
        if "per_round_tokens" in table or "funding_tokens" in table or "per_round_eth" not in table:
            raise ConfigError(f"{where}: [pool] an ETH pool takes per_round_eth (required) and funding_eth; "
                              "per_round_tokens and funding_tokens need a token (nothing was sent)")
        per_round = _wei(table.pop("per_round_eth"))
        funding = _wei(table.pop("funding_eth")) if "funding_eth" in table else None
    else:
        if "per_round_eth" in table or "funding_eth" in table or "per_round_tokens" not in table:
            raise ConfigError(f"{where}: [pool] a token pool takes per_round_tokens (required) and "
                              "funding_tokens, in whole tokens, not per_round_eth or funding_eth "
                              "(nothing was sent)")
        decimals, _held = token_facts(w3, token, None, where)
        per_round = _units(table.pop("per_round_tokens"), decimals, "per_round_tokens", where)
        funding = (_units(table.pop("funding_tokens"), decimals, "funding_tokens", where)
                   if "funding_tokens" in table else None)
        table["token"] = token
    return plan_for(params, run.cfg.diloco.num_replicas * params.num_stages, per_round, where, funding,
                    **table)


def _units(value: float, decimals: int, key: str, where: str) -> int:
    units = Decimal(str(value)) * 10**decimals
    if units != units.to_integral_value():
        raise ConfigError(f"{where}: [pool] {key}={value}: more decimals than the token's {decimals} "
                          "(nothing was sent)")
    return int(units)


def token_facts(w3, token: str, owner: str | None, where: str = "the pool's token") -> tuple[int, int]:
    """(decimals, ``owner``'s balance; 0 for None) of the ERC-20 ``token`` on ``w3``; ConfigError (nothing was
    sent) when it is not an address, holds no contract or does not answer as an ERC-20 does."""
    from ledger.rewards import ERC20_ABI

    if w3 is None or not isinstance(token, str) or not w3.is_address(token):
        raise ConfigError(f"{where}: [pool] token={token!r}: not an address (0x and 40 hex digits; "
                          "nothing was sent)")
    address = w3.to_checksum_address(token)
    if not w3.eth.get_code(address):
        raise ConfigError(f"{where}: [pool] token {address}: no contract there on chain {w3.eth.chain_id} "
                          "(nothing was sent)")
    contract = w3.eth.contract(address=address, abi=ERC20_ABI)
    try:
        decimals = contract.functions.decimals().call()
        held = contract.functions.balanceOf(owner or address).call() if owner else 0
    except Exception as exc:  # noqa: BLE001 - any failure means: not an ERC-20 the pool can use
        raise ConfigError(f"{where}: [pool] token {address} does not answer decimals() and balanceOf() as an "
                          f"ERC-20 does ({type(exc).__name__}; nothing was sent)") from None
    return decimals, held


def plan_for(params, nodes: int, per_round: int, where: str, funding: int | None = None,
             **settings) -> PoolPlan:
    """The pool of ``per_round`` wei a round for a run created with ``params`` (RunParams) placing at most
    ``nodes`` nodes, ``settings`` (PoolParams' fields) over the defaults: the attesters' tenth (all of it in a
    run that is not normed), the run's maxContributions slots a stage, one attester share a node, a claim
    window of the unbonding; funded with ``funding`` (default one round's amount a round of the run).
    ConfigError naming every reason createPool would refuse it."""
    from ledger.errors import LedgerInputError
    from ledger.rewards import BPS, NORMED_COMMITMENTS, PoolParams, pool_param_problems

    normed = params.commitments == NORMED_COMMITMENTS
    defaults = {"attester_bps": 1_000 if normed else BPS, "contribution_slots": params.max_contributions,
                "attester_slots": nodes, "claim_blocks": params.unbonding_blocks}
    try:
        pool = PoolParams(per_round, **{**defaults, **settings})
    except LedgerInputError as exc:
        raise ConfigError(f"{where}: [pool] {exc} (nothing was sent)") from None
    funding = per_round * max(1, params.max_rounds) if funding is None else funding
    problems = pool_param_problems(pool, funding, commitments=params.commitments,
                                   max_contributions=params.max_contributions,
                                   unbonding_blocks=params.unbonding_blocks)
    if problems:
        raise ConfigError(f"{where}: [pool] would be refused by the RewardPool: " + "; ".join(problems)
                          + " (nothing was sent)")
    return PoolPlan(pool, funding)


def verify_pool(w3, pool: str, ledger: str) -> None:
    """``pool`` holds the committed RewardPool build and pays from the TrainingLedger ``ledger``;
    ConfigError with what is wrong otherwise."""
    import contracts
    from ledger.bytecode import verify_bytecode
    from ledger.errors import AuditError
    from node.commands.link import check_address

    check_address(pool, "reward_pool")
    try:
        verify_bytecode(w3, w3.to_checksum_address(pool), contracts.artifact("RewardPool"))
    except AuditError as exc:
        raise ConfigError(f"RewardPool at {pool} on chain {w3.eth.chain_id}: {exc}") from None
    bound = w3.eth.contract(address=w3.to_checksum_address(pool), abi=contracts.artifact("RewardPool")["abi"])
    if bound.functions.ledger().call().lower() != ledger.lower():
        raise ConfigError(f"RewardPool {pool} pays from another ledger than {ledger}")


def deployment_pool(w3, deployment: dict, where: str) -> str:
    """The RewardPool of ``deployment`` (deployment.json), checked; ConfigError when it has none."""
    pool = str(deployment.get("reward_pool", "") or "")
    if not pool:
        raise ConfigError(f"{where} has a [pool] table but the deployment has no reward_pool (a deployment "
                          "made before issue 77): deploy again with 'dlx-node deploy', which deploys one, or "
                          "drop [pool] (nothing was sent)")
    verify_pool(w3, pool, deployment["ledger"])
    return pool


def pool_spends(plan: PoolPlan | None, pool_client, run_id: int | None, fee: int) -> list[Spend]:
    """createPool in create-run's spend plan (a token pool's approve before it), unless there is no
    ``[pool]`` or the run (``run_id``: one created before) has its pool already. ConfigError (nothing was
    sent) when a token pool's creator holds less of the token than the funding."""
    if plan is None or (run_id is not None and pool_client.has_pool(run_id)):
        return []
    opening = f"open the run's reward pool with {plan.amount(plan.funding)}: {plan.describe()}"
    if not plan.params.is_token:
        return [Spend(opening, POOL_GAS, fee, plan.funding)]
    owner = pool_client.account_address
    _decimals, held = token_facts(pool_client.w3, plan.params.token, owner)
    if held < plan.funding:
        raise ConfigError(f"[pool] {owner} holds {held} units of token {plan.params.token}, not the "
                          f"funding's {plan.funding} (nothing was sent)")
    return [Spend(f"allow the reward pool {plan.amount(plan.funding)}", POOL_APPROVE_GAS, fee),
            Spend(opening, POOL_GAS, fee)]


def open_pool(plan: PoolPlan | None, pool_client, run_id: int) -> None:
    """Open run ``run_id``'s pool as ``plan`` says (its creator's createPool), unless it has one."""
    if plan is None:
        return
    if pool_client.has_pool(run_id):
        opened = pool_client.pool_of(run_id)
        same = opened["params"] == plan.params
        print(f"run {run_id} has its reward pool at {pool_client.address} already"
              + ("" if same else f" (opened with {opened['params']}; [pool] differs and was not applied)"))
        return
    if plan.params.is_token:
        token = pool_client.token(plan.params.token)
        allowed = token.functions.allowance(pool_client.account_address, pool_client.address).call()
        if allowed < plan.funding:
            pool_client.approve(plan.params.token, plan.funding)
    pool_client.create_pool(run_id, plan.params, plan.funding)
    print(f"opened run {run_id}'s reward pool at {pool_client.address} with {plan.amount(plan.funding)}: "
          f"{plan.describe()}")
