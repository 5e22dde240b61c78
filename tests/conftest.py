"""Shared pytest configuration. Fixture plugins of each area are listed here; append, do not rewrite."""

import pytest

pytest_plugins = ["ledger_fixtures", "node_fixtures", "torch_fixtures"]

#: Modules that build into contracts/forge (out/, cache/): under pytest-xdist one worker runs them all.
FORGE_MODULES = ("tests/test_forge_invariants.py", "tests/test_static_analysis.py", "tests/test_halmos.py")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: none without it
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile`` (pyproject.toml's addopts): each test module goes whole to one worker, so a
    module- or class-scoped fixture (a short run, a compiled model) is built once, and the modules that
    build with forge go to one worker together."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "forge" if module in FORGE_MODULES else module

    return ModuleScheduling(config, log)
