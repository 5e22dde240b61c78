"""Every account's unclaimed credits (final, not claimed) and the pool's holding against them (issue 77;
ledger/rewardunclaimed.py, docs/REWARDS.md "Unclaimed credits, per account"), on py-evm and anvil with real
commits and claims: the per-account table agrees with each account's statement and with the rule's shares,
falls as members claim, lists an unfunded round apart, and each check fails on a pool whose books do not
hold (anvil: the pool contract's real balance lowered; py-evm: a pool whose views lie); ``dlx-node rewards
--all`` and the audit's items on anvil."""

from __future__ import annotations

import json
import logging

import pytest

from ledger.rewardstatement import statement
from ledger.rewardunclaimed import unclaimed
from node.cli import main
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves, write_stage
from node.tools.audit_pool import POOL_ACCOUNT, POOL_UNCLAIMED, unclaimed_checks
from node.tools.report import FAIL, OK
from tests.ledger_fixtures import SHORT_WINDOWS, deploy, fresh_anvil_w3
from tests.reward_fixtures import FEE_ON_TRANSFER, MAX_CONTRIBUTIONS, params, reward_run, token_run


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def _two_rounds(w3, funding_rounds: int = 10):
    """A run with a pool funded for ``funding_rounds`` rounds; rounds 0 and 1 list member 1 (stage 0) and 2
    and 3 (stage 1), attested by 1 and 2, both final; their sources."""
    rr = reward_run(deploy(w3), pool=params(), funding=funding_rounds * params().amount_per_round)
    for r in range(2):
        rr.commit([[(1, None)], [(2, None), (3, None)]], signers=(1, 2), label=f"r{r}")
    rr.mine_to_final(1)
    return rr, {r: (entry.leaves, entry.factors) for r, entry in enumerate(rr.rounds)}


def _by_account(found) -> dict:
    return {a.account: a for a in found.accounts}


def test_every_accounts_unclaimed_credits_fit_the_pool_and_fall_as_members_claim(chain_w3):
    rr, sources = _two_rounds(chain_w3)
    reader = rr.run.reader
    att = rr.expected_attester_share(0)
    share = {1: rr.expected_share(0, 0, 1), 2: rr.expected_share(0, 1, 2), 3: rr.expected_share(0, 1, 3)}
    found = unclaimed(rr.pool(0), reader, rr.run_id, sources)
    assert found.problems == []
    table = _by_account(found)
    assert set(table) == {rr.address(1), rr.address(2), rr.address(3)}
    expected = {1: 2 * (share[1] + att), 2: 2 * (share[2] + att), 3: 2 * share[3]}
    assert {i: table[rr.address(i)].claimable for i in expected} == expected
    for i in expected:  # the same as each account's own statement
        assert table[rr.address(i)].claimable == statement(rr.pool(i), reader, rr.run_id, rr.address(i),
                                                           sources).total("claimable")
    assert found.total("claimable") == sum(expected.values()) <= found.held
    assert found.held == found.funded - found.claimed == 10 * rr.params.amount_per_round
    assert found.balance == found.contract_held == found.held and found.rounds_without_factors == []
    # real claims: member 1 claims round 0's contribution and attestation, member 3 round 1's contribution
    rr.claim(1, 0, 0)
    rr.claim_attestation(1, 0)
    rr.claim(3, 1, 1)
    after = unclaimed(rr.pool(0), reader, rr.run_id, sources)
    assert after.problems == []
    table = _by_account(after)
    assert table[rr.address(1)].claimable == share[1] + att and table[rr.address(1)].claimed == share[1] + att
    assert table[rr.address(3)].claimable == share[3] and table[rr.address(3)].claimed == share[3]
    assert after.claimed == share[1] + att + share[3] and after.held == found.held - after.claimed
    # rounds 0 and 1 opened (the claims opened them): their unpaid budgets hold every claimable credit
    assert after.open_unpaid == 2 * rr.params.amount_per_round - after.claimed
    assert after.total("claimable") <= after.open_unpaid
    # without the kept factors, contributions are known only once claimed: the rounds are named
    bare = unclaimed(rr.pool(0), reader, rr.run_id)
    assert bare.rounds_without_factors == [0, 1] and bare.problems == []
    assert _by_account(bare)[rr.address(2)].claimable == 2 * att  # its attestations alone


