"""The audit report: its data (items, per-round verdicts) and its renderings for machines and people.

:class:`AuditReport` is what :func:`node.tools.audit.audit_run` returns. Every
audited item is a :class:`Check` whose status is ``ok``, ``FAIL`` or
``unverifiable`` (never ok for what could not be checked). It renders as JSON
(:func:`write_json`) and as one self-contained HTML page (:func:`write_html`)
with no external resources (no scripts, fonts or images): the loss curve is an
inline SVG drawn from the losses the chain records for each round, with one
``<polyline>`` point per committed round, so the page renders the same in any
browser, offline, and can be archived next to the JSON.
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


@dataclass
class RoundVerdict:
    """Everything checked about one committed round."""

    round: int
    committer: str
    block: int
    train_loss: float
    eval_loss: float
    tokens: int
    num_contributors: int
    weights_root: str
    contributions_root: str
    checks: list[Check] = field(default_factory=list)
    contributors: list[Contributor] = field(default_factory=list)
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
        extra = [f"{len(self.contributors)} contributions"]
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

    def all_checks(self) -> list[Check]:
        return self.general + [c for r in self.rounds for c in r.checks] + self.checkpoints

    def counts(self) -> dict[str, int]:
        checks = self.all_checks()
        return {status: sum(c.status == status for c in checks) for status in (OK, FAIL, UNVERIFIABLE)}

    @property
    def ok(self) -> bool:
        """No item failed (unverifiable items are allowed: see :meth:`counts`)."""
        return not any(c.status == FAIL for c in self.all_checks())

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

    def summary(self) -> str:
        counts = self.counts()
        verdict = "PASSED" if self.ok else "FAILED"
        text = (
            f"audit of run {self.run_id} {verdict}: {len(self.rounds)} rounds, {counts[OK]} items ok, "
            f"{counts[FAIL]} failed, {counts[UNVERIFIABLE]} unverifiable"
        )
        if not self.ok:
            first = self.first_bad_round
            text += (
                f"; first bad round: {first}"
                if first is not None
                else "; no round is bad (chain-level items)"
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["first_bad_round"] = self.first_bad_round
        data["counts"] = self.counts()
        for verdict, raw in zip(self.rounds, data["rounds"]):
            raw["status"] = verdict.status
        return data


# ---------------------------------------------------------------------- renderings

_COLORS = {OK: "#1a7f37", FAIL: "#cf222e", UNVERIFIABLE: "#9a6700"}


def write_json(report: Any, path: str | Path) -> Path:
    """Write ``report.to_dict()`` as indented JSON, atomically."""
    data = json.dumps(report.to_dict(), indent=1, sort_keys=True).encode() + b"\n"
    return atomic_write_bytes(path, data)


def loss_curve_svg(
    rounds: list[int], series: dict[str, list[float]], width: int = 640, height: int = 240
) -> str:
    """An inline SVG line chart: x = round, one polyline per named series (one point per round).

    Values that are not finite or not positive are plotted as gaps would
    mislead; they are left out and the polyline's ``data-points`` says how many
    points it holds.
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
    parts.append("</svg>")
    return "".join(parts)


def _status(status: str) -> str:
    return f'<span class="status" style="color:{_COLORS.get(status, "#000")}">{html.escape(status)}</span>'


def _checks_table(checks: list[Any], css: str) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(c.name)}</td><td>{_status(c.status)}</td><td>{html.escape(c.reason)}</td></tr>"
        for c in checks
    )
    return f'<table class="{css}"><tr><th>item</th><th>verdict</th><th>reason</th></tr>{rows}</table>'


def render_html(report: Any) -> str:
    """The report as one self-contained HTML document."""
    esc = html.escape
    counts = report.counts()
    verdict = "PASSED" if report.ok else "FAILED"
    rounds = [r.round for r in report.rounds]
    svg = loss_curve_svg(
        rounds,
        {
            "eval loss": [r.eval_loss for r in report.rounds],
            "train loss": [r.train_loss for r in report.rounds],
        },
    )
    round_rows = []
    for r in report.rounds:
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
        replay = f"{r.replay_seconds:.3f}" if r.replay_seconds is not None else "-"
        round_rows.append(
            f'<tr class="round" data-round="{r.round}" data-status="{esc(r.status)}"><td>{r.round}</td>'
            f"<td>{_status(r.status)}</td><td>{esc(problem.name + ': ' + problem.reason) if problem else ''}</td>"
            f"<td>{r.eval_loss:.4f}</td><td>{r.train_loss:.4f}</td><td>{r.num_contributors}</td>"
            f'<td class="contributors">{contributors}</td><td>{esc(r.committer[:12])}</td><td>{replay}</td></tr>'
        )
    first = report.first_bad_round
    headline = (
        f"{len(report.rounds)} rounds, {counts['ok']} items ok, {counts['FAIL']} failed, "
        f"{counts['unverifiable']} unverifiable" + (f"; first bad round {first}" if first is not None else "")
    )
    timings = ", ".join(f"{esc(k)} {v}" for k, v in report.timings.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dlx-node audit of run {report.run_id}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #1f2328; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }}
td, th {{ border: 1px solid #d0d7de; padding: 3px 6px; vertical-align: top; text-align: left; }}
.status {{ font-weight: bold; }}
code {{ font-size: 12px; }}
</style></head>
<body>
<h1>Audit of run {report.run_id}</h1>
<p id="verdict" data-ok="{str(report.ok).lower()}">{_status(verdict if report.ok else "FAIL")} {esc(headline)}</p>
<p>chain {report.chain_id}, ledger <code>{esc(report.ledger)}</code>, registry <code>{esc(report.registry)}</code>,
configHash <code>{esc(report.config_hash)}</code>, {report.num_stages} stages, H = {report.inner_steps},
head <code>{esc(report.head)}</code></p>
<p>evidence: {esc(", ".join(report.sources) or "chain only")}; replay {"on" if report.replay else "off"};
timings: {timings}</p>
<h2>Loss per round (from the chain)</h2>
{svg}
<h2>Rounds</h2>
<table class="rounds"><tr><th>round</th><th>verdict</th><th>first problem</th><th>eval loss</th><th>train loss</th>
<th>contributors</th><th>contributions (stage, replica, peer, account)</th><th>committer</th><th>replay s</th></tr>
{"".join(round_rows)}</table>
<h2>Checkpoints</h2>
{_checks_table(report.checkpoints, "checkpoints")}
<h2>Chain</h2>
{_checks_table(report.general, "general")}
</body></html>
"""


def write_html(report: Any, path: str | Path) -> Path:
    """Write :func:`render_html` atomically."""
    return atomic_write_bytes(path, render_html(report).encode("utf-8"))
