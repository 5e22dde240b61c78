"""A managed anvil across stops, crashes and outages: state file, idempotent resubmission, retries."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from ledger_fixtures import FAST_RETRY, deploy
from web3 import HTTPProvider, Web3

from ledger.account import dev_account
from ledger.chain import OutageLog, RetryPolicy, call_with_retries, connect_rpc
from ledger.anvil import AnvilProcess
from ledger.client import LedgerClient
from ledger.errors import ChainUnavailable, LedgerConfigError


def reconnect(
    anvil: AnvilProcess, deployment, index: int = 1, retry: RetryPolicy = FAST_RETRY
) -> LedgerClient:
    w3 = connect_rpc(anvil.url, wait=5)
    return LedgerClient(
        w3, dev_account(index, w3.eth.chain_id), deployment.registry, deployment.ledger, retry=retry
    )


def test_resubmission_after_restart_with_state_file_is_idempotent(tmp_path):
    state = tmp_path / "chain.json"
    anvil = AnvilProcess(state_file=state)
    try:
        anvil.start()
        deployment = deploy(connect_rpc(anvil.url))
        run = deployment.member_run((1, 2), quorum=2)
        record, first = run.commit()
        signatures = run.sign(record)
        anvil.stop()  # SIGTERM: anvil dumps its state file
        assert state.stat().st_size > 0

        anvil.start()
        client = reconnect(anvil, deployment)
        assert client.commit_of(run.run_id, 0) == record
        block = client.w3.eth.block_number
        assert client.commit_round(record, signatures) == first  # the node retrying after the outage
        assert client.w3.eth.block_number == block
        deployment.w3 = client.w3
        deployment._clients = {1: client}
        run.commit()  # the nonce continues from the restored chain
        assert client.last_round(run.run_id) == 1 and client.commit_count(run.run_id) == 2
        assert client.history(run.run_id).commits[0].tx_hash == first
    finally:
        anvil.stop()


def test_crash_loses_recent_blocks_and_resubmission_recommits(tmp_path):
    state = tmp_path / "chain.json"
    anvil = AnvilProcess(state_file=state, state_interval=1)
    try:
        anvil.start()
        deployment = deploy(connect_rpc(anvil.url))
        run = deployment.member_run((1,), quorum=1)
        first, _ = run.commit()
        time.sleep(2.5)  # at least one periodic dump holds round 0
        second, _ = run.commit()
        signatures = run.sign(second)
        anvil.kill()  # SIGKILL: round 1 may or may not have reached the state file

        anvil.start()
        client = reconnect(anvil, deployment)
        deployment.w3 = client.w3
        deployment._clients = {1: client}
        assert client.commit_of(run.run_id, 0) == first
        client.commit_round(second, signatures)  # either a no-op or a fresh commit, never a double one
        run.commit()
        assert client.commit_count(run.run_id) == 3
        assert [r.commit.round for r in client.history(run.run_id).commits] == [0, 1, 2]
    finally:
        anvil.stop()


def test_calls_retry_while_the_rpc_is_down(tmp_path):
    state = tmp_path / "chain.json"
    anvil = AnvilProcess(state_file=state)
    try:
        anvil.start()
        deployment = deploy(connect_rpc(anvil.url))
        run = deployment.member_run((1,), quorum=1)
        client, run_id = run.client(1), run.run_id
        record = run.next_record()
        signatures = run.sign(record)
        port = int(anvil.url.rsplit(":", 1)[1])
        anvil.stop()

        patient = LedgerClient(
            client.w3,
            client.account,
            deployment.registry,
            deployment.ledger,
            retry=RetryPolicy(total_seconds=30, initial_delay=0.1, max_delay=0.5),
        )
        impatient = LedgerClient(
            client.w3,
            client.account,
            deployment.registry,
            deployment.ledger,
            retry=RetryPolicy(total_seconds=0.3, initial_delay=0.1, max_delay=0.1),
        )
        with pytest.raises(ChainUnavailable):
            impatient.last_round(run_id)

        restarted = AnvilProcess(state_file=state, port=port)
        reconnect_later = threading.Timer(1.0, restarted.start)
        reconnect_later.start()
        try:
            patient.commit_round(record, signatures)  # blocks through the outage, then commits
            assert patient.commit_of(run_id, 0) == record
        finally:
            reconnect_later.join()
            restarted.stop()
    finally:
        anvil.stop()


def test_unreachable_rpc_and_missing_binary(tmp_path, monkeypatch):
    with AnvilProcess() as anvil:
        url = anvil.url
    with pytest.raises(ChainUnavailable, match="unreachable"):
        connect_rpc(url, timeout=1, wait=0.3)
    with pytest.raises(LedgerConfigError, match="http"):  # a usage error (exit 2), not an outage
        connect_rpc("ws://127.0.0.1:1")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("not a state file {")
    with pytest.raises(ChainUnavailable, match="exited with code"):
        AnvilProcess(state_file=corrupt).start()
    monkeypatch.setenv("DLX_ANVIL", str(tmp_path / "no-anvil"))
    with pytest.raises(ChainUnavailable, match="DLX_ANVIL"):
        AnvilProcess().start()


def test_an_outage_is_logged_at_a_bounded_rate(tmp_path, caplog):
    """Many failed requests of one outage, from several threads, give one warning, then one line when it ends.

    The threads share a log of their own: the process's (``OUTAGE``) is also told by any other thread of the
    test process whose chain answers (a full suite run had such threads, and each answer ended the outage).
    """
    log = OutageLog()
    policy = RetryPolicy(total_seconds=1.0, initial_delay=0.02, max_delay=0.02)
    with AnvilProcess() as anvil:
        url = anvil.url
        w3 = Web3(HTTPProvider(url, request_kwargs={"timeout": 1}, exception_retry_configuration=None))
        # an answer: no outage in progress
        call_with_retries(lambda: w3.eth.chain_id, policy, "eth_chainId", outage=log)
    failures = []

    def poll() -> None:
        try:
            call_with_retries(lambda: w3.eth.chain_id, policy, "eth_chainId", outage=log)
        except ChainUnavailable as exc:
            failures.append(exc)

    with caplog.at_level(logging.DEBUG, logger="ledger.chain"):
        threads = [threading.Thread(target=poll) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(failures) == 3 and "attempt(s)" in str(failures[0])
        attempts = sum(int(str(exc).split(" attempt(s)")[0].rsplit(" ", 1)[1]) for exc in failures)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        # Several failed attempts (more than one a thread; how many fit in the policy's second depends on the
        # machine's load), one warning.
        assert attempts > len(threads) and len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "unreachable" in warnings[0].getMessage() and log.down_since is not None
        with AnvilProcess(port=int(url.rsplit(":", 1)[1])):
            assert call_with_retries(lambda: w3.eth.chain_id, policy, "eth_chainId", outage=log) == 31337
        assert log.down_since is None
        assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_a_nodes_head_reads_fail_as_chain_unavailable_through_an_outage(tmp_path):
    # The 60-minute soak's chain RPC outage: NodeChain read the head block from web3 directly, so the
    # outage reached the availability-challenge thread as requests' ReadTimeout, outside DLX_ERRORS,
    # and killed the thread (five nodes, "Exception in thread challenges"). Every head read now goes
    # through the client's retries and ends, when the outage outlasts them, as ChainUnavailable.
    from node.errors import DLX_ERRORS
    from node.live.chain.onchain import NodeChain

    anvil = AnvilProcess()
    try:
        anvil.start()
        deployment = deploy(connect_rpc(anvil.url))
        run = deployment.member_run((1, 2), quorum=2)
        run.commit()
        chain = NodeChain(reconnect(anvil, deployment, retry=RetryPolicy(total_seconds=0.5, initial_delay=0.1,
                                                                          max_delay=0.2)), confirmations=3)
        head = chain.block_number()
        assert chain.availability_challenges(run.run_id, 0) == ([], head)
    finally:
        anvil.stop()
    reads = (chain.block_number, lambda: chain.availability_challenges(run.run_id, 0),
             lambda: chain.final_commit_of(run.run_id, 0))
    for read in reads:
        with pytest.raises(ChainUnavailable, match="unreachable") as caught:
            read()
        assert isinstance(caught.value, DLX_ERRORS)


@pytest.mark.parametrize("history_states", [64, None])
def test_anvil_writes_no_state_history_to_disk_and_keeps_logs(tmp_path, monkeypatch, history_states):
    """By its default anvil writes every older state to ~/.foundry/anvil/tmp and never removes them (6 GB in
    half an hour of this suite, which filled CI's disk); an AnvilProcess keeps the last ``history_states`` in
    memory and writes none, while every block and event log stays readable."""
    monkeypatch.setenv("HOME", str(tmp_path))  # anvil's foundry directory is $HOME/.foundry
    anvil = AnvilProcess(history_states=history_states)
    try:
        anvil.start()
        w3 = connect_rpc(anvil.url)
        deployment = deploy(w3)
        deployment.member_run((1, 2), quorum=2)
        sender = w3.eth.accounts[0]
        for _ in range(500):  # a block each, with a state (anvil writes none for empty blocks)
            sent = w3.provider.make_request("eth_sendTransaction",
                                            [{"from": sender, "to": sender, "value": "0x1"}])
            assert "error" not in sent, sent
            # Mined before the next is sent: anvil answers with the hash once the transaction is in its pool,
            # and two sent back to back on a loaded machine can
            # share a block (a full suite once counted 499 blocks).
            w3.eth.wait_for_transaction_receipt(sent["result"], timeout=60, poll_latency=0.01)
        assert w3.eth.block_number > 500
        logs = w3.eth.get_logs({"fromBlock": 0, "toBlock": "latest", "address": deployment.ledger})
        assert logs, "the deployment's events are gone"
        assert w3.eth.get_block(1)["number"] == 1
        written = [p for p in (tmp_path / ".foundry").rglob("*") if p.is_file()]
    finally:
        anvil.stop()
    if history_states is None:
        assert written, "anvil's default wrote no state: this test no longer shows what it guards"
    else:
        assert written == [], written[:3]
        with pytest.raises(ValueError, match="history_states"):
            AnvilProcess(history_states=0)
