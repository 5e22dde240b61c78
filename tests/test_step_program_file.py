"""The run's step program file a node defends with (node/stepprogram.py, issue 78): a file that is not a
program is refused at load time naming what is wrong, and a program that is not the chain's is refused before
anything is sent; the toy program read from the committed start's chunk leaves gives the test runs' traces."""

from __future__ import annotations

import json

import pytest

from ledger.stepproof import program_hash, state_roots
from node.errors import ConfigError
from node.stepprogram import StepProgram
from tests.step_binding_fixtures import TOY_STEPS, toy_round
from tests.test_case_defense import toy_program
from tests.test_step_proof_run import _run, _start_state, _traces


@pytest.mark.parametrize("change, why", [
    (lambda p: p.pop("ops"), "KeyError"),
    (lambda p: p.update(ops=[[9, 1, 0, 1, 1, 1, 0, 0]]), "is not [kind 1-7"),
    (lambda p: p["ops"].__setitem__(0, [5, 3, 4, 8, 12, 32, 0, 3]), "reads trace leaf 3, not one before it"),
    (lambda p: p.update(depth=2), "depth 2 holds no 8 trace leaves"),
    (lambda p: p.update(copies=[0, 6, 8]), "past the 8 trace leaves"),
    (lambda p: p.update(origins=p["origins"][:2]), "one origin per state tensor"),
])
def test_a_file_that_is_not_a_program_is_refused_by_name(tmp_path, change, why):
    program = json.loads(toy_program().to_json())
    change(program)
    path = tmp_path / "program.json"
    path.write_text(json.dumps(program))
    with pytest.raises(ConfigError, match=why.replace("[", r"\[")):
        StepProgram.load(path)


def test_another_program_than_the_chains_is_refused_and_the_toy_runs_from_the_committed_start(tmp_path):
    program = toy_program()
    path = tmp_path / "program.json"
    path.write_text(program.to_json())
    assert StepProgram.load(path) == program
    with pytest.raises(ConfigError, match="not the run's"):
        program.check_on(bytes(32), bytes(32))
    with pytest.raises(ConfigError, match="origins are not the run's"):
        program.check_on(program_hash(program.head()), bytes(32))
    side = program.defense(list(toy_round().prev.weight_leaves), TOY_STEPS)
    assert side.roots == state_roots(_traces(_run(_start_state())))