def test_an_unfunded_round_is_listed_apart_and_fails_no_check(chain_w3):
    rr, sources = _two_rounds(chain_w3, funding_rounds=1)
    found = unclaimed(rr.pool(0), rr.run.reader, rr.run_id, sources)
    assert found.problems == []
    member1 = _by_account(found)[rr.address(1)]
    one_round = rr.expected_share(0, 0, 1) + rr.expected_attester_share(0)
    assert (member1.claimable, member1.unfunded) == (one_round, one_round)  # round 1 waits for a fund
    # the pool holds one round's amount, reserved for round 0's opening: round 1's credits are not counted
    assert found.total("unfunded") == found.total("claimable") <= found.held == rr.params.amount_per_round


def test_a_token_pools_unclaimed_credits_are_in_its_units_and_a_second_runs_pool_counts(chain_w3):
    """A pool in a fee-on-transfer token (10%): the books in the token's units, what arrived; a second run's
    pool in the same contract and token adds to what the contract must hold."""
    rr, token = token_run(deploy(chain_w3), FEE_ON_TRANSFER, fee_bps=1_000)
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    rr.claim(1, 0, 0)
    sources = {0: (rr.rounds[0].leaves, rr.rounds[0].factors)}
    found = unclaimed(rr.pool(0), rr.run.reader, rr.run_id, sources)
    assert found.problems == [] and found.token == token.address
    assert found.balance == token.balance_of(rr.pool_address) == found.contract_held == found.held
    assert found.held == 9 * 10 * rr.params.amount_per_round // 10 - rr.expected_share(0, 0, 1)
    assert _by_account(found)[rr.address(2)].claimable == rr.expected_share(0, 1, 2) \
        + rr.expected_attester_share(0)
    # a second run's pool in the same contract and token: the contract holds both
    other = rr.deployment.member_run((1, 2, 3), quorum=2, commitments=3, **SHORT_WINDOWS,
                                     values={"max_contributions": MAX_CONTRIBUTIONS, "max_rank": 1})
    rr.pool(1).approve(token.address, 10 * rr.params.amount_per_round)
    rr.pool(1).create_pool(other.run_id, rr.params, 10 * rr.params.amount_per_round)
    again = unclaimed(rr.pool(0), rr.run.reader, rr.run_id, sources)
    assert again.problems == [] and again.held == found.held
    assert again.contract_held == again.balance == found.held + 9 * rr.params.amount_per_round


class _Lying:
    """A pool client whose views say what ``lies`` gives (a buggy pool's books)."""

    def __init__(self, pool, **lies):
        self._pool, self._lies = pool, lies

    def __getattr__(self, name):
        if name in self._lies:
            return self._lies[name]
        return getattr(self._pool, name)


def test_each_check_fails_on_books_that_do_not_hold(chain_w3):
    rr, sources = _two_rounds(chain_w3)
    rr.claim(1, 0, 0)  # round 0 and 1 not both opened: round 0 opened by this claim
    pool, reader = rr.pool(0), rr.run.reader
    view = pool.pool_of(rr.run_id)
    short = _Lying(pool, balance=lambda token: view["funded"] - view["claimed"] - 1)
    assert any("balance" in p and "below" in p for p in unclaimed(short, reader, rr.run_id, sources).problems)
    amount = params().amount_per_round
    spent = _Lying(pool, round_of=lambda run_id, r: {**pool.round_of(run_id, r), "paid": amount})
    problems = unclaimed(spent, reader, rr.run_id, sources).problems
    assert any("round 0: its claimable credits" in p for p in problems), problems
    assert any("free + the opened rounds' unpaid" in p for p in problems), problems
    drained = _Lying(pool, pool_of=lambda run_id: {**pool.pool_of(run_id), "claimed": view["funded"]})
    problems = unclaimed(drained, reader, rr.run_id, sources).problems
    assert any("exceed what the run's pool holds" in p for p in problems), problems


