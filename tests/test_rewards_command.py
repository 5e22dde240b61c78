"""``dlx-node rewards`` (issue 77; docs/REWARDS.md, "dlx-node rewards"): an account's credits per round from
the record and the pool's events (py-evm and anvil), and the command on a real anvil: its statement, --json,
--claim with its gas and balance check, and bad input refused with one line before anything is sent."""

from __future__ import annotations

import json
import logging

import pytest

from ledger.rewards import attester_share
from ledger.rewardstatement import claim_call, statement
from node.cli import main
from node.errors import ConfigError
from node.tools.audit_pool import POOL_BOOKS, pool_check
from node.tools.report import FAIL, OK
from tests.ledger_fixtures import deploy, fresh_anvil_w3
from tests.reward_fixtures import params, reward_run


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def _send(rr, index: int, call) -> dict:
    name, args = call
    pool = rr.pool(index)
    return pool.sender.transact(pool.contract, name, args, name)


def test_a_statement_follows_each_credit_from_pending_to_claimed(chain_w3):
    rr = reward_run(deploy(chain_w3), pool=params())
    entry = rr.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    sources = {0: (entry.leaves, entry.factors)}
    reader = rr.run.reader
    pending = statement(rr.pool(1), reader, rr.run_id, rr.address(1), sources)
    assert [(c.stage, c.state) for c in pending.credits] == [(None, "pending"), (0, "pending")]
    assert claim_call(reader, rr.run_id, pending.credits[0]) is None  # not final: nothing to send
    rr.mine_to_final(0)
    now = statement(rr.pool(1), reader, rr.run_id, rr.address(1), sources)
    attest, contribution = now.credits
    assert (attest.state, attest.amount) == ("claimable", attester_share(rr.params, 2))
    assert (contribution.state, contribution.amount) == ("claimable", rr.expected_share(0, 0, 1))
    assert now.to_json()["claimable_amount"] == attest.amount + contribution.amount
    for credit in now.credits:
        _send(rr, 1, claim_call(reader, rr.run_id, credit, sources))
    done = statement(rr.pool(1), reader, rr.run_id, rr.address(1))  # no sources: claims say it
    assert [(c.stage, c.state, c.amount) for c in done.credits] == [
        (None, "claimed", attest.amount), (0, "claimed", contribution.amount)]
    assert done.to_json()["claimed_amount"] == attest.amount + contribution.amount
    outsider = statement(rr.pool(5), reader, rr.run_id, rr.address(5), sources)
    assert outsider.credits == []  # listed nowhere: no credit
    member3 = statement(rr.pool(3), reader, rr.run_id, rr.address(3))
    assert member3.credits == []  # unclaimed contributions need the round's factors (not on chain)


def test_a_convicted_members_unclaimed_credits_are_forfeited(chain_w3):
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    before = statement(rr.pool(2), rr.run.reader, rr.run_id, rr.address(2))
    assert [c.state for c in before.credits] == ["claimable"]
    second = rr.commit([[(1, None)], []], signers=(1, 2))  # member 2 signs two records of round 1
    other = rr.run.next_record("other")
    other = type(other)(**{**other.__dict__, "round": 1, "prev_head": second.record.prev_head})
    client2 = rr.deployment.client(2)
    rr.deployment.client(5).report_equivocation(second.record, client2.sign_record(second.record), other,
                                                client2.sign_record(other))
    after = statement(rr.pool(2), rr.run.reader, rr.run_id, rr.address(2))
    assert after.convicted and {c.state for c in after.credits} == {"forfeited"}
    assert after.to_json()["claimable_amount"] == 0
    assert claim_call(rr.run.reader, rr.run_id, after.credits[0]) is None


@pytest.fixture
def anvil_run(request, tmp_path):
    """A normed run with a funded pool on a fresh anvil, round 0 committed by members 1 and 2 and final, and
    member 1's node.toml."""
    w3 = fresh_anvil_w3(request, timeout=10.0)
    rr = reward_run(deploy(w3), pool=params())
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    config = tmp_path / "node.toml"
    config.write_text(f'[ledger]\nbackend = "rpc"\nrpc_url = "{w3.provider.endpoint_uri}"\ndev_account = 1\n'
                      f'registry_address = "{rr.deployment.registry}"\n'
                      f'ledger_address = "{rr.deployment.ledger}"\n'
                      f"run_id = {rr.run_id}\nchain_id = {w3.eth.chain_id}\n")
    return rr, str(config)


