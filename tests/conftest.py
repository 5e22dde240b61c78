"""Shared pytest configuration. Fixture plugins of each area are listed here; append, do not rewrite."""

import logging
import shutil
import subprocess

import pytest

from contracts import CONTRACTS_DIR

pytest_plugins = ["ledger_fixtures", "node_fixtures", "torch_fixtures"]


@pytest.fixture(autouse=True)
def _logging_as_found():
    """Each test ends with the root and ``libp2p`` loggers as it found them. A test that runs a command in
    process (node.cli.configure_logging) gives the root logger a handler bound to that test's captured stderr;
    after it, every record of a later test on the worker went to the closed capture ("--- Logging error ---"
    printed into that test's own captured stderr, seen failing test_shard_transfer's progress line)."""
    root, libp2p = logging.getLogger(), logging.getLogger("libp2p")
    saved = (root.handlers[:], root.level, libp2p.handlers[:], libp2p.level, libp2p.propagate)
    yield
    root.handlers[:], _, libp2p.handlers[:], _, libp2p.propagate = saved
    root.setLevel(saved[1])
    libp2p.setLevel(saved[3])

#: Modules that build the contracts: with forge into contracts/forge (out/, cache/), or with solcjs through
#: :func:`contracts_build_check`. Under pytest-xdist one worker runs them all (forge's builds do not
#: collide, the solcjs build runs once).
CONTRACT_MODULES = ("tests/test_forge_invariants.py", "tests/test_static_analysis.py", "tests/test_halmos.py",
                    "tests/test_contracts_build.py")


#: The default suite's longest modules, longest first (per-module totals of a full run, 2026-11-28; the
#: ledger modules it found longest are short since their fresh anvil and short windows), collected first:
#: pytest-xdist hands the modules out in the collected order (``--no-loadscope-reorder`` in pyproject.toml;
#: its default order, most tests first, left the one-test end-to-end modules, minutes each, to the end, one
#: worker running them while the other idled). The modules that build the contracts (one scope,
#: :data:`CONTRACT_MODULES`) are listed together. A module missing here keeps its place after these; a
#: renamed one is only ordered later.
LONG_MODULES = ("test_journeys.py", "test_contribution_binding.py", "test_fraud_clock.py",
                "test_trust_attacks.py", "test_forge_invariants.py", "test_contracts_build.py",
                "test_static_analysis.py", "test_halmos.py", "test_run_values.py", "test_trust_model.py",
                "test_heterogeneous_screening.py", "test_norm_proof.py", "test_ledger_commits.py",
                "test_reproducible.py", "test_fraud_live_rank.py", "test_journeys_printed.py",
                "test_training_simulate.py", "test_reexec_e2e.py", "test_fraud_live.py",
                "test_exit_codes.py", "test_node_e2e.py", "test_audit_ledger.py",
                "test_fraud_live_sums.py", "test_fraud_live_values.py", "test_audit_e2e.py",
                "test_demo.py", "test_byzantine_e2e.py", "test_reentry_hold.py")


#: The end-to-end tier (marker ``e2e``, issue 80 point 10): real multi-process runs and commands (every
#: ``*_e2e.py`` module, the newcomer's journeys, the demo, a fresh node joining a running run, two sites
#: behind NATs in network namespaces, :data:`PROCESS_MODULES`), the live node's whole fraud-proof games
#: (real libp2p hosts and py-evm, one to two minutes a module: :data:`LIVE_GAME_MODULES`) and the
#: contracts' tools (forge's
#: campaign, slither, halmos, and tests/test_contracts_build.py's solcjs rebuild, marked ``e2e`` by itself:
#: .ci/run also checks it with ``build.js --check``, and the module's fast checks stay in the default tier).
#: README's test command leaves them out (pyproject.toml's addopts: ``-m 'not slow and not e2e'``) so that
#: a contributor's run of it takes about 12 minutes on 2 cores; ``pytest -m 'e2e and not slow'`` runs them,
#: and .ci/run runs both.
LIVE_GAME_MODULES = ("test_fraud_live.py", "test_fraud_live_sums.py", "test_fraud_live_values.py",
                     "test_fraud_live_normed.py", "test_fraud_live_rank.py", "test_reentry_hold.py")
#: Commands and processes started as a user starts them: the CLI's exit codes (a demo, a join, a full disk),
#: start and status with SIGTERM, the launcher past the dev accounts, demos stopped by signals, a late
#: joiner, an organizer's second run, a replica's stages in 2 gloo processes, and the network emulator's
#: hosts in namespaces.
PROCESS_MODULES = ("test_exit_codes.py", "test_node_operations.py", "test_launcher.py", "test_signals.py",
                   "test_late_joiner.py", "test_organizer_runs.py", "test_training_pipeline.py",
                   "test_netlab.py", "test_netlab_p2p.py")
E2E_MODULES = ("test_journeys.py", "test_journeys_printed.py", "test_demo.py", "test_forge_invariants.py",
               "test_static_analysis.py", "test_halmos.py", "test_join.py",
               "test_p2p_nat.py", *LIVE_GAME_MODULES, *PROCESS_MODULES)


def is_e2e_module(name: str) -> bool:
    return name.endswith("_e2e.py") or name in E2E_MODULES


def pytest_collection_modifyitems(items):
    """Mark the end-to-end tier (:func:`is_e2e_module`); then the modules of :data:`LONG_MODULES` first, in
    its order, the others after, as collected (a stable sort: each module's tests keep their order)."""
    for item in items:
        if is_e2e_module(item.nodeid.split("::")[0].rsplit("/", 1)[-1]):
            item.add_marker(pytest.mark.e2e)
    rank = {name: index for index, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].rsplit("/", 1)[-1], len(rank)))


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
