"""The audit report on its own (no chain): verdict arithmetic, JSON, HTML escaping and the loss curve."""

from __future__ import annotations

import io
import json
import math

from node.tools.audit_cli import _ProgressBar
from node.tools.report import (
    FAIL,
    FAILED,
    INCOMPLETE,
    OK,
    PASSED,
    UNVERIFIABLE,
    AuditReport,
    Check,
    DisputeView,
    RoundVerdict,
    worst,
    write_json,
)
from node.tools.report_html import loss_curve_svg, render_html


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
            index,
            "0xS",
            10 + index,
            5.0 - 0.1 * index,
            4.9 - 0.1 * index,
            512,
            2,
            "00" * 32,
            "11" * 32,
            attesters=["0xA1", "0xA2"],
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
    assert report.verdict == PASSED and report.ok and report.first_bad_round is None
    report.rounds[3].checks.append(Check("contribution s0 r1 abc", UNVERIFIABLE, "not held"))
    # Unverifiable is never ok and never a failure: the audit is INCOMPLETE, not PASSED.
    assert report.verdict == INCOMPLETE and not report.ok and not report.failed
    assert report.rounds[3].status == UNVERIFIABLE and report.first_unverified_round == 3
    assert "INCOMPLETE" in report.summary() and "first unverified round: 3" in report.summary()
    assert report.first_unverifiable().name == "contribution s0 r1 abc"
    report.rounds[4].checks.append(Check("weights root (replay)", FAIL, "replayed x != committed y"))
    report.checkpoints.append(Check("checkpoint of round 2 ff", FAIL, "content", round=2))
    assert report.verdict == FAILED and report.failed and report.first_bad_round == 2
    assert report.first_failure().name.startswith("checkpoint of round 2")
    assert report.counts() == {OK: 11, FAIL: 2, UNVERIFIABLE: 1}


def test_json_report_round_trips(tmp_path):
    report = _report(3)
    report.rounds[1].checks.append(Check("round shape", FAIL, "tokens"))
    data = json.loads(write_json(report, tmp_path / "a.json").read_text())
    assert data["ok"] is False and data["verdict"] == FAILED and data["first_bad_round"] == 1
    assert data["rounds"][0]["attesters"] == ["0xA1", "0xA2"]
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


def test_html_colours_the_verdict_marks_unverified_points_and_shows_roots_attesters_disputes():
    report = _report(4)
    page = render_html(report)
    assert 'data-verdict="PASSED"' in page and "#1a7f37" in page.split('id="verdict"')[1][:200]
    assert 'class="unverified"' not in page and 'class="failed"' not in page
    assert ("00" * 32) in page and ("11" * 32) in page  # the roots, whole, in tooltips
    assert page.count('class="attesters" data-count="2"') == 4
    report.rounds[1].checks.append(Check("weights root (replay)", UNVERIFIABLE, "no run document"))
    report.rounds[2].disputes.append(DisputeView("0xD1", 99, "22" * 32, "11" * 32, 5.0, 4.8, "", "yes"))
    report.rounds[2].notes.append("disputed by 0xD1 at block 99")
    page = render_html(report)
    assert 'data-verdict="INCOMPLETE"' in page and "#9a6700" in page.split('id="verdict"')[1][:200]
    assert page.count('class="unverified"') == 1 and 'class="unverified" data-round="1"' in page
    assert 'class="disputes" data-count="1"' in page and 'data-replays="yes"' in page and "22" * 32 in page
    report.rounds[3].checks.append(Check("weights root (replay)", FAIL, "replayed x != committed y"))
    page = render_html(report)
    assert 'data-verdict="FAILED"' in page and "#cf222e" in page.split('id="verdict"')[1][:200]
    assert 'class="failed" data-round="3"' in page and page.count('class="unverified"') == 1


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
