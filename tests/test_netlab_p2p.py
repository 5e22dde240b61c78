"""Hosts on the emulated internet (tests/netlab.py): what only shows with real link delay.

Each host is a tests/p2p_agent.py process in its own namespace, 100 ms one way from the other. Skips, with
the reason, where the emulator cannot be built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from netlab import LabUnavailable, NetLab, Site  # noqa: E402

AGENT = str(Path(__file__).parent / "p2p_agent.py")


class Agent:
    """A tests/p2p_agent.py process inside a lab site; its stderr (the host's logs) kept in a file."""

    def __init__(self, lab: NetLab, site: str, config: dict, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = data_dir / "agent.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(lab.cmd(site, sys.executable, AGENT, json.dumps(config),
                                                 str(data_dir)),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         env=dict(os.environ, DLX_AGENT_LOG="ERROR"))
        hello = self._read()
        self.peer_id, self.listen_addrs = hello["peer_id"], hello["listen_addrs"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"agent exited with {self.proc.wait(10)}: {self.log.read_text()[-2000:]}")
        return json.loads(line)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> int:
        """Close stdin (the agent closes its host and exits); its exit code."""
        try:
            self.proc.stdin.close()
            return self.proc.wait(60)
        except Exception:
            self.proc.kill()
            return self.proc.wait(10)


@pytest.fixture
def lab(tmp_path):
    try:
        made = NetLab([Site("a", 1000), Site("b", 1000)], {"a": {"b": 100}, "b": {"a": 100}},
                      workdir=tmp_path / "lab")
    except LabUnavailable as exc:
        pytest.skip(f"cannot build the network emulator here: {exc}")
    try:
        yield made
    finally:
        made.close()


@pytest.mark.timeout(300)
def test_a_host_closing_while_gossip_is_in_flight_stops_cleanly(lab, tmp_path):
    """bench/bench_soak.py (issue 45): a member stopped after `dlx-node leave` logged ten tracebacks and
    "p2p host ... stopped with an error": messages still in flight over 100 ms links reached py-libp2p's
    pubsub after its service had stopped (its task group closed: "Nursery is closed to new arrivals"),
    while the connections carrying them were still open. The host now closes its connections first."""
    for attempt in range(3):
        a = Agent(lab, "a", {"listen_host": lab.host_ip("a"), "listen_port": 4001}, tmp_path / f"a{attempt}")
        b = Agent(lab, "b", {"listen_host": lab.host_ip("b"), "listen_port": 4001}, tmp_path / f"b{attempt}")
        try:
            assert b.ask(cmd="connect", addr=a.listen_addrs[0], timeout=30)["ok"]
            a.ask(cmd="subscribe", topic="t")
            b.ask(cmd="subscribe", topic="t")
            b.ask(cmd="flood", topic="t", seconds=30)
            deadline = time.monotonic() + 60
            while a.ask(cmd="received", topic="t")["count"] < 50 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert a.ask(cmd="received", topic="t")["count"] >= 50  # gossip is flowing into a
            code = a.stop()
        finally:
            a.stop()
            b.stop()
        log = a.log.read_text()
        assert code == 0, log[-3000:]
        assert "stopped with an error" not in log and "Nursery is closed" not in log, log[-4000:]
