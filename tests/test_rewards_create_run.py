"""A run's reward pool opened by ``dlx-node create-run`` from the run file's ``[pool]`` (issue 77;
docs/REWARDS.md, "Opening a pool"): the run file's table checked, every rule of ``createPool`` checked
before anything is sent and agreeing with the contract (py-evm and anvil), and the command on a real anvil:
the pool opened and funded right after createRun, a rerun that opens nothing twice but finishes a run whose
pool was not opened, and bad pool parameters refused with one message, nothing sent."""

from __future__ import annotations

import json
import logging

import pytest

from ledger import errors
from ledger.account import dev_account
from ledger.client import LedgerClient
from ledger.rewards import PoolParams, RewardPoolClient, pool_param_problems
from node.cli import main
from node.commands.runfile import read_run_file, run_params
from node.commands.runpool import pool_plan
from node.errors import ConfigError
from tests.ledger_fixtures import FAST_RETRY, deploy, fresh_anvil_w3
from tests.reward_fixtures import AMOUNT, MAX_CONTRIBUTIONS, params, reward_run
from tests.test_chain_commands import RUN_FILE

POOL = "\n[pool]\nper_round_eth = 0.01\n"


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def _plan(tmp_path, pool_table: str, text: str = RUN_FILE):
    path = tmp_path / "run.toml"
    path.write_text(text + pool_table)
    run = read_run_file(str(path))
    return pool_plan(run, run_params(run), "run file"), run_params(run)


# ---------------------------------------------------------------------- the run file, no chain
@pytest.mark.parametrize("table, says", [
    ("\n[pool]\nfunding_eth = 1\n", r"\[pool\] needs per_round_eth"),
    (POOL + "amount = 1\n", r"unknown \[pool\] key\(s\) \['amount'\]"),
    (POOL + "attester_bps = -1\n", "attester_bps=-1: must be an integer >= 0"),
    (POOL + "claim_blocks = true\n", "claim_blocks=True: must be an integer"),
    ("\n[pool.sub]\nper_round_eth = 1\n", r"\[pool\] needs per_round_eth.*unknown|unknown.*\['sub'\]"),
])
def test_a_pool_table_with_a_bad_value_is_refused_naming_it(tmp_path, table, says):
    with pytest.raises(ConfigError, match=says):
        _plan(tmp_path, table)


def test_a_pool_tables_defaults_follow_the_run(tmp_path):
    plan, run = _plan(tmp_path, POOL)
    # RUN_FILE: tiny, 3 rounds, 2 replicas x 1 stage, normed (commitments 3), unbonding the proof window
    assert plan.params == PoolParams(10**16, attester_bps=1_000, contribution_slots=run.max_contributions,
                                     attester_slots=2, claim_blocks=run.unbonding_blocks)
    assert plan.funding == 3 * 10**16  # one round's amount per round of the run
    assert _plan(tmp_path, "")[0] is None  # no [pool]: no pool, as before


@pytest.mark.parametrize("extra, says", [
    ("funding_eth = 0.005\n", "does not cover one round's amount .* would exceed what the pool holds"),
    ("per_round_eth = 0\n", "the amount per round is zero"),
    ("attester_bps = 10001\n", "attester_bps=10001 is above 10000"),
    ("contribution_slots = 1\n", "contribution_slots=1 is below the run's max_contributions"),
    ("attester_slots = 0\n", "attester_slots is zero with an attesters' part"),
    ("claim_blocks = 1\n", "claim_blocks=1 is shorter than the run's unbonding"),
])
def test_pool_parameters_the_contract_refuses_are_refused_before_anything_is_sent(tmp_path, extra, says):
    table = POOL.replace("per_round_eth = 0.01\n", "") + extra
    table += "" if "per_round_eth" in extra else "per_round_eth = 0.01\n"
    with pytest.raises(ConfigError, match=f"would be refused by the RewardPool: .*{says}.*nothing was sent"):
        _plan(tmp_path, table)


def test_every_bad_pool_parameter_is_named_in_one_message(tmp_path):
    with pytest.raises(ConfigError) as info:
        _plan(tmp_path, POOL + "funding_eth = 0.001\nclaim_blocks = 1\nattester_bps = 20000\n")
    message = str(info.value)
    assert message.count("\n") == 0 and all(
        what in message for what in ("does not cover", "claim_blocks=1", "attester_bps=20000"))


def test_a_hashed_run_may_pay_its_attesters_only(tmp_path):
    hashed = RUN_FILE.replace("num_replicas = 2\n", 'num_replicas = 2\ncommitments = "hashed"\n')
    with pytest.raises(ConfigError, match="contributions are paid only in a normed run"):
        _plan(tmp_path, POOL + "attester_bps = 5000\n", hashed)
    plan, _ = _plan(tmp_path, POOL, hashed)  # its default: the whole amount to the attesters
    assert plan.params.attester_bps == 10_000


