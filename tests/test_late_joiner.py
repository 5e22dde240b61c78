"""Issue 80 point 2: a late joiner is told how many rounds are left before it stakes, is refused a seat too
short to count, and a node whose run ended stops by itself with the run-over code (6).

``join`` of a run at its last round staked 1 ETH with no word that one round was left; after the run
committed, the node stayed at "finishing" and logged "no close ... waiting for replicas" for minutes. The
commands run for real (``python -m node.cli``) against a real anvil run (node/commands/launcher.py LocalRun);
the node's wait on its last close is the real RoundCoordinator's, on a real chain (py-evm).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from node_fixtures import TINY

from ledger.account import dev_account
from ledger.chain import connect_pyevm
from ledger.runparams import DEFAULT_TENURE_ROUNDS
from node.exitcodes import ExitCode
from tests.ledger_fixtures import deploy, make_record

CLI = [sys.executable, "-m", "node.cli"]


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, input="",
                          check=False)


@pytest.fixture(scope="module")
def late_run(tmp_path_factory):
    """A 3-round run on a real anvil (tenure 4: a joiner counts after 4 rounds) whose round 0 two founders
    committed (dev accounts of its first two slots); slot 2 holds no seat."""
    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path_factory.mktemp("late"), replicas=3, stages=1, split=False,
                   settings=[*TINY, "rounds=3"], stake_wei=10**17, attest_quorum=1, attest_quorum_bps=0,
                   allow_weak_quorum=True)
    run.setup()
    try:
        founders = []
        for slot in run.nodes[:2]:
            client = run.client()
            from ledger.client import LedgerClient
            from tests.ledger_fixtures import node_key, raw_public_key

            member = LedgerClient(client.w3, dev_account(slot.account, run.chain_id), run.registry,
                                  run.ledger)
            key = node_key(slot.account + 100)
            member.register(raw_public_key(key), key.sign(member.my_binding_message()))
            member.join_run(run.run_id)
            founders.append(member)
        record = make_record(run.run_id, 0, founders[0].head_of(run.run_id), "round 0")
        founders[0].commit_round(record, [founders[0].sign_record(record)])
        yield run
    finally:
        run.stop()


def test_join_says_the_rounds_left_and_refuses_a_seat_that_would_never_count(late_run, tmp_path):
    run = late_run
    client = run.client()
    assert client.commit_count(run.run_id) == 1 and client.run_info(run.run_id).tenure_rounds == \
        DEFAULT_TENURE_ROUNDS
    joiner = dev_account(7, run.chain_id).address
    proc = run_cli("join", run.link(), "--data-dir", str(tmp_path / "late"), "--dev-account", "7", "--yes",
                   "--no-start", "--no-progress")
    assert proc.returncode == ExitCode.ACCOUNT == 6, proc.stdout + proc.stderr
    assert f"run {run.run_id}: 2 of its 3 rounds left (1 committed)" in proc.stdout, proc.stdout
    assert "tenure_rounds = 4 rounds in force" in proc.stderr and "not staking (nothing was sent)" in \
        proc.stderr, proc.stderr
    assert client.member(run.run_id, joiner) is None and client.key_of(joiner) is None  # nothing staked


def test_start_of_a_node_without_a_seat_says_the_rounds_left_and_refuses(late_run):
    run = late_run
    slot = run.nodes[2]
    account = dev_account(slot.account, run.chain_id).address
    proc = run_cli("start", "--no-progress", "--yes", "--config", str(slot.config_path))
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert f"run {run.run_id}: 2 of its 3 rounds left (1 committed)" in proc.stdout, proc.stdout
    assert "not staking (nothing was sent)" in proc.stderr, proc.stderr
    assert run.client().member(run.run_id, account) is None


def test_a_node_still_waiting_for_a_close_stops_once_the_run_is_over():
    """The real close wait of a node whose replicas finished without it: once the chain holds the run's last
    round, it stops (RoundStopped, the node's stop event set) and the node exits with RunOver (6)."""
    from node.errors import RunOver
    from node.exitcodes import exit_code_for
    from node.live.chain.onchain import NodeChain
    from node.live.exchange.coordination import RoundCoordinator, RoundStopped
    from node.live.round.ending import RunOverWatch

    deployment = deploy(connect_pyevm())
    members = deployment.member_run((1, 2), quorum=1, max_rounds=2)
    watch = RunOverWatch(NodeChain(deployment.client(1)), members.run_id, every=0.0)
    members.commit("round 0")
    assert not watch()  # round 1 still to come
    coordinator = RoundCoordinator.__new__(RoundCoordinator)  # its wait's check alone, as assembled
    coordinator.stop, coordinator.interrupt = threading.Event(), None
    coordinator.run_over, coordinator.run_over_seen = watch, False
    coordinator._raise_if_no_longer_waited(1, 0)  # waits on
    members.commit("round 1")
    with pytest.raises(RoundStopped, match="the run is over on chain"):
        coordinator._raise_if_no_longer_waited(1, 0)
    assert coordinator.run_over_seen and coordinator.stop.is_set()
    assert exit_code_for(RunOver("x")) == 6
    open_ended = deployment.member_run((1, 2), quorum=1)
    endless = RunOverWatch(NodeChain(deployment.client(1)), open_ended.run_id, every=0.0)
    open_ended.commit("round 0")
    assert not endless()  # an open-ended run never ends
