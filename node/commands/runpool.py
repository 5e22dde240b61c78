"""A run's reward pool as ``dlx-node deploy`` and ``dlx-node create-run`` open it (issue 77; docs/REWARDS.md,
docs/DEPLOY.md): ``deploy`` puts a RewardPool beside the ledger (deployment.json's ``reward_pool``), and a run
file's ``[pool]`` table makes ``create-run`` open the run's pool with its schedule and funding right after
``createRun`` (the pool is a contract of its own: ``createPool`` is the creator's second transaction, listed
and agreed with the first).

Every rule of ``RewardPool.createPool`` is checked here before anything is sent (ledger.rewards
.pool_param_problems), so bad pool parameters are refused with one message and nothing on chain. A run whose
``createRun`` went through but whose ``createPool`` did not is finished by the same command again, as
create-run finishes the rest of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from node.commands.chainops import Spend
from node.errors import ConfigError

#: Gas reserved for createPool in create-run's spend plan: it cannot be estimated before the run exists
#: (bench/results/rewards_gas.json: 153,809 on anvil).
POOL_GAS = 250_000


@dataclass(frozen=True)
class PoolPlan:
    """The pool create-run opens: its schedule and the wei sent with createPool."""

    params: object  # ledger.rewards.PoolParams
    funding: int

    def describe(self) -> str:
        p = self.params
        return (f"{_eth(p.amount_per_round)} per final round ({p.attester_bps / 100:g}% to its attesters in "
                f"{p.attester_slots} shares, the rest to each stage's contributions in "
                f"{p.contribution_slots} slots), claimable for {p.claim_blocks} blocks after a round opens")


def _eth(wei: int) -> str:
    return f"{wei / 1e18:g} ETH"


def _wei(value: float) -> int:
    return int(Decimal(str(value)) * 10**18)


def pool_plan(run, params, where: str) -> PoolPlan | None:
    """The pool of a checked run file ``run`` (node.commands.runfile.RunFile) for a run created with
    ``params`` (RunParams), its defaults filled in; None when the run file has no ``[pool]``. ConfigError
    naming every reason createPool would refuse it, before anything is sent."""
    if run.pool is None:
        return None
    table = dict(run.pool)
    per_round = _wei(table.pop("per_round_eth"))
    funding = _wei(table.pop("funding_eth")) if "funding_eth" in table else None
    return plan_for(params, run.cfg.diloco.num_replicas * params.num_stages, per_round, where, funding,
                    **table)


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
    """createPool in create-run's spend plan, unless there is no ``[pool]`` or the run (``run_id``: one
    created before) has its pool already."""
    if plan is None or (run_id is not None and pool_client.has_pool(run_id)):
        return []
    return [Spend(f"open the run's reward pool with {_eth(plan.funding)}: {plan.describe()}", POOL_GAS, fee,
                  plan.funding)]


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
    pool_client.create_pool(run_id, plan.params, plan.funding)
    print(f"opened run {run_id}'s reward pool at {pool_client.address} with {_eth(plan.funding)}: "
          f"{plan.describe()}")
