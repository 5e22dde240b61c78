"""``dlx-node audit``: re-derive a run's training history from the chain and the signed contributions.

An auditor trusts no node. It reads the run's record from the chain (an RPC URL
and the two contract addresses are all it needs) and checks, item by item:

1. **Chain** -- the contracts' bytecode against the committed build artifacts
   and the ledger's trusted registry; the commit hash chain link by link up to
   the contract's ``headOf(runId)``; every registration's ed25519 binding
   signature (the EVM cannot check it); every member's node key bound by a
   valid registration; that each round's record was attested by ``quorum``
   distinct members in force at its commit (membership rebuilt from the chain's
   events) and lies within the run's ``maxRounds``. Disputes (a member's own
   signed, differing record), equivocation reports and slashings are read and
   shown with their rounds.
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
4. **Each published checkpoint** -- the file's sha256 (a header-hashed run's: its
   header's hash, and every stage against its leaf) against the chain's content
   hash, its metadata, its weights against the commit of its round and, when
   the replay reached that round, against the replayed weights and momentum.

Every item ends as ``ok``, ``FAIL`` (with the reason) or ``unverifiable`` (with
the reason: the evidence was not available, e.g. an archive no peer serves any
more). Nothing that could not be checked is reported as ``ok``: the audit
PASSED only if every item is ok; with unverifiable items and no failure it is
INCOMPLETE (exit 13), with a failure FAILED (exit 8). A disputed round is judged
by replay: FAIL if the committed record does not replay, otherwise ok with a
note naming the dispute (and whether the disputer's record replays). See
docs/AUDIT.md.

This module composes the checks and is the command's face: the chain items
are :mod:`ledger.checks`'s, a round's contributions :mod:`node.tools.audit_rounds`'s,
the run document :mod:`node.tools.audit_rundoc`'s, the replay and checkpoints
:mod:`node.tools.audit_replay`'s, and
the bytes come through :mod:`node.tools.evidence`.
"""

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from node.errors import DLX_ERRORS, AuditFailed, AuditIncomplete
from node.tools.audit_proof import check_fraud_proof
from node.tools.audit_replay import Replayer, check_checkpoint, check_replay
from node.tools.audit_rounds import check_contributions
from node.tools.audit_rundoc import check_run_document
from node.tools.evidence import ArchiveSource, PeerSource
from node.tools.report import (
    FAIL,
    FAILED,
    INCOMPLETE,
    OK,
    PASSED,
    UNVERIFIABLE,
    AuditReport,
    Check,
    DisputeView,
    RoundVerdict,
    worst,
)

__all__ = [
    "ATTESTED",
    "FAIL",
    "FAILED",
    "INCOMPLETE",
    "OK",
    "PASSED",
    "UNVERIFIABLE",
    "AuditFailed",
    "AuditIncomplete",
    "AuditReport",
    "Check",
    "RoundVerdict",
    "audit_run",
    "worst",
]

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]

#: The per-round item that replaced "committer registered":
#: quorum distinct members in force signed the record.
ATTESTED = "attested by k members in force"
WITHIN_MAX_ROUNDS = "within maxRounds"


def _report_item(item: Any) -> Check:
    """A report item from a :class:`ledger.checks.ItemResult`."""
    return Check(item.name, OK if item.ok else FAIL, item.reason)


