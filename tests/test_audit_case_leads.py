"""``audit --reexecute`` names the contributions it found wrong or could not rerun, each with the
``dlx-node challenge`` command that opens a case against it (issue 78; node/tools/audit_cases.py), and the
printed command, run as printed, opens the case on a real anvil.

The reruns' findings are given (their own tests rerun real contributions); what is tested here is the
naming: a member's node directory (the audit's --archive) kept rounds 0 and 1's stage leaves and version-3
factors (node/store/rewardsources.py) and sealed the round's contributions, whose envelope digests the
factors list; the leads find each contribution's place in its stage's factors from the envelope digest."""

from __future__ import annotations

import json
import logging
import shlex

import pytest

from ledger.account import dev_account
from ledger.stepcase import ledger_step_prover
from ledger.stepproof import StepProverClient
from node.cli import main
from node.tools.audit_cases import NOT_RERUN, WRONG, CaseLead, Pending, case_leads, print_leads
from node.tools.audit_reexec_checks import _pending
from node.tools.report import FAIL, OK, UNVERIFIABLE, AuditReport, Check, write_json
from node.store.rewardsources import REWARD_SOURCES_DIR, write_leaves, write_stage
from tests.ledger_fixtures import deploy, digest, fresh_anvil_w3, mine, mining_meanwhile
from tests.reward_fixtures import reward_run
from tests.step_binding_fixtures import TOY_STEPS, toy_program

OUTSIDER = 8


@pytest.fixture(autouse=True)
def _fresh_log_handlers():
    yield
    logging.getLogger().handlers[:] = []


def _member_directory(path, rounds) -> None:
    """What a member's node kept of ``rounds``: each stage's leaf and factors, every leaf of the record."""
    for entry in rounds:
        for stage, (leaf, factors) in enumerate(zip(entry.leaves, entry.factors)):
            write_stage(path / REWARD_SOURCES_DIR, entry.record.round, stage, leaf, factors)
        write_leaves(path / REWARD_SOURCES_DIR, entry.record.round, entry.leaves)


def _config(path, w3, deployment, run_id: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "node.toml").write_text(
        f'data_dir = "{path}"\n[ledger]\nbackend = "rpc"\nrpc_url = "{w3.provider.endpoint_uri}"\n'
        f"dev_account = {OUTSIDER}\nregistry_address = \"{deployment.registry}\"\n"
        f'ledger_address = "{deployment.ledger}"\nrun_id = {run_id}\nchain_id = {w3.eth.chain_id}\n')


