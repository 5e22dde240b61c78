"""The page docs/RESULTS.md assembled from its sections (scripts/results_page.py names them)."""

from __future__ import annotations

import json
from pathlib import Path

from results_headline import PageError
from results_sections import provenance


def render_page(results: Path, sections, header: str) -> str:
    """docs/RESULTS.md from the JSON under ``results``: a section each (results_page.py's SECTIONS)."""
    known = {s.file for s in sections}
    unknown = sorted(p.name for p in results.glob("*.json") if p.name not in known)
    if unknown:
        raise PageError(
            f"no section in scripts/results_page.py for bench/results/{', '.join(unknown)}: add one "
            "(every benchmark writes one current result, and each has a section)")
    out = [header, "## Contents", ""]
    out += [f"- [{s.title}](#{_anchor(s.title)})" for s in sections]
    out.append("")
    for section in sections:
        out += [f"## {section.title}", "",
                (f"[`{section.script}`](../{section.script}) -> [`bench/results/{section.file}`]"
                f"(../bench/results/{section.file})"), ""]
        path = results / section.file
        if not path.exists():
            out += ["No result yet: run the script.", ""]
            continue
        try:
            result = json.loads(path.read_text())
            out += section.render(result)
            out += [section.notes, ""] if section.notes else []
            out += provenance(result)
        except (ValueError, KeyError, TypeError, IndexError, ZeroDivisionError) as exc:
            raise PageError(f"bench/results/{section.file}: {type(exc).__name__}: {exc} (not what "
                            f"{section.script} writes?)") from exc
    return "\n".join(out).rstrip() + "\n"


def _anchor(title: str) -> str:
    keep = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -")
    return keep.replace(" ", "-")
