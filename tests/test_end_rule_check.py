"""A node checks its settings against the run's end rule before it joins (issue 78, docs/FRAUD_PROOF.md "The
node defends its contributions"; node/live/fraud/endrule.py).

In a run whose creator fixed the plain end rule (StepProver ``endRuleOf`` 1) a contribution's payload must
code ``fl(S - E)`` with nothing carried between rounds and no low-rank piece; a node whose settings carry
state could not defend its contributions there, so it refuses, naming each setting. What is tested: the
settings named (error feedback, a ``min_compress_numel`` that lets a tensor be coded low-rank, the inner
optimizer's carried state, ``training.inner_state``, the left-out update put back, ``diloco.put_back``, and
the one-step delay), each alone, and a run with none of them taken; the switches in the run document only
when set; the chain's rule read on py-evm (refused under the rule, nothing said without it); a real node
process started in a plain-end run on anvil with the default settings exits before it trains, its log naming
the settings, and two with the switches train and commit rounds.
"""

from __future__ import annotations

import pytest

from node.config import load_config
from node.errors import ConfigError
from node.live.fraud.endrule import check_end_rule, plain_end_problems
from tests.test_case_defense import _setup
from tests.test_step_proof import _backend
from training.errors import TrainingConfigError

TINY_V3 = ["model.preset=tiny", "diloco.commitments=normed"]


PLAIN = ["compression.error_feedback=false", "compression.min_compress_numel=8193",
         "training.inner_state=fresh", "diloco.put_back=false", "diloco.one_step_delay=false"]


def test_every_setting_that_carries_state_is_named():
    problems = plain_end_problems(load_config(None, TINY_V3))
    assert [p.split(" ")[0] for p in problems] == [
        "compression.error_feedback", "compression.min_compress_numel", "training.inner_state",
        "diloco.put_back", "diloco.one_step_delay"]
    assert "the largest, 'transformer.wte.weight', has 8,192); set it above 8,192" in problems[1]
    assert "training.inner_state = 'carry': the inner optimizer's state (adamw's moments)" in problems[2]
    assert "left out of its round is put back" in problems[3] and "set it false" in problems[4]
    # feedback off, every tensor quantized, a fresh inner optimizer, nothing put back, no delay: taken
    assert plain_end_problems(load_config(None, [*TINY_V3, *PLAIN])) == []
    assert plain_end_problems(load_config(None, [*TINY_V3, *PLAIN[2:], "compression.enabled=false"])) == []
    # and each of them alone back at what carries state is refused by its own name
    for good, bad in zip(PLAIN, ["compression.error_feedback=true", "compression.min_compress_numel=8192",
                                 "training.inner_state=carry", "diloco.put_back=true",
                                 "diloco.one_step_delay=true"]):
        settings = [bad if s == good else s for s in PLAIN]
        named = [p.split(" ")[0] for p in plain_end_problems(load_config(None, [*TINY_V3, *settings]))]
        assert named == [bad.split("=")[0]], (bad, named)
    muon = plain_end_problems(load_config(None, [*TINY_V3, *PLAIN[:2], "training.optimizer=muon"]))
    assert "training.inner_state = 'carry': the inner optimizer's state (muon's moments)" in muon[0]


def test_the_switches_are_run_settings_in_the_document_only_when_set():
    from node.runconfig import config_hash, node_config_from_run, run_document

    carry = run_document(load_config(None, TINY_V3))
    assert "inner_state" not in carry["training"] and "put_back" not in carry["diloco"]  # older hashes kept
    fresh = run_document(load_config(None, [*TINY_V3, *PLAIN]))
    assert fresh["training"]["inner_state"] == "fresh" and fresh["diloco"]["put_back"] is False
    assert config_hash(fresh) != config_hash(run_document(load_config(None, [*TINY_V3, *PLAIN[:2],
                                                                             *PLAIN[3:]])))
    joined = node_config_from_run(fresh)
    assert joined.training.inner_state == "fresh" and joined.diloco.put_back is False
    assert plain_end_problems(joined) == []
    assert node_config_from_run(carry).training.inner_state == "carry"
    assert node_config_from_run(carry).diloco.put_back is True
    with pytest.raises(TrainingConfigError, match="training.inner_state='new': must be one of"):
        load_config(None, [*TINY_V3, "training.inner_state=new"])
    with pytest.raises(ConfigError, match="diloco.put_back='yes': must be true or false"):
        load_config(None, [*TINY_V3, "diloco.put_back=yes"])


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
    assert "compression.error_feedback = true" in message and "training.inner_state = 'carry'" in message
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
    assert "compression.error_feedback = true" in log and "training.inner_state = 'carry'" in log
    assert run.client().commit_count(run.run_id) == 0


