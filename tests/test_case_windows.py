"""A contribution case fits create-run's default windows (issue 78, docs/FRAUD_PROOF.md "The contribution
case"): a case takes 4 clocks and a block (the clock: the run's accusationBlocks) and must end inside the
round's proof window, so at the old defaults (64 and 64) no case could be opened. create-run's default dispute
window is now 5 x accusation_blocks (320): one clock to notice a wrong contribution and open its case, four
for the case. Here, on py-evm, a case runs to its end at those defaults: a coalition's wrong claim is refuted
and the round overturned inside the window; at 64 and 64 the same case is refused."""

from __future__ import annotations

from pathlib import Path

from ledger.chain import connect_pyevm
from ledger.runparams import DEFAULT_ACCUSATION_BLOCKS, case_course_blocks, case_dispute_blocks, case_room
from ledger.stepcase import CaseClient, case_claim, ledger_step_prover, run_stake
from ledger.stepproof import StepProverClient, run_game, state_roots
from node.commands.runfile import read_run_file, run_params
from tests.fraud_fixtures import commit
from tests.ledger_fixtures import deploy as deploy_ledger
from tests.step_binding_fixtures import STAKE, TOY_STEPS, fix_program, honest_round, subject_of
from tests.test_chain_commands import RUN_FILE
from tests.test_step_case import OUTSIDER, SALT, _address, _lands_at, _ledger_state, _named
from tests.test_step_proof_run import _honest_policy, _run, _start_state, _traces


def _run_file(tmp_path: Path, drop: tuple[str, ...], extra: str = "") -> dict:
    text = "".join(line + "\n" for line in RUN_FILE.splitlines() if not line.startswith(drop)) + extra
    path = tmp_path / "run.toml"
    path.write_text(text)
    run = read_run_file(str(path))
    return {"chain": run.chain, "params": run_params(run)}


def test_create_runs_default_dispute_window_leaves_room_for_a_case(tmp_path):
    defaults = _run_file(tmp_path, ("accusation_blocks", "dispute_blocks"))
    assert defaults["chain"]["accusation_blocks"] == DEFAULT_ACCUSATION_BLOCKS == 64
    assert defaults["chain"]["dispute_blocks"] == defaults["params"].dispute_blocks == 320
    assert case_course_blocks(64) == 257 and case_room(64, 320) == 62 and case_room(64, 64) == 0
    # the default follows a run file's own clock; a window it names is kept
    assert _run_file(tmp_path, ("dispute_blocks",))["chain"]["dispute_blocks"] == case_dispute_blocks(8) == 40
    assert _run_file(tmp_path, ())["chain"]["dispute_blocks"] == 8


def _case_run(w3, dispute_blocks: int):
    round_ = honest_round()
    deployment = deploy_ledger(w3, min_stake=STAKE)
    client = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger))
    committed = commit(deployment, round_, round_.honest, stake=STAKE,
                       accusation_blocks=DEFAULT_ACCUSATION_BLOCKS, dispute_blocks=dispute_blocks,
                       inner_steps=TOY_STEPS, before=fix_program(client))
    client.bond = run_stake(w3, deployment.ledger, committed.run_id)
    return client, CaseClient(client), committed


def test_a_case_runs_to_its_end_at_the_default_windows_and_not_at_the_old_ones():
    w3 = connect_pyevm()
    client, cases, committed = _case_run(w3, case_dispute_blocks(DEFAULT_ACCUSATION_BLOCKS))
    outsider, member = _address(w3, OUTSIDER), _address(w3, 1)
    reader, attesters = _ledger_state(committed)
    _, closes_at = reader.ledger_contract.functions.proofWindowOf(committed.run_id, 1).call()
    subject = subject_of(committed, 0)
    # the honest node needs a while to rerun the contribution: it opens the case in the last block it can
    _lands_at(w3, closes_at - case_course_blocks(DEFAULT_ACCUSATION_BLOCKS) - 2)
    cases.commit(outsider, subject, SALT)
    cases.open(outsider, subject, SALT)
    case = cases.case(subject)
    assert case["ends"] == closes_at - 1
    # the coalition defends it with a claim one ulp off in step 3 in the claims' last block; the outsider
    # refutes it with a full game
    truth, cheat = _run(_start_state()), _run(_start_state(), 3, 1)
    _lands_at(w3, case["deadline"] - 1)
    truth_roots = state_roots(_traces(truth))
    won, _ = run_game(client, _traces(cheat), member, outsider, subject=subject,
                      judge_state=lambda i, root: root == truth_roots[i],
                      step_policy=_honest_policy(truth, cheat))
    assert not won and w3.eth.block_number < closes_at
    _lands_at(w3, max(case["deadline"], w3.eth.block_number + 1))
    cases.overturn(outsider, subject, attesters)
    assert w3.eth.block_number < closes_at and reader.invalid_from(committed.run_id) == 1
    # at the old defaults (64 and 64) the same case is refused from the commit on
    old_client, old_cases, old = _case_run(w3, 64)
    old_subject = subject_of(old, 0)
    old_cases.commit(outsider, old_subject, SALT)
    _lands_at(w3, w3.eth.block_number + 2)
    assert _named(old_client, "openCase", outsider, case_claim(old_subject), old_subject.binding, SALT,
                  value=old_client.bond) == "ProverStepWindowClosed"
