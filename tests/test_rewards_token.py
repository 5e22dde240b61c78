"""A reward pool in an ERC-20 (issue 77; contracts/src/RewardPool.sol, docs/REWARDS.md "A pool in an
ERC-20") on py-evm and a real anvil: funded by its creator and topped up by anyone in its token, claims paid
in it, and the tokens a pool must survive (contracts/src/test/QuirkyToken.sol): one returning nothing, one
returning false, a fee-on-transfer one, one taking an extra fee from the sender, and a re-entrant one."""

from __future__ import annotations

import pytest

from ledger import errors
from ledger.reverts import revert_from_data
from ledger.rewardbooks import check_pool
from tests.ledger_fixtures import deploy, mine
from tests.reward_fixtures import (
    AMOUNT,
    FEE_ON_TRANSFER,
    RETURNS_FALSE,
    RETURNS_NOTHING,
    SENDER_FEE,
    params,
    reward_run,
    token_run,
)
from tests.test_rewards import paid_to


def token_books(rr, token) -> dict:
    """The pool's invariants in its token: what the pool contract holds of it is funded - claimed (one run
    per pool contract here); free + the open rounds' unpaid budgets is the same; no round paid past its
    budget. The pool's views."""
    pool = rr.pool(0).pool_of(rr.run_id)
    assert token.balance_of(rr.pool_address) == pool["funded"] - pool["claimed"]
    assert rr.pool(0).balance(token.address) == pool["funded"] - pool["claimed"]
    assert rr.w3.eth.get_balance(rr.pool_address) == 0  # no ETH in a token pool
    held = pool["free"]
    for r in range(pool["firstRound"], pool["nextRound"]):
        budget = rr.pool(0).round_of(rr.run_id, r)
        assert budget["paid"] <= budget["budget"]
        held += 0 if budget["swept"] else budget["budget"] - budget["paid"]
    assert held == pool["funded"] - pool["claimed"]
    assert check_pool(rr.pool(0), rr.run.reader, rr.run_id) == []
    return pool


def gas_paid(receipt) -> int:
    return receipt["gasUsed"] * receipt["effectiveGasPrice"]


def test_a_token_pool_pays_in_its_token_and_anyone_tops_it_up(chain_w3):
    """Who pays: the creator's and a funder's tokens, nothing else; who is paid: each listed contribution and
    attester, in the token, once; an outsider, a front-runner and a coalition that drops honest work get
    nothing more."""
    rr, token = token_run(deploy(chain_w3))
    assert token.balance_of(rr.address(1)) == 90 * AMOUNT and token.balance_of(rr.pool_address) == 10 * AMOUNT
    assert rr.pool(0).pool_of(rr.run_id)["params"].token == token.address
    rr.commit([[(1, None), (2, None), (3, None)], [(4, None)]], signers=(1, 2, 3))
    rr.commit([[(1, None), (2, None)], [(4, None)]], signers=(1, 2), label="r1")  # 3's work dropped
    rr.mine_to_final(1)
    with pytest.raises(errors.RewardNotListed):
        rr.claim(9, 0, 0, position=1)  # an outsider naming member 2's place
    with pytest.raises(errors.RewardNotListed):
        rr.claim(2, 0, 0, as_index=9)  # a front-runner sending member 2's claim
    for round_, index, stage in ((0, 1, 0), (0, 2, 0), (0, 3, 0), (0, 4, 1), (1, 1, 0), (1, 2, 0)):
        before, eth = token.balance_of(rr.address(index)), chain_w3.eth.get_balance(rr.address(index))
        receipt = rr.claim(index, round_, stage)
        expected = rr.expected_share(round_, stage, index)
        assert token.balance_of(rr.address(index)) == before + expected
        assert chain_w3.eth.get_balance(rr.address(index)) == eth - gas_paid(receipt)  # gas only
        assert paid_to(chain_w3, receipt, rr.address(index)) == expected
    # the coalition that dropped member 3 in round 1 earns per contribution what it earned with 3 listed
    assert rr.expected_share(1, 0, 1) == rr.expected_share(0, 0, 1)
    for attester in rr.rounds[0].attesters:
        index = next(i for i in range(1, 6) if rr.address(i) == attester)
        before = token.balance_of(attester)
        rr.claim_attestation(index, 0)
        assert token.balance_of(attester) == before + rr.expected_attester_share(0)
    with pytest.raises(errors.RewardAlreadyClaimed):
        rr.claim(1, 0, 0)
    funder = rr.pool(8)
    funder.approve(token.address, AMOUNT)
    with pytest.raises(errors.RewardBadFunding):  # ETH sent to a token pool
        funder.sender.transact(funder.contract, "fund", (rr.run_id, AMOUNT), "fund", AMOUNT)
    before = token.balance_of(rr.address(8))
    funder.fund(rr.run_id, AMOUNT)
    assert token.balance_of(rr.address(8)) == before - AMOUNT
    assert funder.pool_events(rr.run_id)[-1].args["amount"] == AMOUNT
    assert token_books(rr, token)["funded"] == 11 * AMOUNT


