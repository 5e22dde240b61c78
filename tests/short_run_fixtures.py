"""One short real run, shared by tests/test_audit_e2e.py and tests/test_pull_e2e.py.

Real anvil, 2 real ``dlx-node start`` processes, 2 replicas x 2 stages held by one node each, 3 outer
rounds, a checkpoint every round, every round's record signed by both nodes (the run's quorum is k = 2).
The fixtures are module-scoped: each test module that imports them gets its own run, and anvil stays up
until that module ends.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from node.commands.launcher import LocalRun

SETTINGS = [
    "model.preset=tiny",
    "diloco.inner_steps=4",
    "training.batch_size=4",
    "round_timeout=60",
    "checkpoint_every=1",
    "rounds=3",
    "join_timeout=60",
]
ROUNDS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # Set up in the first test's setup: the tests' timeouts bound their own bodies (func_only), and the run's
    # wait gives up only when no node has finished a round for 300 s, so a loaded machine makes it slower.
    local = LocalRun(
        tmp_path_factory.mktemp("audit-run"),
        replicas=2,
        stages=2,
        split=False,
        settings=SETTINGS,
        attest_quorum=2,  # both nodes sign every round's record
    )
    try:
        local.setup()
        local.start()
        ok = local.wait(300, progress=True)
        logs = "\n".join(
            p.read_text(errors="replace")[-3000:] for s in local.nodes for p in s.data_dir.glob("*.log")
        )
        assert ok, logs
        assert [c.commit.round for c in local.client().history(local.run_id).commits] == list(
            range(ROUNDS)
        ), logs
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def client(run):
    return run.client()


def node_archives(run) -> list[Path]:
    return [slot.data_dir for slot in run.nodes]


def cli_args(run, **options) -> SimpleNamespace:
    """The parsed arguments of a command that reads the run's chain (``dlx-node audit``, ``pull``): the run's
    RPC, run id and deployment file, no registry or ledger override, no bootstrap peers; ``options`` add the
    rest."""
    return SimpleNamespace(rpc=run.url, run=run.run_id, deployment=str(run.workdir / "deployment.json"),
                           registry="", ledger="", bootstrap=[], **options)
