"""``dlx-node explorer``: a read-only web page that shows a run as the chain records it, live.

A small :class:`http.server.ThreadingHTTPServer` (127.0.0.1 by default) serves one static page
(``node/tools/explorer_page/index.html``, plain HTML and JavaScript, no external resources) and JSON
endpoints the page polls:

* ``/api/snapshot`` -- everything below at once (``?limit=N`` rounds, newest last; default 200);
* ``/api/run`` -- the run's parameters, members with their stakes and status (``run-info``'s summary);
* ``/api/rounds?from=R&limit=N`` -- committed rounds: record fields, losses, attesters, commit transaction,
  checkpoint, disputes and equivocations, and whether the round's hash-chain link and attesters verify;
* ``/api/accusations`` -- every accusation (open, guilty, cleared, expired), disputes, equivocations,
  slashings;
* ``/api/checks`` -- the audit's chain checks (:func:`ledger.checks.check_chain_record`) item by item;
* ``/api/pool`` -- the run's reward pool (``--pool``, or deployment.json's ``reward_pool``; null without one):
  its schedule and books and each member's credits (node/commands/explorerpool.py; issue 77).

It sends no transaction and holds no key. The chain is read at most once per ``refresh`` seconds, however
many browsers poll; a chain that stops answering gives ``503`` with the reason (the page says so and keeps
polling), a bad query parameter ``400``, an unknown path ``404``, any method but GET/HEAD ``405``.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable

from node.errors import ConfigError, PortBusy

logger = logging.getLogger(__name__)

DEFAULT_ROUNDS = 200
MAX_ROUNDS = 5000


class BadQuery(ValueError):
    """A query parameter of an explorer request is malformed or out of range (answered with 400)."""


def _hex(value: bytes) -> str:
    return "0x" + value.hex()


def _loss(micro: int) -> float:
    return micro / 1e6


def round_rows(history, checks, last_final: int | None = None) -> list[dict]:
    """One plain row per committed round, with what the chain checks say of it (``history.commits`` order);
    ``final``: whether the chain's ``isFinal`` holds for it (``last_final``: the highest such round; None:
    not read)."""
    checkpoints = {c.round: c for c in history.checkpoints}
    rows = []
    for index, record in enumerate(history.commits):
        commit = record.commit
        link = checks.hash_chain.links[index] if index < len(checks.hash_chain.links) else None
        attesters = checks.attesters[index] if index < len(checks.attesters) else None
        checkpoint = checkpoints.get(commit.round)
        rows.append({
            "round": commit.round, "block": record.block_number, "tx": record.tx_hash,
            "submitter": record.submitter, "attesters": list(record.attesters),
            "prev_head": _hex(commit.prev_head), "head": _hex(record.head_hash),
            "weights_root": _hex(commit.weights_root), "contributions_root": _hex(commit.contributions_root),
            "train_loss": _loss(commit.train_loss_micro), "eval_loss": _loss(commit.eval_loss_micro),
            "tokens": commit.tokens, "contributors": commit.num_contributors,
            "final": None if last_final is None else commit.round <= last_final,
            "checkpoint": None if checkpoint is None else {"hash": _hex(checkpoint.content_hash),
                                                           "uri": checkpoint.uri, "tx": checkpoint.tx_hash},
            "disputes": [{"disputer": d.disputer, "block": d.block_number, "tx": d.tx_hash,
                          "weights_root": _hex(d.record.weights_root)}
                         for d in checks.disputes.get(commit.round, [])],
            "equivocations": [{"account": e.account, "reporter": e.reporter, "block": e.block_number,
                               "tx": e.tx_hash} for e in checks.equivocations.get(commit.round, [])],
            "verified": {
                "hash_chain": None if link is None else {"ok": link.ok, "reason": link.reason},
                "attesters": None if attesters is None else {"ok": attesters.ok, "reason": attesters.reason},
            },
        })
    return rows


def accusation_rows(history) -> list[dict]:
    rows = []
    for a in history.accusations:
        if a.open:
            status = "open"
        elif a.expired_block is not None:
            status = "expired"
        else:
            status = "guilty" if a.guilty else "cleared"
        rows.append({"accused": a.accused, "accuser": a.accuser, "evidence": _hex(a.evidence_hash),
                     "status": status, "opened_block": a.opened_block, "opened_tx": a.opened_tx,
                     "deadline": a.deadline, "resolved_block": a.resolved_block, "signers": list(a.signers),
                     "bond_wei": a.bond, "quorum": a.quorum})
    return rows


def check_rows(checks) -> dict:
    items = [{"name": item.name, "ok": item.ok, "reason": item.reason} for item in checks.items()]
    return {"ok": checks.ok, "failed": sum(not item["ok"] for item in items), "items": items,
            "notes": list(checks.notes), "contracts_checked": checks.contracts is not None}


def read_snapshot(client, run_id: int, pool=None) -> dict:
    """Everything the page shows, read from the chain now: one history read, the audit's chain checks on
    it, and the run's reward pool where ``pool`` (a RewardPoolClient) is given (issue 77)."""
    from ledger.checks import check_chain_record
    from node.commands.explorerpool import pool_snapshot
    from node.commands.member import run_info_summary
    from node.tools.standing import last_final_on_chain

    history = client.history(run_id)
    checks = check_chain_record(client, history)
    summary = run_info_summary(client, run_id, history)
    return {
        "run": summary,
        "rounds": round_rows(history, checks, last_final_on_chain(client, history)),
        "accusations": accusation_rows(history),
        "slashings": [{"account": s.account, "stake_wei": s.stake, "block": s.block_number, "tx": s.tx_hash}
                      for s in history.slashings],
        "checks": check_rows(checks),
        "pool": None if pool is None else pool_snapshot(pool, client, run_id, history),
        "read_at": time.time(),
    }


