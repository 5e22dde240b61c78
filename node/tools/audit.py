"""``dlx-node audit``: re-derive a run's training history from the chain and the signed contributions.

An auditor trusts no node. It reads the run's record from the chain (an RPC URL
and the two contract addresses are all it needs) and checks, item by item:

1. **Chain** -- the contracts' bytecode against the committed build artifacts
   and the ledger's trusted registry; the commit hash chain link by link up to
   the contract's ``headOf(runId)``; every registration's ed25519 binding
   signature (the EVM cannot check it); that every committer held a valid
   registration at the commit's block.
2. **Run document** -- a copy whose sha256 is the chain's ``configHash`` (from an
   archive or fetched by that hash from peers); it pins the model, the seed and
   so the initial weights, and the DiLoCoX settings of the outer step.
3. **Each round t** -- the signed contribution envelopes (archives given with
   ``--archive`` and/or fetched by hash over libp2p from ``--bootstrap`` peers):
   their Merkle root in canonical order (stage, replica, peer id, hash) against
   the commit's ``contributionsRoot``; each envelope's signature, run, round,
   stage, replica, kind and that its signer's key is bound to a registered
   account; then the bit-exact replay of aggregation + outer step
   (:func:`training.diloco.aggregate`, DiLoCo Algorithm 1's outer step,
   arXiv 2311.08105) from the initial weights or from a published checkpoint,
   compared with the committed ``weightsRoot``.
4. **Each published checkpoint** -- the file's sha256 against the chain's content
   hash, its metadata, its weights against the commit of its round and, when
   the replay reached that round, against the replayed weights and momentum.

Every item ends as ``ok``, ``FAIL`` (with the reason) or ``unverifiable`` (with
the reason: the evidence was not available, e.g. an archive no peer serves any
more). Nothing that could not be checked is reported as ``ok``. See
docs/AUDIT.md.

This module composes the checks and is the command's face: the chain items
are :mod:`ledger.checks`'s, a round's contributions :mod:`node.tools.audit_rounds`'s,
the run document, replay and checkpoints :mod:`node.tools.audit_replay`'s, and
the bytes come through :mod:`node.tools.evidence`.
"""

import logging
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, AuditFailed
from node.tools.audit_replay import Replayer, check_checkpoint, check_replay, check_run_document
from node.tools.audit_rounds import check_contributions
from node.tools.evidence import ArchiveSource, PeerFetcher, PeerSource, reader_client
from node.tools.report import FAIL, OK, UNVERIFIABLE, AuditReport, Check, RoundVerdict, worst

__all__ = [
    "FAIL",
    "OK",
    "UNVERIFIABLE",
    "AuditFailed",
    "AuditReport",
    "Check",
    "RoundVerdict",
    "audit_run",
    "run_audit",
    "worst",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]


def _report_item(item: Any) -> Check:
    """A report item from a :class:`ledger.checks.ItemResult`."""
    return Check(item.name, OK if item.ok else FAIL, item.reason)


def _chain_checks(client: Any, history: Any, report: AuditReport, check_code: bool) -> dict[str, list]:
    """The chain items (:func:`ledger.checks.check_chain_record`) into the report; return the valid
    registrations by account (the contribution checks need them)."""
    from ledger.checks import check_chain_record

    chain = check_chain_record(client, history, check_code)
    if chain.contracts is None:
        report.general.append(Check("contract bytecode", UNVERIFIABLE, "skipped on request"))
    else:
        report.general += [_report_item(item) for item in chain.contracts]
    report.general.append(_report_item(chain.hash_chain.genesis))
    report.general += [_report_item(item) for item in chain.registrations]
    for verdict, link, committer in zip(report.rounds, chain.hash_chain.links, chain.committers):
        verdict.checks.append(Check("hash chain link", OK if link.ok else FAIL, link.reason))
        verdict.checks.append(Check("committer registered", OK if committer.ok else FAIL, committer.reason))
    report.general.append(_report_item(chain.hash_chain.head))
    return chain.valid


