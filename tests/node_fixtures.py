"""Fixtures and helpers for tests that run real node processes with the local launcher."""

from __future__ import annotations

import json
import time

import pytest

from node.commands.launcher import LocalRun

#: A tiny, fast run: every test's base settings.
TINY = ["model.preset=tiny", "diloco.inner_steps=4", "training.batch_size=4", "round_timeout=60",
        "checkpoint_every=1"]
#: What a test that audits the whole run from the nodes' files adds: every round kept (the default retention,
#: "windows", drops rounds whose windows closed, which the audit would then call unverifiable).
KEEP_ALL = ["storage.retention=all"]


def run_logs(run: LocalRun, lines: int = 40) -> str:
    """The last lines of every node's logs (for assertion messages)."""
    out = []
    for slot in run.nodes:
        for path in sorted(slot.data_dir.glob("node-*.log")):
            out.append(f"==== {path}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(out)


def node_log(slot) -> str:
    """Every log file of a node, whole, in order (its lives after restarts included)."""
    return "\n".join(path.read_text(errors="replace") for path in sorted(slot.data_dir.glob("node-*.log")))


def wait_for(predicate, timeout: float, what: str, run: LocalRun, *, none_exits: bool = False) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` with the run's logs after ``timeout`` seconds
    (``none_exits``: and as soon as any of the run's nodes has exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if none_exits:
            assert len(run.running()) == len(run.nodes), "a node exited:\n" + run_logs(run)
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout}s\n" + run_logs(run))


def stopped_cleanly(run: LocalRun, client) -> tuple[object, list[int]]:
    """Stop every node and check that each exited 0 with no traceback in any log and that the run's committed
    rounds are in order, none twice, none missing. Returns (the run's history, its committed rounds)."""
    run.stop_nodes()
    assert all(s.process.returncode == 0 for s in run.nodes), run_logs(run)
    logs = "".join(node_log(s) for s in run.nodes)
    assert "Traceback" not in logs, run_logs(run)
    history = client.history(run.run_id)
    rounds = [c.commit.round for c in history.commits]
    assert rounds == list(range(len(rounds))), rounds
    return history, rounds


def node_state(slot) -> dict:
    """A node's state.json."""
    return json.loads((slot.data_dir / "state.json").read_text())


def assert_chain_roots(run: LocalRun, commits) -> None:
    """Every node recorded, for every committed round, the weights root the chain holds."""
    for slot in run.nodes:
        roots = node_state(slot)["weights_roots"]
        assert [roots.get(str(c.commit.round)) for c in commits] == [c.commit.weights_root.hex()
                                                                     for c in commits], \
            slot.name


def assert_round_1_proven_against_the_colluders(client, run: LocalRun, honest, colluders) -> str:
    """Round 1 of ``run`` was proven wrong on chain: its attesters are exactly the colluders, each slashed,
    and the honest member is still active. Returns the honest member's account."""
    from ledger.account import dev_account

    history = client.history(run.run_id)
    assert history.dispute_outcomes.get(1) == "proven wrong", history.dispute_outcomes
    committed = next(c for c in history.commits if c.commit.round == 1)
    colluder_accounts = {dev_account(slot.account, run.chain_id).address.lower() for slot in colluders}
    assert {a.lower() for a in committed.attesters} == colluder_accounts  # the whole quorum colluded
    for account in colluder_accounts:
        assert client.member(run.run_id, account).status == "slashed"
    honest_account = dev_account(honest.account, run.chain_id).address
    assert client.member(run.run_id, honest_account).status == "active"
    return honest_account


@pytest.fixture
def make_run(tmp_path):
    """Make (and set up) LocalRuns in the test's directory; every one is stopped at teardown."""
    runs = []

    def make(**kw) -> LocalRun:
        # These runs test the protocol's other mechanics as they were written: k alone (1 unless given), no
        # fraction. The shipped defaults (k 2, half the counted members) run in the demo and the trust tests.
        kw.setdefault("attest_quorum", 1)
        kw.setdefault("attest_quorum_bps", 0)
        kw.setdefault("allow_weak_quorum", kw["attest_quorum"] < 2 or kw["attest_quorum_bps"] < 5000)
        run = LocalRun(tmp_path / f"run{len(runs)}", **kw)
        runs.append(run)
        run.setup()
        return run

    yield make
    for run in runs:
        run.stop()