def _chain_checks(client: Any, history: Any, report: AuditReport, check_code: bool) -> Any:
    """The chain items (:func:`ledger.checks.check_chain_record`) into the report; return the
    :class:`ledger.checks.ChainChecks` (valid registrations, disputes, equivocations, slashings)."""
    from ledger.checks import check_chain_record

    chain = check_chain_record(client, history, check_code)
    if chain.contracts is None:
        report.general.append(Check("contract bytecode", UNVERIFIABLE, "skipped on request"))
    else:
        report.general += [_report_item(item) for item in chain.contracts]
    report.general.append(_report_item(chain.hash_chain.genesis))
    report.general += [_report_item(item) for item in chain.registrations]
    report.general += [_report_item(item) for item in chain.members]
    max_rounds = history.run.max_rounds
    last_final = _last_final(client, history)
    for verdict, record, link, attested in zip(
        report.rounds, history.commits, chain.hash_chain.links, chain.attesters
    ):
        verdict.checks.append(Check("hash chain link", OK if link.ok else FAIL, link.reason))
        verdict.final = None if last_final is None else verdict.round <= last_final
        in_force = len(history.members_at(record.position))
        why = attested.reason or (
            f"{len(record.attesters)} of {in_force} members in force, quorum {history.run.quorum}"
        )
        verdict.checks.append(Check(ATTESTED, OK if attested.ok else FAIL, why))
        if max_rounds and verdict.round >= max_rounds:
            verdict.checks.append(
                Check(
                    WITHIN_MAX_ROUNDS,
                    FAIL,
                    f"round {verdict.round} is past the run's last round {max_rounds - 1} "
                    f"(maxRounds {max_rounds})",
                )
            )
        else:
            verdict.checks.append(Check(WITHIN_MAX_ROUNDS, OK, f"of {max_rounds}" if max_rounds
                                        else "open-ended"))
    report.general.append(_report_item(chain.hash_chain.head))
    return chain


def _last_final(client: Any, history: Any) -> int | None:
    """The highest round the chain's ``isFinal`` holds for now (issue 79), None where it cannot be read."""
    from node.tools.standing import last_final_on_chain

    try:
        return last_final_on_chain(client, history)
    except DLX_ERRORS as exc:
        logger.info("the chain's isFinal was not read: %s", exc)
        return None


def _findings(history: Any, chain: Any, report: AuditReport) -> None:
    """Equivocation reports into their rounds' notes; slashings and accusations into the report's notes."""
    by_round = {verdict.round: verdict for verdict in report.rounds}
    causes = {}
    for round_index, reports in chain.equivocations.items():
        for equivocation in reports:
            causes[equivocation.tx_hash] = f"equivocation on round {round_index}"
            verdict = by_round.get(round_index)
            if verdict is not None:
                role = "an attester of this round" if equivocation.account in verdict.attesters \
                    else "a member"
                verdict.notes.append(
                    f"{role}, {equivocation.account}, signed two records of this round (reported by "
                    f"{equivocation.reporter} at block {equivocation.block_number}; slashed)"
                )
    for accusation in history.accusations:
        if accusation.guilty:
            causes.setdefault(f"verdict:{accusation.accused}:{accusation.resolved_block}", "a guilty verdict")
        state = "open" if accusation.open else ("guilty" if accusation.guilty else "cleared")
        report.notes.append(
            f"accusation of {accusation.accused} by {accusation.accuser} "
            f"(evidence {accusation.evidence_hash.hex()[:16]}, block {accusation.opened_block}): {state}"
        )
    for slash in chain.slashings:
        cause = causes.get(slash.tx_hash) or causes.get(
            f"verdict:{slash.account}:{slash.block_number}", "cause not found"
        )
        report.notes.append(
            f"member {slash.account} slashed {slash.stake} wei at block {slash.block_number} ({cause})"
        )


def _judge_disputes(verdict: RoundVerdict, disputes: list, commit: Any, replayed: bytes | None) -> None:
    """Show each disputer's record next to the committed one and say which one the replay supports.

    The round's own status is left to its items: FAIL if the committed record does not replay, otherwise
    ok (or unverifiable) with a note naming the dispute.
    """
    committed = (
        "unverified" if replayed is None else ("replays" if replayed == commit.weights_root
                                               else "does NOT replay")
    )
    for dispute in disputes:
        record = dispute.record
        replays = "unknown" if replayed is None else ("yes" if record.weights_root == replayed else "no")
        verdict.disputes.append(
            DisputeView(
                disputer=dispute.disputer,
                block=dispute.block_number,
                weights_root=record.weights_root.hex(),
                contributions_root=record.contributions_root.hex(),
                train_loss=record.train_loss_micro / 1e6,
                eval_loss=record.eval_loss_micro / 1e6,
                checkpoint_hash=record.checkpoint_hash.hex() if record.has_checkpoint else "",
                replays=replays,
            )
        )
        differs = [
            name
            for name in ("weights_root", "contributions_root", "train_loss_micro", "eval_loss_micro",
                         "tokens", "num_contributors", "checkpoint_hash", "prev_head")
            if getattr(record, name) != getattr(commit, name)
        ]
        other_list = (
            "; its contributions root differs, so its weights were judged against the committed contributions"
            if record.contributions_root != commit.contributions_root
            else ""
        )
        theirs = {"yes": "replays", "no": "does not replay", "unknown": "is unverified"}[replays]
        verdict.notes.append(
            f"disputed by {dispute.disputer} at block {dispute.block_number} (its record differs in "
            f"{', '.join(differs) or 'nothing'}): the committed record {committed}, the disputer's "
            f"{theirs}{other_list}"
        )


