"""The exit codes of ``dlx-node``: one meaning each, in one table.

:class:`ExitCode` names every code a ``dlx-node`` command exits with and says what it means; README.md's
"Exit codes" table is rendered from it (tests/test_exit_codes.py checks that README holds that table).
:data:`EXIT_CODES` maps the packages' error classes to them, most specific first: :func:`exit_code_for`
returns the code of the first class an error is an instance of, 1 (an unexpected error) for any other.
:func:`readme_table` renders the table README.md holds (``python -m node.exitcodes`` prints it).
Only light modules are imported here (no torch, libp2p, web3).
"""

from __future__ import annotations

import enum

from ledger.errors import AccountError, ChainUnavailable, LedgerError
from node.errors import (
    CONFIG_ERRORS,
    AuditFailed,
    AuditIncomplete,
    DataFetchError,
    NetworkUnreachable,
    NodeError,
    NotRegistered,
    NotYet,
    PortBusy,
    PullRefused,
    StateError,
)
from p2p.errors import BlobStoreFull, P2PError
from training.errors import TrainingError


class ExitCode(enum.IntEnum):
    """Every exit code of ``dlx-node``; :attr:`meaning` is what README.md says of it."""

    OK = 0
    UNEXPECTED = 1
    USAGE = 2
    PROTOCOL = 3
    STATE = 4
    CHAIN_UNREACHABLE = 5
    ACCOUNT = 6
    PORT_BUSY = 7
    AUDIT_FAILED = 8
    PULL_REFUSED = 9
    NETWORK = 10
    LEDGER = 11
    TRAINING = 12
    AUDIT_INCOMPLETE = 13
    NOT_YET = 14
    NOT_RUNNING = 15
    INTERRUPTED = 130
    TERMINATED = 143

    @property
    def meaning(self) -> str:
        return MEANINGS[self]


#: What each code means, in the words README.md uses (its first words are checked against README.md).
MEANINGS: dict[ExitCode, str] = {
    ExitCode.OK: "ok",
    ExitCode.UNEXPECTED: "an unexpected error (a bug: DLX_DEBUG=1 shows its traceback) or an I/O error of "
                         "the machine",
    ExitCode.USAGE: "usage or configuration (a bad or missing setting, option or input file, a declined or "
                    "unaffordable transaction)",
    ExitCode.PROTOCOL: "node/protocol (the round protocol could not go on: a peer set that did not form, "
                       "contributions that did not arrive)",
    ExitCode.STATE: "state on disk (a corrupt state or checkpoint in the data directory, or a full disk: "
                    "a write it refused, or a node stopped while one waited; free space and run it again)",
    ExitCode.CHAIN_UNREACHABLE: "chain unreachable",
    ExitCode.ACCOUNT: "the account cannot take part (not registered, registered to another key, cannot "
                      "join, or the run is over)",
    ExitCode.PORT_BUSY: "port busy",
    ExitCode.AUDIT_FAILED: "audit FAILED",
    ExitCode.PULL_REFUSED: "checkpoint refused by pull (nothing installed: the round asked publishes no "
                           "checkpoint, its bytes or round fail a check, or it or its tokenizer is found "
                           "nowhere)",
    ExitCode.NETWORK: "network (peers; a dataset's server, unreachable or sending other bytes than the "
                      "pinned ones)",
    ExitCode.LEDGER: "ledger (a contract's refusal, decoded)",
    ExitCode.TRAINING: "training",
    ExitCode.AUDIT_INCOMPLETE: "audit INCOMPLETE (nothing failed, something could not be checked)",
    ExitCode.NOT_YET: "not yet (e.g. withdraw while the stake unbonds: run it again later)",
    ExitCode.NOT_RUNNING: "not running (status of a node that is stopped: its last status is printed)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
    ExitCode.TERMINATED: "the demo stopped by SIGTERM",
}

#: Exit codes by error class, most specific first (the first class the error is an instance of wins).
#: 0, 1, 130 and 143 belong to no error class: success, anything else, SIGINT and the demo's SIGTERM.
EXIT_CODES: tuple[tuple[tuple[type[Exception], ...], ExitCode], ...] = (
    (CONFIG_ERRORS, ExitCode.USAGE),
    ((StateError, BlobStoreFull), ExitCode.STATE),  # a fetch's full disk too
    ((ChainUnavailable,), ExitCode.CHAIN_UNREACHABLE),
    ((NotRegistered, AccountError), ExitCode.ACCOUNT),
    ((PortBusy,), ExitCode.PORT_BUSY),
    ((AuditFailed,), ExitCode.AUDIT_FAILED),
    ((AuditIncomplete,), ExitCode.AUDIT_INCOMPLETE),
    ((PullRefused,), ExitCode.PULL_REFUSED),
    ((P2PError, NetworkUnreachable, DataFetchError), ExitCode.NETWORK),
    ((LedgerError,), ExitCode.LEDGER),
    ((TrainingError,), ExitCode.TRAINING),
    ((NotYet,), ExitCode.NOT_YET),
    ((NodeError,), ExitCode.PROTOCOL),
)


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a command that failed with ``exc``: its class's in :data:`EXIT_CODES`, else 1."""
    for classes, code in EXIT_CODES:
        if isinstance(exc, classes):
            return int(code)
    return int(ExitCode.UNEXPECTED)


def readme_table() -> str:
    """README.md's table of exit codes, one row per :class:`ExitCode`, as markdown."""
    rows = ["| code | meaning |", "| ---: | --- |"]
    rows += [f"| {int(code)} | {meaning} |" for code, meaning in MEANINGS.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(readme_table(), end="")
