"""CLI surface: --help is fast and torch-free; errors are one line with an exit code."""

import signal
import socket
import subprocess
import sys
import time

import pytest


def run_cli(*args, timeout=240, **kw):
    """``dlx-node ARGS`` in a child process (a bound for a loaded machine: two test workers on 2 cores
    took 60 s and more for one start that fails at its chain check)."""
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_help_does_not_import_torch():
    code = ("import sys; from node.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'libp2p', 'web3') if m in sys.modules]\n"
            "assert not heavy, heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "dlx-node" in proc.stdout


def test_start_with_missing_config_is_a_config_error(tmp_path):
    proc = run_cli("start", "--config", str(tmp_path / "none.toml"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "dlx-node init" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_start_with_bad_value_is_a_config_error(tmp_path):
    (tmp_path / "node.toml").write_text("[diloco]\ninner_steps = -1\n")
    proc = run_cli("start", "--config", str(tmp_path / "node.toml"))
    assert proc.returncode == 2
    assert "diloco.inner_steps=-1" in proc.stderr


def test_every_bad_value_of_a_node_toml_is_named_at_once(tmp_path):
    """Issue 80: rounds="four" and batch_size=-3 (and more, in three tables): one message names each, not
    only the first; a value's type and its range alike, a bad value's neighbours still checked."""
    (tmp_path / "node.toml").write_text('rounds = "four"\nquorum = 3\n[training]\nbatch_size = -3\n'
                                        'inner_lr = -1.0\n[diloco]\nnum_replicas = 3\ninner_steps = "x"\n'
                                        '[p2p]\nlisten_port = 70000\n')
    proc = run_cli("start", "--config", str(tmp_path / "node.toml"))
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "5 settings are wrong" in line, line
    for needle in ("rounds='four': must be an integer", "training.batch_size=-3", "training.inner_lr=-1.0",
                   "diloco.inner_steps='x'", "p2p.listen_port=70000"):
        assert needle in line, (needle, line)
    assert "quorum" not in line  # 3 of diloco.num_replicas = 3 is fine: the bad inner_steps hides nothing


def test_every_bad_value_of_a_run_file_is_named_at_once(tmp_path):
    """The same through create-run: [run]'s bad values and the training settings' in one message, before
    the deployment or the chain is looked at."""
    (tmp_path / "run.toml").write_text('rounds = "four"\n[run]\nquorum = 0\n[training]\nbatch_size = -3\n')
    proc = run_cli("create-run", str(tmp_path / "run.toml"), "--deployment", str(tmp_path / "none.json"),
                   "--data-dir", str(tmp_path / "org"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "3 settings are wrong" in line, line
    for needle in ("[run] quorum=0", "rounds='four': must be an integer", "training.batch_size=-3"):
        assert needle in line, (needle, line)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_toml(tmp_path, rpc_url: str):
    """A node.toml of a run whose chain is at ``rpc_url`` (nothing answers there: no deployment needed)."""
    (tmp_path / "node.toml").write_text(
        f'data_dir = "{tmp_path}"\n[ledger]\nbackend = "rpc"\nrpc_url = "{rpc_url}"\nrun_id = 1\n'
        'registry_address = "0x1111111111111111111111111111111111111111"\n'
        'ledger_address = "0x2222222222222222222222222222222222222222"\n')
    return tmp_path / "node.toml"


def test_a_first_start_against_no_chain_says_so_with_the_url_at_once_and_every_few_seconds(tmp_path):
    """Issue 80 (was a 600 s wait with one line): a node's first start waits 30 s for a chain that does not
    answer, says so at once with the URL and again every few seconds; a SIGTERM ends the wait (exit 0).
    Past the wait, exit 5: test_rpc_unreachable_past_the_chain_wait_exits_5."""
    url = f"http://127.0.0.1:{_closed_port()}"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "node.cli", "start", "--config",
                                 str(_node_toml(tmp_path, url))], stdout=subprocess.DEVNULL, stderr=err)
    said = lambda: (tmp_path / "stderr").read_text()  # noqa: E731
    try:
        deadline = time.monotonic() + 180  # the imports, on a loaded machine
        while f"no chain answers at {url} yet: waited 5s of up to 30s" not in said():
            assert proc.poll() is None and time.monotonic() < deadline, said()
            time.sleep(0.2)
        assert (f"no chain answers at {url}: waiting up to 30s for it (a first start; --chain-wait SECONDS "
                "waits longer") in said()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, said()
    finally:
        proc.kill()


def test_how_long_a_start_waits_for_its_chain(tmp_path):
    from ledger.config import LedgerConfig
    from node.commands.chainwait import chain_wait_for

    assert chain_wait_for(LedgerConfig(), tmp_path, None)[0] == 30.0  # a first start
    assert chain_wait_for(LedgerConfig(startup_wait=4.0), tmp_path, None)[0] == 4.0
    assert chain_wait_for(LedgerConfig(), tmp_path, 90.0) == (90.0, "--chain-wait")
    (tmp_path / "state.json").write_text("{}")  # a restart
    assert chain_wait_for(LedgerConfig(), tmp_path, None) == (600.0, "a restart: ledger.startup_wait")
    assert chain_wait_for(LedgerConfig(), tmp_path, 0.0)[0] == 0.0


# ---------------------------------------------------------------------- errors against a real chain


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A real anvil with the contracts and a run, node configs written, no node started."""
    from node.commands.launcher import LocalRun

    run = LocalRun(tmp_path_factory.mktemp("cli-run"), replicas=2, stages=2, split=False,
                   settings=["model.preset=tiny", "rounds=1"])
    run.setup()
    yield run
    run.stop()


def _one_line_error(proc, code, *needles):
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("dlx-node start: error:"), proc.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


def test_rpc_unreachable_past_the_chain_wait_exits_5(deployed):
    # A starting node waits for its chain (--chain-wait; tests/test_chain_startup_e2e.py), saying so with the
    # URL; past the wait, exit 5 naming the URL and what to check.
    url = f"http://127.0.0.1:{_closed_port()}"
    proc = run_cli("start", "--config", str(deployed.nodes[0].config_path), "--set", f"ledger.rpc_url={url}",
                   "--set", "ledger.request_timeout=1", "--chain-wait", "2")
    assert f"no chain answers at {url}: waiting up to 2s for it (--chain-wait)" in proc.stderr, proc.stderr
    _one_line_error(proc, 5, f"chain RPC {url} unreachable", "waited 2s", "--chain-wait SECONDS")


def test_settings_that_differ_from_the_run_exit_2(deployed):
    # Both named in one refusal (was a start each): another training setting, and another `rounds` (the
    # run's length sets the inner learning-rate schedule: another one would train differently).
    proc = run_cli("start", "--config", str(deployed.nodes[0].config_path), "--set", "diloco.outer_lr=0.5",
                   "--set", "rounds=7")
    _one_line_error(proc, 2, "configHash", "use exactly the run's", "rounds=7", "maxRounds=1")


def test_key_registered_to_another_node_exits_6(deployed):
    from ledger.account import dev_account
    from ledger.chain import connect_rpc
    from ledger.binding import binding_message
    from ledger.client import LedgerClient
    from p2p.identity import Identity

    slot = deployed.nodes[1]
    w3 = connect_rpc(deployed.url, wait=5)
    account = dev_account(slot.account, w3.eth.chain_id)
    client = LedgerClient(w3, account, deployed.registry, deployed.ledger)
    other = Identity.generate()
    client.register(other.public_key_bytes,
                    other.sign(binding_message(w3.eth.chain_id, deployed.registry, account.address)))
    proc = run_cli("start", "--config", str(slot.config_path))
    _one_line_error(proc, 6, "registered with another node key")
    assert "--identity OLD_DIR/identity.key" in proc.stderr  # what fixes it (issue 80 point 3)


def test_busy_port_exits_7(deployed):
    slot = deployed.nodes[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", slot.listen_port))
        s.listen()
        proc = run_cli("start", "--config", str(slot.config_path))
    _one_line_error(proc, 7, f"p2p.listen_port={slot.listen_port}", "already in use")


def test_corrupt_state_file_exits_4_and_is_left_untouched(deployed):
    slot = deployed.nodes[0]
    state = slot.data_dir / "state.json"
    state.write_text('{"run_id": 1, "last_contr')
    proc = run_cli("start", "--config", str(slot.config_path))
    _one_line_error(proc, 4, "state.json", "corrupt")
    assert state.read_text() == '{"run_id": 1, "last_contr'
    state.unlink()
