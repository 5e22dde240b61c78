"""Issue 79 point 6: "final" is what the chain says (``TrainingLedger.isFinal``), in ``pull``, on py-evm and
on a real anvil.

An outsider challenges a round in the last block of its dispute window: ``commit + disputeBlocks`` passes, the
old count called the round final and ``pull`` installed it, while the chain's ``isFinal`` stayed false (the
challenge, if it expired, would overturn the round). Now a pull while the challenge is open installs nothing
for that round (RoundPending, exit 9), and takes it once the chain calls it final.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from ledger.availability import WEIGHTS, availability_answer, availability_target
from node.cli import exit_code_for
from node.errors import NodeError, RoundPending
from node.tools.pull import pull_checkpoint
from node.tools.standing import last_final_round, round_standing
from ledger.chunkproof import chunked_weights_root
from node.commitments import scheme_named
from tests.fraud_fixtures import aggregated_round, contribution
from tests.ledger_fixtures import chain_w3, deploy, mine  # noqa: F401 (chain_w3: py-evm / anvil)

SHAPES = {"a.weight": (16, 80), "b.bias": (70,)}
STAKE = 10**18


@pytest.fixture(scope="module")
def round_():
    return aggregated_round(SHAPES,
                            [contribution(SHAPES, "lowrank", 20, rank=4), contribution(SHAPES, "quant", 21)])


def land_at(w3, block: int) -> None:
    if block > w3.eth.block_number + 1:
        mine(w3, block - w3.eth.block_number - 1)


def committed_with_checkpoints(w3, round_):
    """Rounds 0 and 1 of a chunked run (tests/fraud_fixtures.py commit's), each publishing a checkpoint."""
    deployment = deploy(w3, min_stake=STAKE)
    version = scheme_named("normed" if round_.honest.factors.norms is not None else "chunked").version
    run = deployment.member_run((1, 2, 3), quorum=2, min_stake=STAKE, commitments=version,
                                accusation_blocks=8, dispute_blocks=8, max_game_steps=4)
    records, stages = [], []
    for state in (round_.prev, round_.honest):
        if records:
            mine(w3, run.client(1).run_struct(run.run_id)["disputeBlocks"])
        leaves = [state.leaf(), round_.other.leaf()]
        record = dataclasses.replace(run.next_record(), weights_root=chunked_weights_root(leaves),
                                     checkpoint_hash=hashlib.sha256(b"checkpoint %d" % len(records)).digest())
        run.client(1).commit_round(record, run.sign(record, (1, 2)))
        records.append(record)
        stages.append(leaves)
    return deployment, run.run_id, records, stages


def test_a_pull_while_a_challenge_is_open_installs_nothing_for_that_round(chain_w3, round_, tmp_path):
    deployment, run_id, records, stages = committed_with_checkpoints(chain_w3, round_)
    w3 = chain_w3
    outsider, member = deployment.client(6), deployment.client(1)
    closed_at = outsider.commit_block_of(run_id, 1) + outsider.run_struct(run_id)["disputeBlocks"]
    land_at(w3, closed_at - 1)
    challenge = outsider.challenge_availability(availability_target(
        records[1], stages[1], round_.honest.factors, 0, WEIGHTS, 2))
    mine(w3, 2)  # commit + disputeBlocks passed: the old count called round 1 final
    history = member.history(run_id, with_registrations=False)
    assert history.block_number >= closed_at
    assert round_standing(history, member.chain_id, member.ledger_address, final_only=True)[1] is None  # old
    assert not member.is_final(run_id, 1)
    out = tmp_path / "model"
    with pytest.raises(RoundPending, match="round 1 of run .* is not final on chain") as pending:
        pull_checkpoint(member, run_id, out, 1)
    assert exit_code_for(pending.value) == 9 and not out.exists()  # nothing installed
    # the latest round asked for: round 1 is passed over, round 0 (final) is the one judged
    standing = round_standing(history, member.chain_id, member.ledger_address, final_only=True,
                              is_final=lambda r: member.is_final(run_id, r))
    assert standing[0] is None and isinstance(standing[1], RoundPending)
    assert finals(member, run_id) == ([True, False], [True, False])  # audit and explorer: the chain's word
    # answered, and its window closed: the chain calls it final, and so does pull (which then looks for the
    # checkpoint's bytes: none is served here)
    deadline = outsider.challenge_of(challenge)["deadline"]
    land_at(w3, deadline - 1)
    member.answer_challenge(challenge, *availability_answer(round_.honest, WEIGHTS, 2))
    closes = outsider.proof_window_of(run_id, 1)[1]
    mine(w3, max(0, closes - w3.eth.block_number))
    assert member.is_final(run_id, 1)
    assert finals(member, run_id) == ([True, True], [True, True])
    with pytest.raises(NodeError) as looked:
        pull_checkpoint(member, run_id, out, 1)
    assert not isinstance(looked.value, RoundPending) and "checkpoint" in str(looked.value), looked.value


def finals(client, run_id: int) -> tuple[list, list]:
    """Each round's ``final`` as ``audit`` (its report) and the explorer (its snapshot) show it."""
    from node.commands.explorer import read_snapshot
    from node.tools.audit import audit_run

    report = audit_run(client, run_id, replay=False)
    return [v.final for v in report.rounds], [row["final"] for row in read_snapshot(client, run_id)["rounds"]]


def test_the_last_final_round_is_found_by_bisection():
    calls = []

    def is_final(round_index: int) -> bool:
        calls.append(round_index)
        return round_index <= 41

    assert last_final_round(list(range(100)), is_final) == 41 and len(calls) <= 7
    assert last_final_round(list(range(5)), lambda r: False) == -1
    assert last_final_round([], lambda r: True) == -1
    assert last_final_round([0, 1, 2], lambda r: True) == 2
