"""The audit report: its data (items, per-round verdicts) and its renderings for machines and people.

:class:`AuditReport` is what :func:`node.tools.audit.audit_run` returns. Every
audited item is a :class:`Check` whose status is ``ok``, ``FAIL`` or
``unverifiable`` (never ok for what could not be checked). The report's verdict
is ``PASSED`` only if every item is ok, ``FAILED`` if any item failed, and
``INCOMPLETE`` otherwise (some items unverifiable, none failed). It renders as
JSON (:func:`write_json`) and as one self-contained HTML page
(:func:`write_html`) with no external resources (no scripts, fonts or images):
the loss curve is an inline SVG drawn from the losses the chain records for
each round, with one ``<polyline>`` point per committed round and a marker on
every round that is not verified, so the page renders the same in any browser,
offline, and can be archived next to the JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from node.fsutil import atomic_write_bytes

logger = logging.getLogger(__name__)

OK, FAIL, UNVERIFIABLE = "ok", "FAIL", "unverifiable"
_RANK = {OK: 0, UNVERIFIABLE: 1, FAIL: 2}
#: The report's overall verdicts: every item ok / some unverifiable, none failed / some item failed.
PASSED, INCOMPLETE, FAILED = "PASSED", "INCOMPLETE", "FAILED"
_VERDICT_OF = {OK: PASSED, UNVERIFIABLE: INCOMPLETE, FAIL: FAILED}


def worst(statuses: Iterable[str]) -> str:
    """The most severe of ``statuses`` (FAIL > unverifiable > ok); ok for none."""
    return max(statuses, key=_RANK.__getitem__, default=OK)


@dataclass
class Check:
    """One audited item and its outcome."""

    name: str
    status: str
    reason: str = ""
    round: int | None = None  # the round the item belongs to, if any

    def line(self) -> str:
        return f"{self.name}: {self.status}" + (f" ({self.reason})" if self.reason else "")


@dataclass
class Contributor:
    """One aggregated contribution of a round, as listed by the evidence."""

    stage: int
    replica: int
    peer_id: str
    envelope: str  # sha256 hex of the envelope bytes
    account: str = ""  # registered account of the signing key, if found
    applied: str = ""  # hex of the applied_hash its body binds (node.protocol.ContributionBody), if read
    binding: str = ""  # hex of its body's contributor and binding signature (issue 62), if it carries them


@dataclass
class DisputeView:
    """A member's own signed record of a disputed round (``RoundDisputed``), next to the committed one."""

    disputer: str
    block: int
    weights_root: str
    contributions_root: str
    train_loss: float
    eval_loss: float
    checkpoint_hash: str
    replays: str = "unknown"  # "yes" / "no": its weights root is / is not the replay of the round; "unknown"


@dataclass
class RoundVerdict:
    """Everything checked about one committed round."""

    round: int
    submitter: str
    block: int
    train_loss: float
    eval_loss: float
    tokens: int
    num_contributors: int
    weights_root: str
    contributions_root: str
    attesters: list[str] = field(default_factory=list)  # the members whose signatures committed the record
    prev_head: str = ""
    checkpoint_hash: str = ""  # empty: the round published no checkpoint
    checks: list[Check] = field(default_factory=list)
    contributors: list[Contributor] = field(default_factory=list)
    disputes: list[DisputeView] = field(default_factory=list)
    replay_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    final: bool | None = None  # the chain's isFinal when audited (issue 79); None: not read

    @property
    def status(self) -> str:
        return worst(c.status for c in self.checks)

    def first_problem(self) -> Check | None:
        for wanted in (FAIL, UNVERIFIABLE):
            for check in self.checks:
                if check.status == wanted:
                    return check
        return None

    def line(self) -> str:
        """The one-line verdict printed per round."""
        text = f"round {self.round}: {self.status}"
        problem = self.first_problem()
        if problem is not None:
            text += f" -- {problem.name}: {problem.reason}"
        extra = [f"{len(self.contributors)} contributions", f"attested by {len(self.attesters)}"]
        if self.final is False:
            extra.append("not final on chain")
        if self.disputes:
            extra.append(f"disputed by {', '.join(d.disputer for d in self.disputes)}")
        if self.replay_seconds is not None:
            extra.append(f"replay {self.replay_seconds:.3f}s")
        return text + f" [{', '.join(extra)}]"


