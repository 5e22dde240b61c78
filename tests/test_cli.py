"""CLI surface: --help is fast and torch-free; errors are one line with an exit code."""

import socket
import subprocess
import sys

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


def test_rpc_unreachable_past_the_startup_wait_exits_5(deployed):
    # A starting node waits ledger.startup_wait for its chain
    # (tests/test_chain_startup_e2e.py); past it, exit 5.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    proc = run_cli("start", "--config", str(deployed.nodes[0].config_path), "--set",
                   f"ledger.rpc_url=http://127.0.0.1:{closed}", "--set", "ledger.request_timeout=1",
                   "--set", "ledger.startup_wait=1")
    _one_line_error(proc, 5, f"127.0.0.1:{closed}")


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