def test_an_eth_pool_stays_the_default_and_takes_exactly_the_wei_named(chain_w3):
    rr = reward_run(deploy(chain_w3), pool=None)
    pool = rr.pool(1)
    assert params().token == "0x0000000000000000000000000000000000000000"
    with pytest.raises(errors.RewardBadFunding):  # msg.value is not the funding named
        pool.sender.transact(pool.contract, "createPool", (rr.run_id, params().fields(), AMOUNT), "create",
                             AMOUNT - 1)
    pool.create_pool(rr.run_id, params(), AMOUNT)
    with pytest.raises(errors.RewardBadFunding):
        pool.sender.transact(pool.contract, "fund", (rr.run_id, AMOUNT), "fund", AMOUNT + 1)
    rr.pool(8).fund(rr.run_id, AMOUNT)
    assert rr.pool(0).pool_of(rr.run_id)["funded"] == 2 * AMOUNT == rr.pool(0).balance()
    with pytest.raises(errors.RewardBadParams, match="no code"):  # a token that is no contract
        other = reward_run(rr.deployment, pool=None)
        other.pool(1).create_pool(other.run_id, params(token=rr.address(7)), AMOUNT)


def test_a_token_pool_at_the_last_block_of_its_windows(chain_w3):
    """The last block before finality pays nothing and the first after pays, in the token; the claim
    window's last block refuses the sweep and its end takes it, returning the unpaid tokens to the free
    funds."""
    rr, token = token_run(deploy(chain_w3))
    rr.commit([[(1, None)], []])
    final_at = rr.final_at(0)
    mine(chain_w3, final_at - 2 - chain_w3.eth.block_number)
    before = token.balance_of(rr.address(1))
    assert rr.claim_mined(1, 0, 0) == 0  # mined in final_at - 1
    assert token.balance_of(rr.address(1)) == before
    assert rr.claim_mined(1, 0, 0) == 1  # mined in final_at
    assert token.balance_of(rr.address(1)) == before + rr.expected_share(0, 0, 1)
    end = rr.pool(0).round_of(rr.run_id, 0)["openedAt"] + rr.params.claim_blocks
    mine(chain_w3, max(0, end - 2 - chain_w3.eth.block_number))
    free = rr.pool(0).pool_of(rr.run_id)["free"]
    assert rr.sweep_mined(9, 0) == 0  # mined in end - 1
    assert rr.sweep_mined(9, 0) == 1  # mined in end
    assert rr.pool(0).pool_of(rr.run_id)["free"] == free + AMOUNT - rr.expected_share(0, 0, 1)
    with pytest.raises(errors.RewardClaimClosed):
        rr.claim_attestation(1, 0)
    token_books(rr, token)


def test_a_fee_on_transfer_token_is_credited_what_arrived_and_a_sender_fee_is_refused(chain_w3):
    deployment = deploy(chain_w3)
    rr, token = token_run(deployment, FEE_ON_TRANSFER, fee_bps=1_000, funding=20 * AMOUNT)
    assert rr.pool(0).pool_of(rr.run_id)["funded"] == 18 * AMOUNT  # the token kept a tenth
    assert rr.pool(0).pool_events(rr.run_id)[0].args["funding"] == 18 * AMOUNT
    rr.commit([[(1, None), (2, None)], []])
    rr.mine_to_final(0)
    before = token.balance_of(rr.address(1))
    receipt = rr.claim(1, 0, 0)
    share = rr.expected_share(0, 0, 1)
    assert paid_to(chain_w3, receipt, rr.address(1)) == share  # what left the pool
    assert token.balance_of(rr.address(1)) == before + share - share // 10  # what the token let arrive
    token_books(rr, token)
    # a funding whose arrival does not cover one round is refused, though the amount named does
    other = reward_run(deployment, pool=None)
    other.pool(1).approve(token.address, AMOUNT)
    with pytest.raises(errors.RewardBadParams, match="the funding received does not cover"):
        other.pool(1).create_pool(other.run_id, params(token=token.address), AMOUNT)
    # a token taking more from the pool than it pays: the claim is refused and nothing changes
    token.set_mode(SENDER_FEE, 1_000)
    pool = rr.pool(0).pool_of(rr.run_id)
    with pytest.raises(errors.RewardTokenFailed) as refused:
        rr.claim(2, 0, 0)
    assert "did not fall by the amount paid" in refused.value.values["reason"]
    assert not rr.pool(0).claimed_of(rr.run_id, 0, 0, rr.address(2))
    assert rr.pool(0).pool_of(rr.run_id) == pool
    token.set_mode(FEE_ON_TRANSFER, 0)
    rr.claim(2, 0, 0)
    token_books(rr, token)


