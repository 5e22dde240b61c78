"""The package layering: training/, p2p/ and ledger/ import neither node/ nor each other."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("training", "p2p", "ledger")
PROJECT = (*LOWER, "node")


def imported_packages(path: Path) -> set[str]:
    """The project packages a module imports (at any depth of the file, deferred imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in PROJECT)
    return found


@pytest.mark.parametrize("package", LOWER)
def test_lower_packages_import_only_themselves(package):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) - {package})
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    offenders = {name: packages for name, packages in offenders.items() if packages}
    assert not offenders, f"{package}/ must import no other project package: {offenders}"


def test_the_checker_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\ndef f():\n    from node.errors import NodeError\n    import p2p.host\n")
    assert imported_packages(probe) == {"node", "p2p"}
