"""The audit report: its data (items, per-round verdicts) and its renderings for machines and people.

:class:`AuditReport` is what :func:`node.tools.audit.audit_run` returns. Every
audited item is a :class:`Check` whose status is ``ok``, ``FAIL`` or
``unverifiable`` (never ok for what could not be checked). The report's verdict
is ``PASSED`` only if every item is ok, ``FAILED`` if any item failed, and
``INCOMPLETE`` otherwise (some items unverifiable, none failed). It renders as
JSON (:func:`write_json`) and as one self-contained HTML page
(:func:`write_html`) with no external resources (no scripts, fonts or images):
the loss curve is an inline SVG drawn from the losses the chain records for
each round, with one ``<polyline>`` point per committed round and a marker on
every round that is not verified, so the page renders the same in any browser,
offline, and can be archived next to the JSON.
"""

from __future__ import annotations

import html
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from node.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

OK, FAIL, UNVERIFIABLE = "ok", "FAIL", "unverifiable"
_RANK = {OK: 0, UNVERIFIABLE: 1, FAIL: 2}
#: The report's overall verdicts: every item ok / some unverifiable, none failed / some item failed.
PASSED, INCOMPLETE, FAILED = "PASSED", "INCOMPLETE", "FAILED"
_VERDICT_OF = {OK: PASSED, UNVERIFIABLE: INCOMPLETE, FAIL: FAILED}


def worst(statuses: Iterable[str]) -> str:
    """The most severe of ``statuses`` (FAIL > unverifiable > ok); ok for none."""
    return max(statuses, key=_RANK.__getitem__, default=OK)


@dataclass
class Check:
    """One audited item and its outcome."""

    name: str
    status: str
    reason: str = ""
    round: int | None = None  # the round the item belongs to, if any

    def line(self) -> str:
        return f"{self.name}: {self.status}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class Contributor:
    """One aggregated contribution of a round, as listed by the evidence."""

    stage: int
    replica: int
    peer_id: str
    envelope: str  # sha256 hex of the envelope bytes
    account: str = ""  # registered account of the signing key, if found
    applied: str = ""  # hex of the applied_hash its body binds (node.protocol.ContributionBody), if read


@dataclass
class DisputeView:
    """A member's own signed record of a disputed round (``RoundDisputed``), next to the committed one."""

    disputer: str
    block: int
    weights_root: str
    contributions_root: str
    train_loss: float
    eval_loss: float
    checkpoint_hash: str
    replays: str = "unknown"  # "yes" / "no": its weights root is / is not the replay of the round; "unknown"


@dataclass
class RoundVerdict:
    """Everything checked about one committed round."""

    round: int
    submitter: str
    block: int
    train_loss: float
    eval_loss: float
    tokens: int
    num_contributors: int
    weights_root: str
    contributions_root: str
    attesters: list[str] = field(default_factory=list)  # the members whose signatures committed the record
    prev_head: str = ""
    checkpoint_hash: str = ""  # empty: the round published no checkpoint
    checks: list[Check] = field(default_factory=list)
    contributors: list[Contributor] = field(default_factory=list)
    disputes: list[DisputeView] = field(default_factory=list)
    replay_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def first_problem(self) -> Check | None:
        for wanted in (FAIL, UNVERIFIABLE):
            for check in self.checks:
                if check.status == wanted:
                    return check
        return None

    def line(self) -> str:
        """The one-line verdict printed per round."""
        text = f"round {self.round}: {self.status}"
        problem = self.first_problem()
        if problem is not None:
            text += f" -- {problem.name}: {problem.reason}"
        extra = [f"{len(self.contributors)} contributions", f"attested by {len(self.attesters)}"]
        if self.disputes:
            extra.append(f"disputed by {', '.join(d.disputer for d in self.disputes)}")
        if self.replay_seconds is not None:
            extra.append(f"replay {self.replay_seconds:.3f}s")
        return text + f" [{', '.join(extra)}]"


