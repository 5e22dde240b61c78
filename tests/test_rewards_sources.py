"""What a node keeps so its contributions can be paid (issue 77; node/store/rewardsources.py): its stage
leaves and factors, read back from node directories and kept only where the chain's record vouches for them;
the statement, ``dlx-node rewards --claim`` and the demo's summary then show and claim contribution credits.
py-evm and anvil; the command on anvil."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from ledger.rewardstatement import claim_call, statement
from node.cli import main
from node.commands.demorewards import rewards_lines, rewards_summary
from node.store.rewardsources import REWARD_SOURCES_DIR, read_sources, write_leaves, write_stage
from tests.ledger_fixtures import deploy, fresh_anvil_w3
from tests.reward_fixtures import params, reward_run, token_run


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def _keep(rr, entry, directory, stages, leaves: bool = False) -> None:
    """Write what a node holding ``stages`` of ``entry``'s round keeps into ``directory``."""
    for stage in stages:
        write_stage(directory / REWARD_SOURCES_DIR, entry.record.round, stage, entry.leaves[stage],
                    entry.factors[stage])
    if leaves:
        write_leaves(directory / REWARD_SOURCES_DIR, entry.record.round, entry.leaves)


def test_a_run_without_a_pool_is_audited_with_archives_without_a_crash(chain_w3, tmp_path):
    """`create-run` without a [pool] makes a run the deployment's RewardPool holds nothing of, and the audit
    takes deployment.json's pool by default: with archives its unclaimed-credits item divided by the absent
    pool's zero slots (ZeroDivisionError after every rerun, seen by hand). Now one OK item naming the absence
    when the pool came from the deployment, the books' FAIL and nothing else when --pool named it."""
    from node.tools.audit_pool import POOL_BOOKS, pool_checks
    from node.tools.report import FAIL, OK

    rr = reward_run(deploy(chain_w3), pool=params())
    other = reward_run(rr.deployment, pool=None)
    entry = other.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    _keep(other, entry, tmp_path / "a", [0, 1])
    other.mine_to_final(0)
    reader = other.run.reader
    implicit = pool_checks(reader, other.run_id, rr.pool_address, [tmp_path / "a"], named=False)
    assert [(c.name, c.status) for c in implicit] == [(POOL_BOOKS, OK)]
    assert f"run {other.run_id} has no reward pool" in implicit[0].reason
    named = pool_checks(reader, other.run_id, rr.pool_address, [tmp_path / "a"], named=True)
    assert [(c.name, c.status) for c in named] == [(POOL_BOOKS, FAIL)]
    assert "0 PoolCreated events" in named[0].reason


def test_kept_leaves_and_factors_prove_and_pay_contributions(chain_w3, tmp_path):
    rr = reward_run(deploy(chain_w3), pool=params())
    entry = rr.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    node_a, node_b = tmp_path / "a", tmp_path / "b"
    _keep(rr, entry, node_a, [0])  # one node a stage: together they hold every leaf
    _keep(rr, entry, node_b, [1])
    reader = rr.run.reader
    sources = read_sources([node_a, node_b], reader, rr.run_id)
    assert sources == {0: (entry.leaves, entry.factors)}
    # a node holding one stage of two, with the record's leaves kept by its committer: its own stage proven
    _keep(rr, entry, tmp_path / "c", [0], leaves=True)
    alone = read_sources([tmp_path / "c"], reader, rr.run_id)
    assert alone == {0: (entry.leaves, [entry.factors[0], None])}
    rr.mine_to_final(0)
    mine = statement(rr.pool(1), reader, rr.run_id, rr.address(1), alone)
    credit = next(c for c in mine.credits if c.stage == 0)
    assert (credit.state, credit.amount) == ("claimable", rr.expected_share(0, 0, 1))
    name, args = claim_call(reader, rr.run_id, credit, alone)
    pool = rr.pool(1)
    pool.sender.transact(pool.contract, name, args, name)
    assert pool.claimed_of(rr.run_id, 0, 0, rr.address(1))
    # member 2 is listed in stage 1, whose factors node c did not keep: its credit is not known from there
    assert [c.stage for c in statement(rr.pool(2), reader, rr.run_id, rr.address(2), alone).credits] == [None]


