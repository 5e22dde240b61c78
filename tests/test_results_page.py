"""docs/RESULTS.md is generated from bench/results/*.json, and the committed page is what the JSON gives."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import results_page  # noqa: E402


def test_the_committed_page_is_up_to_date():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "results_page.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr + "\nrun: python scripts/results_page.py"


def test_a_stale_page_or_headline_table_fails_the_check(tmp_path):
    page, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    files = ["--page", str(page), "--readme", str(readme)]
    page.write_text(results_page.render().replace("1.7674", "1.7000", 1))
    assert results_page.main(["--check", *files]) == 1
    assert results_page.main(["--page", str(tmp_path / "absent.md"), "--readme", str(readme), "--check"]) == 1
    assert results_page.main(files) == 0
    assert results_page.main(["--check", *files]) == 0
    # A hand edit of README's generated table is stale too; the rest of README is left alone.
    original = readme.read_text()
    readme.write_text(original.replace("| Ledger |", "| Ledger (edited) |"))
    assert results_page.main(["--check", *files]) == 1
    assert results_page.main(files) == 0 and readme.read_text() == original
    readme.write_text(original.replace(results_page.END, ""))
    assert results_page.main(files) == 2


def test_the_figures_come_from_the_json(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    diloco = json.loads((results / "diloco.json").read_text())
    diloco["summary"]["diloco_x"]["held_out_loss"] = 1.2345678
    diloco["summary"]["diloco_x"]["loss_vs_ddp"] = -0.25
    (results / "diloco.json").write_text(json.dumps(diloco))
    text = results_page.render(results)
    row = next(line for line in text.splitlines() if line.startswith("| DiLoCoX"))
    assert "1.2346" in row and "-25.0%" in row
    assert "held-out loss -25.0% against centralized AdamW" in results_page.headline(results)


def test_every_result_file_has_a_section_and_a_bad_one_is_named(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    (results / "diloco_one_off.json").write_text("{}")
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    files = ["--results", str(results), "--page", str(tmp_path / "p.md"), "--readme", str(readme)]
    assert results_page.main(files) == 2
    assert "diloco_one_off.json" in capsys.readouterr().err
    (results / "diloco_one_off.json").unlink()
    (results / "p2p.json").write_text(json.dumps({"machine": {}}))  # no "blob": not what bench_p2p writes
    assert results_page.main(files) == 2
    assert "p2p.json" in capsys.readouterr().err
    assert not (tmp_path / "p.md").exists()


def test_every_benchmark_script_writes_a_result_the_page_shows():
    """One current JSON per benchmark: each bench script's default output is a file with a section."""
    sections = {s.file: s.script for s in results_page.SECTIONS}
    assert sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json")) == sorted(sections)
    scripts = {Path(s).name for s in sections.values()}
    files = {p.name: p.read_text() for p in (ROOT / "bench").glob("*.py")}
    # A profiler that writes no result, and the modules a
    # benchmark script imports (bench.<name>): parts of it.
    parts = {name for name in files
             if any(re.search(rf"^\s*from bench\.{name[:-3]} import", other, re.MULTILINE)
                    for other in files.values())}
    tools = {"codec_profile.py"} | parts
    assert "benchio.py" in parts
    assert set(files) - tools == scripts
    for name in scripts:
        source = (ROOT / "bench" / name).read_text()
        named = {f for f in sections if sections[f] == f"bench/{name}"}
        assert any(re.search(rf"\b{re.escape(f)}\b", source) for f in named), (name, named)