def test_the_audit_names_each_lead_and_its_printed_command_opens_the_case(request, tmp_path, capsys,
                                                                          monkeypatch):
    w3 = fresh_anvil_w3(request, timeout=10.0)
    deployment = deploy(w3)
    rr = reward_run(deployment, pool=None, accusation_blocks=8, dispute_blocks=200, inner_steps=TOY_STEPS)
    StepProverClient(w3, ledger_step_prover(w3, deployment.ledger)).set_program(rr.address(1), rr.run_id,
                                                                                toy_program())
    rounds = [rr.commit([[(1, None)], [(2, None)]])]
    mine(w3, 200)
    rounds.append(rr.commit([[(1, None), (3, None)], [(2, None)]]))  # stage 0 lists envelopes e0, e1
    member = tmp_path / "member"
    _member_directory(member, rounds)
    # the archives' sealed contributions: replica 1 of round 1 is e1 in stage 0 (the factors' index 1) and
    # e0 in stage 1; replica 2's stage-0 envelope was left out of the aggregate; round 0's replica 0
    sealed = {0: [[0, 0, "peer-a", digest("e0").hex()], [1, 0, "peer-b", digest("e0").hex()]],
              1: [[0, 1, "peer-c", digest("e1").hex()], [1, 1, "peer-b", digest("e0").hex()],
                  [0, 2, "peer-d", digest("late").hex()]]}
    pending = [Pending(1, 1, WRONG, "does not reproduce", (0,)), Pending(1, 2, NOT_RERUN, "inputs missing"),
               Pending(0, 0, NOT_RERUN, "inputs missing"), Pending(1, 1, NOT_RERUN, "undecided", (1,))]
    leads = case_leads(pending, sealed, [member], rr.run.reader, rr.run_id)
    assert [(lead.round, lead.stage, lead.replica, lead.index) for lead in leads] == [
        (1, 0, 1, 1), (1, 0, 2, None), (0, 0, 0, None), (0, 1, 0, None), (1, 1, 1, 0)]
    wrong, late, first, _, other_stage = leads
    assert wrong.payload_root == _payload_roots(rounds[1], 0)[1].hex()
    assert "left out of the aggregate" in late.no_case and not late.command
    assert "genesis" in first.no_case and not first.command
    assert other_stage.command.split()[6:10] == ["--stage", "1", "--contribution", "0"]
    # found wrong: the command opens the case; not rerun (not known wrong): it shows the case only
    assert wrong.command.endswith(" --open") and "--open" not in other_stage.command
    print_leads(leads)
    out = capsys.readouterr().out
    assert wrong.command in out
    assert "5 contribution(s) wrong or not rerun, 2 with a challenge command" in out
    report = AuditReport(rr.run_id, w3.eth.chain_id, "", "", "", 2, TOY_STEPS, "", False, case_leads=leads)
    written = json.loads(write_json(report, tmp_path / "audit.json").read_text())
    assert written["case_leads"][0]["command"] == wrong.command and written["case_leads"][0]["index"] == 1

    # an outsider runs the printed command as printed, from its node.toml's directory (which kept nothing:
    # the factors come from the printed --archive), and the case against the wrong contribution is open
    outsider = tmp_path / "outsider"
    _config(outsider, w3, deployment, rr.run_id)
    monkeypatch.chdir(outsider)
    argv = shlex.split(wrong.command)
    assert argv[:2] == ["dlx-node", "challenge"] and "--archive" in argv
    with mining_meanwhile(w3):
        assert main([*argv[1:], "--yes"]) == 0
    assert "opened a case" in capsys.readouterr().out
    prover = StepProverClient(w3, ledger_step_prover(w3, deployment.ledger)).contract
    key = prover.functions.contributionOf(rr.run_id, 1, 0, _payload_roots(rounds[1], 0)[1]).call()
    assert prover.functions.caseOf(key).call()[0] == dev_account(OUTSIDER, w3.eth.chain_id).address
    # without the --archive the outsider's own directory names nothing: refused by name before any sending
    bare = [a for i, a in enumerate(argv[1:]) if a != "--archive" and argv[i] != "--archive"]
    assert main([*bare, "--yes"]) == 2
    assert "kept no stage leaves" in capsys.readouterr().err

    # a run that set no step program: the leads say the ledger takes no case, and give no command
    plain = reward_run(deployment, pool=None, accusation_blocks=8, dispute_blocks=200)
    plain_rounds = [plain.commit([[(1, None)], [(2, None)]]),
                    plain.commit([[(1, None), (3, None)], [(2, None)]])]
    _member_directory(tmp_path / "plain", plain_rounds)
    leads = case_leads([Pending(1, 1, WRONG, "does not reproduce", (0,))], sealed, [tmp_path / "plain"],
                       plain.run.reader, plain.run_id)
    assert [lead.index for lead in leads] == [1] and not leads[0].command
    assert "ProverStepNoProgram" in leads[0].no_case
    # the archives hold no factors (a reader of the run's peers, no --archive): named, no command
    leads = case_leads([Pending(1, 1, WRONG, "does not reproduce", (0,))], sealed, [], rr.run.reader,
                       rr.run_id)
    assert "no --archive" in leads[0].no_case and leads[0].index is None


def test_each_rerun_item_that_is_not_reproduced_is_a_lead():
    """The rerun items as audit_reexec_checks makes them, to leads: a failed rerun blames its failed stages
    (all of the replica's when it names none), a member caught on chain is still a lead (its round lists the
    contribution), an unverifiable item is one not rerun, a reproduced one is none."""

    class Result:
        failed_stages = (1,)

    failed = _pending(Check("r", FAIL, "does not reproduce (x; judged exact)"), (3, 2), Result())
    assert (failed.round, failed.replica, failed.finding, failed.stages) == (3, 2, WRONG, (1,))
    caught = _pending(Check("r", OK, "does not reproduce (x); its member was found guilty on chain"), (3, 2),
                      Result())
    assert caught.finding == WRONG
    unparsed = _pending(Check("r", FAIL, "inputs do not parse: bad"), (4, 0), None)
    assert (unparsed.finding, unparsed.stages) == (WRONG, ())
    missing = _pending(Check("r", UNVERIFIABLE, "its start state is not in the archives"), (4, 1), Result())
    assert (missing.finding, missing.stages) == (NOT_RERUN, ())
    assert _pending(Check("r", OK, "reproduced (exact, distance 0)"), (4, 1), Result()) is None
    lead = CaseLead(2, 0, 1, "ab", WRONG, "does not reproduce", no_case="round 0 ...")
    assert lead.line().endswith("no case: round 0 ...")


def _payload_roots(entry, stage: int) -> list[bytes]:
    from ledger.chunkproof import Factors

    return list(Factors.decode(entry.factors[stage]).payload_roots)