def test_kept_files_the_chain_does_not_vouch_for_are_skipped(chain_w3, tmp_path):
    rr = reward_run(deploy(chain_w3), pool=params())
    entry = rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    other = rr.commit([[(2, None)], [(1, None)]], signers=(1, 2), label="other")
    reader = rr.run.reader
    node = tmp_path / "n"
    # round 1's leaves and factors filed as round 0's, a forged factors file, garbage, a round not committed
    write_leaves(node / REWARD_SOURCES_DIR, 0, other.leaves)
    write_stage(node / REWARD_SOURCES_DIR, 0, 0, entry.leaves[0], other.factors[0])
    (node / REWARD_SOURCES_DIR / "round-00000000-stage-1.json").write_text("{not json")
    (node / REWARD_SOURCES_DIR / "round-00000005-leaves.json").write_text(json.dumps({"leaves": ["00"]}))
    (node / REWARD_SOURCES_DIR / "round-00000001-leaves.json").write_text(json.dumps({"leaves": "zz"}))
    assert read_sources([node], reader, rr.run_id) == {}
    write_leaves(node / REWARD_SOURCES_DIR, 1, other.leaves)  # round 1's own leaves, no factors kept
    assert read_sources([node], reader, rr.run_id) == {1: (other.leaves, [None, None])}


@pytest.mark.parametrize("in_token", [False, True], ids=["eth", "token"])
def test_the_demo_summary_shows_each_members_earnings_from_the_chain(chain_w3, tmp_path, in_token):
    """The summary's figures from the chain, named in the pool's unit as ``dlx-node rewards --json`` names
    them (``*_amount``, ``unit``), and its lines in ETH or the token's symbol (a token pool is not wei)."""
    deployment = deploy(chain_w3)
    rr, token = token_run(deployment) if in_token else (reward_run(deployment, pool=params()), None)
    entry = rr.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    slots = [SimpleNamespace(name=f"r{i}", data_dir=tmp_path / f"r{i}", account=i) for i in (1, 2, 3)]
    _keep(rr, entry, slots[0].data_dir, [0])
    _keep(rr, entry, slots[1].data_dir, [1])
    run = SimpleNamespace(reward_pool=rr.pool_address, client=lambda: rr.run.reader, run_id=rr.run_id,
                          nodes=slots, chain_id=chain_w3.eth.chain_id)
    pending = rewards_summary(run)
    assert (pending["unit"], pending["token"], pending["symbol"]) == (
        ("token units", token.address, "QRK") if in_token else ("wei", None, "ETH"))
    assert not [key for key in [*pending, *pending["members"][0]] if key.endswith("_wei")]
    by_node = {m["node"]: m for m in pending["members"]}
    one = rr.expected_share(0, 0, 1) + rr.expected_attester_share(0)
    assert (by_node["r1"]["earned_amount"], by_node["r1"]["final_amount"]) == (one, 0)
    assert (by_node["r1"]["attestations"], by_node["r1"]["contributions"]) == (1, 1)
    assert (by_node["r3"]["earned_amount"], by_node["r3"]["attestations"]) == (rr.expected_share(0, 0, 3), 0)
    assert pending["rounds_with_factors"] == [0]
    assert pending["funded_amount"] == 10 * params().amount_per_round
    assert "not final yet" in "\n".join(rewards_lines(pending))
    rr.mine_to_final(0)
    final = {m["node"]: m for m in rewards_summary(run)["members"]}
    assert final["r1"]["final_amount"] == final["r1"]["claimable_amount"] == one
    lines = rewards_lines(rewards_summary(run))
    whole, rest = divmod(one, 10**18)
    assert any(line.split()[:1] == ["r1"] and f"{whole}.{rest:018d}"[:-12] in line for line in lines), lines
    symbol = "QRK" if in_token else "ETH"
    assert f"{params().amount_per_round / 10**18:.6f} {symbol} a final round" in lines[0], lines[0]
    named = f"(token {token.address})" if in_token else "(token "
    assert (named in lines[0]) == in_token and "wei" not in "\n".join(lines)
    assert rewards_summary(SimpleNamespace(reward_pool="")) is None  # a run without a pool: no lines