# ---------------------------------------------------------------------- the check agrees with the contract
def test_the_checks_refusals_are_exactly_the_contracts(chain_w3):
    """Each parameter set around every rule's boundary: pool_param_problems refuses it iff createPool
    reverts RewardBadParams (py-evm and anvil)."""
    deployment = deploy(chain_w3)
    rr = reward_run(deployment, pool=None)
    unbonding = rr.run.reader.run_info(rr.run_id).unbonding_blocks
    cases = [(params(amount_per_round=0), AMOUNT), (params(), AMOUNT - 1),
             (params(attester_bps=10_001), AMOUNT), (params(contribution_slots=0), AMOUNT),
             (params(contribution_slots=MAX_CONTRIBUTIONS - 1), AMOUNT),
             (params(attester_slots=0), AMOUNT), (params(claim_blocks=unbonding - 1), AMOUNT),
             (params(attester_slots=0, attester_bps=0), AMOUNT), (params(attester_bps=10_000), AMOUNT),
             (params(contribution_slots=MAX_CONTRIBUTIONS, claim_blocks=unbonding), AMOUNT)]
    pool = rr.pool(1)
    verdicts = []
    for bad, funding in cases:
        problems = pool_param_problems(bad, funding, commitments=3, max_contributions=MAX_CONTRIBUTIONS,
                                       unbonding_blocks=unbonding)
        data = pool.contract.encode_abi("createPool", args=[rr.run_id, bad.fields(), funding])
        try:
            pool.sender.estimate({"to": pool.address, "value": funding, "data": data}, "createPool")
            refused = False
        except errors.RewardBadParams:
            refused = True
        verdicts.append((bool(problems), refused))
    assert all(ours == theirs for ours, theirs in verdicts), verdicts
    assert [ours for ours, _ in verdicts] == [True] * 7 + [False] * 3


# ---------------------------------------------------------------------- the command, on a real anvil
@pytest.fixture
def deployed(request, tmp_path):
    """Fresh contracts with a RewardPool, and their deployment.json (as dlx-node deploy writes it)."""
    w3 = fresh_anvil_w3(request, timeout=10.0)
    registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id), retry=FAST_RETRY)
    pool = RewardPoolClient.deploy(w3, dev_account(0, w3.eth.chain_id), ledger, retry=FAST_RETRY)
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"chain_id": w3.eth.chain_id, "rpc_url": w3.provider.endpoint_uri,
                                "registry": registry, "ledger": ledger, "reward_pool": pool,
                                "from_block": 0}))
    return w3, path, LedgerClient(w3, None, registry, ledger), RewardPoolClient(w3, None, pool)


def _create(tmp_path, deployment, text: str) -> int:
    (tmp_path / "run.toml").write_text(text)
    return main(["create-run", str(tmp_path / "run.toml"), "--deployment", str(deployment), "--data-dir",
                 str(tmp_path / "org"), "--listen-port", "24999", "--confirmations", "1",
                 "--dev-account", "3", "--yes"])


def test_create_run_opens_the_runs_pool_and_a_rerun_opens_none_twice(deployed, tmp_path, capsys):
    w3, path, ledger, pool = deployed
    # first without [pool] (as a createRun whose createPool never went through), then with it: the same
    # command finishes the run by opening its pool; a third time opens nothing
    assert _create(tmp_path, path, RUN_FILE) == 0 and not pool.has_pool(1)
    capsys.readouterr()
    table = POOL + "funding_eth = 0.025\nattester_bps = 2500\n"
    assert _create(tmp_path, path, RUN_FILE + table) == 0
    out = capsys.readouterr().out
    assert "finishing it" in out and "opened run 1's reward pool" in out and "0.025 ETH" in out
    view = pool.pool_of(1)
    info = ledger.run_info(1)
    assert view["params"] == PoolParams(10**16, 2_500, info.max_contributions, 2, info.unbonding_blocks)
    assert (view["funded"], view["free"], view["firstRound"]) == (25 * 10**15, 25 * 10**15, 0)
    assert pool.balance() == 25 * 10**15 and ledger.run_count() == 1
    assert _create(tmp_path, path, RUN_FILE + table) == 0
    assert "has its reward pool" in capsys.readouterr().out and pool.pool_of(1)["funded"] == 25 * 10**15


def test_create_run_opens_a_new_runs_pool_with_createrun(deployed, tmp_path, capsys):
    w3, path, ledger, pool = deployed
    assert _create(tmp_path, path, RUN_FILE + POOL) == 0
    out = capsys.readouterr().out
    assert "open the run's reward pool with 0.03 ETH" in out  # listed with the other transactions
    assert "created run 1" in out and "opened run 1's reward pool" in out
    assert pool.pool_of(1)["funded"] == 3 * 10**16 and pool.balance() == 3 * 10**16
    events = [e.name for e in pool.pool_events(1)]
    assert events == ["PoolCreated"]


@pytest.mark.parametrize("table, says", [
    (POOL + "funding_eth = 0.001\n", "would exceed what the pool holds"),
    (POOL + "claim_blocks = 3\n", "claim_blocks=3 is shorter than the run's unbonding"),
])
def test_create_run_refuses_bad_pool_parameters_and_sends_nothing(deployed, tmp_path, capsys, table, says):
    w3, path, ledger, pool = deployed
    organizer = dev_account(3, w3.eth.chain_id).address
    nonce = w3.eth.get_transaction_count(organizer)
    assert _create(tmp_path, path, RUN_FILE + table) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "nothing was sent" in err[-1]
    assert ledger.run_count() == 0 and w3.eth.get_transaction_count(organizer) == nonce
    assert not (tmp_path / "org" / "node.toml").exists()


def test_create_run_refuses_a_pool_without_a_deployed_reward_pool(deployed, tmp_path, capsys):
    w3, path, ledger, pool = deployed
    deployment = json.loads(path.read_text())
    del deployment["reward_pool"]
    path.write_text(json.dumps(deployment))
    assert _create(tmp_path, path, RUN_FILE + POOL) == 2
    assert "the deployment has no reward_pool" in capsys.readouterr().err
    deployment["reward_pool"] = deployment["ledger"]  # code, but not a RewardPool's
    path.write_text(json.dumps(deployment))
    assert _create(tmp_path, path, RUN_FILE + POOL) == 2
    assert "RewardPool at" in capsys.readouterr().err and ledger.run_count() == 0
