"""A node checks its settings against the run's end rule before it joins (issue 78, docs/FRAUD_PROOF.md "The
node defends its contributions"; node/live/fraud/endrule.py).

In a run whose creator fixed the plain end rule (StepProver ``endRuleOf`` 1) a contribution's payload must
code ``fl(S - E)`` with nothing carried between rounds and no low-rank piece; a node whose settings carry
state could not defend its contributions there, so it refuses, naming each setting. What is tested: the
settings named (error feedback, a ``min_compress_numel`` that lets a tensor be coded low-rank, the inner
optimizer's carried state, the left-out update put back: the last two have no setting yet, so every node
refuses such a run today); the chain's rule read on py-evm (refused under the rule, nothing said without it);
and a real node process started in a plain-end run on anvil exits before it trains, its log naming the
settings.
"""

from __future__ import annotations

import pytest

from node.config import load_config
from node.errors import ConfigError
from node.live.fraud.endrule import check_end_rule, plain_end_problems
from tests.test_case_defense import _setup
from tests.test_step_proof import _backend

TINY_V3 = ["model.preset=tiny", "diloco.commitments=normed"]


def test_every_setting_that_carries_state_is_named():
    problems = plain_end_problems(load_config(None, TINY_V3))
    assert [p.split(" ")[0] for p in problems] == [
        "compression.error_feedback", "compression.min_compress_numel", "training.optimizer", "a"]
    assert "the largest, 'transformer.wte.weight', has 8,192); set it above 8,192" in problems[1]
    assert "left out of its round is put back" in problems[3]
    # feedback off and every tensor quantized only: what is left has no setting yet
    quiet = plain_end_problems(load_config(None, [*TINY_V3, "compression.error_feedback=false",
                                                  "compression.min_compress_numel=8193"]))
    assert [p.split(" ")[0] for p in quiet] == ["training.optimizer", "a"]
    assert [p.split(" ")[0] for p in plain_end_problems(load_config(None, [*TINY_V3,
                                                                           "compression.enabled=false"]))] \
        == ["training.optimizer", "a"]


@pytest.mark.parametrize("end_rule", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_rule_is_read_from_the_chain(request, tmp_path, end_rule):
    w3 = _backend(request, "pyevm")
    _client, _cases, committed, _states = _setup(w3, tmp_path, end_rule=end_rule)
    reader = committed.deployment.client(1)
    cfg = load_config(None, TINY_V3)
    if not end_rule:
        check_end_rule(reader, committed.run_id, cfg)  # no rule: nothing to refuse
        return
    with pytest.raises(ConfigError) as caught:
        check_end_rule(reader, committed.run_id, cfg)
    message = str(caught.value)
    assert f"run {committed.run_id} fixes the plain end rule on chain (StepProver.endRuleOf = 1" in message
    assert "compression.error_feedback = true" in message and "training.optimizer = 'adamw'" in message
    assert "not joining" in message and "the run's creator must make the run again" in message
    hashed = load_config(None, ["model.preset=tiny", "diloco.commitments=hashed"])
    check_end_rule(reader, committed.run_id, hashed)  # a run that takes no case: not asked


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_node_process_refuses_to_start_in_a_plain_end_run(make_run):
    from ledger.account import dev_account
    from ledger.stepcase import ledger_step_prover
    from ledger.stepproof import StepProverClient
    from tests.test_case_defense_e2e import _program

    run = make_run(replicas=1, stages=1, split=False, settings=["model.preset=tiny", "diloco.inner_steps=4",
                                                                 "training.batch_size=4", "join_timeout=30"])
    w3 = run.client().w3
    client = StepProverClient(w3, ledger_step_prover(w3, run.ledger))
    creator = dev_account(0, w3.eth.chain_id).address
    program = _program(run)
    client.set_program(creator, run.run_id, program.head(), program.origin_leaves())
    client.set_end_rule(creator, run.run_id)
    run.start()
    slot = run.nodes[0]
    assert slot.process.wait(timeout=240) != 0
    log = slot.log_path.read_text()
    assert "fixes the plain end rule on chain" in log, log[-3000:]
    assert "compression.error_feedback = true" in log and "training.optimizer = 'adamw'" in log
    assert run.client().commit_count(run.run_id) == 0