def test_rewards_command_shows_and_claims_a_members_credits(anvil_run, capsys):
    rr, config = anvil_run
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    share = attester_share(rr.params, 2)
    assert shown["claimable_amount"] == share and shown["claimed_amount"] == 0
    place = list(rr.rounds[0].attesters).index(rr.address(1))
    assert shown["credits"] == [{"round": 0, "stage": None, "amount": share, "state": "claimable",
                                 "index": place}]
    before = rr.w3.eth.get_balance(rr.address(1))
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--claim", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "claim round 0's attestation" in out and "claimed round 0" in out
    paid = rr.pool(0).pool_of(rr.run_id)["claimed"]
    assert paid == share and rr.w3.eth.get_balance(rr.address(1)) > before - 10**15
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--claim", "--yes"]) == 0
    assert "nothing to claim now" in capsys.readouterr().out
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--account", rr.address(2),
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["claimable_amount"] == share  # member 2's, unclaimed
    assert (shown["unit"], shown["token"], shown["decimals"], shown["symbol"]) == ("wei", None, 18, "ETH")


def test_rewards_command_refuses_bad_input_and_a_poor_account_before_sending(anvil_run, capsys):
    rr, config = anvil_run
    cases = [(["--pool", "0x1234"], "not an address"),
             (["--pool", rr.deployment.registry], "not a RewardPool"),
             (["--pool", "0x" + "11" * 20], "no contract there"),
             (["--pool", rr.pool_address, "--account", rr.address(2), "--claim"], "drop --account")]
    for extra, says in cases:
        assert main(["rewards", "--config", config, *extra]) == 2
        assert says in capsys.readouterr().err
    rr.w3.provider.make_request("anvil_setBalance", [rr.address(1), hex(1000)])
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--claim", "--yes"]) == 2
    assert "fund it first (nothing was sent)" in capsys.readouterr().err
    assert rr.pool(0).pool_of(rr.run_id)["claimed"] == 0


def test_the_audits_pool_item_recomputes_the_books(chain_w3):
    rr = reward_run(deploy(chain_w3), pool=params())
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    rr.claim(1, 0, 0)
    rr.claim_attestation(2, 0)
    reader = rr.run.reader
    item = pool_check(reader, rr.run_id, rr.pool_address)
    assert item.status == OK and item.name == POOL_BOOKS
    claimed = rr.expected_share(0, 0, 1) + rr.expected_attester_share(0)
    assert f"claimed {claimed} wei" in item.reason
    other = reward_run(rr.deployment, pool=None)  # a run without a pool, audited against this pool
    other.pool_address = rr.pool_address
    missing = pool_check(other.run.reader, other.run_id, rr.pool_address)
    assert missing.status == FAIL and "0 PoolCreated events" in missing.reason
    with pytest.raises(ConfigError, match="not a pool of|not a RewardPool|a pool of ledger"):
        pool_check(deploy(chain_w3).client(0), rr.run_id, rr.pool_address)  # another deployment's ledger


def test_audit_reports_the_pool_item_in_its_json(anvil_run, tmp_path, capsys):
    rr, _config = anvil_run
    rr.claim_attestation(1, 0)
    out = tmp_path / "audit.json"
    code = main(["audit", "--rpc", rr.w3.provider.endpoint_uri, "--run", str(rr.run_id), "--registry",
                 rr.deployment.registry, "--ledger", rr.deployment.ledger, "--no-replay", "--pool",
                 rr.pool_address, "--json", str(out)])
    printed = capsys.readouterr().out
    assert "reward pool books: ok" in printed
    items = [c for c in json.loads(out.read_text())["general"] if c["name"] == POOL_BOOKS]
    assert len(items) == 1 and items[0]["status"] == OK, items
    assert code in (0, 8, 13)  # the fixture's rounds carry no run document: other items decide the exit
    other = reward_run(rr.deployment, pool=None)  # a run the pool holds nothing of: its books fail
    code = main(["audit", "--rpc", rr.w3.provider.endpoint_uri, "--run", str(other.run_id), "--registry",
                 rr.deployment.registry, "--ledger", rr.deployment.ledger, "--no-replay", "--pool",
                 rr.pool_address])
    assert code == 8 and "reward pool books: FAIL" in capsys.readouterr().out


def test_anyone_funds_a_pool_through_the_command_and_bad_amounts_are_refused(anvil_run, capsys):
    rr, config = anvil_run
    before = rr.pool(0).pool_of(rr.run_id)
    for amount, says in (("-1", "a positive amount"), ("abc", "not a number"), ("1e-19", "18 decimals")):
        assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--fund", amount]) == 2
        assert says in capsys.readouterr().err
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--fund", "0.25", "--yes"]) == 0
    assert "funded the pool of run" in capsys.readouterr().out
    after = rr.pool(0).pool_of(rr.run_id)
    assert after["funded"] - before["funded"] == after["free"] - before["free"] == 25 * 10**16
    assert rr.pool(0).balance() == after["funded"] - after["claimed"]
    rr.w3.provider.make_request("anvil_setBalance", [rr.address(1), hex(10**17)])
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--fund", "0.25", "--yes"]) == 2
    assert "fund it first (nothing was sent)" in capsys.readouterr().err
    assert rr.pool(0).pool_of(rr.run_id)["funded"] == after["funded"]
