"""The ``dlx-node`` command line.

Only this module configures logging and turns the packages' errors
(:data:`node.errors.DLX_ERRORS`) into exit codes and one-line messages. Heavy packages (torch, libp2p, web3)
are imported inside the commands, so ``dlx-node --help`` stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from node.commands.parsers import build_parser
from node.errors import DLX_ERRORS
from node.exitcodes import EXIT_CODES, ExitCode, exit_code_for  # noqa: F401 - EXIT_CODES, exit_code_for: re-exported
from node.fsutil import disk_full_message, is_disk_full

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = int(ExitCode.INTERRUPTED)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _FullDiskTolerant:
    """A log handler that drops a record its full disk cannot take (ENOSPC), counted, instead of printing a
    traceback per record to stderr (on the same disk, as a rule); the next record written says how many."""

    dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        if is_disk_full(sys.exc_info()[1]):
            self.dropped += 1
            return
        super().handleError(record)  # type: ignore[misc]

    def emit(self, record: logging.LogRecord) -> None:
        if self.dropped:
            dropped, self.dropped = self.dropped, 0
            super().emit(logging.LogRecord(__name__, logging.WARNING, __file__, 0, "%d log records dropped: "
                                           "the log's disk was full", (dropped,), None))  # type: ignore[misc]
            if self.dropped:  # still full: the notice went the same way
                self.dropped = dropped
        super().emit(record)  # type: ignore[misc]


class _FileHandler(_FullDiskTolerant, logging.FileHandler):
    pass


class _StreamHandler(_FullDiskTolerant, logging.StreamHandler):
    pass


def configure_logging(level: str = "info", json_logs: bool = False, log_file: str | None = None) -> None:
    handler: logging.Handler = _FileHandler(log_file) if log_file else _StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                                               "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # py-libp2p and web3 are chatty at INFO.
    for noisy in ("web3", "urllib3", "asyncio", "multiaddr", "async_service"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))



def tame_libp2p_logging(level: int) -> None:
    """py-libp2p resets its loggers when imported (level WARNING, no handler, no propagation),
    so every failed dial to a peer that is down lands on stderr unformatted. Import it now and
    route its records through our handler: errors only, unless we log at debug level."""
    import libp2p  # noqa: F401  (its import-time logging set-up must run before we adjust it)

    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.setLevel(logging.DEBUG if level <= logging.DEBUG else logging.ERROR)
    libp2p_logger.propagate = True
    if level > logging.DEBUG:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_quiet_libp2p)


#: py-libp2p's ERROR for one failed dial: a peer not listening yet (start-up) or gone (shutdown). The host
#: retries with backoff and counts failures itself (status.json ``failed_dials``); at ERROR it alarms users.
_DIAL_FAILED = "Failed to open TCP stream"
#: The same failed dial where py-libp2p bound the source address first (port reuse for hole punching): its
#: connect's OSError arrives wrapped and is logged as "unexpected" (e.g. EADDRNOTAVAIL, ENETUNREACH towards a
#: NATed peer's private address; ~500 lines an hour in issue 45's soak).
_DIAL_FROM_FAILED = ("Unexpected error opening TCP stream", "Failed to connect ")
#: py-libp2p's seven-line ERROR for a stream it could not open on a connection already closed: a peer that
#: left (its own background protocols, e.g. autonat, probe peers as the run ends).
_STREAM_ON_CLOSED = ("Failed to open stream to peer", "established=False")


#: py-libp2p's ERRORs for a new stream whose multistream-select negotiation broke off because the stream was
#: reset or its connection closed meanwhile (an I/O error, not a timeout: the negotiation timeout is
#: p2p.transport.STREAM_NEGOTIATION_TIMEOUT_S, 30 s, 50 round trips of a 200 ms link, and reads "response
#: timed out", which stays at ERROR). It logs one line in the
#: multiselect client and a seven-line block in the host, then raises StreamFailure to the opener, which
#: handles it (the blob client tries the other providers, gossip re-syncs, the DHT its next peer). Over
#: 20-200 ms links with restarts and relayed connections replaced by direct ones, about 450 such lines an
#: hour (issue 45's soak, docs/P2P.md); debug level only.
_NEGOTIATION_BROKEN = ("fail to read from multiselect communicator",
                       "fail to write to multiselect communicator")
_MULTISELECT_CLIENT = "libp2p.protocol_muxer.multiselect_client"


def _quiet_libp2p(record: logging.LogRecord) -> bool:
    """Below debug level: no py-libp2p record under ERROR (some of its modules set their own logger to INFO at
    import, e.g. the auto-connector's per-dial-round state), no per-dial failure line, no failed stream on a
    connection that is already closed, and no stream negotiation broken off by a reset (its opener gets the
    error). Its other errors are kept."""
    if not record.name.startswith("libp2p"):
        return True
    if record.levelno < logging.ERROR:
        return False
    if record.name.startswith("libp2p.transport") and str(record.msg).startswith(_DIAL_FAILED):
        return False
    if record.name.startswith("libp2p.transport") and str(record.msg).startswith(_DIAL_FROM_FAILED[0]):
        return not record.getMessage().split(": ", 1)[-1].startswith(_DIAL_FROM_FAILED[1])
    if record.name == _MULTISELECT_CLIENT and str(record.msg).startswith("MultiselectClient handshake:"):
        return not any(text in record.getMessage() for text in _NEGOTIATION_BROKEN)
    if record.name == "libp2p.host.basic_host" and str(record.msg).startswith(_STREAM_ON_CLOSED[0]):
        message = record.getMessage()
        return _STREAM_ON_CLOSED[1] not in message \
            and not any(text in message for text in _NEGOTIATION_BROKEN)
    return True


def parse_command_line(parser, argv: list[str] | None):
    """The arguments, options allowed between a command's positionals (``pull LINK --archive DIR OUT``):
    argparse stops a command's positionals at its first option, so what is left over is parsed again by
    the command's own parser, intermixed. Anything else left over is the usual usage error (exit 2)."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if not extra or args.command is None:
        return parser.parse_args(argv)  # no leftovers, or its own error message
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[args.command]
    at = argv.index(args.command)
    try:
        own = command.parse_intermixed_args(argv[at + 1:])
    except TypeError:  # a command whose arguments cannot be intermixed (argparse's own limits)
        return parser.parse_args(argv)
    for key, value in vars(own).items():
        setattr(args, key, value)
    return args


def _destination(args) -> str | None:
    """Where the command writes (its output, else its data directory), to name a full disk by."""
    for key in ("out_dir", "out", "dir", "data_dir"):
        value = getattr(args, key, None)
        if isinstance(value, str) and value:
            return os.path.abspath(os.path.expanduser(value))
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    if args.command is None:
        parser.print_help()
        return int(ExitCode.USAGE)
    if args.command in ("start", "join"):  # a long-running node: before any thread starts (node/arenas.py)
        from node.arenas import limit_arenas, map_large_blocks, start_heap_trimmer

        limit_arenas()
        map_large_blocks()
        start_heap_trimmer()
    configure_logging(args.log_level, args.log_json, args.log_file)
    if args.command in ("start", "join", "audit", "pull", "demo"):  # the demo's --keep runs a libp2p seeder
        tame_libp2p_logging(logging.getLogger().level)
    if args.command in ("start", "join", "demo"):  # may run a local anvil: an installed package takes PATH's
        from node.anvil import locate_anvil

        locate_anvil()
    from node.commands.faces import COMMANDS  # deferred: pulls in torch / libp2p / web3 as needed

    started = time.monotonic()
    try:
        return int(COMMANDS[args.command](args) or 0)
    except KeyboardInterrupt:
        print("dlx-node: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except DLX_ERRORS as exc:
        logger.debug("command failed after %.1fs", time.monotonic() - started, exc_info=True)
        full = exc.__cause__
        if isinstance(full, OSError) and is_disk_full(full):  # a package's error over a full disk (pull's
            if not full.filename:                              # export, an archive): state, 4, not its own
                full.filename = _destination(args)
            print(f"dlx-node {args.command}: error: {exc}; "
                  f"{disk_full_message(full, 'free space and run it again')}", file=sys.stderr)
            return int(ExitCode.STATE)
        print(f"dlx-node {args.command}: error: {exc}", file=sys.stderr)
        return exit_code_for(exc)
    except OSError as exc:
        if os.environ.get("DLX_DEBUG"):
            raise
        if is_disk_full(exc):  # every write is atomic: what is on disk loads on the next start
            if not exc.filename:  # a write() names no file: the command's own output or data directory
                exc.filename = _destination(args)
            print(f"dlx-node {args.command}: error: "
                  f"{disk_full_message(exc, 'stopped; free space and run it again')}",
                  file=sys.stderr)
            return int(ExitCode.STATE)
        print(f"dlx-node {args.command}: error: {exc}", file=sys.stderr)
        return int(ExitCode.UNEXPECTED)


if __name__ == "__main__":
    sys.exit(main())
