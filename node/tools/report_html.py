"""The audit report as a self-contained HTML page, with the loss curve as inline SVG."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from node.fsutil import atomic_write_bytes
from node.tools.report import FAIL, FAILED, INCOMPLETE, OK, PASSED, UNVERIFIABLE

_COLORS = {
    OK: "#1a7f37",
    FAIL: "#cf222e",
    UNVERIFIABLE: "#9a6700",
    PASSED: "#1a7f37",
    FAILED: "#cf222e",
    INCOMPLETE: "#9a6700",
}


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
        return (f'<svg class="loss-curve" width="{width}" height="{height}"><text x="10" y="20">no losses '
                'recorded</text></svg>')
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
                f'stroke="{_COLORS[UNVERIFIABLE]}" stroke-width="2"><title>round {r}: '
                'unverifiable</title></circle>'
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
            f'<div class="dispute" data-replays="{esc(d.replays)}">by {_short(d.disputer)}'
            f' (block {d.block}): '
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
"""  # noqa: E501 - the page's HTML, kept as written


def write_html(report: Any, path: str | Path) -> Path:
    """Write :func:`render_html` atomically."""
    return atomic_write_bytes(path, render_html(report).encode("utf-8"))
