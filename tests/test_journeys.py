"""A newcomer's journeys (issue 65), each through the real ``dlx-node`` command against a real anvil.

A node directory reused for a second run (a fresh chain at the same addresses and run id) trains that
run to its end: the first run's state is set aside, not mistaken for the second's. A run whose rounds are
all committed is neither started nor joined, and nothing is sent. A node without a seat stakes only after a
yes, and never from an account that cannot pay for it. A node whose account left stops. ``withdraw --wait``
asks before it waits; ``init`` then ``join`` in one directory joins; ``create-run`` takes the demo's
deployment file.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from node_fixtures import TINY, node_log, run_logs
from small_disk import check_small_disk, small_disk_command

from ledger.account import dev_account
from ledger.chain import connect_rpc
from node.commands.preflight import EARLIER_RUNS, SCOPE_FILE

CLI = [sys.executable, "-m", "node.cli"]


def run_cli(*args: str, timeout: float = 180, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          input=stdin if stdin is not None else "", check=False)


def _committed(run) -> list[int]:
    return [c.commit.round for c in run.client().history(run.run_id, with_registrations=False).commits]


def _tx_count(run, account: int) -> int:
    w3 = connect_rpc(run.url, wait=5)
    return w3.eth.get_transaction_count(dev_account(account, run.chain_id).address)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A one-node run of two rounds, trained to its end on a real anvil (the chain kept)."""
    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path_factory.mktemp("finished"), replicas=1, stages=1, split=False,
                   settings=[*TINY, "rounds=2"], attest_quorum=1, attest_quorum_bps=0, allow_weak_quorum=True)
    run.setup()
    try:
        run.start()
        assert run.wait(600, progress=True), run_logs(run)
        assert _committed(run) == [0, 1]
        yield run
    finally:
        run.stop()


def test_the_node_directory_names_its_run(finished):
    (slot,) = finished.nodes
    scope = json.loads((slot.data_dir / SCOPE_FILE).read_text())
    w3 = connect_rpc(finished.url, wait=5)
    assert scope == {"chain_id": finished.chain_id, "genesis": w3.eth.get_block(0)["hash"].hex().lower(),
                     "ledger": finished.ledger.lower(), "run_id": finished.run_id}
    assert any((slot.data_dir / "said").rglob("*.env")), "the node signed nothing?"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_directory_reused_for_a_run_on_a_fresh_chain_trains_it_to_the_end(finished, make_run):
    # The same directory (its identity included), a fresh chain at the same addresses and run id, and
    # another inner learning rate: every contribution of the second run differs from the first's. Before
    # the directory named its run, the node refused to sign them ("signed another ... in an earlier life").
    second = make_run(replicas=1, stages=1, split=False,
                      settings=[*TINY, "rounds=2", "training.inner_lr=0.002"])
    (old,), (slot,) = finished.nodes, second.nodes
    assert (second.ledger, second.run_id) == (finished.ledger, finished.run_id)
    shutil.copytree(old.data_dir, slot.data_dir, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("node.toml", "node-*.log"))
    earlier_said = sorted(p.relative_to(old.data_dir) for p in (old.data_dir / "said").rglob("*.env"))
    second.start()
    assert second.wait(600, progress=True), run_logs(second)
    assert _committed(second) == [0, 1]
    log = node_log(slot)
    assert "earlier life" not in log and "held another run's state" in log, log[-3000:]
    (aside,) = (slot.data_dir / EARLIER_RUNS).iterdir()
    assert sorted(p.relative_to(aside) for p in (aside / "said").rglob("*.env")) == earlier_said
    assert json.loads((aside / SCOPE_FILE).read_text())["genesis"] != json.loads(
        (slot.data_dir / SCOPE_FILE).read_text())["genesis"]


