"""Static analysis of the contracts (issue 63): the compiler's warnings and slither's findings.

slither-analyzer runs over contracts/forge (it builds with forge, which compiles through
contracts/forge/solc: the project's solcjs); every high or medium finding must be answered in
contracts/slither-triage.json. slither and halmos live in their own virtualenv, .venv-analysis
(scripts/setup.sh, scripts/analysis-requirements.txt): slither needs web3 < 8, the node web3 8.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRIAGE = REPO / "contracts" / "slither-triage.json"
NODE_BIN = REPO / "contracts" / "node_modules" / ".bin"


def analysis_tool(name: str) -> str | None:
    """``name`` from .venv-analysis (scripts/setup.sh), else from PATH."""
    local = REPO / ".venv-analysis" / "bin" / name
    return str(local) if local.exists() else shutil.which(name)


def finding_key(result: dict) -> str:
    """``<check> <contract>.<function or variable>``: stable across line moves."""
    element = result["elements"][0]
    parent = element.get("type_specific_fields", {}).get("parent", {})
    if element["type"] == "variable" and parent.get("type") == "function":  # a local: name its function
        owner = parent.get("type_specific_fields", {}).get("parent", {}).get("name", "")
        return f"{result['check']} {owner}.{parent['name']}"
    return f"{result['check']} {parent.get('name', '')}.{element['name']}"


def slither_findings() -> list[dict]:
    slither = analysis_tool("slither")
    if slither is None or not (NODE_BIN / "forge").exists():
        pytest.fail("slither or forge missing (a test dependency): run scripts/setup.sh")
    env = {**os.environ, "PATH": f"{NODE_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([slither, ".", "--json", "-"], cwd=REPO / "contracts" / "forge", env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"slither gave no JSON (exit {done.returncode}):\n"
                             f"{done.stderr[-3000:]}") from None
    assert report["success"], report.get("error")
    return report["results"].get("detectors", [])


@pytest.mark.timeout(1200)  # slither builds every contract with forge first: over 300 s at a load of 17
def test_every_high_or_medium_slither_finding_is_fixed_or_answered():
    answered = json.loads(TRIAGE.read_text())["findings"]
    serious = [r for r in slither_findings() if r["impact"] in ("High", "Medium")]
    keys = {finding_key(r) for r in serious}
    unanswered = sorted(keys - set(answered))
    assert not unanswered, ("slither findings neither fixed nor answered in contracts/slither-triage.json:\n"
                            + "\n".join(r["description"] for r in serious if finding_key(r) in unanswered))
    assert all(answered[k].strip() for k in keys), "a triage entry without a reason"


def test_the_triage_file_answers_each_finding_with_a_reason():
    triage = json.loads(TRIAGE.read_text())
    for key, reason in triage["findings"].items():
        check, _, where = key.partition(" ")
        assert check and "." in where and len(reason) > 20, key


def test_the_compiler_gives_no_warning(contracts_build_check):
    done = contracts_build_check  # the session's one compile (tests/conftest.py)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stderr, done.stderr