def test_a_token_returning_false_or_nothing(chain_w3):
    """A token that returns nothing (as old USDT) works; one that returns false moves nothing and is
    refused (RewardTokenFailed) at createPool, fund and claim, leaving the books as they were."""
    deployment = deploy(chain_w3)
    rr, token = token_run(deployment, RETURNS_NOTHING)
    rr.commit([[(1, None), (2, None)], []])
    rr.mine_to_final(0)
    before = token.balance_of(rr.address(1))
    rr.claim(1, 0, 0)
    assert token.balance_of(rr.address(1)) == before + rr.expected_share(0, 0, 1)
    token.set_mode(RETURNS_FALSE)
    pool = rr.pool(0).pool_of(rr.run_id)
    with pytest.raises(errors.RewardTokenFailed):
        rr.claim(2, 0, 0)
    assert not rr.pool(0).claimed_of(rr.run_id, 0, 0, rr.address(2))
    rr.pool(8).approve(token.address, AMOUNT)
    with pytest.raises(errors.RewardTokenFailed) as refused:
        rr.pool(8).fund(rr.run_id, AMOUNT)
    assert "did not return true" in refused.value.values["reason"]
    assert rr.pool(0).pool_of(rr.run_id) == pool
    other = reward_run(deployment, pool=None)
    other.pool(1).approve(token.address, 10 * AMOUNT)
    with pytest.raises(errors.RewardTokenFailed):
        other.pool(1).create_pool(other.run_id, params(token=token.address), 10 * AMOUNT)
    token.set_mode(RETURNS_NOTHING)
    rr.claim(2, 0, 0)
    token_books(rr, token)


def test_a_reentrant_token_is_refused_inside_its_calls(chain_w3):
    """The token calls the pool back in the middle of a transferFrom (fund) and of a transfer (a claim):
    each inner call is refused (RewardReentered), the outer one credits or pays once."""
    rr, token = token_run(deploy(chain_w3))
    rr.commit([[(1, None)], []])
    rr.mine_to_final(0)
    pool = rr.pool(8)
    inner_fund = pool.contract.encode_abi("fund", args=[rr.run_id, AMOUNT])
    entry = rr.rounds[0]
    inner_claim = pool.contract.encode_abi("claimAttestation", args=[rr.run_id, 0, list(entry.attesters), 0])
    funded = rr.pool(0).pool_of(rr.run_id)["funded"]
    for outer, inner in (("fund", inner_fund), ("claim", inner_claim), ("claim again", inner_fund)):
        token.send(0, "arm", rr.pool_address, bytes.fromhex(inner[2:]))
        if outer == "fund":
            pool.approve(token.address, AMOUNT)
            pool.fund(rr.run_id, AMOUNT)
        elif outer == "claim":
            rr.claim(1, 0, 0)
        else:
            rr.claim_attestation(1, 0)
        armed, reentered, ok, returned = token.outcome()
        assert not armed and reentered and not ok, outer
        assert isinstance(revert_from_data(returned, "re-entered"), errors.RewardReentered), outer
    assert rr.pool(0).pool_of(rr.run_id)["funded"] == funded + AMOUNT  # credited once
    assert rr.pool(0).claimed_of(rr.run_id, 0, 0, rr.address(1))
    token_books(rr, token)


# ---------------------------------------------------------------------- create-run's [pool] with a token
def _token_plan(tmp_path, w3, table: str):
    from node.commands.runfile import read_run_file, run_params
    from node.commands.runpool import pool_plan
    from tests.test_chain_commands import RUN_FILE

    path = tmp_path / "run.toml"
    path.write_text(RUN_FILE + "\n[pool]\n" + table)
    run = read_run_file(str(path))
    return pool_plan(run, run_params(run), "run file", w3)


