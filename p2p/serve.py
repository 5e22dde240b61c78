"""``python -m p2p.serve``: run a standalone host that provides files, for tests, benchmarks and ops.

Prints one JSON line ``{"peer_id", "listen_addrs", "blobs": {path: sha256}}`` on
stdout once the blobs are provided, then serves until stdin is closed (or the
process is killed). Options map to :class:`~p2p.config.P2PConfig` fields.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile

from p2p.config import P2PConfig
from p2p.host import P2PHost
from p2p.identity import Identity


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="files to provide as blobs")
    parser.add_argument("--data-dir", default=None, help="blob dir parent (default: a temp dir)")
    parser.add_argument("--key", default=None, help="identity key file (default: a fresh identity)")
    parser.add_argument("--bootstrap", action="append", default=[], help="bootstrap multiaddr")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--rate-limit-bps", type=float, default=0.0)
    parser.add_argument("--rate-limit-burst", type=float, default=0.0, help="bucket bytes (0: the default)")
    parser.add_argument("--subscribe", action="append", default=[], help="topic to join (echoes nothing)")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr)

    identity = Identity.load_or_create(args.key) if args.key else Identity.generate()
    config = P2PConfig(
        listen_port=args.port,
        bootstrap=args.bootstrap,
        rate_limit_bps=args.rate_limit_bps,
        rate_limit_burst=args.rate_limit_burst,
    )
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="dlx-p2p-serve-")
    host = P2PHost.start(config, identity, data_dir=data_dir)
    try:
        for topic in args.subscribe:
            host.subscribe(topic)
        blobs = {path: host.provide_blob(path, announce=bool(args.bootstrap)) for path in args.files}
        # A serving process: its start-up objects (libp2p's import graph) live as long as
        # it does, so keep the garbage collector from rescanning them during transfers.
        gc.collect()
        gc.freeze()
        print(
            json.dumps({"peer_id": host.peer_id, "listen_addrs": host.listen_addrs, "blobs": blobs}),
            flush=True,
        )
        sys.stdin.read()  # serve until the parent closes our stdin
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
