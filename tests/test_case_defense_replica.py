"""A node that holds a whole replica of two stages defends its stage-1 contribution with its replica's key
(issue 78; docs/FRAUD_PROOF.md "The replica's key", "The node defends its contributions"), on py-evm and on
anvil, with the node's own parts (tests/test_case_defense.py's).

The run has two stages, a program that reads each step's batch and fixed data terms
(tests/step_data_fixtures.py). Member ``j + 1`` signed both stages' contribution ``j`` in round 1 (one node,
the whole replica). A case on the node's stage-1 contribution: the node's claim names its replica's key (its
own account, which the round's stage-0 factors list), signs ``DataKey`` and, as the replica's stage-0 member,
``ReplicaPartner`` naming itself, carries them in ``RunBinding.replica`` with the stage-0 leaf and factors it
kept, and is taken (StepProverBinding ``_dataKey``); its batches are those windows, so a data dispute of its
last token and a liar in the step game both lose their bonds to it.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest

from ledger.stepbinding import bind_run
from ledger.stepcase import CaseClient, ledger_step_prover, run_stake
from ledger.stepdata import DataClient, batch_root
from ledger.stepproof import PHASES, StepProverClient
from node.commitments.registry import scheme_named
from node.live.fraud.chunkstate import ChunkedStates
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves
from tests.fraud_fixtures import bound, commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, toy_origins, toy_round
from tests.step_data_fixtures import PROGRAM, ROWS, WINDOW, batches_of, program_fields, terms
from tests.test_case_defense import BACKENDS, OPENER, _claim_of, _defender, _liar, _play
from tests.test_case_defense_data import _challenge_data, claimed, data_program, node_data
from tests.test_step_case import SALT, _address
from tests.test_step_data_replica import _stage1_state
from tests.test_step_proof import _backend
from training.data_binding import batch_leaves

NODE, OWN = 3, 2  # member 3 signed both stages' contribution 2


def _setup(w3, tmp_path):
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    fix = fix_program(client, program_fields(), toy_origins())
    round_ = dataclasses.replace(toy_round(), other=_stage1_state())

    def before(run):
        fix(run)
        DataClient(client).set_data(run.deployment.client(run.members[0]).address, run.run_id, terms())
        round_.other = bound(round_.other, [run.deployment.client(i) for i in (1, 2, 3)], run.run_id, 1,
                             stage=1)

    committed = commit(deployment, round_, round_.honest, stake=STAKE, accusation_blocks=200,
                       dispute_blocks=1000, inner_steps=TOY_STEPS, before=before)
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    states = ChunkedStates(cfg=SimpleNamespace(commitment_scheme=scheme_named("normed")), host=None,
                           layout=None, config_hash=b"", sources_dir=tmp_path / REWARD_SOURCES_DIR,
                           keeps_starts=True)
    for outer_round, state in enumerate(committed.states):  # the node holds both stages
        states.replace(outer_round, 0, state)
        states.replace(outer_round, 1, round_.other)
        write_leaves(tmp_path / REWARD_SOURCES_DIR, outer_round,
                     [leaf.encode() for leaf in committed.stages[outer_round]])
    return client, CaseClient(client), committed, states, round_.other


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_whole_replica_node_defends_its_later_stage_with_its_replicas_key(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states, stage1 = _setup(w3, tmp_path)
    node, opener = _address(w3, NODE), _address(w3, OPENER)
    subject = bind_run(committed.records[1], committed.stages[1], stage1.factors, OWN, committed.records[0],
                       committed.stages[0], 1)  # the case's subject: no replica binding needed to open it
    cases.commit(opener, subject, SALT)
    cases.open(opener, subject, SALT)
    defender = _defender(committed, states, tmp_path, program=data_program(), data=node_data())
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    assert cases.case(subject)["claims"] == 1
    run = claimed(client, claim_id)
    assert (run["stage"], run["dataKey"]) == (1, node)  # the replica's key: its stage-0 member, this node
    ours = batches_of(node, 1, TOY_STEPS)  # the replica's windows, the ones its stage 0 trained on
    assert bytes(run["batchRoot"]) == batch_root([batch_leaves(b) for b in ours])
    games = {_challenge_data(client, claim_id, _address(w3, 5), (TOY_STEPS - 1, ROWS - 1, WINDOW)):
             (_address(w3, 5), None)}
    liar = _address(w3, 9)
    client._send("challengeRun", liar, claim_id, value=client.bond)
    games[bytes(client.contract.functions.gameIdOf(claim_id, liar).call())] = (
        liar, _liar(random.Random(3), PROGRAM))
    _play(client, defender, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == 2 * client.bond