class SnapshotCache:
    """The latest snapshot, read again at most every ``refresh`` seconds, by one reader thread at a time.

    A request waits for a new read at most ``wait`` seconds once there is a snapshot: a chain that does not
    answer (its client retries for ``ledger.retry_seconds``) leaves the page with the last snapshot read,
    marked ``not_live`` with the reason, at once, not with empty tables for half a minute (issue 65). Only
    the very first read is waited for to its end (there is nothing to show before it).
    """

    def __init__(self, read: Callable[[], dict], refresh: float = 2.0, wait: float = 3.0) -> None:
        self._read = read
        self.refresh = refresh
        self.wait = wait
        self._lock = threading.Lock()
        self._snapshot: dict | None = None
        self._at = 0.0
        self._last_error = ""
        self._reader: threading.Thread | None = None

    def get(self) -> dict:
        """The snapshot (the last one read, with ``not_live``, while the chain does not answer); raises
        :class:`ChainRead` (with the reason) when the chain was never read."""
        with self._lock:
            if self._snapshot is not None and time.monotonic() - self._at < self.refresh:
                return self._snapshot
            if self._reader is None or not self._reader.is_alive():
                self._reader = threading.Thread(target=self._refresh, name="explorer-read", daemon=True)
                self._reader.start()
            reader, had = self._reader, self._snapshot
        reader.join(None if had is None else self.wait)
        with self._lock:
            if self._snapshot is None:
                raise ChainRead(self._last_error or "the chain has not answered yet")
            if not reader.is_alive() and not self._last_error:
                return self._snapshot
            reason = self._last_error or f"the chain has not answered for {self.wait:g}s"
            return {**self._snapshot, "not_live": reason}

    def _refresh(self) -> None:
        try:
            snapshot = self._read()
        except Exception as exc:  # noqa: BLE001 - thread boundary: any chain failure is reported to the page
            reason = _reason(exc)
            with self._lock:
                if reason != self._last_error:
                    logger.warning("explorer: cannot read the chain: %s", reason)
                self._last_error = reason
            return
        with self._lock:
            if self._last_error:
                logger.info("explorer: the chain answers again")
                self._last_error = ""
            self._snapshot, self._at = snapshot, time.monotonic()


