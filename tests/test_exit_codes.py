"""One meaning per exit code (issues 65 point 14, 80 point 6): node/exitcodes.py is the one table, README.md
holds it as :func:`node.exitcodes.readme_table` renders it.

Every error class maps to exactly one code and no two codes share a meaning. The real ``dlx-node`` is run:
usage (2), README's fetch-then-prepare offline (10, then no prepare), an interrupted fetch (130), ``status``
of a missing or never-used directory (2) and of a stopped node (15, figures rounded), a full disk (4, naming
the destination), a join whose peers answer nothing against a real anvil (10), a start whose run's checkpoint
no peer serves (10), ``pull --round`` of a round without a checkpoint (9) and a demo stopped by SIGTERM (143).
``create-run`` by an account registered with another node key (6) is run in tests/test_chain_commands.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_disk import check_small_disk, small_disk_command

from ledger.account import dev_account
from ledger.errors import AccountError, ChainUnavailable, LedgerError
from node.errors import (
    AuditFailed,
    AuditIncomplete,
    ConfigError,
    DataFetchError,
    DataFetchUsage,
    DataMismatch,
    DataUnreachable,
    DiskFull,
    NetworkUnreachable,
    NodeError,
    NotRegistered,
    NotYet,
    PortBusy,
    PullUnavailable,
    RoundPending,
    StateError,
)
from node.exitcodes import EXIT_CODES, MEANINGS, ExitCode, exit_code_for, readme_table
from node.tools.pull import NoCheckpoint
from p2p.errors import BlobStoreFull, P2PError
from training.errors import TrainingError

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "node.cli"]


def test_the_readme_holds_the_table_rendered_from_node_exitcodes_and_no_other():
    text = (REPO / "README.md").read_text()
    table = readme_table()
    assert text.count("| code | meaning |") == 1 and table in text
    rows = table.splitlines()[2:]
    assert [int(row.split("|")[1]) for row in rows] == [int(code) for code in ExitCode]
    for code in (1, 130, 143):  # the codes of no error class are listed too
        assert f"| {code} | {MEANINGS[ExitCode(code)]} |" in text


def test_one_meaning_per_code_and_one_code_per_error_class():
    assert set(MEANINGS) == set(ExitCode) and len({int(c) for c in ExitCode}) == len(ExitCode)
    assert len(set(MEANINGS.values())) == len(MEANINGS)
    classes = [cls for group, _ in EXIT_CODES for cls in group]
    assert len(classes) == len(set(classes))
    codes = [code for _, code in EXIT_CODES]
    assert len(codes) == len(set(codes)), "two rows of the table give one code: merge them"
    assert {ExitCode.OK, ExitCode.UNEXPECTED, ExitCode.INTERRUPTED, ExitCode.TERMINATED}.isdisjoint(codes)


@pytest.mark.parametrize(("error", "code"), [
    (ConfigError("x"), 2), (NodeError("x"), 3), (StateError("x"), 4), (DiskFull("x"), 4),
    (ChainUnavailable("x"), 5), (NotRegistered("x"), 6), (AccountError("x"), 6), (PortBusy("x"), 7),
    (AuditFailed("x"), 8), (RoundPending("x"), 9), (PullUnavailable("x"), 9), (NoCheckpoint("x"), 9),
    (P2PError("x"), 10), (NetworkUnreachable("x"), 10), (DataUnreachable("x"), 10), (DataFetchError("x"), 10),
    (DataMismatch("x"), 10), (DataFetchUsage("x"), 2), (LedgerError("x"), 11), (BlobStoreFull("x"), 4),
    (TrainingError("x"), 12), (AuditIncomplete("x"), 13), (NotYet("x"), 14), (RuntimeError("x"), 1),
])
def test_each_kind_of_failure_has_its_code(error, code):
    assert exit_code_for(error) == code


def test_no_command_and_a_bad_option_are_usage_errors():
    proc = subprocess.run(CLI, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    proc = subprocess.run([*CLI, "data", "fetch", "tinyshakespeare", "--no-such-option"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr


def test_an_interrupted_command_exits_130_without_a_traceback(tmp_path):
    with socket.socket() as server:  # accepts the connection (the kernel's backlog) and never answers
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/input.txt"
        command = [*CLI, "data", "fetch", "tinyshakespeare", "--dir", str(tmp_path), "--url", url]
        # As from a terminal: SIGINT at its default. A process started with it ignored (an xdist worker's
        # children, `cmd &` in a script) keeps ignoring it, as POSIX wants: no KeyboardInterrupt.
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        server.settimeout(0.5)
        conn = None
        try:
            deadline = time.monotonic() + 60
            while conn is None and time.monotonic() < deadline and proc.poll() is None:
                try:  # it waits on the server once it connected
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
            time.sleep(1.0)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGINT)
            _out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            if conn is not None:
                conn.close()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and re.search(r"interrupted", err), err


def _readme_block_with(text: str) -> list[str]:
    """The lines of README.md's bash block that holds ``text``."""
    readme = (REPO / "README.md").read_text()
    at = readme.index(text)
    start = readme.rindex("```bash\n", 0, at) + len("```bash\n")
    return readme[start:readme.index("```", at)].splitlines()


