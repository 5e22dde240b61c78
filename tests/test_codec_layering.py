"""The codec's modules: no import cycle, no private name crossing a module, each importable on its own.

The codec is ``training/compression.py`` (the front door), ``training/codec_wire.py``
(the wire format) and the ``training/codec/`` package (the encoder protocol, one
module per kind, the registry and what they share). Its modules once imported
each other in a cycle held together by function-level imports and 17 private
names (issue 29 item 2); these tests keep it from coming back.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("training", "p2p", "ledger", "node")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES
                for path in sorted((ROOT / package).rglob("*.py"))}


def codec_modules() -> list[str]:
    names = ["training.compression", "training.codec_wire"]
    names += sorted(module_name(path) for path in (ROOT / "training/codec").glob("*.py"))
    return names


def is_codec(module: str) -> bool:
    return module in ("training.compression", "training.codec_wire") or module.startswith("training.codec.") \
        or module == "training.codec"


def imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """``(imported module, imported name or "", nested)`` of every project import in ``path`` (any depth)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        nested = id(node) not in top_level
        if isinstance(node, ast.Import):
            found += [(alias.name, "", nested) for alias in node.names if alias.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in modules:  # ``from training.codec import base``: the module itself
                    found.append((submodule, "", nested))
                elif node.module in modules:
                    found.append((node.module, alias.name, nested))
    return found


def private_attribute_uses(path: Path, modules: dict[str, Path]) -> list[str]:
    """``module._name`` where ``module`` is a codec module bound by an import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
    return [
        f"{bound[node.value.id]}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
        and is_codec(bound[node.value.id]) and node.attr.startswith("_") and not node.attr.startswith("__")
    ]


def test_no_private_name_crosses_into_or_out_of_a_codec_module():
    modules = project_modules()
    offenders = []
    for importer, path in modules.items():
        for module, name, _ in imports(path, modules):
            if (is_codec(importer) or is_codec(module)) and name.startswith("_") \
                    and not name.startswith("__"):
                offenders.append(f"{importer} imports {module}.{name}")
        offenders += [f"{importer} uses {use}" for use in private_attribute_uses(path, modules)]
    assert not offenders, offenders


def test_codec_modules_import_at_module_level_only_and_form_no_cycle():
    modules = project_modules()
    graph = {}
    nested = []
    for importer in codec_modules():
        deps = set()
        for module, _, inner in imports(modules[importer], modules):
            if inner:
                nested.append(f"{importer} imports {module} inside a function")
            if is_codec(module) and module != importer:
                deps.add(module)
        graph[importer] = deps
    assert not nested, nested
    # Depth-first search for a back edge: a cycle among the codec's modules.
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*trail, module, dep])}")
            if dep not in state:
                visit(dep, [*trail, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_checks_see_what_they_look_for(tmp_path, monkeypatch):
    probe = tmp_path / "probe.py"
    probe.write_text("from training.codec import base\nfrom training.codec.coding import _CANDIDATES\n"
                     "def f():\n    from training.codec_wire import f32_bytes\n    return base._x\n")
    modules = project_modules()
    found = imports(probe, modules)
    assert ("training.codec.base", "", False) in found
    assert ("training.codec.coding", "_CANDIDATES", False) in found
    assert ("training.codec_wire", "f32_bytes", True) in found
    assert private_attribute_uses(probe, modules) == ["training.codec.base._x"]


def test_each_codec_module_imports_on_its_own():
    """In a fresh interpreter, each module is imported with none of the project's modules loaded before it.

    One interpreter for all of them (a fresh one per module would pay torch's import each time):
    before each import every ``training``/``node``/``p2p``/``ledger`` module is dropped from
    ``sys.modules``, so each import starts from the project state of a fresh interpreter, which is
    what a cycle between modules depends on.
    """
    names = codec_modules()
    script = (
        "import json, sys, importlib\n"
        "import torch  # noqa: F401  (the heavy dependency, loaded once)\n"
        f"names = {names!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('training', 'node', 'p2p', "
        "'ledger')]:\n        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(failed))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}
    assert len(names) >= 12  # the front door, the wire format and the package's modules


@pytest.mark.parametrize("version", ["v1", "v2", "v3", "v4"])
def test_every_version_a_configuration_can_name_is_registered(version):
    from training.codec.registry import ENCODERS, encoder_for
    from training.config import EncoderVersion
    from training.config_compression import CompressionConfig

    assert set(ENCODERS) == set(EncoderVersion)
    encoder = encoder_for(CompressionConfig(encoder=version))
    assert encoder.version == version and type(encoder) is ENCODERS[EncoderVersion(version)]