@dataclass
class AuditReport:
    """The outcome of :func:`audit_run` (rendered by :mod:`node.tools.report`)."""

    run_id: int
    chain_id: int
    registry: str
    ledger: str
    config_hash: str
    num_stages: int
    inner_steps: int
    head: str
    replay: bool
    general: list[Check] = field(default_factory=list)
    rounds: list[RoundVerdict] = field(default_factory=list)
    checkpoints: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    quorum: int = 0
    max_rounds: int = 0  # 0: open-ended
    notes: list[str] = field(default_factory=list)  # findings that are not items: slashings, accusations

    def all_checks(self) -> list[Check]:
        return self.general + [c for r in self.rounds for c in r.checks] + self.checkpoints

    def counts(self) -> dict[str, int]:
        checks = self.all_checks()
        return {status: sum(c.status == status for c in checks) for status in (OK, FAIL, UNVERIFIABLE)}

    @property
    def verdict(self) -> str:
        """PASSED (every item ok), INCOMPLETE (some unverifiable, none failed) or FAILED (some item failed)."""
        return _VERDICT_OF[worst(c.status for c in self.all_checks())]

    @property
    def ok(self) -> bool:
        """The audit PASSED: every item was checked and matches (an unverifiable item is not ok)."""
        return self.verdict == PASSED

    @property
    def failed(self) -> bool:
        """Some item contradicts the record."""
        return self.verdict == FAILED

    @property
    def first_bad_round(self) -> int | None:
        """The lowest round with a failed item (its own or its checkpoint's), or None."""
        bad = [r.round for r in self.rounds if r.status == FAIL]
        bad += [c.round for c in self.checkpoints if c.status == FAIL and c.round is not None]
        return min(bad, default=None)

    def first_failure(self) -> Check | None:
        """The first failed item of the first bad round, else the first failed chain-level item."""
        first = self.first_bad_round
        if first is not None:
            for check in [c for r in self.rounds if r.round == first for c in r.checks] + self.checkpoints:
                if check.status == FAIL and (check.round is None or check.round == first):
                    return check
        return next((c for c in self.all_checks() if c.status == FAIL), None)

    @property
    def first_unverified_round(self) -> int | None:
        """The lowest round that is not fully verified (failed or unverifiable), or None."""
        return min((r.round for r in self.rounds if r.status != OK), default=None)

    def first_unverifiable(self) -> Check | None:
        """The first unverifiable item (of the first unverified round if there is one)."""
        first = self.first_unverified_round
        ordered = [c for r in self.rounds if r.round == first for c in r.checks] + self.all_checks()
        return next((c for c in ordered if c.status == UNVERIFIABLE), None)

    def summary(self) -> str:
        counts = self.counts()
        text = (
            f"audit of run {self.run_id} {self.verdict}: {len(self.rounds)} rounds, {counts[OK]} items ok, "
            f"{counts[FAIL]} failed, {counts[UNVERIFIABLE]} unverifiable"
        )
        if self.verdict == INCOMPLETE:
            first = self.first_unverified_round
            text += f"; first unverified round: {first}" if first is not None else "; every round verified"
        if self.failed:
            first = self.first_bad_round
            text += (
                f"; first bad round: {first}"
                if first is not None
                else "; no round is bad (chain-level items)"
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        data["ok"] = self.ok
        data["first_bad_round"] = self.first_bad_round
        data["counts"] = self.counts()
        for verdict, raw in zip(self.rounds, data["rounds"]):
            raw["status"] = verdict.status
        return data


# ---------------------------------------------------------------------- renderings

_COLORS = {
    OK: "#1a7f37",
    FAIL: "#cf222e",
    UNVERIFIABLE: "#9a6700",
    PASSED: "#1a7f37",
    FAILED: "#cf222e",
    INCOMPLETE: "#9a6700",
}


def write_json(report: Any, path: str | Path) -> Path:
    """Write ``report.to_dict()`` as indented JSON, atomically."""
    data = json.dumps(report.to_dict(), indent=1, sort_keys=True).encode() + b"\n"
    return atomic_write_bytes(path, data)


def loss_curve_svg(
    rounds: list[int],
    series: dict[str, list[float]],
    width: int = 640,
    height: int = 240,
    statuses: list[str] | None = None,
) -> str:
    """An inline SVG line chart: x = round, one polyline per named series (one point per round).

    Values that are not finite or not positive are plotted as gaps would
    mislead; they are left out and the polyline's ``data-points`` says how many
    points it holds. With ``statuses`` (one per round), every round that is not
    ok gets a marker on the first series: a hollow amber circle (class
    ``unverified``) or a red cross (class ``failed``): the chain's losses of
    those rounds are claims the audit could not confirm.
    """
    pad_left, pad_right, pad_top, pad_bottom = 48, 12, 12, 28
    values = [v for vs in series.values() for v in vs if math.isfinite(v) and v > 0]
    if not rounds or not values:
        return f'<svg class="loss-curve" width="{width}" height="{height}"><text x="10" y="20">no losses recorded</text></svg>'
    lo, hi = min(values), max(values)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    r0, r1 = min(rounds), max(rounds)
    span = max(r1 - r0, 1)

    def x(r: int) -> float:
        return pad_left + (r - r0) / span * (width - pad_left - pad_right)

    def y(v: float) -> float:
        return pad_top + (hi - v) / (hi - lo) * (height - pad_top - pad_bottom)

    colors = {"eval loss": "#0969da", "train loss": "#bc4c00"}
    parts = [
        (
            f'<svg class="loss-curve" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="loss per round">'
        ),
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
        (
            f'<line x1="{pad_left}" y1="{height - pad_bottom}" x2="{width - pad_right}" '
            f'y2="{height - pad_bottom}" stroke="#888"/>'
        ),
        f'<line x1="{pad_left}" y1="{pad_top}" x2="{pad_left}" y2="{height - pad_bottom}" stroke="#888"/>',
        f'<text x="4" y="{pad_top + 10}" font-size="11">{hi:.3f}</text>',
        f'<text x="4" y="{height - pad_bottom}" font-size="11">{lo:.3f}</text>',
        f'<text x="{pad_left}" y="{height - 8}" font-size="11">round {r0}</text>',
        f'<text x="{width - pad_right - 60}" y="{height - 8}" font-size="11">round {r1}</text>',
    ]
    legend_y = pad_top + 12
    for name, vs in series.items():
        points = [(x(r), y(v)) for r, v in zip(rounds, vs) if math.isfinite(v) and v > 0]
        if not points:
            continue
        color = colors.get(name, "#555")
        coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        css = name.replace(" ", "-")
        parts.append(
            f'<polyline class="{css}" data-points="{len(points)}" fill="none" stroke="{color}" '
            f'stroke-width="2" points="{coords}"/>'
        )
        parts.append(
            f'<text x="{width - pad_right - 90}" y="{legend_y}" font-size="11" fill="{color}">'
            f"{html.escape(name)}</text>"
        )
        legend_y += 14
    first = next(iter(series.values()), [])
    parts += _status_markers(rounds, first, statuses or [], x, y)
    parts.append("</svg>")
    return "".join(parts)


def _status_markers(rounds: list[int], values: list[float], statuses: list[str], x, y) -> list[str]:
    """A marker on the curve for every round that is not ok: a red cross (failed), else a hollow circle."""
    parts = []
    for r, v, status in zip(rounds, values, statuses):
        if status == OK or not (math.isfinite(v) and v > 0):
            continue
        px, py = x(r), y(v)
        if status == FAIL:
            parts.append(
                f'<path class="failed" data-round="{r}" stroke="{_COLORS[FAIL]}" stroke-width="2" '
                f'd="M{px - 4:.1f},{py - 4:.1f} L{px + 4:.1f},{py + 4:.1f} M{px - 4:.1f},{py + 4:.1f} '
                f'L{px + 4:.1f},{py - 4:.1f}"><title>round {r}: FAIL</title></path>'
            )
        else:
            parts.append(
                f'<circle class="unverified" data-round="{r}" cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#fff" '
                f'stroke="{_COLORS[UNVERIFIABLE]}" stroke-width="2"><title>round {r}: unverifiable</title></circle>'
            )
    return parts


def _status(status: str) -> str:
    return f'<span class="status" style="color:{_COLORS.get(status, "#000")}">{html.escape(status)}</span>'


def _checks_table(checks: list[Any], css: str) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(c.name)}</td><td>{_status(c.status)}</td><td>{html.escape(c.reason)}</td></tr>"
        for c in checks
    )
    return f'<table class="{css}"><tr><th>item</th><th>verdict</th><th>reason</th></tr>{rows}</table>'