def audit_run(
    client: Any,
    run_id: int,
    archives: Iterable[str | Path] = (),
    fetcher: Any = None,
    replay: bool = True,
    progress: Progress | None = None,
    check_code: bool = True,
    data_path: str | Path | None = None,
    reexecute: int = 0,
    reexec_progress: Progress | None = None,
    processes: int = 1,
) -> AuditReport:
    """Audit run ``run_id`` (module docstring): return an :class:`AuditReport`, never raise on a finding.

    Args:
        client: A :class:`ledger.client.LedgerClient` of the deployment (its account is only a reader).
        archives: Local directories with archived contributions, run documents and checkpoints.
        fetcher: A connected :class:`node.tools.evidence.PeerFetcher` to fetch missing evidence from peers,
            or None.
        replay: Re-run the aggregation and outer step of every round (False: chain and archives only).
        progress: Called as ``progress(done, total, what)`` while rounds are checked.
        data_path: The run's training text, for re-deriving contribution screening (None: only runs on the
            project's generated corpus can be screened here).
        reexecute: Rerun this many sampled contributions (-1: all) and every ejection's evidence
            (:mod:`node.tools.audit_reexec`); 0: none.
        reexec_progress: Called as ``progress(done, total, what)`` after each of those reruns.
        processes: The processes a rerun may use: a cluster node's contribution of N <= ``processes`` ranks
            reruns on N ranks, bit for bit; else in one process, by the tolerance rule (docs/CLUSTER.md).
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    history = client.history(run_id)
    timings["read_history_s"] = time.perf_counter() - started
    report = _new_report(client, run_id, history, replay)
    mark = time.perf_counter()
    chain = _chain_checks(client, history, report, check_code)
    _findings(history, chain, report)
    timings["chain_checks_s"] = time.perf_counter() - mark
    timings["chain_total_s"] = time.perf_counter() - started

    archives = list(archives)
    sources: list = [ArchiveSource(d, run_id, archives) for d in archives]
    if fetcher is not None:
        sources.append(PeerSource(fetcher, run_id))
    report.sources = [s.name for s in sources]
    mark = time.perf_counter()
    document, replayer, layout = _replay_setup(report, history, sources, data_path, run_id,
                                               (archives, fetcher))
    _check_rounds(report, history, chain, sources, (document, replayer, layout), replay, progress, client)
    timings["rounds_s"] = time.perf_counter() - mark
    if reexecute:
        from node.tools.audit_reexec_checks import reexec_checks

        mark = time.perf_counter()
        reexec_checks(report, history, replayer, archives, reexecute, reexec_progress, fetcher=fetcher,
                      processes=processes, reader=client)
        timings["reexecute_s"] = time.perf_counter() - mark
    timings["total_s"] = time.perf_counter() - started
    replays = [r.replay_seconds for r in report.rounds if r.replay_seconds is not None]
    if replays:
        timings["replay_mean_s_per_round"] = sum(replays) / len(replays)
        timings["replay_max_s_per_round"] = max(replays)
    report.timings = {k: round(v, 4) for k, v in timings.items()}
    return report


def _new_report(client: Any, run_id: int, history: Any, replay: bool) -> AuditReport:
    """The report of a run's history before any check: the run's fields and one verdict per commit."""
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
        quorum=run.quorum,
        max_rounds=run.max_rounds,
    )
    for record in history.commits:
        c = record.commit
        report.rounds.append(
            RoundVerdict(
                round=c.round,
                submitter=record.submitter,
                block=record.block_number,
                train_loss=c.train_loss_micro / 1e6,
                eval_loss=c.eval_loss_micro / 1e6,
                tokens=c.tokens,
                num_contributors=c.num_contributors,
                weights_root=c.weights_root.hex(),
                contributions_root=c.contributions_root.hex(),
                attesters=list(record.attesters),
                prev_head=c.prev_head.hex(),
                checkpoint_hash=c.checkpoint_hash.hex() if c.has_checkpoint else "",
            )
        )
    return report


def _replay_setup(report: AuditReport, history: Any, sources: list, data_path, run_id: int,
                  local: tuple = ((), None)) -> tuple:
    """The run document (checked against the configHash), a replayer and the checkpoint layout, or Nones;
    ``local``: (archives, fetcher), where an imported model's initial weights and the run's tokenizer are
    (node/tools/audit_inputs.py)."""
    from node.tools.audit_inputs import initial_weights_check, tokenizer_dirs

    def inputs(document: dict) -> None:  # before the document's values (genesis root) are derived
        check = initial_weights_check(document, *local)
        if check is not None:
            report.general.append(check)

    document = check_run_document(report, history, sources, inputs)
    replayer = layout = None
    if document is not None:
        try:
            replayer = Replayer(document, data_path)
            replayer.sources, replayer.run_id = sources, run_id
            replayer.tokenizer_dirs = tokenizer_dirs(document, *local)
            from node.store.checkpoint import RunLayout

            layout = RunLayout.of_document(run_id, history.run.config_hash, document)
        except DLX_ERRORS as exc:  # hashes to the configHash, yet its settings do not load
            report.general.append(Check("run document settings", FAIL, str(exc)))
    return document, replayer, layout


def _check_rounds(
    report: AuditReport, history: Any, chain: Any, sources: list, setup: tuple, replay: bool,
    progress: Progress | None, client: Any = None,
) -> None:
    """Every committed round in order: contributions, replay (and a chunked run's fraud proof of a round that
    does not replay), disputes, checkpoints (and orphan checkpoints)."""
    document, replayer, layout = setup
    run = history.run
    checkpoints = {c.round: c for c in history.checkpoints}
    commits = {r.commit.round: r.commit for r in history.commits}
    for ckpt_round in sorted(set(checkpoints) - set(commits)):
        check_checkpoint(report, checkpoints[ckpt_round], None, sources, replayer, layout)
    previous_block = run.block_number
    previous_round = -1
    total = len(history.commits)
    if progress is not None:
        progress(0, total, "")
    for index, (record, verdict) in enumerate(zip(history.commits, report.rounds, strict=True)):
        commit = record.commit
        if replayer is not None and replay:
            if commit.round == 0:
                replayer.start_from_initial()
            elif commit.round != previous_round + 1:
                replayer.drop()  # a round that was never committed: the state after it is unknown
                verdict.notes.append(f"rounds {previous_round + 1}..{commit.round - 1} were never committed")
        payloads = check_contributions(verdict, record, sources, run.num_stages, chain.valid, previous_block,
                                       run, document)
        replayed = check_replay(verdict, commit, replayer, payloads, replay)
        if replayed is not None and replayed != commit.weights_root and replayer.scheme.chunked \
                and client is not None:
            check_fraud_proof(verdict, record, commits.get(commit.round - 1), replayer, sources, client,
                              history, layout)
        if commit.round in chain.disputes:
            _judge_disputes(verdict, chain.disputes[commit.round], commit, replayed)
        if commit.round in checkpoints:
            ckpt = check_checkpoint(report, checkpoints[commit.round], commit, sources,
                                    replayer if replay else None, layout)
            if ckpt is not None and replayer is not None and replay and replayer.weights is None:
                replayer.start_from_checkpoint(ckpt)  # the base for the rounds after a gap
        previous_block, previous_round = record.block_number, commit.round
        if progress is not None:
            progress(index + 1, total, f"round {commit.round}")
