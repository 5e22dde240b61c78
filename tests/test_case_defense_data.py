"""The node's defender commits its claim's batches and answers data disputes (issue 78; docs/FRAUD_PROOF.md
"The data's binding", "The node defends its contributions"; node/live/fraud/dataside.py), on py-evm and on
anvil, with the node's own parts (tests/test_case_defense.py's: its NodeChain over its account, its
ChunkedStates, the reward sources its data directory kept).

The run's program reads each step's batch (tests/step_data_fixtures.py: the toy step plus an embedding lookup
of the batch) and its data terms are fixed (StepProver.setData), so a claim's end depends on every token of
its batches, and anyone may dispute one token of one step's batch against the run's data. What is tested: the
node's claim commits the batches of the windows keyed by its own account (the member the round's factors list:
the batches its worker trained on, ``claim_batches``), the root the contract checks; challengers that dispute
a batch token (the first, the last of the last step, one between) and a liar at every level of the step game
(whose op game opens the step's batch under the claim's ``batchRoot``) all lose their bonds to the node; the
node's answer to a data dispute sent in its clock's last block is taken; a node restarted mid-game (no state
held, the same data directory) answers a data dispute opened before the restart from its kept copy and its
dataset; a node given no dataset, or one whose data root is not the run's, says why it cannot defend and posts
nothing. A later stage's claim (its replica's key, signed) is tested in tests/test_case_defense_replica.py.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from eth_abi import decode

from ledger.stepdata import batch_root
from ledger.stepproof import PHASES
from node.live.fraud.dataside import NodeData
from node.live.fraud.defensefiles import DEFENSE_DIR, DefenseFiles
from node.stepprogram import StepProgram
from tests.step_binding_fixtures import TOY_STEPS, toy_origins
from tests.step_data_fixtures import COPIES, PROGRAM, ROWS, WINDOW, batches_of, corpus, program_fields, terms
from tests.test_case_defense import BACKENDS, NODE, _claim_of, _defender, _liar, _open, _play, _setup
from tests.test_case_defense_restart import _empty
from tests.test_step_case import _address, _lands_at
from tests.test_step_proof import _backend
from training.data import corpus_from_ids
from training.data_binding import batch_leaves

#: Challengers of the node's claim: three data disputes (step, row, position) and a liar in the step game.
DISPUTES = {5: (0, 0, 0), 6: (TOY_STEPS - 1, ROWS - 1, WINDOW), 7: (2, 1, 2)}
LIAR = 9


def data_program() -> StepProgram:
    """The run's program as its file holds it: the toy step with the batch's lookup, the toy's origins."""
    origins = tuple(tuple(decode(["uint32", "uint64", "uint64", "uint64"], o)) for o in toy_origins())
    return StepProgram(tuple(PROGRAM), tuple(COPIES), 4, origins)


def node_data(source=corpus) -> NodeData:
    """The node's dataset (``source``: what opens it), drawn by account."""
    return NodeData(source, "account")


def _data_run(w3, tmp_path, **kwargs):
    return _setup(w3, tmp_path, program=program_fields(), data=terms(), **kwargs)


def _data_defender(committed, states, tmp_path, data: NodeData | None = None, **kwargs):
    return _defender(committed, states, tmp_path, program=data_program(),
                     data=data if data is not None else node_data(), **kwargs)


def claimed(client, claim_id: bytes) -> dict:
    """Claim ``claim_id``'s ``RunClaim`` as the contract took it (its RunClaimed transaction's), by name."""
    events = client.contract.events.RunClaimed().get_logs(from_block=0)
    tx = next(e.transactionHash for e in events if bytes(e.args.claimId) == claim_id)
    _fn, args = client.contract.decode_function_input(client.w3.eth.get_transaction(tx)["input"])
    return dict(args["run"])


