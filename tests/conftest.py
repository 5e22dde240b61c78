"""Shared pytest configuration. Fixture plugins of each area are listed here; append, do not rewrite."""

import shutil
import subprocess

import pytest

from contracts import CONTRACTS_DIR

pytest_plugins = ["ledger_fixtures", "node_fixtures", "torch_fixtures"]

#: Modules that build the contracts: with forge into contracts/forge (out/, cache/), or with solcjs through
#: :func:`contracts_build_check`. Under pytest-xdist one worker runs them all (forge's builds do not
#: collide, the solcjs build runs once).
CONTRACT_MODULES = ("tests/test_forge_invariants.py", "tests/test_static_analysis.py", "tests/test_halmos.py",
                    "tests/test_contracts_build.py")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: none without it
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile`` (pyproject.toml's addopts): each test module goes whole to one worker, so a
    module- or class-scoped fixture (a short run, a compiled model) is built once, and the modules that
    build the contracts (:data:`CONTRACT_MODULES`) go to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "contracts" if module in CONTRACT_MODULES else module

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def contracts_build_check() -> subprocess.CompletedProcess:
    """``node contracts/build.js --check``, run once: the contracts compiled in memory by the pinned solcjs
    and compared with the committed artifacts (a full compile: minutes on a loaded 2-core machine)."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node missing (a test dependency)")
    return subprocess.run([node, str(CONTRACTS_DIR / "build.js"), "--check"], capture_output=True, text=True,
                          timeout=600, check=False)
