"""One training run across NATs, orchestrated from inside the lab's public namespace (tests/netns_lab.py).

``ip netns exec <public ns> python tests/nat_run.py '<lab JSON>' WORKDIR ROUNDS TIMEOUT [relay-only]`` sets up
a
:class:`node.commands.launcher.LocalRun` of three one-node replicas (its anvil on the public
namespace's loopback, reachable from the sites through a TCP forwarder on the public address),
places replica 0 on the public network as the run's relay, replicas 1 and 2 each behind its own NAT
(started with ``ip netns exec <site>``), trains, and prints one JSON line: the rounds the chain
committed, the contributors of each, and per node how it was connected to each peer (``direct``,
``relayed``, ``hole_punched``: the last path seen, and every path seen, sampled once a second).
``relay-only`` turns hole punching off on every node: the NATed pair then talks through the relay.

The lab JSON: ``{"public_ip": ip, "sites": [[namespace, ip], [namespace, ip]]}``.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from node_fixtures import TINY

from node.commands.launcher import LocalRun
from node.config import dump_toml, load_config


def forward_tcp(listen_ip: str, port: int, target_ip: str, target_port: int) -> socket.socket:
    """Accept on ``listen_ip:port`` and splice each connection to ``target_ip:target_port`` (daemon
    threads)."""
    server = socket.create_server((listen_ip, port))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection((target_ip, target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def main() -> int:
    lab = json.loads(sys.argv[1])
    workdir, rounds, timeout = Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    relay_only = sys.argv[5:] == ["relay-only"]
    run = LocalRun(workdir, replicas=3, stages=1, split=False,
                   settings=TINY + [f"rounds={rounds}", "join_timeout=180", "round_timeout=180"])
    try:
        run.setup()
        anvil_port = int(run.url.rsplit(":", 1)[1])
        forward_tcp(lab["public_ip"], anvil_port, "127.0.0.1", anvil_port)
        rpc_url = f"http://{lab['public_ip']}:{anvil_port}"
        relay = run.nodes[0]
        relay_addr = f"/ip4/{lab['public_ip']}/tcp/{relay.listen_port}/p2p/{relay.peer_id}"
        places = [(None, lab["public_ip"])] + [tuple(site) for site in lab["sites"]]
        where = {}
        for slot, (namespace, ip) in zip(run.nodes, places):
            table = load_config(slot.config_path).to_dict()
            table["p2p"]["listen_host"] = ip
            table["ledger"]["rpc_url"] = rpc_url
            table["p2p"]["hole_punch"] = not relay_only
            if namespace is None:
                table["p2p"]["bootstrap"] = []
                table["p2p"]["relay_serve"] = True
                where[slot.peer_id] = "public"
            else:
                table["p2p"]["bootstrap"] = [relay_addr]
                table["p2p"]["relay_use"] = [relay_addr]
                slot.command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "node.cli"]
                where[slot.peer_id] = f"nat:{namespace.rsplit('-', 1)[1]}"
            slot.config_path.write_text("# placed in the NAT lab by tests/nat_run.py\n" + dump_toml(table))
            load_config(slot.config_path)

        seen: dict[str, dict[str, dict]] = {slot.name: {} for slot in run.nodes}

        listen_addrs: dict[str, list[str]] = {}

        def sample(current: LocalRun) -> None:
            for slot in current.nodes:
                status = slot.status()
                if status.get("listen_addrs"):
                    listen_addrs[slot.name] = status["listen_addrs"]
                for peer, path in (status.get("paths") or {}).items():
                    record = seen[slot.name].setdefault(peer, {"last": path, "seen": []})
                    record["last"] = path
                    if path not in record["seen"]:
                        record["seen"].append(path)

        run.start()
        ok = run.wait(timeout, on_tick=sample)
        history = run.client().history(run.run_id)
        names = {slot.peer_id: slot.name for slot in run.nodes}
        result = {
            "ok": ok,
            "exit_codes": {slot.name: slot.process.returncode if slot.process else None
                               for slot in run.nodes},
            "placement": {slot.name: where[slot.peer_id] for slot in run.nodes},
            "committed": [c.commit.round for c in history.commits],
            "contributors": [c.commit.num_contributors for c in history.commits],
            "listen_addrs": listen_addrs,
            "paths": {name: {names.get(peer, peer): record for peer, record in peers.items()}
                      for name, peers in seen.items()},
        }
        if not ok:
            from node_fixtures import run_logs
            result["logs"] = run_logs(run, lines=30)
        print(json.dumps(result), flush=True)
        return 0
    finally:
        run.stop()


if __name__ == "__main__":
    sys.exit(main())