def test_rewards_command_claims_a_contribution_from_the_node_directory(request, tmp_path, capsys):
    w3 = fresh_anvil_w3(request, timeout=10.0)
    rr = reward_run(deploy(w3), pool=params())
    entry = rr.commit([[(1, None)], [(2, None)]], signers=(1, 2))
    rr.mine_to_final(0)
    _keep(rr, entry, tmp_path, [0], leaves=True)  # member 1's node: stage 0, and the record's leaves
    config = tmp_path / "node.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n[ledger]\nbackend = "rpc"\n'
                      f'rpc_url = "{w3.provider.endpoint_uri}"\ndev_account = 1\n'
                      f'registry_address = "{rr.deployment.registry}"\n'
                      f'ledger_address = "{rr.deployment.ledger}"\n'
                      f"run_id = {rr.run_id}\nchain_id = {w3.eth.chain_id}\n")
    assert main(["rewards", "--config", str(config), "--pool", rr.pool_address, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    share = rr.expected_share(0, 0, 1)
    assert {(c["stage"], c["state"]) for c in shown["credits"]} == {(None, "claimable"), (0, "claimable")}
    assert shown["claimable_amount"] == share + rr.expected_attester_share(0)
    assert main(["rewards", "--config", str(config), "--pool", rr.pool_address, "--claim", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "claim round 0's contribution" in out and "claim round 0's attestation" in out
    assert rr.pool(0).pool_of(rr.run_id)["claimed"] == share + rr.expected_attester_share(0)


def test_the_audit_checks_contribution_claims_against_the_kept_factors(chain_w3, tmp_path):
    """audit --pool with --archive node directories: each contribution claim of a round whose factors they
    kept is checked (listed, its share by the rule); a claim the factors do not list, or of another amount,
    is a mismatch (forged events: the contract itself pays none)."""
    import dataclasses

    from ledger.rewardbooks import check_events
    from node.tools.audit_pool import pool_check
    from node.tools.report import OK

    rr = reward_run(deploy(chain_w3), pool=params())
    entry = rr.commit([[(1, None), (3, None)], [(2, None)]], signers=(1, 2))
    _keep(rr, entry, tmp_path / "a", [0, 1])
    rr.mine_to_final(0)
    rr.claim(1, 0, 0)
    rr.claim(2, 0, 1)
    reader = rr.run.reader
    item = pool_check(reader, rr.run_id, rr.pool_address, [tmp_path / "a"])
    assert item.status == OK and "factors of 1 rounds" in item.reason, item.reason
    pool = rr.pool(0)
    events, views = pool.pool_events(rr.run_id), pool.pool_of(rr.run_id)
    listed = {(0, 0): [(rr.address(1), None), (rr.address(3), None)], (0, 1): [(rr.address(2), None)]}
    assert check_events(events, views, pool.balance(), {}, {}, listed) == []
    claim = next(e for e in events if e.name == "RewardClaimed" and e.args["stage"] == 0)
    wrong = dataclasses.replace(claim, args={**claim.args, "amount": claim.args["amount"] + 1})
    unlisted = dataclasses.replace(claim, args={**claim.args, "account": rr.address(4)})
    for forged, says in ((wrong, "the rule gives"), (unlisted, "its factors do not list")):
        others = [e for e in events if e is not claim]
        problems = check_events([*others, forged], {**views, "claimed": views["claimed"]}, pool.balance(),
                                {}, {}, listed)
        assert any(says in p for p in problems), problems
    # every credit of round 0 (both stages' factors kept, its attesters from the chain) recomputed: it fits
    # the round's budget; a RoundOpened reserving less than the rule's credits is a mismatch
    attesters = {0: entry.attesters}
    assert check_events(events, views, pool.balance(), attesters, {}, listed) == []
    opened = next(e for e in events if e.name == "RoundOpened")
    short = dataclasses.replace(opened, args={**opened.args, "budget": 2 * rr.expected_share(0, 0, 1)})
    problems = check_events([short if e is opened else e for e in events], views, pool.balance(), attesters,
                            {}, listed)
    assert any("its credits by the rule sum to" in p for p in problems), problems