def _short(value: str, keep: int = 12) -> str:
    """``value`` cut to ``keep`` characters, the whole in a tooltip (roots and addresses)."""
    esc = html.escape
    return f'<code title="{esc(value)}">{esc(value[:keep])}</code>' if value else "-"


def _dispute_cell(r: Any) -> str:
    esc = html.escape
    rows = []
    for d in r.disputes:
        rows.append(
            f'<div class="dispute" data-replays="{esc(d.replays)}">by {_short(d.disputer)} (block {d.block}): '
            f"weights {_short(d.weights_root)}, contributions {_short(d.contributions_root)}, "
            f"eval loss {d.eval_loss:.4f}; replays: {esc(d.replays)}</div>"
        )
    return "".join(rows) or "-"


def _round_row(r: Any) -> str:
    """One row of the rounds table."""
    esc = html.escape
    problem = r.first_problem()
    contributors = (
        "<br>".join(
            esc(
                f"s{c.stage} r{c.replica} {c.peer_id[-10:]}"
                + (f" ({c.account[:10]})" if c.account else "")
            )
            for c in r.contributors
        )
        or "-"
    )
    attesters = "<br>".join(_short(a) for a in r.attesters) or "-"
    notes = "".join(f'<div class="note">{esc(n)}</div>' for n in r.notes)
    replay = f"{r.replay_seconds:.3f}" if r.replay_seconds is not None else "-"
    return (
        f'<tr class="round" data-round="{r.round}" data-status="{esc(r.status)}"><td>{r.round}</td>'
        f"<td>{_status(r.status)}</td>"
        f"<td>{esc(problem.name + ': ' + problem.reason) if problem else ''}{notes}</td>"
        f"<td>{r.eval_loss:.4f}</td><td>{r.train_loss:.4f}</td>"
        f'<td class="roots">weights {_short(r.weights_root)}<br>contributions {_short(r.contributions_root)}'
        f"<br>checkpoint {_short(r.checkpoint_hash)}</td>"
        f'<td class="attesters" data-count="{len(r.attesters)}">{attesters}<br>submitted by '
        f"{_short(r.submitter)}</td>"
        f'<td class="disputes" data-count="{len(r.disputes)}">{_dispute_cell(r)}</td>'
        f'<td>{r.num_contributors}</td><td class="contributors">{contributors}</td><td>{replay}</td></tr>'
    )


