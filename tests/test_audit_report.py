"""The audit report on its own (no chain): verdict arithmetic, JSON, HTML escaping and the loss curve."""

from __future__ import annotations

import io
import json
import math

from node.tools.audit import _ProgressBar
from node.tools.report import (
    FAIL,
    OK,
    UNVERIFIABLE,
    AuditReport,
    Check,
    RoundVerdict,
    loss_curve_svg,
    render_html,
    worst,
    write_json,
)


def _report(rounds: int) -> AuditReport:
    report = AuditReport(
        run_id=7,
        chain_id=31337,
        registry="0xR",
        ledger="0xL",
        config_hash="ab" * 32,
        num_stages=2,
        inner_steps=4,
        head="cd" * 32,
        replay=True,
    )
    report.general.append(Check("hash chain head", OK))
    for index in range(rounds):
        verdict = RoundVerdict(
            index, "0xC", 10 + index, 5.0 - 0.1 * index, 4.9 - 0.1 * index, 512, 2, "00" * 32, "11" * 32
        )
        verdict.checks.append(Check("contributions root", OK))
        verdict.checks.append(Check("weights root (replay)", OK))
        report.rounds.append(verdict)
    return report


def test_verdicts_rank_fail_over_unverifiable_over_ok():
    assert worst([]) == OK
    assert worst([OK, UNVERIFIABLE]) == UNVERIFIABLE
    assert worst([UNVERIFIABLE, FAIL, OK]) == FAIL
    report = _report(5)
    assert report.ok and report.first_bad_round is None
    report.rounds[3].checks.append(Check("contribution s0 r1 abc", UNVERIFIABLE, "not held"))
    assert report.ok and report.rounds[3].status == UNVERIFIABLE  # unverifiable is never ok, never a failure
    report.rounds[4].checks.append(Check("weights root (replay)", FAIL, "replayed x != committed y"))
    report.checkpoints.append(Check("checkpoint of round 2 ff", FAIL, "content", round=2))
    assert not report.ok and report.first_bad_round == 2
    assert report.first_failure().name.startswith("checkpoint of round 2")
    assert report.counts() == {OK: 11, FAIL: 2, UNVERIFIABLE: 1}


def test_json_report_round_trips(tmp_path):
    report = _report(3)
    report.rounds[1].checks.append(Check("round shape", FAIL, "tokens"))
    data = json.loads(write_json(report, tmp_path / "a.json").read_text())
    assert data["ok"] is False and data["first_bad_round"] == 1
    assert [r["status"] for r in data["rounds"]] == [OK, FAIL, OK]
    assert data["rounds"][1]["checks"][-1] == {
        "name": "round shape",
        "status": FAIL,
        "reason": "tokens",
        "round": None,
    }


def test_html_escapes_what_peers_and_files_supplied():
    report = _report(25)
    report.rounds[0].checks.append(Check("contribution <b>", FAIL, "<script>alert(1)</script>"))
    page = render_html(report)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert 'class="eval-loss" data-points="25"' in page and 'class="train-loss" data-points="25"' in page
    assert page.count('<tr class="round"') == 25


def test_loss_curve_leaves_out_missing_losses():
    svg = loss_curve_svg([0, 1, 2, 3], {"eval loss": [3.0, math.nan, 0.0, 2.0]})
    assert 'data-points="2"' in svg
    assert "no losses recorded" in loss_curve_svg([], {"eval loss": []})


def test_progress_bar_writes_a_line_per_tenth_when_not_a_terminal():
    stream = io.StringIO()
    bar = _ProgressBar(stream)
    for done in range(1, 101):
        bar(done, 100, f"round {done}")
    lines = stream.getvalue().splitlines()
    assert lines[0] == "audit: 1/100 rounds checked" and lines[-1] == "audit: 100/100 rounds checked"
    assert len(lines) == 11
    quiet = io.StringIO()
    _ProgressBar(quiet)(3, 3, "round 2")  # short histories get no bar
    assert quiet.getvalue() == ""
