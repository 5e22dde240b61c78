"""A host keeps nothing of the connections of peers killed mid-stream (p2p.inbound; docs/P2P.md, "What a
surviving node keeps per churn event").

Real py-libp2p hosts: the host under test here, each peer a tests/p2p_agent.py process that dials in,
subscribes to the host's topic, floods it and is killed with SIGKILL while its messages are in flight (the
kernel resets its TCP connection). Before the fix, every trio task started from an inbound connection's
handler copied the handler's context, and with it p2p.inbound's holder of the upgraded connection: a task that
outlived the connection kept its Yamux, SwarmConn, Noise and TCP stream alive (19-20 of them in a loaded run
whose swarm held 1-3).
"""

import gc
import json
import os
import subprocess
import sys

import pytest
import trio
from libp2p.network.connection.swarm_connection import SwarmConn
from waiting import wait_until

from p2p import inbound
from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = 3
TOPIC = "reset"


def swarm_conns() -> list:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is SwarmConn]


def holders_of_closed_connections() -> list:
    """Tasks whose context holds an inbound handler's upgraded connection that is closed."""
    found = []
    for task in [o for o in gc.get_objects() if type(o) is trio.lowlevel.Task]:
        holder = task.context.get(inbound._UPGRADED)
        if holder and any(muxed.event_closed.is_set() for muxed in holder[0]):
            found.append(task.name)
    return found


def kill_mid_flood(host: P2PHost, data_dir) -> str:
    agent = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "p2p_agent.py"),
                              json.dumps({"listen": False, "gossip_resync_interval": 0}), str(data_dir)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        def ask(request: dict) -> dict:
            agent.stdin.write(json.dumps(request) + "\n")
            agent.stdin.flush()
            return json.loads(agent.stdout.readline())

        peer_id = json.loads(agent.stdout.readline())["peer_id"]
        assert ask({"cmd": "connect", "addr": host.listen_addrs[0], "timeout": 60})["ok"]
        assert ask({"cmd": "subscribe", "topic": TOPIC})["ok"]
        assert ask({"cmd": "flood", "topic": TOPIC, "seconds": 120})["ok"]
        wait_until(lambda: peer_id in host.peers(), 60, "the host to see the peer")
    finally:
        agent.kill()  # SIGKILL: no close, no goodbye; the kernel resets the connection
        agent.wait(timeout=60)
    return peer_id


def test_connections_of_peers_killed_mid_stream_are_freed(tmp_path):
    host = P2PHost.start(P2PConfig(gossip_resync_interval=0), Identity.generate(), data_dir=tmp_path / "host")
    try:
        queue = host.subscribe(TOPIC)
        for index in range(PEERS):
            peer_id = kill_mid_flood(host, tmp_path / f"peer{index}")
            wait_until(lambda: peer_id not in host.peers(), 120, "the host to see the killed peer gone")
            while not queue.empty():
                queue.get_nowait()
        assert host.peers() == []
        # No task keeps a closed connection through the handler's context (before: the tasks each
        # connection's handler started, some of them for the host's life).
        wait_until(lambda: not holders_of_closed_connections(), 120, "no task to hold a closed connection")
        # So the swarm's table (empty) holds all there is, but for one: py-libp2p's DCUtR loop keeps the last
        # connection it looked at in a local variable until its next pass (at most one, whatever the churn).
        wait_until(lambda: len(swarm_conns()) <= 1, 120, "the killed peers' connections to be freed")
    finally:
        host.close()