@pytest.fixture
def anvil_member(request, tmp_path):
    """Rounds 0 and 1 on a fresh anvil (:func:`_two_rounds`), member 1's node.toml and node directory
    holding both rounds' sources."""
    w3 = fresh_anvil_w3(request, timeout=10.0)
    rr, _sources = _two_rounds(w3)
    for r, entry in enumerate(rr.rounds):
        for stage, (leaf, factors) in enumerate(zip(entry.leaves, entry.factors, strict=True)):
            write_stage(tmp_path / REWARD_SOURCES_DIR, r, stage, leaf, factors)
        write_leaves(tmp_path / REWARD_SOURCES_DIR, r, entry.leaves)
    config = tmp_path / "node.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n[ledger]\nbackend = "rpc"\n'
                      f'rpc_url = "{w3.provider.endpoint_uri}"\ndev_account = 1\n'
                      f'registry_address = "{rr.deployment.registry}"\n'
                      f'ledger_address = "{rr.deployment.ledger}"\n'
                      f"run_id = {rr.run_id}\nchain_id = {w3.eth.chain_id}\n")
    return rr, str(config), tmp_path


def test_rewards_all_and_the_audit_list_every_account_and_fail_a_short_balance(anvil_member, capsys):
    rr, config, directory = anvil_member
    rewards = ["rewards", "--config", config, "--pool", rr.pool_address, "--all"]
    assert main([*rewards, "--claim"]) == 2 and "read-only" in capsys.readouterr().err
    assert main(["rewards", "--config", config, "--pool", rr.pool_address, "--claim", "--yes"]) == 0
    capsys.readouterr()  # member 1 claimed its 4 credits with the real command
    assert main([*rewards, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    accounts = {a["account"]: a for a in shown["accounts"]}
    assert accounts[rr.address(1)]["claimable"] == 0 and accounts[rr.address(1)]["claimed"] > 0
    assert accounts[rr.address(2)]["claimable"] == 2 * (rr.expected_share(0, 1, 2)
                                                        + rr.expected_attester_share(0))
    assert shown["problems"] == [] and shown["claimable_amount"] <= shown["held_amount"]
    assert shown["held_amount"] == shown["balance_amount"] and shown["unit"] == "wei"
    assert main(rewards) == 0
    printed = capsys.readouterr().out
    assert rr.address(2) in printed and rr.address(3) in printed and "MISMATCH" not in printed
    items = unclaimed_checks(rr.run.reader, rr.run_id, rr.pool_address, [directory])
    assert items[0].name == POOL_UNCLAIMED and items[0].status == OK, items[0]
    assert {c.name for c in items[1:]} == {POOL_ACCOUNT + rr.address(2), POOL_ACCOUNT + rr.address(3)}
    audit = ["audit", "--rpc", rr.w3.provider.endpoint_uri, "--run", str(rr.run_id), "--registry",
             rr.deployment.registry, "--ledger", rr.deployment.ledger, "--no-replay",
             "--pool", rr.pool_address, "--archive", str(directory)]
    main(audit)
    assert "reward pool unclaimed credits: ok" in capsys.readouterr().out
    # the pool contract's real balance lowered below what its pool holds (anvil_setBalance): a mismatch
    held = shown["held_amount"]
    rr.w3.provider.make_request("anvil_setBalance", [rr.pool_address, hex(held - 1)])
    assert main(rewards) == 8
    assert "MISMATCH: the pool contract's balance" in capsys.readouterr().out
    assert main(audit) == 8
    assert "reward pool unclaimed credits: FAIL (the pool contract's balance" in capsys.readouterr().out
    items = unclaimed_checks(rr.run.reader, rr.run_id, rr.pool_address, [directory])
    assert [c.status for c in items] == [FAIL]
