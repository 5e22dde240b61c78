"""The dlx-node audit command: arguments in, the audit run, the report written, the exit code out."""

import sys
import time
from typing import Any

from node.errors import AuditFailed, AuditIncomplete, ConfigError
from node.tools.audit import audit_run
from node.tools.evidence import PeerFetcher, reader_client
from node.tools.report import (
    INCOMPLETE,
    OK,
    UNVERIFIABLE,
)


# ---------------------------------------------------------------------- the command
class _ProgressBar:
    """Progress on stderr: on a terminal a bar redrawn in place, done of how many and an estimate of the time
    left, whatever the total; otherwise a line every 10% of ``min_total`` or more."""

    def __init__(self, stream: Any = None, min_total: int = 20, label: str = "rounds checked") -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.label = label
        self.min_total = min_total
        self._last_decile = -1
        self._started: float | None = None

    def __call__(self, done: int, total: int, what: str) -> None:
        if total < 1 or (not self.tty and total < self.min_total):
            return
        now = time.monotonic()
        if self._started is None or done == 0:
            self._started = now
        if self.tty:
            filled = int(30 * done / total)
            detail = f" ({what})" if what else ""
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {self.label}{detail}, "
                              f"{_left(now - self._started, done, total)}\033[K")
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(done / total * 10) > self._last_decile:
            self._last_decile = int(done / total * 10)
            self.stream.write(f"audit: {done}/{total} {self.label}\n")
            self.stream.flush()


def _left(elapsed: float, done: int, total: int) -> str:
    """An estimate of the time left at the pace so far."""
    if done >= total:
        return f"done in {_duration(elapsed)}"
    if done == 0:
        return "estimating the time left"
    return f"about {_duration(elapsed / done * (total - done))} left"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def _reexecute_count(value: str) -> int:
    """``--reexecute`` as a count: N >= 0, or "all" (-1)."""
    if str(value).lower() == "all":
        return -1
    try:
        count = int(value)
    except ValueError:
        count = -2
    if count < 0:
        raise ConfigError(f"--reexecute {value!r}: give a number of contributions >= 0, or 'all'")
    return count


def _processes(value) -> int:
    """``--processes`` as a count of processes a rerun may use, in [1, 256] (as ``compute.processes``)."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if not 1 <= count <= 256:
        raise ConfigError(f"--processes {value!r}: give a number of processes from 1 to 256")
    return count


def pool_address(args: Any) -> str:
    """The reward pool to audit: --pool, else deployment.json's ``reward_pool`` (empty: none)."""
    if getattr(args, "pool", ""):
        return args.pool
    if getattr(args, "deployment", ""):
        import json
        from pathlib import Path

        try:
            return str(json.loads(Path(args.deployment).read_text()).get("reward_pool", "") or "")
        except (OSError, ValueError, AttributeError):
            return ""  # reader_client has named the unreadable file already
    return ""


def run_audit(args: Any) -> int:
    """``dlx-node audit``: print per-round verdicts and the summary, write --json/--html.

    Exit 0 only if the audit PASSED; AuditFailed (8) if an item contradicts the record, AuditIncomplete (13)
    if some items could not be verified.
    """
    from node.tools.report import write_json
    from node.tools.report_html import write_html

    client = reader_client(args)
    fetcher = PeerFetcher.start(args.bootstrap) if args.bootstrap else None
    try:
        report = audit_run(
            client,
            args.run,
            archives=args.archive,
            fetcher=fetcher,
            replay=not args.no_replay,
            progress=_ProgressBar(),
            data_path=getattr(args, "data", "") or None,
            reexecute=_reexecute_count(getattr(args, "reexecute", "0")),
            reexec_progress=_ProgressBar(min_total=1, label="contributions re-executed"),
            processes=_processes(getattr(args, "processes", 1)),
        )
    finally:
        if fetcher is not None:
            fetcher.close()
    pool = pool_address(args)
    if pool:
        from node.tools.audit_pool import pool_checks

        report.general.extend(pool_checks(client, args.run, pool, args.archive,
                                          named=bool(getattr(args, "pool", ""))))
    for check in report.general:
        if check.status != OK or len(report.general) <= 12 or check.name.startswith("reward pool"):
            print(check.line())
    for verdict in report.rounds:
        print(verdict.line())
        for note in verdict.notes:
            print(f"  {note}")
    for note in report.notes:
        print(note)
    for check in report.checkpoints:
        print(check.line())
    if args.json_out:
        write_json(report, args.json_out)
        print(f"JSON report: {args.json_out}")
    if args.html_out:
        write_html(report, args.html_out)
        print(f"HTML report: {args.html_out}")
    t = report.timings
    print(
        f"chain part {t.get('chain_total_s', 0):.2f}s, rounds {t.get('rounds_s', 0):.2f}s"
        + (f", replay {t['replay_mean_s_per_round']:.3f}s/round" if "replay_mean_s_per_round" in t else "")
    )
    print(report.summary())
    if report.reexecution:
        print(report.reexecution_line())
    if report.case_leads:
        from node.tools.audit_cases import print_leads

        print_leads(report.case_leads)
    if report.failed:
        first, bad = report.first_bad_round, report.first_failure()
        where = f"first bad round {first}" if first is not None else "a chain-level item"
        raise AuditFailed(f"run {args.run} does not match its record: {where}: {bad.name}: {bad.reason}")
    if report.verdict == INCOMPLETE:
        first, missing = report.first_unverified_round, report.first_unverifiable()
        where = f"first unverified round {first}" if first is not None else "a chain-level item"
        raise AuditIncomplete(
            f"run {args.run}: audit INCOMPLETE, {report.counts()[UNVERIFIABLE]} item(s) unverifiable "
            f"({where}: {missing.name}: {missing.reason}); pass --archive or --bootstrap with the evidence"
        )
    return 0