def test_a_finished_run_is_neither_started_nor_joined_and_nothing_is_sent(finished, tmp_path):
    (slot,) = finished.nodes
    sent = _tx_count(finished, slot.account)
    proc = run_cli("start", "--no-progress", "--yes", "--config", str(slot.config_path))
    assert proc.returncode == 6, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"dlx-node start: error: run {finished.run_id} is over: all its 2 rounds are committed"), proc.stderr
    newcomer = 7
    before = _tx_count(finished, newcomer)
    proc = run_cli("join", finished.link(), "--data-dir", str(tmp_path / "late"), "--dev-account",
                   str(newcomer), "--yes", "--no-progress")
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert "is over" in proc.stderr and "nothing was sent" in proc.stderr
    assert not (tmp_path / "late" / "node.toml").exists()
    assert (_tx_count(finished, slot.account), _tx_count(finished, newcomer)) == (sent, before)


@pytest.fixture(scope="module")
def open_run(tmp_path_factory):
    """A run on a real anvil whose nodes hold no seat yet (none started)."""
    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path_factory.mktemp("open"), replicas=2, stages=1, split=False,
                   settings=[*TINY, "rounds=2"], stake_wei=10**18, attest_quorum=1, attest_quorum_bps=0,
                   allow_weak_quorum=True)
    run.setup()
    yield run
    run.stop()


def test_start_without_a_seat_stakes_only_after_a_yes(open_run):
    slot = open_run.nodes[0]
    client = open_run.client()
    account = dev_account(slot.account, open_run.chain_id).address
    proc = run_cli("start", "--no-progress", "--config", str(slot.config_path))  # no terminal, no --yes
    assert proc.returncode == 2, proc.stderr
    assert "register node key" in proc.stdout and "with a stake of 1 ETH" in proc.stdout, proc.stdout
    assert "no terminal to ask on" in proc.stderr and "nothing was sent" in proc.stderr, proc.stderr
    assert client.key_of(account) is None and client.member(open_run.run_id, account) is None