def audit_run(
    client: Any,
    run_id: int,
    archives: Iterable[str | Path] = (),
    fetcher: Any = None,
    replay: bool = True,
    progress: Progress | None = None,
    check_code: bool = True,
) -> AuditReport:
    """Audit run ``run_id`` (module docstring): return an :class:`AuditReport`, never raise on a finding.

    Args:
        client: A :class:`ledger.client.LedgerClient` of the deployment (its account is only a reader).
        archives: Local directories with archived contributions, run documents and checkpoints.
        fetcher: A connected :class:`node.tools.evidence.PeerFetcher` to fetch missing evidence from peers, or None.
        replay: Re-run the aggregation and outer step of every round (False: chain and archives only).
        progress: Called as ``progress(done, total, what)`` while rounds are checked.
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    history = client.history(run_id)
    timings["read_history_s"] = time.perf_counter() - started
    run = history.run
    report = AuditReport(
        run_id=run_id,
        chain_id=client.chain_id,
        registry=client.registry_address,
        ledger=client.ledger_address,
        config_hash=run.config_hash.hex(),
        num_stages=run.num_stages,
        inner_steps=run.inner_steps,
        head=history.head_hash.hex(),
        replay=replay,
    )
    for record in history.commits:
        c = record.commit
        report.rounds.append(
            RoundVerdict(
                round=c.round,
                committer=record.committer,
                block=record.block_number,
                train_loss=c.train_loss_micro / 1e6,
                eval_loss=c.eval_loss_micro / 1e6,
                tokens=c.tokens,
                num_contributors=c.num_contributors,
                weights_root=c.weights_root.hex(),
                contributions_root=c.contributions_root.hex(),
            )
        )
    mark = time.perf_counter()
    valid = _chain_checks(client, history, report, check_code)
    timings["chain_checks_s"] = time.perf_counter() - mark
    timings["chain_total_s"] = time.perf_counter() - started

    sources: list = [ArchiveSource(d, run_id) for d in archives]
    if fetcher is not None:
        sources.append(PeerSource(fetcher, run_id))
    report.sources = [s.name for s in sources]
    mark = time.perf_counter()
    document = check_run_document(report, history, sources)
    replayer = None
    if document is not None:
        try:
            replayer = Replayer(document)
        except DLX_ERRORS as exc:  # hashes to the configHash, yet its settings do not load
            report.general.append(Check("run document settings", FAIL, str(exc)))
    checkpoints = {c.round: c for c in history.checkpoints}
    commits = {r.commit.round: r.commit for r in history.commits}
    for ckpt_round in sorted(set(checkpoints) - set(commits)):
        check_checkpoint(report, checkpoints[ckpt_round], None, sources, replayer, run.config_hash)

    previous_block = run.block_number
    previous_round = -1
    total = len(history.commits)
    for index, (record, verdict) in enumerate(zip(history.commits, report.rounds)):
        commit = record.commit
        if replayer is not None and replay:
            if commit.round == 0:
                replayer.start_from_initial()
            elif commit.round != previous_round + 1:
                replayer.drop()  # a round that was never committed: the state after it is unknown
                verdict.notes.append(f"rounds {previous_round + 1}..{commit.round - 1} were never committed")
        payloads = check_contributions(
            verdict, record, sources, run.num_stages, valid, previous_block, run, document
        )
        check_replay(verdict, commit, replayer, payloads, replay)
        if commit.round in checkpoints:
            ckpt = check_checkpoint(
                report,
                checkpoints[commit.round],
                commit,
                sources,
                replayer if replay else None,
                run.config_hash,
            )
            if ckpt is not None and replayer is not None and replay and replayer.weights is None:
                replayer.start_from_checkpoint(ckpt)  # the base for the rounds after a gap
        previous_block, previous_round = record.block_number, commit.round
        if progress is not None:
            progress(index + 1, total, f"round {commit.round}")
    timings["rounds_s"] = time.perf_counter() - mark
    timings["total_s"] = time.perf_counter() - started
    replays = [r.replay_seconds for r in report.rounds if r.replay_seconds is not None]
    if replays:
        timings["replay_mean_s_per_round"] = sum(replays) / len(replays)
        timings["replay_max_s_per_round"] = max(replays)
    report.timings = {k: round(v, 4) for k, v in timings.items()}
    return report


# ---------------------------------------------------------------------- the command
class _ProgressBar:
    """A progress bar on stderr (redrawn in place on a terminal; a line every 10% otherwise)."""

    def __init__(self, stream: Any = None, min_total: int = 20) -> None:
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_total = min_total
        self._last_decile = -1

    def __call__(self, done: int, total: int, what: str) -> None:
        if total < self.min_total:
            return
        fraction = done / total
        if self.tty:
            filled = int(30 * fraction)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {what:<14}")
            if done == total:
                self.stream.write("\n")
            self.stream.flush()
        elif int(fraction * 10) > self._last_decile:
            self._last_decile = int(fraction * 10)
            self.stream.write(f"audit: {done}/{total} rounds checked\n")
            self.stream.flush()


def run_audit(args: Any) -> int:
    """``dlx-node audit``: print per-round verdicts and the summary, write --json/--html, exit 0 or 8."""
    from node.tools.report import write_html, write_json

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
        )
    finally:
        if fetcher is not None:
            fetcher.close()
    for check in report.general:
        if check.status != OK or len(report.general) <= 12:
            print(check.line())
    for verdict in report.rounds:
        print(verdict.line())
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
    if not report.ok:
        first, bad = report.first_bad_round, report.first_failure()
        where = f"first bad round {first}" if first is not None else "a chain-level item"
        raise AuditFailed(f"run {args.run} does not match its record: {where}: {bad.name}: {bad.reason}")
    return 0
