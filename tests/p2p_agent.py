"""A P2PHost in its own process, driven by JSON lines on stdin (for tests across network namespaces).

``python tests/p2p_agent.py '<P2PConfig fields as JSON>' DATA_DIR`` prints ``{"peer_id", "listen_addrs"}``
once the host runs, then answers one JSON line per command line read:

- ``{"cmd": "connect", "addr": A, "timeout": s}`` -> ``{"ok": true, "peer": id}`` or ``{"ok": false, "error":
  ...}``
- ``{"cmd": "paths"}`` -> ``{"paths": {peer: "direct" | "relayed"}}``
- ``{"cmd": "wait_path", "peer": id, "path": "direct", "timeout": s}`` -> ``{"path": ...}`` (the last seen)
- ``{"cmd": "provide", "size": n}`` -> ``{"sha256": hex}``
- ``{"cmd": "fetch", "sha256": hex, "provider": id, "timeout": s}`` -> ``{"ok": bool, "error": ...}``
- ``{"cmd": "status"}`` -> ``{"reachability", "listen_addrs", "relay_refusals"}``
- ``{"cmd": "subscribe", "topic": t}`` -> ``{"ok": true}``; ``{"cmd": "received", "topic": t}`` -> ``{"count":
  n}``
- ``{"cmd": "flood", "topic": t, "seconds": s}`` -> ``{"ok": true}`` at once; publishes to ``t`` without pause
  for ``s`` seconds on a thread (messages in flight while a peer shuts down)

It exits when stdin closes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from p2p.config import P2PConfig
from p2p.errors import P2PError
from p2p.host import P2PHost
from p2p.identity import Identity

QUEUES: dict = {}  # topic -> the subscription's queue
RECEIVED: dict[str, int] = {}


def answer(host: P2PHost, request: dict, data_dir: str) -> dict:
    cmd = request["cmd"]
    if cmd == "connect":
        try:
            return {"ok": True, "peer": host.connect(request["addr"], timeout=request.get("timeout", 30))}
        except P2PError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if cmd == "paths":
        return {"paths": host.connection_paths()}
    if cmd == "wait_path":
        deadline = time.monotonic() + request.get("timeout", 30)
        path = None
        while time.monotonic() < deadline:
            path = host.connection_paths().get(request["peer"])
            if path == request["path"]:
                break
            time.sleep(0.5)
        return {"path": path}
    if cmd == "provide":
        return {"sha256": host.provide_blob(os.urandom(request["size"]), announce=False)}
    if cmd == "fetch":
        try:
            host.fetch_blob(request["sha256"], os.path.join(data_dir, "fetched"),
                            providers=[request["provider"]], timeout=request.get("timeout", 60))
            return {"ok": True}
        except P2PError as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    if cmd == "subscribe":
        QUEUES[request["topic"]] = host.subscribe(request["topic"])
        return {"ok": True}
    if cmd == "received":
        queue = QUEUES[request["topic"]]
        while not queue.empty():
            queue.get_nowait()
            RECEIVED[request["topic"]] = RECEIVED.get(request["topic"], 0) + 1
        return {"count": RECEIVED.get(request["topic"], 0)}
    if cmd == "flood":
        def flood(topic: str, until: float) -> None:
            sent = 0
            while time.monotonic() < until:
                try:
                    host.publish(topic, f"{sent}".encode() * 64)
                except P2PError:
                    time.sleep(0.01)
                sent += 1

        threading.Thread(target=flood, args=(request["topic"], time.monotonic() + request["seconds"]),
                         daemon=True).start()
        return {"ok": True}
    if cmd == "status":
        return {"reachability": host.reachability(), "listen_addrs": host.listen_addrs,
                "relay_refusals": host.relay_refusals()}
    return {"error": f"unknown command {cmd!r}"}


def main() -> int:
    logging.basicConfig(level=os.environ.get("DLX_AGENT_LOG", "WARNING"), stream=sys.stderr)
    config = P2PConfig(**json.loads(sys.argv[1]))
    data_dir = sys.argv[2]
    host = P2PHost.start(config, Identity.generate(), data_dir=data_dir)
    try:
        print(json.dumps({"peer_id": host.peer_id, "listen_addrs": host.listen_addrs}), flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer(host, json.loads(line), data_dir)), flush=True)
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