def test_the_readmes_prepare_one_liner_stops_when_the_fetch_fails(tmp_path):
    """Offline (a proxy that refuses), README's fetch-then-prepare stops at the fetch with its exit 10; it
    never runs ``prepare ""``; and ``prepare ""`` alone says what went wrong (exit 2)."""
    lines = _readme_block_with("data fetch tinyshakespeare) &&")
    script = "\n".join(line for line in lines if "dlx-node demo" not in line).rstrip().removesuffix("&&")
    assert "data prepare" in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "dlx-node"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m node.cli \"$@\"\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "DLX_DATA_DIR": str(tmp_path / "cache"),
           "https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": "",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert proc.returncode == 10, proc.stderr
    assert "--from" in proc.stderr and "data prepare" not in proc.stderr, proc.stderr
    assert not (tmp_path / "shakespeare-bpe").exists()
    proc = subprocess.run([*CLI, "data", "prepare", "", "--out", str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "an input path is empty" in proc.stderr, proc.stderr
    proc = subprocess.run([*CLI, "data", "prepare", str(tmp_path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "not a file" in proc.stderr, proc.stderr


def test_status_of_a_missing_or_unused_directory_is_usage_2_and_of_a_stopped_node_15(tmp_path):
    """``status`` names what is wrong with --data-dir (2, was 3); a stopped node's last status is printed,
    figures rounded and "-" for what it had none of (no "None"), and it exits 15, not running (was 1, the
    code of a bug)."""
    proc = subprocess.run([*CLI, "status", "--data-dir", str(tmp_path / "nowhere")], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2 and "no such directory" in proc.stderr, proc.stderr
    proc = subprocess.run([*CLI, "status", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2 and "no node has run with this data directory" in proc.stderr, proc.stderr
    gone = subprocess.Popen(["true"])  # a pid that is no process: a child that exited and was reaped
    gone.wait()
    status = {"peer_id": "12D3KooWstopped", "pid": gone.pid, "run_id": 1, "state": "stopped", "round": 7,
              "step": 40, "inner_steps": 40, "loss": 3.456789123, "eval_loss": None, "peers": 2,
              "bytes_sent": 12345678, "bytes_received": 987, "last_finished": 7, "last_commit": 6}
    (tmp_path / "status.json").write_text(json.dumps(status))
    proc = subprocess.run([*CLI, "status", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 15, proc.stdout + proc.stderr
    assert "not running" in proc.stdout and "None" not in proc.stdout, proc.stdout
    assert "loss 3.457  held-out -" in proc.stdout and "sent 12.3 MB  received 987 B" in proc.stdout
    (tmp_path / "status.json").write_text("{not json")
    proc = subprocess.run([*CLI, "status", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 4 and "unreadable" in proc.stderr, proc.stderr


def test_a_full_disk_is_state_4_naming_the_destination(tmp_path):
    """A write the disk has no room for (``data prepare --out`` on a 64 KiB filesystem) exits 4, as README
    and docs/P2P.md say (was 1), naming the output's disk, not a source or "(unnamed file)"."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("To be, or not to be, that is the question. " * 6000)  # 264 KB: its tokens do not fit
    mount = tmp_path / "small"
    mount.mkdir()
    check_small_disk(mount)
    out = mount / "out"
    command = small_disk_command(mount, [*CLI, "data", "prepare", str(corpus), "--out", str(out)])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 4, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"disk of {out} is full" in last and "free space and run it again" in last, last
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def unserved_run(tmp_path_factory):
    """A run on a real anvil whose one node is never started: its link names a peer nobody answers for."""
    from node_fixtures import TINY

    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path_factory.mktemp("unserved"), replicas=1, stages=1, split=False,
                   settings=[*TINY, "rounds=2"], stake_wei=10**18, attest_quorum=1, attest_quorum_bps=0,
                   allow_weak_quorum=True)
    run.setup()
    yield run
    run.stop()


def test_a_join_whose_peers_cannot_be_reached_is_a_network_failure_10(unserved_run, tmp_path):
    """The run document comes from the link's peers: none answers, so nothing can be joined (exit 10, the
    network; was 3), and nothing is sent. Issue 80: join dials them again for --peer-wait seconds first (a
    join right after the organizer's start failed at once), saying so at each try."""
    command = [*CLI, "join", unserved_run.link(), "--data-dir", str(tmp_path / "n"), "--dev-account", "6",
               "--yes", "--no-progress", "--no-start", "--peer-wait", "4"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 10, proc.stdout + proc.stderr
    assert "dialling again for up to 4s (its nodes may be starting)" in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "no peer of the run is reachable" in last and "check the peer multiaddrs" in last, last
    assert "dialled for" in last and "--peer-wait SECONDS" in last, last
    client = unserved_run.client()
    assert client.member(unserved_run.run_id, dev_account(6, unserved_run.chain_id).address) is None


def test_a_start_whose_runs_checkpoint_no_peer_serves_is_a_network_failure_10(unserved_run, tmp_path):
    """The run has a committed round with a published checkpoint; the starting member's peer answers nothing,
    so it cannot enter the run (exit 10, the network: node/live/round/entry.py), saying where to look. (Last
    in this file: it commits round 0 of the module's run.)"""
    from ledger.chain import connect_rpc
    from ledger.client import LedgerClient
    from ledger.records import RoundRecord

    slot = unserved_run.nodes[0]
    unserved_run.seat([slot])
    w3 = connect_rpc(unserved_run.url, wait=5)
    member = LedgerClient(w3, dev_account(slot.account, w3.eth.chain_id), unserved_run.registry,
                          unserved_run.ledger)
    run_id = unserved_run.run_id
    record = RoundRecord(run_id=run_id, round=0, prev_head=member.head_of(run_id), weights_root=b"\x01" * 32,
                         contributions_root=b"\x02" * 32, train_loss_micro=3_500_000,
                         eval_loss_micro=3_600_000, tokens=4096, num_contributors=1,
                         checkpoint_hash=b"\x03" * 32)
    member.commit_round(record, [member.sign_record(record)])
    with socket.socket() as silent:  # a peer address where nothing speaks libp2p
        silent.bind(("127.0.0.1", 0))
        nobody = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{slot.peer_id}"
    command = [*CLI, "start", "--no-progress", "--config", str(slot.config_path), "--set",
               f"p2p.bootstrap={nobody}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 10, proc.stdout + proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "no published checkpoint of the run could be fetched" in last and "bootstrap" in last, last


def _commit_next(run, checkpoint_hash: bytes) -> int:
    """Commit the next round of ``run`` (its first node's account, seated once), as a quorum of one would."""
    from ledger.chain import connect_rpc
    from ledger.client import LedgerClient
    from ledger.records import RoundRecord

    slot = run.nodes[0]
    if not getattr(run, "seated_for_tests", False):
        run.seat([slot])
        run.seated_for_tests = True
    w3 = connect_rpc(run.url, wait=5)
    member = LedgerClient(w3, dev_account(slot.account, w3.eth.chain_id), run.registry, run.ledger)
    last = member.last_round(run.run_id)
    index = 0 if last is None else last + 1
    record = RoundRecord(run_id=run.run_id, round=index, prev_head=member.head_of(run.run_id),
                         weights_root=b"\x01" * 32, contributions_root=b"\x02" * 32,
                         train_loss_micro=3_500_000, eval_loss_micro=3_600_000, tokens=4096,
                         num_contributors=1, checkpoint_hash=checkpoint_hash)
    member.commit_round(record, [member.sign_record(record)])
    return index


def test_a_pull_of_a_round_without_a_checkpoint_is_a_refusal_9(unserved_run, tmp_path):
    """``pull --round N`` of a round committed without a checkpoint, or not committed, installs nothing and
    exits 9 (was 3), saying which and what to pass instead; nothing is fetched (after the start test: the
    module's run has round 0 committed)."""
    index = _commit_next(unserved_run, b"\x00" * 32)  # not a checkpoint round
    reader = ["--rpc", unserved_run.url, "--registry", unserved_run.registry, "--ledger", unserved_run.ledger,
              "--run", str(unserved_run.run_id), "--pending"]
    for round_index, why in ((index, "committed without one"), (index + 5, "it is not committed")):
        out = tmp_path / f"model-{round_index}"
        proc = subprocess.run([*CLI, "pull", *reader, "--round", str(round_index), str(out)],
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 9, proc.stdout + proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert f"no checkpoint published for round {round_index}" in last and why in last, last
        assert "pass one of them to --round" in last and not out.exists(), last


@pytest.mark.timeout(240)
def test_a_demo_stopped_by_sigterm_exits_143_and_leaves_no_chain(tmp_path):
    """SIGTERM while the demo sets its run up (its chain started): it stops in order and exits 128 + 15."""
    command = [*CLI, "demo", "--preset", "tiny", "--rounds", "1", "--inner-steps", "2", "--replicas", "1",
               "--stages", "1", "--weak-run", "--attest-quorum", "1", "--out", str(tmp_path / "demo")]
    log = tmp_path / "demo.log"
    with open(log, "w") as out:  # as from a terminal: SIGINT and SIGTERM at their defaults
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"chain: anvil \(pid (\d+)\)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        anvil_pid = int(found.group(1))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 143, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "signal 15: stopping the nodes, then the chain" in text and "Traceback" not in text, text[-3000:]
    stat = Path(f"/proc/{anvil_pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "anvil left running"