def _reason(exc: BaseException) -> str:
    """Why the chain could not be read, in a few words (not urllib3's nested reprs)."""
    from ledger.chain import short_reason

    return short_reason(exc)[:300]


class ChainRead(Exception):
    """The chain could not be read for a request (answered with 503)."""


def _int_param(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    values = query.get(name)
    if not values:
        return default
    if len(values) > 1:
        raise BadQuery(f"{name}: given {len(values)} times, give it once")
    text = values[0].strip()
    if not text.isdigit() or len(text) > 12:
        raise BadQuery(f"{name}={values[0][:40]!r}: not a whole number >= 0")
    value = int(text)
    if not low <= value <= high:
        raise BadQuery(f"{name}={value}: must be within {low}..{high}")
    return value


def _rounds_view(rounds: list[dict], query: dict[str, list[str]]) -> dict:
    limit = _int_param(query, "limit", DEFAULT_ROUNDS, 1, MAX_ROUNDS)
    start = _int_param(query, "from", -1 if "from" not in query else 0, 0, 2**63)
    if start < 0:  # the newest ``limit``
        chosen = rounds[-limit:]
    else:
        chosen = [r for r in rounds if r["round"] >= start][:limit]
    return {"total": len(rounds), "rounds": chosen}


def explorer_page() -> bytes:
    """The static page (``node/tools/explorer_page/index.html``, package data)."""
    return resources.files("node.tools").joinpath("explorer_page", "index.html").read_bytes()


def api_routes(cache: SnapshotCache) -> dict[str, Callable[[dict], Any]]:
    """The JSON endpoints by path: each takes the parsed query and answers from the cached snapshot."""

    def snapshot(query):
        data = cache.get()
        view = _rounds_view(data["rounds"], query)
        return {**data, "rounds": view["rounds"], "rounds_total": view["total"]}

    def run(query):
        return cache.get()["run"]

    def rounds(query):
        return _rounds_view(cache.get()["rounds"], query)

    def accusations(query):
        data = cache.get()
        return {"accusations": data["accusations"], "disputes": data["run"]["disputes"],
                "equivocations": [{"round": r["round"], **e} for r in data["rounds"]
                                  for e in r["equivocations"]],
                "slashings": data["slashings"]}

    def checks(query):
        return cache.get()["checks"]

    def pool(query):
        return cache.get()["pool"]

    return {"/api/snapshot": snapshot, "/api/run": run, "/api/rounds": rounds,
            "/api/accusations": accusations, "/api/checks": checks, "/api/pool": pool}


def make_handler(cache: SnapshotCache, page: bytes) -> type[BaseHTTPRequestHandler]:
    """The request handler class of one explorer: the page, and GET routes by path through a table."""
    routes = api_routes(cache)

    class Handler(BaseHTTPRequestHandler):
        server_version = "dlx-explorer"
        sys_version = ""

        def handle(self) -> None:
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError) as exc:  # the client left first: nothing to do
                logger.debug("explorer %s: client gone (%s)", self.client_address[0], exc)

        def log_message(self, fmt: str, *args: Any) -> None:
            logger.debug("explorer %s: " + fmt, self.client_address[0], *args)

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy",
                             "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src "
                             "'unsafe-inline'; connect-src 'self'; img-src 'self' data:")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, data: Any) -> None:
            self._send(code, json.dumps(data).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            try:
                parts = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, max_num_fields=20)
            except ValueError as exc:
                self._json(400, {"error": f"bad request: {exc}"})
                return
            if parts.path in ("/", "/index.html"):
                self._send(200, page, "text/html; charset=utf-8")
                return
            route = routes.get(parts.path)
            if route is None:
                self._json(404, {"error": f"no such path {parts.path[:100]!r}: try /api/snapshot",
                                 "paths": sorted(routes)})
                return
            try:
                self._json(200, route(query))
            except BadQuery as exc:
                self._json(400, {"error": str(exc)})
            except ChainRead as exc:
                self._json(503, {"error": f"cannot read the chain: {exc}"})

        do_HEAD = do_GET

        def _refuse(self) -> None:
            self._json(405, {"error": f"{self.command} not allowed: the explorer is read-only (GET)"})

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    return Handler


