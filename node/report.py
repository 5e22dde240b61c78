"""Rendering an :class:`node.audit.AuditReport` for machines (JSON) and people (one self-contained HTML page).

The HTML page has no external resources (no scripts, fonts or images): the loss
curve is an inline SVG drawn from the losses the chain records for each round,
with one ``<polyline>`` point per committed round, so the page renders the same
in any browser, offline, and can be archived next to the JSON.
"""

from __future__ import annotations

import html
import json
import logging
import math
from pathlib import Path
from typing import Any

from node.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

_COLORS = {"ok": "#1a7f37", "FAIL": "#cf222e", "unverifiable": "#9a6700"}


def write_json(report: Any, path: str | Path) -> Path:
    """Write ``report.to_dict()`` as indented JSON, atomically."""
    data = json.dumps(report.to_dict(), indent=1, sort_keys=True).encode() + b"\n"
    return atomic_write_bytes(path, data)


def loss_curve_svg(rounds: list[int], series: dict[str, list[float]], width: int = 640, height: int = 240) -> str:
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
    parts = [f'<svg class="loss-curve" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="loss per round">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
             f'<line x1="{pad_left}" y1="{height - pad_bottom}" x2="{width - pad_right}" y2="{height - pad_bottom}" '
             'stroke="#888"/>',
             f'<line x1="{pad_left}" y1="{pad_top}" x2="{pad_left}" y2="{height - pad_bottom}" stroke="#888"/>',
             f'<text x="4" y="{pad_top + 10}" font-size="11">{hi:.3f}</text>',
             f'<text x="4" y="{height - pad_bottom}" font-size="11">{lo:.3f}</text>',
             f'<text x="{pad_left}" y="{height - 8}" font-size="11">round {r0}</text>',
             f'<text x="{width - pad_right - 60}" y="{height - 8}" font-size="11">round {r1}</text>']
    legend_y = pad_top + 12
    for name, vs in series.items():
        points = [(x(r), y(v)) for r, v in zip(rounds, vs) if math.isfinite(v) and v > 0]
        if not points:
            continue
        color = colors.get(name, "#555")
        coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
        css = name.replace(" ", "-")
        parts.append(f'<polyline class="{css}" data-points="{len(points)}" fill="none" stroke="{color}" '
                     f'stroke-width="2" points="{coords}"/>')
        parts.append(f'<text x="{width - pad_right - 90}" y="{legend_y}" font-size="11" fill="{color}">'
                     f'{html.escape(name)}</text>')
        legend_y += 14
    parts.append("</svg>")
    return "".join(parts)


def _status(status: str) -> str:
    return f'<span class="status" style="color:{_COLORS.get(status, "#000")}">{html.escape(status)}</span>'


def _checks_table(checks: list[Any], css: str) -> str:
    rows = "".join(f"<tr><td>{html.escape(c.name)}</td><td>{_status(c.status)}</td>"
                   f"<td>{html.escape(c.reason)}</td></tr>" for c in checks)
    return f'<table class="{css}"><tr><th>item</th><th>verdict</th><th>reason</th></tr>{rows}</table>'


def render_html(report: Any) -> str:
    """The report as one self-contained HTML document."""
    esc = html.escape
    counts = report.counts()
    verdict = "PASSED" if report.ok else "FAILED"
    rounds = [r.round for r in report.rounds]
    svg = loss_curve_svg(rounds, {"eval loss": [r.eval_loss for r in report.rounds],
                                  "train loss": [r.train_loss for r in report.rounds]})
    round_rows = []
    for r in report.rounds:
        problem = r.first_problem()
        contributors = "<br>".join(
            esc(f"s{c.stage} r{c.replica} {c.peer_id[-10:]}" + (f" ({c.account[:10]})" if c.account else ""))
            for c in r.contributors) or "-"
        replay = f"{r.replay_seconds:.3f}" if r.replay_seconds is not None else "-"
        round_rows.append(
            f'<tr class="round" data-round="{r.round}" data-status="{esc(r.status)}"><td>{r.round}</td>'
            f"<td>{_status(r.status)}</td><td>{esc(problem.name + ': ' + problem.reason) if problem else ''}</td>"
            f"<td>{r.eval_loss:.4f}</td><td>{r.train_loss:.4f}</td><td>{r.num_contributors}</td>"
            f"<td class=\"contributors\">{contributors}</td><td>{esc(r.committer[:12])}</td><td>{replay}</td></tr>")
    first = report.first_bad_round
    headline = (f"{len(report.rounds)} rounds, {counts['ok']} items ok, {counts['FAIL']} failed, "
                f"{counts['unverifiable']} unverifiable" + (f"; first bad round {first}" if first is not None else ""))
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
<p id="verdict" data-ok="{str(report.ok).lower()}">{_status(verdict if report.ok else 'FAIL')} {esc(headline)}</p>
<p>chain {report.chain_id}, ledger <code>{esc(report.ledger)}</code>, registry <code>{esc(report.registry)}</code>,
configHash <code>{esc(report.config_hash)}</code>, {report.num_stages} stages, H = {report.inner_steps},
head <code>{esc(report.head)}</code></p>
<p>evidence: {esc(', '.join(report.sources) or 'chain only')}; replay {'on' if report.replay else 'off'};
timings: {timings}</p>
<h2>Loss per round (from the chain)</h2>
{svg}
<h2>Rounds</h2>
<table class="rounds"><tr><th>round</th><th>verdict</th><th>first problem</th><th>eval loss</th><th>train loss</th>
<th>contributors</th><th>contributions (stage, replica, peer, account)</th><th>committer</th><th>replay s</th></tr>
{''.join(round_rows)}</table>
<h2>Checkpoints</h2>
{_checks_table(report.checkpoints, 'checkpoints')}
<h2>Chain</h2>
{_checks_table(report.general, 'general')}
</body></html>
"""


def write_html(report: Any, path: str | Path) -> Path:
    """Write :func:`render_html` atomically."""
    return atomic_write_bytes(path, render_html(report).encode("utf-8"))
