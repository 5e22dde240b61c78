"""``dlx-node challenge`` (issue 78; node/commands/challenge.py), the real command on a real anvil: an
outsider's node directory, holding the stage leaves and factors of rounds 0 and 1 (rewardsources), shows
a contribution of round 1, opens a case against it (commit, then open, the run's bond), and once nobody
defended it by the deadline overturns the round; a contribution the factors do not list is refused by name
before anything is sent."""

from __future__ import annotations

import logging

import pytest

from ledger.account import dev_account
from ledger.stepcase import ledger_step_prover
from ledger.stepproof import StepProverClient
from node.cli import main
from node.commands.challenge import challenge_command
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves, write_stage
from tests.ledger_fixtures import deploy, fresh_anvil_w3, mine, mining_meanwhile
from tests.reward_fixtures import reward_run
from tests.step_binding_fixtures import TOY_STEPS, toy_program

OUTSIDER = 8


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def test_the_challenge_command_opens_a_case_and_overturns_an_undefended_round(request, tmp_path, capsys):
    w3 = fresh_anvil_w3(request, timeout=10.0)
    deployment = deploy(w3)
    rr = reward_run(deployment, pool=None, accusation_blocks=8, dispute_blocks=200, inner_steps=TOY_STEPS)
    prover = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    prover.set_program(rr.address(1), rr.run_id, toy_program())  # the creator, before round 0
    rounds = [rr.commit([[(1, None)], [(2, None)]])]
    mine(w3, 200)  # round 0's window closes first: a proof of round 1 does not wait for its parent
    rounds.append(rr.commit([[(1, None), (3, None)], [(2, None)]]))
    for entry in rounds:  # what the outsider's node kept of both rounds
        write_stage(tmp_path / REWARD_SOURCES_DIR, entry.record.round, 0, entry.leaves[0], entry.factors[0])
        write_leaves(tmp_path / REWARD_SOURCES_DIR, entry.record.round, entry.leaves)
    config = tmp_path / "node.toml"
    config.write_text(f'data_dir = "{tmp_path}"\n[ledger]\nbackend = "rpc"\n'
                      f'rpc_url = "{w3.provider.endpoint_uri}"\ndev_account = {OUTSIDER}\n'
                      f'registry_address = "{deployment.registry}"\n'
                      f'ledger_address = "{deployment.ledger}"\n'
                      f"run_id = {rr.run_id}\nchain_id = {w3.eth.chain_id}\n")
    base = ["challenge", "--config", str(config), "--round", "1", "--stage", "0", "--contribution"]
    assert main([*base, "1"]) == 0
    assert "no case open" in capsys.readouterr().out
    assert main([*base, "5", "--open", "--yes"]) == 2  # the stage lists two contributions
    assert "--contribution 5" in capsys.readouterr().err
    assert challenge_command(1, 0, 1, str(config)).split()[1:] == [*base, "1", "--open"]
    with mining_meanwhile(w3):  # the opening waits for the block after its commitment's
        assert main([*base, "1", "--open", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "opened a case" in out and "claims 0, refuted 0" in out
    key = bytes(prover.contract.functions.contributionOf(rr.run_id, 1, 0, _payload_root(rounds[1])).call())
    case = dict(zip(("opener", "deadline"), prover.contract.functions.caseOf(key).call()[:2]))
    assert case["opener"] == dev_account(OUTSIDER, w3.eth.chain_id).address
    # nobody defends it: from the deadline on the command overturns the round and the attesters are slashed
    mine(w3, max(0, case["deadline"] - w3.eth.block_number))
    assert main([*base, "1", "--overturn", "--yes"]) == 0
    assert "overturned round 1" in capsys.readouterr().out
    assert rr.run.reader.invalid_from(rr.run_id) == 1


def _payload_root(entry) -> bytes:
    from eth_abi import decode

    return decode(["uint32", "uint32", "bool", "bytes32[]", "bytes32[]"], entry.factors[0])[4][1]