class Explorer:
    """An explorer server over ``read`` (a function returning a snapshot); ``url`` once started."""

    def __init__(self, read: Callable[[], dict], host: str = "127.0.0.1", port: int = 0,
                 refresh: float = 2.0) -> None:
        self.cache = SnapshotCache(read, refresh)
        try:
            self.httpd = ThreadingHTTPServer((host, port), make_handler(self.cache, explorer_page()))
        except OSError as exc:
            raise PortBusy(f"explorer: cannot listen on {host}:{port}: {exc.strerror or exc}: pass another "
                           "--port (0: any free port) or stop the other process") from None
        self.httpd.daemon_threads = True
        bound_host, bound_port = self.httpd.server_address[:2]
        self.url = f"http://{bound_host}:{bound_port}/"
        self._thread: threading.Thread | None = None

    def start(self) -> Explorer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="explorer", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()


def explorer_for_client(client, run_id: int, host: str = "127.0.0.1", port: int = 0,
                        refresh: float = 2.0, pool=None) -> Explorer:
    return Explorer(lambda: read_snapshot(client, run_id, pool), host, port, refresh)


def run_explorer(args: argparse.Namespace) -> int:
    """``dlx-node explorer``: serve until Ctrl-C."""
    from ledger.errors import LedgerError
    from node.commands.member import apply_link
    from node.tools.evidence import reader_client

    apply_link(args)
    if args.run is None or args.run < 0:
        raise ConfigError("--run N: give the run id (>= 0), or a run link")
    client = reader_client(args)
    try:
        client.run_info(args.run)
    except LedgerError as exc:
        raise ConfigError(f"run {args.run}: {exc}") from None
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("explorer: listening on %s, reachable from other machines (it is read-only)",
                       args.host)
    pool = _pool(client, args)
    explorer = explorer_for_client(client, args.run, args.host, args.port, args.refresh, pool)
    print(f"explorer of run {args.run} at {explorer.url} (read-only; Ctrl-C stops it)", flush=True)
    try:
        explorer.serve_forever()
    finally:
        explorer.close()
    return 0


def _pool(client, args: argparse.Namespace):
    """The run's RewardPool to show (--pool, else deployment.json's ``reward_pool``), checked; None: none."""
    from node.tools.audit_cli import pool_address
    from node.tools.audit_pool import pool_client

    address = pool_address(args)
    return pool_client(client, address) if address else None


def add_parser(sub) -> None:
    p = sub.add_parser("explorer",
                       help="a read-only web page showing a run live: rounds, members, accusations, "
                                        "disputes and the chain checks")
    p.add_argument("link", nargs="?", default="", help="run link (or give --rpc, --run and --deployment)")
    p.add_argument("--rpc", default="", help="JSON-RPC URL of the chain, e.g. http://127.0.0.1:8545")
    p.add_argument("--run", type=int, default=None, help="run id")
    p.add_argument("--deployment", default="", help="deployment.json (the contract addresses)")
    p.add_argument("--ledger", default="", help="TrainingLedger address (default: from --deployment)")
    p.add_argument("--registry", default="", help="NodeRegistry address (default: from --deployment)")
    p.add_argument("--pool", default="", metavar="ADDRESS",
                   help="the run's RewardPool: show the pool and each member's credits (default: "
                        "deployment.json's reward_pool, if any)")
    p.add_argument("--bootstrap", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8547,
                   help="port to listen on (default 8547; 0: any free port)")
    p.add_argument("--refresh", type=float, default=2.0,
                   help="read the chain at most every this many seconds")
