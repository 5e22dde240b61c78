"""Operating a node: init, status, Prometheus metrics and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from node.commands.launcher import LocalRun
from node.config import load_config
from p2p.identity import Identity


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_init_creates_keys_and_a_loadable_config(tmp_path):
    password = tmp_path / "pw"
    password.write_text("correct horse\n")
    proc = cli("init", "--data-dir", str(tmp_path / "n"), "--password-file", str(password))
    assert proc.returncode == 0, proc.stderr
    key = tmp_path / "n" / "identity.key"
    assert key.stat().st_mode & 0o777 == 0o600
    identity = Identity.load(key)
    assert identity.peer_id in proc.stdout
    cfg = load_config(tmp_path / "n" / "node.toml")
    assert cfg.ledger.keystore.endswith("keystore.json") and cfg.ledger.dev_account == -1
    keystore = json.loads((tmp_path / "n" / "keystore.json").read_text())
    assert "crypto" in keystore and "0x" + keystore["address"].lower() in proc.stdout.lower()
    # Again: refuses to overwrite the config, keeps the identity.
    again = cli("init", "--data-dir", str(tmp_path / "n"), "--password-file", str(password))
    assert again.returncode == 2 and "--force" in again.stderr
    assert Identity.load(key).peer_id == identity.peer_id


@pytest.mark.timeout(400)
def test_status_metrics_and_graceful_sigterm(tmp_path):
    run = LocalRun(tmp_path / "run", replicas=2, stages=2, split=False, metrics=True,
                   settings=["model.preset=tiny", "diloco.inner_steps=4", "training.batch_size=4",
                             "rounds=0", "round_timeout=60", "checkpoint_every=1"])
    try:
        run.setup()
        run.start()
        client = run.client()
        deadline = time.monotonic() + 240
        while (client.last_round(run.run_id) or -1) < 1:
            assert time.monotonic() < deadline and len(run.running()) == 2, "run did not reach round 1"
            time.sleep(1)
        slot = run.nodes[0]
        status = cli("status", "--data-dir", str(slot.data_dir))
        assert status.returncode == 0, status.stderr
        assert slot.peer_id in status.stdout and "running" in status.stdout
        body = urllib.request.urlopen(f"http://127.0.0.1:{slot.metrics_port}/metrics",
                                      timeout=10).read().decode()
        assert "dlx_round" in body and "dlx_bytes_sent" in body
        round_metric = next(line for line in body.splitlines() if line.startswith("dlx_round "))
        assert float(round_metric.split()[1]) >= 1
        for s in run.nodes:
            s.process.send_signal(signal.SIGTERM)
        for s in run.nodes:
            assert s.process.wait(timeout=120) == 0
            state = json.loads((s.data_dir / "state.json").read_text())
            assert state["last_finished"] >= 1
            assert json.loads((s.data_dir / "status.json").read_text())["state"] == "stopped"
        stopped = cli("status", "--data-dir", str(slot.data_dir))
        assert stopped.returncode == 15 and "not running" in stopped.stdout  # ExitCode.NOT_RUNNING
        rounds = [c.commit.round for c in client.history(run.run_id).commits]
        assert rounds == list(range(len(rounds))) and len(rounds) >= 2
    finally:
        run.stop()


def test_status_prints_the_compute_utilization_of_the_node_clock(tmp_path):
    status = {"peer_id": "12D3KooWtest", "pid": -1, "run_id": 1, "state": "training", "round": 3,
              "timing": {"periods": 4, "inner_s": 99.0, "wall_s": 100.0, "utilization": 0.99}}
    (tmp_path / "status.json").write_text(json.dumps(status))
    shown = cli("status", "--data-dir", str(tmp_path))
    assert shown.returncode == 15 and "not running" in shown.stdout  # pid -1: no such process
    assert "utilization 99.0% over 4 period(s)" in shown.stdout, shown.stdout
    (tmp_path / "status.json").write_text(json.dumps({**status, "timing": {}}))  # no period yet: no line
    assert "utilization" not in cli("status", "--data-dir", str(tmp_path)).stdout