@dataclass
class AuditReport:
    """The outcome of :func:`audit_run` (rendered by :mod:`node.tools.report`)."""

    run_id: int
    chain_id: int
    registry: str
    ledger: str
    config_hash: str
    num_stages: int
    inner_steps: int
    head: str
    replay: bool
    general: list[Check] = field(default_factory=list)
    rounds: list[RoundVerdict] = field(default_factory=list)
    checkpoints: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    quorum: int = 0
    max_rounds: int = 0  # 0: open-ended
    notes: list[str] = field(default_factory=list)  # findings that are not items: slashings, accusations
    # --reexecute: the contributions rerun, by how each was judged (exact, emulated, tolerance, not rerun)
    reexecuted: dict[str, int] = field(default_factory=dict)
    # --reexecute (issue 80): how many contributions it was asked to rerun ("all" or N), how many the archives
    # record of committed rounds, how many were sampled and rerun, and why not the rest ({}: not asked)
    reexecution: dict[str, Any] = field(default_factory=dict)
    # issue 79: whether a wrong round of this run could be proven wrong (None: a hashed run, or not known)
    # and, when not, the parameters that make it unprovable, one message each
    fraud_provable: bool | None = None
    unprovable: list[str] = field(default_factory=list)
    # issue 78: each contribution the reruns found wrong or could not rerun, with the challenge command that
    # opens a case against it or why none (node.tools.audit_cases.CaseLead)
    case_leads: list[Any] = field(default_factory=list)

    def all_checks(self) -> list[Check]:
        return self.general + [c for r in self.rounds for c in r.checks] + self.checkpoints

    def counts(self) -> dict[str, int]:
        checks = self.all_checks()
        return {status: sum(c.status == status for c in checks) for status in (OK, FAIL, UNVERIFIABLE)}

    @property
    def verdict(self) -> str:
        """PASSED (every item ok), INCOMPLETE (some unverifiable, none failed) or FAILED (some item
        failed)."""
        return _VERDICT_OF[worst(c.status for c in self.all_checks())]

    @property
    def ok(self) -> bool:
        """The audit PASSED: every item was checked and matches (an unverifiable item is not ok)."""
        return self.verdict == PASSED

    @property
    def failed(self) -> bool:
        """Some item contradicts the record."""
        return self.verdict == FAILED

    @property
    def first_bad_round(self) -> int | None:
        """The lowest round with a failed item (its own or its checkpoint's), or None."""
        bad = [r.round for r in self.rounds if r.status == FAIL]
        bad += [c.round for c in self.checkpoints if c.status == FAIL and c.round is not None]
        return min(bad, default=None)

    def first_failure(self) -> Check | None:
        """The first failed item of the first bad round, else the first failed chain-level item."""
        first = self.first_bad_round
        if first is not None:
            for check in [c for r in self.rounds if r.round == first for c in r.checks] + self.checkpoints:
                if check.status == FAIL and (check.round is None or check.round == first):
                    return check
        return next((c for c in self.all_checks() if c.status == FAIL), None)

    @property
    def first_unverified_round(self) -> int | None:
        """The lowest round that is not fully verified (failed or unverifiable), or None."""
        return min((r.round for r in self.rounds if r.status != OK), default=None)

    def first_unverifiable(self) -> Check | None:
        """The first unverifiable item (of the first unverified round if there is one)."""
        first = self.first_unverified_round
        ordered = [c for r in self.rounds if r.round == first for c in r.checks] + self.all_checks()
        return next((c for c in ordered if c.status == UNVERIFIABLE), None)

    def summary(self) -> str:
        counts = self.counts()
        text = (
            f"audit of run {self.run_id} {self.verdict}: {len(self.rounds)} rounds, {counts[OK]} items ok, "
            f"{counts[FAIL]} failed, {counts[UNVERIFIABLE]} unverifiable"
        )
        if self.verdict == INCOMPLETE:
            first = self.first_unverified_round
            text += f"; first unverified round: {first}" if first is not None else "; every round verified"
        if self.failed:
            first = self.first_bad_round
            text += (
                f"; first bad round: {first}"
                if first is not None
                else "; no round is bad (chain-level items)"
            )
        if self.fraud_provable is False:
            names = ", ".join(dict.fromkeys(p.split(":")[0] for p in self.unprovable))
            text += f"; history unprovable (the run's {names} make a wrong round unprovable)"
        return text

    def reexecution_line(self) -> str:
        """How many sampled contributions ``--reexecute`` reran, and how each was judged."""
        rules = ("exact", "emulated", "tolerance")
        rerun = sum(self.reexecuted.get(rule, 0) for rule in rules)
        sampled = sum(self.reexecuted.values())
        how = ", ".join(f"{self.reexecuted.get(rule, 0)} {rule}" for rule in rules)
        others = ", ".join(f"{n} {what}" for what, n in sorted(self.reexecuted.items()) if what not in rules)
        asked = self.reexecution.get("asked", sampled)
        why = self.reexecution.get("why_not", "")
        return (f"re-executed {rerun} of {sampled} sampled contributions (asked: {asked}): {how}"
                + (f"; {others}" if others else "") + (f"; not rerun: {why}" if why else ""))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = self.verdict
        data["ok"] = self.ok
        data["first_bad_round"] = self.first_bad_round
        data["counts"] = self.counts()
        for verdict, raw in zip(self.rounds, data["rounds"]):
            raw["status"] = verdict.status
        return data


# ---------------------------------------------------------------------- renderings


def write_json(report: Any, path: str | Path) -> Path:
    """Write ``report.to_dict()`` as indented JSON, atomically."""
    data = json.dumps(report.to_dict(), indent=1, sort_keys=True).encode() + b"\n"
    return atomic_write_bytes(path, data)