def test_create_runs_pool_table_takes_a_token_checked_before_anything_is_sent(chain_w3, tmp_path):
    from node.commands.runpool import PoolPlan, open_pool, pool_spends
    from node.errors import ConfigError

    rr, token = token_run(deploy(chain_w3))
    refusals = [
        ('token = "0x12"\nper_round_tokens = 1\n', "not an address"),
        (f'token = "{rr.address(7)}"\nper_round_tokens = 1\n', "no contract there"),
        (f'token = "{rr.pool_address}"\nper_round_tokens = 1\n', "does not answer decimals"),
        (f'token = "{token.address}"\nper_round_eth = 1\n', "a token pool takes per_round_tokens"),
        ("per_round_tokens = 1\n", "an ETH pool takes per_round_eth"),
        (f'token = "{token.address}"\nper_round_tokens = 0\n', "the amount per round is zero"),
        (f'token = "{token.address}"\nper_round_tokens = 1\nfunding_tokens = 0.5\n', "does not cover one"),
        (f'token = "{token.address}"\nper_round_tokens = 1e-19\n', "more decimals than the token's 18"),
        ('token = 7\nper_round_tokens = 1\n', "token=7: must be a string"),
    ]
    for table, says in refusals:
        with pytest.raises(ConfigError, match=says):
            _token_plan(tmp_path, chain_w3, table)
    plan = _token_plan(tmp_path, chain_w3, f'token = "{token.address}"\nper_round_tokens = 0.01\n')
    assert plan.params.token == token.address and plan.params.amount_per_round == 10**16
    assert plan.funding == 3 * 10**16  # RUN_FILE's 3 rounds
    # the creator's token balance is checked with the spend plan: approve and createPool, no ETH sent
    other = reward_run(rr.deployment, pool=None)
    block = chain_w3.eth.block_number
    poor = PoolPlan(params(token=token.address), 91 * AMOUNT)  # member 1 holds 90 (10 funded rr)
    with pytest.raises(ConfigError, match=rf"holds {90 * AMOUNT} units of token .*nothing was sent"):
        pool_spends(poor, other.pool(1), None, 10**9)
    assert chain_w3.eth.block_number == block  # nothing was sent
    good = PoolPlan(params(token=token.address), 10 * AMOUNT)
    spends = pool_spends(good, other.pool(1), None, 10**9)
    assert [s.value for s in spends] == [0, 0] and "allow the reward pool" in spends[0].what
    before = token.balance_of(other.address(1))
    open_pool(good, other.pool(1), other.run_id)
    assert other.pool(0).pool_of(other.run_id)["funded"] == 10 * AMOUNT
    assert token.balance_of(other.address(1)) == before - 10 * AMOUNT
    assert pool_spends(good, other.pool(1), other.run_id, 10**9) == []  # opened: a rerun sends nothing


def test_the_rewards_command_claims_and_funds_a_token_pool(request, tmp_path, capsys):
    """dlx-node rewards on a token pool (anvil): its credits in the token, --claim paying in it, --fund in
    whole tokens (approve, then fund) and refused before anything is sent when the account holds fewer."""
    import json

    from node.cli import main
    from tests.ledger_fixtures import fresh_anvil_w3

    w3 = fresh_anvil_w3(request, timeout=10.0)
    rr, token = token_run(deploy(w3))
    rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    config = tmp_path / "node.toml"
    config.write_text(f'[ledger]\nbackend = "rpc"\nrpc_url = "{w3.provider.endpoint_uri}"\ndev_account = 1\n'
                      f'registry_address = "{rr.deployment.registry}"\n'
                      f'ledger_address = "{rr.deployment.ledger}"\n'
                      f"run_id = {rr.run_id}\nchain_id = {w3.eth.chain_id}\n")
    command = ["rewards", "--config", str(config), "--pool", rr.pool_address]
    assert main([*command, "--json"]) == 0
    share = rr.expected_attester_share(0)
    shown = json.loads(capsys.readouterr().out)
    assert shown["claimable_amount"] == share  # the token's units, named so
    assert (shown["unit"], shown["token"]) == ("token units", token.address) and "claimable_wei" not in shown
    assert (shown["decimals"], shown["symbol"]) == (18, "QRK")  # how the explorer and the demo show them too
    before = token.balance_of(rr.address(1))
    assert main([*command, "--claim", "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"claimed round 0: {share // 10**9 / 10**9:.9f} QRK to" in out, out  # (its gas is in ETH)
    assert token.balance_of(rr.address(1)) == before + share
    funded = rr.pool(0).pool_of(rr.run_id)["funded"]
    assert main([*command, "--fund", "0.01", "--yes"]) == 0
    assert "10000000000000000 units of token" in capsys.readouterr().out
    assert rr.pool(0).pool_of(rr.run_id)["funded"] == funded + 10**16
    assert token.balance_of(rr.address(1)) == before + share - 10**16
    block = w3.eth.block_number
    assert main([*command, "--fund", "1", "--yes"]) == 2  # holds 0.08 tokens
    assert "not the 1000000000000000000 asked (nothing was sent)" in capsys.readouterr().err
    assert w3.eth.block_number == block
    token_books(rr, token)