def test_join_from_an_unfunded_account_sends_nothing(open_run, tmp_path):
    password = tmp_path / "password"
    password.write_text("correct horse\n")
    proc = run_cli("join", open_run.link(), "--data-dir", str(tmp_path / "poor"), "--password-file",
                   str(password), "--yes", "--no-progress", timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "holds 0.000000 ETH" in proc.stderr and "nothing was sent" in proc.stderr, proc.stderr
    created = json.loads((tmp_path / "poor" / "keystore.json").read_text())["address"]
    w3 = connect_rpc(open_run.url, wait=5)
    assert w3.eth.get_transaction_count(w3.to_checksum_address("0x" + created.removeprefix("0x"))) == 0


def test_withdraw_wait_without_a_terminal_refuses_before_it_waits(open_run):
    import time

    slot = open_run.nodes[1]
    open_run.seat([slot])
    proc = run_cli("leave", "--config", str(slot.config_path), "--yes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The launcher's anvil mines only on transactions: no "about 32 min" for blocks that never come alone.
    assert "mines a block only when a transaction comes" in proc.stdout, proc.stdout
    started = time.monotonic()
    proc = run_cli("withdraw", "--config", str(slot.config_path), "--wait", timeout=120)  # stdin: not a tty
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60
    assert "unbonding:" not in proc.stdout, "it waited first"
    assert "pass --yes" in proc.stderr and "nothing was waited for" in proc.stderr, proc.stderr
    seat = open_run.client().member(open_run.run_id, dev_account(slot.account, open_run.chain_id).address)
    assert seat is not None and seat.status == "unbonding"


def test_init_then_join_in_the_same_directory_joins(open_run, tmp_path):
    from node.commands.link import run_link
    from node.commands.seeder import ArchiveSeeder

    # A peer that serves the run document (the seeder of a kept demo, over a copy of the run's own).
    served = tmp_path / "served" / "archive" / f"run-{open_run.run_id}"
    served.mkdir(parents=True)
    shutil.copy(open_run.workdir / "run.json", served / "run.json")
    seeder = ArchiveSeeder.start([tmp_path / "served"], open_run.run_id)
    try:
        link = run_link(open_run.chain_id, open_run.ledger, open_run.run_id, open_run.url, [seeder.multiaddr],
                        checkpoint_every=1)
        c1 = tmp_path / "c1"
        proc = run_cli("init", "--data-dir", str(c1), "--dev-account", "6")
        assert proc.returncode == 0, proc.stderr
        proc = run_cli("join", link, "--data-dir", str(c1), "--dev-account", "6", "--yes", "--no-start",
                       timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"is a member of run {open_run.run_id}" in proc.stdout
        assert "written by 'dlx-node join'" in (c1 / "node.toml").read_text()
        # A node directory of another run is still refused, at once, naming that run.
        other = link.replace(f"/{open_run.run_id}?", f"/{open_run.run_id + 1}?")
        proc = run_cli("join", other, "--data-dir", str(c1), "--dev-account", "6", "--yes", "--no-start")
        assert proc.returncode == 2, proc.stderr
        assert f"belongs to run {open_run.run_id} of ledger" in proc.stderr, proc.stderr
        assert "connected to" not in proc.stderr  # refused before the chain was asked anything
    finally:
        seeder.close()


def test_init_with_a_missing_password_file_is_a_usage_error_that_writes_nothing(tmp_path):
    proc = run_cli("init", "--data-dir", str(tmp_path / "n"), "--password-file", str(tmp_path / "missing"))
    assert proc.returncode == 2, proc.stderr
    assert "--password-file" in proc.stderr and "cannot read it" in proc.stderr
    assert not (tmp_path / "n" / "identity.key").exists() and not (tmp_path / "n" / "node.toml").exists()


def test_create_run_takes_the_launchers_deployment_file_on_an_idle_dev_chain(open_run, tmp_path):
    import time

    from test_chain_commands import RUN_FILE

    deployment = json.loads((open_run.workdir / "deployment.json").read_text())
    assert "from_block" not in deployment  # as the demo writes it
    (tmp_path / "run.toml").write_text(RUN_FILE)
    started = time.monotonic()
    proc = run_cli("create-run", str(tmp_path / "run.toml"), "--deployment",
                   str(open_run.workdir / "deployment.json"), "--data-dir", str(tmp_path / "org"),
                   "--listen-port", "24998", "--dev-account", "9", "--yes", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # The default 2 confirmations would wait for a block no transaction brings (120 s, then exit 11).
    assert "mines a block only when a transaction comes" in proc.stdout, proc.stdout
    assert time.monotonic() - started < 100
    assert "confirmations = 1" in (tmp_path / "org" / "node.toml").read_text()


def test_a_deployment_files_bad_values_are_reported_together(tmp_path):
    path = tmp_path / "deployment.json"
    path.write_text(json.dumps({"registry": "0x" + "11" * 20, "ledger": "0x1234", "from_block": -1,
                                "rpc_url": "ftp://x"}))
    from test_chain_commands import RUN_FILE

    (tmp_path / "run.toml").write_text(RUN_FILE)
    proc = run_cli("create-run", str(tmp_path / "run.toml"), "--deployment", str(path), "--dev-account", "9",
                   "--data-dir", str(tmp_path / "org"))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "ledger" in last and "from_block must be" in last and "rpc_url must be" in last, last


def test_a_run_files_bad_values_are_reported_together(tmp_path):
    from test_chain_commands import RUN_FILE

    text = RUN_FILE.replace("quorum = 2", "quorum = 0").replace("stake_eth = 0.5", 'stake_eth = "lots"')
    (tmp_path / "run.toml").write_text(text + "colour = 3\n")
    proc = run_cli("create-run", str(tmp_path / "run.toml"), "--deployment", str(tmp_path / "none.json"),
                   "--dev-account", "9", "--data-dir", str(tmp_path / "org"))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "quorum=0" in last and "stake_eth='lots'" in last and "['colour']" in last, last


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_whose_account_left_finishes_and_stops(make_run):
    import time

    from node_fixtures import wait_for

    run = make_run(replicas=1, stages=1, split=False, stake_wei=10**18, settings=[*TINY, "rounds=0"])
    run.start()
    (slot,) = run.nodes
    wait_for(lambda: len(_committed(run)) >= 2, 300, "two rounds committed", run, none_exits=True)
    proc = run_cli("leave", "--config", str(slot.config_path), "--yes")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left_at = time.monotonic()
    wait_for(lambda: slot.process.poll() is not None, 240, "the node stopping after its account left", run)
    assert slot.process.returncode == 0, run_logs(run)
    log = node_log(slot)
    assert "this node's account left run" in log, log[-3000:]
    before, after = log.split("this node's account left run", 1)
    # It trains no round after it saw the seat end (it trained every round, LedgerNotMember every commit, and
    # never exited); the rounds it had trained are finished (in a one-member run their commits fail).
    assert "inner steps in" not in after, after[-3000:]
    trained = [int(r) for r in re.findall(r"round (\d+): \d+ inner steps in", before)]
    assert all(int(r) <= max(trained) for r in re.findall(r"commitRound\(run \d+, round (\d+)\)", after))
    print(f"stopped {time.monotonic() - left_at:.1f}s after leaving")


def test_init_then_start_names_every_missing_and_differing_setting_at_once(open_run, tmp_path):
    from node.commands.seeder import ArchiveSeeder

    node = tmp_path / "n"
    assert run_cli("init", "--data-dir", str(node), "--dev-account", "5").returncode == 0
    config = str(node / "node.toml")
    proc = run_cli("start", "--no-progress", "--config", config)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "ledger.registry_address, ledger.ledger_address, ledger.run_id not set" in last, last
    assert "dlx-node join LINK" in last
    # The run's deployment filled in, nothing else: the template's other settings are not the run's.
    settings = (f"ledger.rpc_url={open_run.url}", f"ledger.registry_address={open_run.registry}",
                f"ledger.ledger_address={open_run.ledger}", f"ledger.run_id={open_run.run_id}")
    chain = [arg for value in settings for arg in ("--set", value)]
    open_run.seat([open_run.nodes[0]])  # a member: a newcomer without bootstrap peers would find nobody
    proc = run_cli("start", "--no-progress", "--config", config, *chain)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "rounds=0, but run" in last and "maxRounds=2" in last, last
    assert "configHash" in last and "p2p.bootstrap is empty" in last, last
    # With a peer that serves the run's document, the fields that differ are named.
    served = tmp_path / "served" / "archive" / f"run-{open_run.run_id}"
    served.mkdir(parents=True)
    shutil.copy(open_run.workdir / "run.json", served / "run.json")
    seeder = ArchiveSeeder.start([tmp_path / "served"], open_run.run_id)
    try:
        proc = run_cli("start", "--no-progress", "--config", config, *chain, "--set",
                       f"p2p.bootstrap={seeder.multiaddr}", "--set", "rounds=2")
    finally:
        seeder.close()
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "diloco.inner_steps = 50, the run's 4" in last, last
    assert "rounds=" not in last and "bootstrap" not in last, last
    account = dev_account(5, open_run.chain_id).address
    assert open_run.client().key_of(account) is None  # nothing was sent


def test_data_commands_exit_with_the_code_of_their_fault(tmp_path):
    # Offline: a network failure (10), naming the ways to fetch without the server.
    proc = run_cli("data", "fetch", "tinyshakespeare", "--dir", str(tmp_path), "--url", "http://127.0.0.1:9/x.txt")
    assert proc.returncode == 10, proc.stderr
    assert "--from" in proc.stderr and "--url" in proc.stderr and proc.stdout == ""
    # A missing input file is a usage error (2), not a training error (12).
    proc = run_cli("data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "no such input file(s)" in proc.stderr and not (tmp_path / "out").exists()


def test_withdraw_while_unbonding_is_not_yet_14(open_run):
    slot = open_run.nodes[1]  # left in test_withdraw_wait_without_a_terminal_refuses_before_it_waits
    seat = open_run.client().member(open_run.run_id, dev_account(slot.account, open_run.chain_id).address)
    if seat is None or seat.status != "unbonding":
        open_run.seat([slot])
        assert run_cli("leave", "--config", str(slot.config_path), "--yes").returncode == 0
    proc = run_cli("withdraw", "--config", str(slot.config_path), "--yes")
    assert proc.returncode == 14, proc.stderr
    assert "still unbonding" in proc.stderr


def test_a_malformed_rpc_url_is_a_usage_error_and_an_unreachable_one_says_why_in_a_few_words(open_run):
    import time

    from ledger.chain import connect_rpc
    from ledger.errors import LedgerError
    from node.exitcodes import exit_code_for

    link = open_run.link()
    started = time.monotonic()
    proc = run_cli("run-info", link, "--rpc", "notaurl")
    assert proc.returncode == 2, proc.stderr
    assert "not an http:// or https:// URL" in proc.stderr and time.monotonic() - started < 30
    # The other malformed forms meet the same check, here in this process (a command each cost ~8 s).
    for url in ("ftp://x", "http://"):
        with pytest.raises(LedgerError, match="not an http:// or https:// URL") as refused:
            connect_rpc(url, wait=0)
        assert exit_code_for(refused.value) == 2
    proc = run_cli("run-info", link, "--rpc", "http://127.0.0.1:9")
    assert proc.returncode == 5, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Connection refused" in last and "HTTPConnectionPool" not in last and len(last) < 250, last
    assert "host 127.0.0.1, port 9" in last and "check that the chain's node runs there" in last, last


def test_leave_with_a_missing_config_names_the_file_join_writes(tmp_path):
    proc = run_cli("leave", "--config", str(tmp_path / "node.toml"), "--yes")
    assert proc.returncode == 2, proc.stderr
    assert "join or create-run wrote" in proc.stderr and "dlx-node init" not in proc.stderr


def test_the_explorer_on_a_busy_port_names_the_option(open_run):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("explorer", open_run.link(), "--port", str(port))
    assert proc.returncode == 7, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last and "pass another --port" in last, last


def test_pull_takes_an_option_between_its_positionals(finished, tmp_path):
    (slot,) = finished.nodes
    out = tmp_path / "model"
    proc = run_cli("pull", finished.link(), "--pending", "--archive", str(slot.data_dir), str(out),
                   timeout=600)
    assert "unrecognized arguments" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any(out.iterdir())
    # (issue 80 point 7) the archive holds the document, checkpoint and tokenizer: the link's peer (the
    # node, gone since the run ended) is never dialed, so no dial failure is logged
    assert "SwarmDialAllFailedError" not in proc.stderr and "unreachable" not in proc.stderr, proc.stderr
    assert f"from {slot.data_dir}" in proc.stdout, proc.stdout


def test_pull_into_a_full_disk_exits_4_naming_the_destination(finished, tmp_path):
    """The export's write refused by a full destination (a 64 KiB tmpfs in a mount namespace of its own)
    is a full disk, 4, naming that disk (issue 80 points 5 and 6: it was the export's own error, 12)."""
    (slot,) = finished.nodes
    mount = tmp_path / "small"
    mount.mkdir()
    check_small_disk(mount)
    pull = [*CLI, "pull", finished.link(), str(mount / "model"), "--pending", "--archive", str(slot.data_dir)]
    proc = subprocess.run(small_disk_command(mount, pull), capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"disk of {mount}/" in last and "is full (No space left on device" in last, last
    assert "free space and run it again" in last and "Traceback" not in proc.stderr, last