def render_html(report: Any) -> str:
    """The report as one self-contained HTML document."""
    esc = html.escape
    counts = report.counts()
    verdict = report.verdict
    rounds = [r.round for r in report.rounds]
    svg = loss_curve_svg(
        rounds,
        {
            "eval loss": [r.eval_loss for r in report.rounds],
            "train loss": [r.train_loss for r in report.rounds],
        },
        statuses=[r.status for r in report.rounds],
    )
    round_rows = [_round_row(r) for r in report.rounds]
    headline = f"{len(report.rounds)} rounds, {counts['ok']} items ok, {counts['FAIL']} failed, " + (
        f"{counts['unverifiable']} unverifiable"
    )
    if report.first_bad_round is not None:
        headline += f"; first bad round {report.first_bad_round}"
    elif verdict == INCOMPLETE and report.first_unverified_round is not None:
        headline += f"; first unverified round {report.first_unverified_round}"
    timings = ", ".join(f"{esc(k)} {v}" for k, v in report.timings.items())
    findings = "".join(f"<li>{esc(n)}</li>" for n in report.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dlx-node audit of run {report.run_id}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #1f2328; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }}
td, th {{ border: 1px solid #d0d7de; padding: 3px 6px; vertical-align: top; text-align: left; }}
.status {{ font-weight: bold; }}
.note {{ color: #57606a; font-size: 12px; }}
code {{ font-size: 12px; }}
</style></head>
<body>
<h1>Audit of run {report.run_id}</h1>
<p id="verdict" data-verdict="{verdict}" data-ok="{str(report.ok).lower()}">{_status(verdict)} {esc(headline)}</p>
<p>chain {report.chain_id}, ledger <code>{esc(report.ledger)}</code>, registry <code>{esc(report.registry)}</code>,
configHash <code>{esc(report.config_hash)}</code>, {report.num_stages} stages, H = {report.inner_steps},
quorum {report.quorum}, maxRounds {report.max_rounds or "open-ended"}, head <code>{esc(report.head)}</code></p>
<p>evidence: {esc(", ".join(report.sources) or "chain only")}; replay {"on" if report.replay else "off"};
timings: {timings}</p>
<h2>Loss per round (from the chain)</h2>
{svg}
<p class="note">Hollow circles: rounds not verified (their losses are the chain's claim only);
crosses: failed rounds.</p>
<h2>Rounds</h2>
<table class="rounds"><tr><th>round</th><th>verdict</th><th>first problem, notes</th><th>eval loss</th>
<th>train loss</th><th>roots</th><th>attesters</th><th>disputes</th><th>contributors</th>
<th>contributions (stage, replica, peer, account)</th><th>replay s</th></tr>
{"".join(round_rows)}</table>
<h2>Findings</h2>
<ul class="findings">{findings or "<li>no slashing, accusation or equivocation</li>"}</ul>
<h2>Checkpoints</h2>
{_checks_table(report.checkpoints, "checkpoints")}
<h2>Chain</h2>
{_checks_table(report.general, "general")}
</body></html>
"""


def write_html(report: Any, path: str | Path) -> Path:
    """Write :func:`render_html` atomically."""
    return atomic_write_bytes(path, render_html(report).encode("utf-8"))
