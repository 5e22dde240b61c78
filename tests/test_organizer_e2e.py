"""A run created and joined with the commands alone, on an anvil with a block every second.

``dlx-node deploy`` -> ``create-run`` -> the organizer's ``start`` (it serves the run document) ->
``join`` -> the joiner's ``start`` -> every round committed -> ``run-info`` shows them -> ``leave`` ->
``withdraw --wait`` once unbonding is over -> ``run-info`` shows the seat gone. Every command is a real
process of the CLI; the chain is a real anvil with ``--block-time 1``; nodes confirm commits two deep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ledger.anvil import AnvilProcess
from node.commands.launcher import free_port

CLI = [sys.executable, "-m", "node.cli"]

RUN_FILE = """\
run_name = "organizer-e2e"
rounds = 2
checkpoint_every = 1
round_timeout = 180
torch_threads = 1
join_timeout = 900          # the organizer waits for the joiner (slow to load on a shared machine)

[model]
preset = "tiny"

[diloco]
inner_steps = 4
num_replicas = 2

[pipeline]
num_stages = 1

[run]
stake_eth = 2.0
quorum = 2
accusation_blocks = 8
dispute_blocks = 8
"""


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, \
        f"dlx-node {args[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done


def start(config, log) -> subprocess.Popen:
    return subprocess.Popen([*CLI, "--log-file", str(log), "start", "--no-progress", "--yes", "--config",
                             str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_listening(log, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and "listening on" in log.read_text()):
        assert process.poll() is None, f"the organizer's node exited {process.returncode}"
        assert time.monotonic() < deadline, "the organizer's node never listened"
        time.sleep(1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_run_created_and_joined_with_the_commands_alone(tmp_path):
    anvil = AnvilProcess(extra_args=("--block-time", "1"))
    url = anvil.start()
    nodes: list[subprocess.Popen] = []
    try:
        deployment = tmp_path / "deployment.json"
        cli("deploy", "--rpc", url, "--chain-id", "31337", "--dev-account", "0", "--yes", "--out",
            str(deployment))
        (tmp_path / "run.toml").write_text(RUN_FILE)
        created = cli("create-run", str(tmp_path / "run.toml"), "--deployment", str(deployment),
                      "--dev-account", "1", "--data-dir", str(tmp_path / "org"), "--listen-port",
                      str(free_port()), "--yes")
        assert "create run (1 stage(s), H=4, k=2, stake 2 ETH, unbonding 16 blocks, 2 rounds)" \
            in created.stdout
        link = (tmp_path / "org" / "run-link.txt").read_text().strip()
        nodes.append(start(tmp_path / "org" / "node.toml", tmp_path / "org.log"))
        wait_for_listening(tmp_path / "org.log", nodes[0])  # it serves the run document from then on
        joined = cli("join", link, "--dev-account", "2", "--data-dir", str(tmp_path / "j1"), "--yes",
                     "--no-start", "--listen-port", str(free_port()), "--set", "ledger.confirmations=2",
                     timeout=600)
        assert "fetched from the run's peers and checked against the chain" in joined.stdout
        nodes.append(start(tmp_path / "j1" / "node.toml", tmp_path / "j1.log"))
        deadline = time.monotonic() + 900
        while any(n.poll() is None for n in nodes) and time.monotonic() < deadline:
            time.sleep(2)
        logs = {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in ("org", "j1")}
        assert [n.returncode for n in nodes] == [0, 0], logs

        info = json.loads(cli("run-info", link, "--json").stdout)
        assert info["rounds_committed"] == 2 and info["last_record"]["round"] == 1, info
        assert len(info["last_record"]["attesters"]) == 2 and info["last_record"]["checkpoint"]
        assert sorted(m["status"] for m in info["members"]) == ["active", "active"]
        assert all(m["stake_wei"] == 2 * 10**18 for m in info["members"])

        left = cli("leave", "--config", str(tmp_path / "j1" / "node.toml"), "--yes")
        assert "can be withdrawn from block" in left.stdout
        withdrawn = cli("withdraw", "--config", str(tmp_path / "j1" / "node.toml"), "--yes", "--wait",
                        timeout=300)
        assert "unbonding:" in withdrawn.stdout and "withdrew 2 ETH" in withdrawn.stdout
        info = json.loads(cli("run-info", link, "--json").stdout)
        assert sorted(m["status"] for m in info["members"]) == ["active", "withdrawn"]
    finally:
        for node in nodes:
            stop(node)
        anvil.stop()