def _start_weights(kept) -> dict:
    """The start a kept defense holds (its weight chunk leaves) as the stage's tensors by name."""
    import numpy as np
    import torch

    from training.chunks import leaf_values

    names = sorted(kept.shapes, key=lambda n: n.encode())
    flat = {name: np.zeros(int(np.prod(kept.shapes[name])), dtype=np.uint32) for name in names}
    for leaf in kept.start:
        (tensor, offset, _cols, count), bits = leaf_values(leaf)
        flat[names[tensor]][offset:offset + count] = bits
    return {name: torch.from_numpy(flat[name].view(np.float32).copy()).reshape(kept.shapes[name])
            for name in names}


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_node_processes_with_the_switches_train_and_commit_in_a_plain_end_run(make_run, tmp_path):
    """Two real node processes (one replica each, anvil) in a normed run of the tiny model, reproducible,
    whose creator fixed a program and the plain end rule before the first commit, the run's settings carrying
    nothing between rounds: both start, train and commit rounds, and every contribution they kept for a
    defense codes, element by element, ``fl(S - E)`` with ``E`` the end of the round's program from the
    committed start alone (training.end_relation.program_end: a new trainer, a fresh inner optimizer) on its
    replica's batches, and not on the other replica's."""
    from ledger.account import dev_account
    from ledger.stepcase import ledger_step_prover
    from ledger.stepproof import StepProverClient
    from node.live.fraud.defensefiles import DEFENSE_DIR, DefenseFiles
    from node.runconfig import node_config_from_run, run_document
    from tests.node_fixtures import TINY, wait_for
    from tests.test_case_defense_e2e import _program
    from training.data import corpus_from_config, round_batches
    from training.end_relation import end_relation, program_end

    program_file = tmp_path / "program.json"
    rounds = 3
    run = make_run(replicas=2, stages=1, split=False,
                   settings=[*TINY, "join_timeout=90", f"rounds={rounds}", "training.reproducible=true",
                             f"ledger.step_program={program_file}", *PLAIN])
    w3 = run.client().w3
    client = StepProverClient(w3, ledger_step_prover(w3, run.ledger))
    creator = dev_account(0, w3.eth.chain_id).address
    program = _program(run)
    program_file.write_text(program.to_json())
    client.set_program(creator, run.run_id, program.head(), program.origin_leaves())
    client.set_end_rule(creator, run.run_id)
    assert client.contract.functions.endRuleOf(run.run_id).call() == 1
    run.start()
    reader = run.client()
    wait_for(lambda: reader.commit_count(run.run_id) >= rounds, 480, "the last round's commit", run,
             none_exits=True)
    for slot in run.nodes:
        log = "\n".join(path.read_text(errors="replace") for path in sorted(slot.data_dir.glob("node-*.log")))
        assert "fixes the plain end rule on chain" not in log
    cfg = node_config_from_run(run_document(load_config(None, run._base_settings())))
    assert cfg.training.inner_state == "fresh" and not cfg.diloco.put_back and plain_end_problems(cfg) == []
    corpus, h = corpus_from_config(cfg.training, cfg.model), cfg.diloco.inner_steps
    judged = []
    for slot in run.nodes:
        files = DefenseFiles(slot.data_dir / DEFENSE_DIR)
        wait_for(lambda: files.rounds(), 120, "a kept defense", run)
        for outer_round, stage in files.rounds():
            kept = files.kept(outer_round, stage)
            start = _start_weights(kept)
            holds = []
            for replica in (0, 1):
                batches = round_batches(corpus, cfg.training.seed, replica, outer_round, h,
                                        cfg.training.batch_size, cfg.model.block_size)
                end = program_end(cfg.model, cfg.training, start, batches, outer_round, h, rounds * h)
                relation = end_relation(start, end, kept.blob)
                assert relation.unchecked == 0 and sum(relation.checked.values()) == sum(
                    t.numel() for t in start.values())
                holds.append(relation.holds)
            assert holds.count(True) == 1, (slot.data_dir, outer_round, holds)
            judged.append((outer_round, holds.index(True)))
    assert {replica for _, replica in judged} == {0, 1}, judged  # each node's own replica, both of them