def _challenge_data(client, claim_id: bytes, challenger: str, dispute: tuple) -> bytes:
    client._send("challengeData", challenger, claim_id, *dispute, value=client.bond)
    return bytes(client.contract.functions.gameIdOf(claim_id, challenger).call())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_node_commits_its_batches_and_every_data_challenger_loses(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states = _data_run(w3, tmp_path, clock=200, window=1000)
    node = _address(w3, NODE)
    defender = _data_defender(committed, states, tmp_path)
    subject, _case = _open(cases, committed)
    defender.poll()  # the node notices the case and claims its contribution, its batches committed
    claim_id = _claim_of(client, cases, subject, node)
    assert subject.data_key == node  # stage 0: its own account, the member the factors list
    ours = batches_of(node, 1, TOY_STEPS)  # what its worker trained on
    assert bytes(claimed(client, claim_id)["batchRoot"]) == batch_root([batch_leaves(b) for b in ours])
    games = {_challenge_data(client, claim_id, _address(w3, c), dispute): (_address(w3, c), None)
             for c, dispute in DISPUTES.items()}
    liar = _address(w3, LIAR)
    client._send("challengeRun", liar, claim_id, value=client.bond)
    games[bytes(client.contract.functions.gameIdOf(claim_id, liar).call())] = (
        liar, _liar(random.Random(5), PROGRAM))
    _play(client, defender, games)
    assert all(client.game(g)["phase"] == PHASES.index("Done") for g in games) and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == len(games) * client.bond


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_dispute_answered_in_the_clocks_last_block(request, backend, tmp_path):
    w3 = _backend(request, backend)
    client, cases, committed, states = _data_run(w3, tmp_path)
    node, challenger = _address(w3, NODE), _address(w3, 5)
    defender = _data_defender(committed, states, tmp_path)
    subject, _case = _open(cases, committed)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    game_id = _challenge_data(client, claim_id, challenger, (TOY_STEPS - 1, ROWS - 1, WINDOW))
    state = client.game(game_id)
    _lands_at(w3, state["turnSince"] + state["defenderLeft"])  # its move lands in its clock's last block
    defender.poll()
    assert client.game(game_id)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == client.bond


def test_a_restarted_node_answers_a_data_dispute_opened_before(request, tmp_path):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _data_run(w3, tmp_path, clock=200, window=1000)
    node, challenger = _address(w3, NODE), _address(w3, 6)
    files = DefenseFiles(tmp_path / DEFENSE_DIR)
    first = _data_defender(committed, states, tmp_path, files=files)
    first.poll()  # its inputs kept
    subject, _case = _open(cases, committed)
    first.poll()
    claim_id = _claim_of(client, cases, subject, node)
    game_id = _challenge_data(client, claim_id, challenger, (3, 0, 1))
    # the node dies before it answers; its next life holds no state, only its data directory and dataset
    second = _data_defender(committed, _empty(), tmp_path, files=DefenseFiles(tmp_path / DEFENSE_DIR))
    second.poll()
    assert cases.case(subject)["claims"] == 1  # it found its standing claim: nothing posted again
    assert client.game(game_id)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert client.contract.functions.balanceOf(node).call() == client.bond


def test_a_node_that_cannot_draw_the_runs_batches_says_why(request, tmp_path, caplog):
    w3 = _backend(request, "anvil")
    client, cases, committed, states = _data_run(w3, tmp_path)
    subject, _case = _open(cases, committed)
    caplog.set_level(logging.INFO, logger="node.live.fraud.defender")
    elsewhere = corpus_from_ids(torch.arange(800) % 8, "00" * 32, source="<other ids>")  # another data root
    for data, why in ((NodeData(corpus, "replica"), "draws its windows by 'replica'"),
                      (node_data(lambda: elsewhere), "is not the run's")):
        caplog.clear()
        _data_defender(committed, states, tmp_path, data=data).poll()
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "CANNOT DEFEND" in errors[0] and why in errors[0], errors
    caplog.clear()
    _defender(committed, states, tmp_path, program=data_program()).poll()  # no dataset given
    assert "no dataset" in caplog.text
    assert cases.case(subject)["claims"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_data_dispute_in_the_last_block_before_the_cases_end_is_answered_then_dismissed(request, backend,
                                                                                        tmp_path):
    """A challenger disputes the node's batch in the last block before the case's end (a dismissal taken
    from the next block would leave the claim open to it): the node answers it, and dismisses the case only
    once that game is decided; the challenger's bond and the opener's are the node's."""
    w3 = _backend(request, backend)
    client, cases, committed, states = _data_run(w3, tmp_path)
    node, challenger = _address(w3, NODE), _address(w3, 7)
    defender = _data_defender(committed, states, tmp_path)
    subject, case = _open(cases, committed)
    defender.poll()
    claim_id = _claim_of(client, cases, subject, node)
    _lands_at(w3, case["ends"] - 1)
    game_id = _challenge_data(client, claim_id, challenger, (1, 1, 3))
    assert w3.eth.block_number == case["ends"] - 1
    before = w3.eth.get_balance(node)
    for _ in range(3):
        defender.poll()
    assert client.game(game_id)["phase"] == PHASES.index("Done") and not client.wrong(claim_id)
    assert cases.case(subject)["opener"] == "0x" + "00" * 20  # dismissed
    assert client.contract.functions.balanceOf(node).call() == 0  # both bonds withdrawn
    assert w3.eth.get_balance(node) - before > 2 * client.bond - 10**16
