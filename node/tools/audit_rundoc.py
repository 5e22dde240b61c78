"""The run document of an audit: the copy whose sha256 is the chain's ``configHash``, checked against the
run's shape, its commitments version (``RunParams.commitments``) and its per-round values (issue 62). See
docs/AUDIT.md.
"""

import hashlib
from collections.abc import Callable
from typing import Any

from node.errors import DLX_ERRORS
from node.tools.evidence import PeerSource, first_good_copy
from node.tools.report import FAIL, OK, UNVERIFIABLE, AuditReport, Check


def check_run_document(report: AuditReport, history: Any, sources: list,
                       prepare: Callable[[dict], None] | None = None) -> dict | None:
    """The run document whose sha256 is the chain's ``configHash``, checked against the run's shape; None
    (and a FAIL or unverifiable item in the report) if no source has a usable copy. ``prepare(document)``
    runs before its values are derived (an imported model's initial weights: node/tools/audit_inputs.py)."""
    from node.runconfig import parse_run_document

    expected = history.run.config_hash.hex()

    def getter(source: Any) -> bytes | None:
        if isinstance(source, PeerSource):
            return source.blob(expected)
        docs = source.run_documents()
        good = [d for d in docs if hashlib.sha256(d).hexdigest() == expected]
        return (good or docs or [None])[0]

    copy = first_good_copy(sources, getter, expected)
    if copy.data is None:
        if copy.bad:
            report.general.append(
                Check("run document", FAIL, "no copy hashes to the configHash: " + "; ".join(copy.bad))
            )
        else:
            report.general.append(
                Check(
                    "run document", UNVERIFIABLE, f"no archive or peer holds the run document {expected[:16]}"
                )
            )
        return None
    try:
        document = parse_run_document(copy.data, history.run.config_hash)
        stages, inner = document["pipeline"]["num_stages"], document["diloco"]["inner_steps"]
    except (*DLX_ERRORS, KeyError, TypeError) as exc:
        report.general.append(
            Check("run document", FAIL, f"hashes to the configHash but is not a valid run document: {exc}")
        )
        return None
    if (stages, inner) != (history.run.num_stages, history.run.inner_steps):
        report.general.append(
            Check(
                "run document",
                FAIL,
                f"says {stages} stages x H={inner}, the run was created "
                f"with {history.run.num_stages} x {history.run.inner_steps}",
            )
        )
        return None
    note = f" (corrupt copies ignored: {'; '.join(copy.bad)})" if copy.bad else ""
    report.general.append(Check("run document", OK, f"sha256 = configHash{note}" if note else ""))
    if prepare is not None:
        prepare(document)
    report.general.append(commitments_check(document, history.run.commitments))
    provable, report.unprovable = provable_check(document, history.run)
    if provable is not None:
        report.general.append(provable)
        report.fraud_provable = provable.status == OK
    values = values_check(document, history.run)
    if values is not None:
        report.general.append(values)
    return document


def provable_check(document: dict, run: Any) -> tuple[Check | None, list[str]]:
    """Whether the run's parameters leave every part of the fraud proof possible (issue 79,
    node/commitments/values.py unprovable_values): unverifiable, each parameter named, when they do not (its
    history's finality proves nothing: a wrong round could not have been proven wrong, and honest nodes refuse
    such a run), and those problems; None for a hashed run (nothing provable by design)."""
    from node.commitments.values import unprovable_values, values_of
    from node.runconfig import node_config_from_run

    try:
        cfg = node_config_from_run(document)
        if not cfg.commitment_scheme.chunked:
            return None, []
        problems = unprovable_values(cfg, values_of(run))
    except DLX_ERRORS as exc:
        return Check("fraud provable", UNVERIFIABLE, f"the document's run could not be derived: {exc}"), []
    if problems:
        return Check("fraud provable", UNVERIFIABLE, "; ".join(problems)), problems
    return Check("fraud provable", OK, "a schedule, a genesis root, a proof within its bounds and games long "
                 "enough for the largest stage are bound on chain"), []


def values_check(document: dict, run: Any) -> Check | None:
    """Whether the per-round values the run was created with (issue 62: its schedule, Nesterov flag, norm clip
    and genesis root, ``RunParams``) are those its document gives (node/commitments/values.py); None for a run
    that binds none (a hashed one, or one created before issue 62)."""
    from node.commitments.values import other_values, values_of
    from node.runconfig import node_config_from_run

    on_chain = values_of(run)
    if not on_chain.get("schedule_rounds") and on_chain.get("genesis_root", bytes(32)) == bytes(32):
        return None
    try:
        problems = other_values(node_config_from_run(document), on_chain, run.max_rounds)
    except DLX_ERRORS as exc:
        return Check("per-round values", UNVERIFIABLE, f"the document's values could not be derived: {exc}")
    if problems:
        return Check("per-round values", FAIL, "the run was created on chain with other values than its "
                     "document gives (the fraud proofs hold its rounds to the chain's): "
                     + "; ".join(problems))
    return Check("per-round values", OK, "the schedule, Nesterov flag, norm clip and genesis root on chain "
                 "are the document's")


def commitments_check(document: dict, on_chain: int) -> Check:
    """Whether the run was created on chain (``RunParams.commitments``) with the commitments version its
    document names (``diloco.commitments``; a document without it is a hashed run's): the prover holds every
    round's factors to the chain's, so a mismatch lets the norm proof overturn honest rounds, or a quorum
    escape it."""
    from node.commitments import SCHEMES, UNNAMED, version_name

    diloco = document.get("diloco")
    setting = diloco.get("commitments", UNNAMED) if isinstance(diloco, dict) else None
    scheme = SCHEMES.get(setting) if isinstance(setting, str) else None
    if scheme is None or scheme.version != on_chain:
        return Check("commitments version", FAIL,
                     f"the document says diloco.commitments = {setting!r}, the run was created on chain with "
                     f"version {on_chain} ({version_name(on_chain)}): the fraud proofs hold its "
                     "rounds to the chain's")
    return Check("commitments version", OK, f"{on_chain} ({setting}) on chain, as the document says: "
                                            f"{scheme.audit_note}")
