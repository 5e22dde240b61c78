"""The package as users get it: a wheel that holds every module and the data files the code reads.

The quick test builds the wheel (no dependencies: seconds) from a copy of the files git tracks, as a fresh
clone has them, and checks its contents. The slow one installs it into a fresh virtual environment
(torch==2.13.0 CPU first, then the wheel's dependencies) and runs the CLI and the package-data readers from
/tmp, outside the clone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("node", "p2p", "ledger", "contracts", "training", "rulebook")
#: Files the code reads at run time through the package (importlib.resources or __file__).
DATA_FILES = ("contracts/artifacts/NodeRegistry.json", "contracts/artifacts/TrainingLedger.json",
              "contracts/artifacts/LedgerDisputes.json", "contracts/artifacts/ProverNorms.json",
              "contracts/build/input.json", "contracts/src/TrainingLedger.sol", "node/templates/node.toml",
              "node/tools/explorer_page/index.html")


def _tracked_tree(dest: Path) -> Path:
    """A copy of the files git tracks or would add (what a clone of this branch holds), without build
    outputs."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file() and not source.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(tmp_path: Path) -> Path:
    tree = _tracked_tree(tmp_path / "src")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "dist"), "-q"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = (tmp_path / "dist").glob("dlx_node-*.whl")
    return wheel


def test_the_wheel_holds_every_module_and_the_package_data(tmp_path):
    wheel = build_wheel(tmp_path)
    # pip builds in the source tree: setuptools' build/ and egg-info went there and stayed (dlx_build.py)
    tree = tmp_path / "src"
    left = sorted(p.name for p in tree.iterdir() if p.name == "build" or p.suffix == ".egg-info")
    assert not left, f"the wheel's build left {left} in the source tree"
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *PACKAGES], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout.split()
    modules = [name for name in tracked if name.endswith(".py") and "node_modules" not in name]
    missing = [name for name in modules if name not in names]
    assert not missing, f"modules left out of the wheel (a package missing from pyproject.toml?): {missing}"
    assert not [name for name in DATA_FILES if name not in names]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "dlx-node = node.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert not [n for n in names if "node_modules" in n or n.startswith(("tests/", "bench/"))]


def test_a_wheel_builds_from_the_sdist(tmp_path):
    """`python -m build` makes the sdist, then the wheel from it: the sdist must hold the build backend
    (dlx_build.py, MANIFEST.in), else building from it fails with "Cannot import 'dlx_build'"."""
    tree = _tracked_tree(tmp_path / "src")
    sdist_dir, wheel_dir = tmp_path / "sdist", tmp_path / "dist"
    build_sdist = f"import dlx_build; dlx_build.build_sdist({str(sdist_dir)!r})"
    done = subprocess.run([sys.executable, "-c", build_sdist], cwd=tree, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [sdist] = sdist_dir.glob("dlx_node-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    [unpacked] = (tmp_path / "unpacked").iterdir()
    assert (unpacked / "dlx_build.py").is_file(), sorted(p.name for p in unpacked.iterdir())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(unpacked), "--no-deps",
                           "--no-build-isolation", "-w", str(wheel_dir), "-q"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    [wheel] = wheel_dir.glob("dlx_node-*.whl")
    assert "node/cli.py" in zipfile.ZipFile(wheel).namelist()
    assert not [p.name for p in unpacked.iterdir() if p.name == "build"], "the build left build/ in the sdist"


_OUTSIDE = r"""
import json, sys
from importlib.resources import files
import contracts, node
assert "site-packages" in contracts.__file__ and "site-packages" in node.__file__, \
    (contracts.__file__, node.__file__)
abi = contracts.artifact("TrainingLedger")["abi"]
template = files("node").joinpath("templates", "node.toml").read_text()
from node.commands.explorer import explorer_page
page = explorer_page()
from ledger.client import LedgerClient
from ledger.chain import connect_pyevm
from ledger.account import dev_account
w3 = connect_pyevm()
registry, ledger = LedgerClient.deploy(w3, dev_account(0, w3.eth.chain_id))
print(json.dumps({"abi": len(abi), "template": "[training]" in template, "page": b"/api/snapshot" in page,
                  "deployed": bool(w3.eth.get_code(ledger))}))
"""


@pytest.mark.slow
@pytest.mark.timeout(3600)  # a fresh venv: torch and the dependencies are installed
def test_the_installed_wheel_works_outside_the_clone(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # Nothing of the clone may leak in: with PYTHONPATH naming the checkout, pip would take its
    # dlx_node.egg-info for an installed dlx-node and skip the wheel.
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # torch first, pinned: the wheel's looser torch requirement would otherwise pull the CUDA build.
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=1800, env=clean)
    subprocess.run([*pip, str(wheel)], check=True, timeout=1800, env=clean)
    outside = Path("/tmp") / f"dlx-wheel-{tmp_path.name}"
    outside.mkdir(exist_ok=True)
    try:
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(outside)}
        cli = str(venv / "bin" / "dlx-node")
        done = subprocess.run([cli, "--help"], cwd=outside, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "explorer" in done.stdout and "demo" in done.stdout, done.stderr
        done = subprocess.run([cli, "init", "--data-dir", "n", "--dev-account", "1"], cwd=outside, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[ledger]" in (outside / "n" / "node.toml").read_text()
        done = subprocess.run([str(venv / "bin" / "python"), "-c", _OUTSIDE], cwd=outside, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert '"template": true' in done.stdout and '"page": true' in done.stdout
        assert '"deployed": true' in done.stdout
        # No anvil on this PATH: the demo says exactly how to get it, and starts nothing.
        done = subprocess.run([cli, "demo", "--out", "d"], cwd=outside, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 2 and "npm install -g @foundry-rs/anvil@" in done.stderr, done.stderr
    finally:
        shutil.rmtree(outside, ignore_errors=True)
