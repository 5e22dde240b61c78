"""One round of an audit: its contribution list against the chain, its shape, and every signed envelope.

The lists come from archives (``round.json``) or from the coordinators' signed ``close`` messages that
peers still hold (:mod:`node.tools.evidence`); the one whose Merkle root the commit records is used. Each
envelope listed must hash to its listed hash, decode strictly, carry a valid ed25519 signature and the
round's header, and be signed by a key bound to an account registered during the round
(:func:`ledger.checks.bound_account`). See docs/AUDIT.md, "Per round".
"""

import itertools
import logging
from typing import Any

from node import protocol as msg
from node.errors import DLX_ERRORS
from node.exchangekinds import traits_of
from node.tools.evidence import first_good_copy
from node.tools.report import FAIL, OK, UNVERIFIABLE, Check, Contributor, RoundVerdict

logger = logging.getLogger(__name__)

MAX_COMBINATIONS = 64  # distinct per-stage contribution lists tried against one contributions root
CONTRIBUTION_KIND = "contribution"  # node.protocol.CONTRIBUTION (not imported: keeps this module light)
MAX_ENVELOPE_BYTES = 2 << 30


def _candidate_sets(
    sources: list, round_index: int, num_stages: int, root_hex: str = ""
) -> tuple[list[list[tuple[int, int, str, str]]], list[int]]:
    """Full canonical contribution lists to try (one distinct per-stage list per stage, combined), and the
    stages no source lists (then the evidence is incomplete and nothing is tried); ``root_hex``, the commit's
    contributions root, names the list a peer may serve under it."""
    per_stage: dict[int, list[tuple]] = {s: [] for s in range(num_stages)}
    for source in sources:
        try:
            lists = source.round_lists(round_index, root_hex)
        except DLX_ERRORS as exc:
            logger.debug("%s: %s", source.name, exc)
            continue
        for entries in lists:
            for stage in range(num_stages):
                part = tuple(sorted(e for e in entries if e[0] == stage))
                if part and part not in per_stage[stage]:
                    per_stage[stage].append(part)
    unlisted = [s for s in range(num_stages) if not per_stage[s]]
    if unlisted:
        return [], unlisted
    combos = itertools.islice(itertools.product(*(per_stage[s] for s in range(num_stages))), MAX_COMBINATIONS)
    return [[e for part in combo for e in part] for combo in combos], []


def _contribution_root(entries: list[tuple[int, int, str, str]]) -> bytes:
    from ledger.merkle import merkle_root

    return merkle_root([bytes.fromhex(h) for _s, _r, _p, h in entries])


def _committed_entries(verdict: RoundVerdict, commit: Any, sources: list, num_stages: int) -> list | None:
    """The listed contributions whose Merkle root is the commit's (a check appended either way), or None."""
    candidates, unlisted = _candidate_sets(sources, commit.round, num_stages, commit.contributions_root.hex())
    if unlisted:
        what = "this round's contributions" if len(unlisted) == num_stages \
            else f"stage(s) {unlisted} of this round"
        verdict.checks.append(Check("contributions root", UNVERIFIABLE, f"no archive or peer lists {what}"))
        return None
    entries = next((c for c in candidates if _contribution_root(c) == commit.contributions_root), None)
    if entries is None:
        got = _contribution_root(candidates[0]).hex()
        verdict.checks.append(Check(
            "contributions root", FAIL,
            f"Merkle root of the archived contributions is {got}, chain says "
            f"{commit.contributions_root.hex()}"))
        return None
    verdict.checks.append(Check("contributions root", OK))
    return entries


def _shape_problems(entries: list, commit: Any, num_stages: int, document: dict | None) -> list[str]:
    """Every stage aggregated something, one contribution per replica per stage, the commit's counts."""
    problems = []
    for stage in range(num_stages):
        replicas = [r for s, r, _p, _h in entries if s == stage]
        if not replicas:
            problems.append(f"stage {stage} has no contribution")
        if len(set(replicas)) != len(replicas):
            problems.append(f"stage {stage} has two contributions of one replica")
    peers = {p for _s, _r, p, _h in entries}
    if len(peers) != commit.num_contributors:
        problems.append(f"{len(peers)} distinct contributors, commit says {commit.num_contributors}")
    if document is not None and not _steps_range(document):  # a time-bounded run's: _token_check
        last_replicas = {r for s, r, _p, _h in entries if s == num_stages - 1}
        per_replica = (
            document["diloco"]["inner_steps"] * document["training"]["batch_size"]
            * document["model"]["block_size"]
        )
        if commit.tokens != per_replica * len(last_replicas):
            problems.append(f"tokens {commit.tokens} != {per_replica} x {len(last_replicas)} replicas")
    return problems


def _verified_payload(
    data: bytes, contributor: Contributor, record: Any, run: Any, valid: dict[str, list], previous_block: int
) -> tuple[bytes | None, str, bool]:
    """``(blob, "", _)`` for a committed envelope that verifies (its signer's account set on ``contributor``),
    else ``(None, reason, absent_ok)``; ``absent_ok``: in the sliced exchange the envelope is an absent input
    rather than a failure (a holder does not fetch the closed envelopes:
    node.live.exchange.sliced.usable_reference)."""
    from ledger.checks import bound_account
    from p2p.envelope import decode_envelope
    from p2p.errors import EnvelopeRejected

    try:
        env = decode_envelope(data, MAX_ENVELOPE_BYTES)
    except EnvelopeRejected as exc:
        return None, f"envelope rejected: {exc}", True
    got = (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id)
    want = (CONTRIBUTION_KIND, run.run_id, record.commit.round, contributor.stage, contributor.replica,
            contributor.peer_id)
    if got != want:
        fields = ("kind", "run", "round", "stage", "replica", "signer")
        diff = ", ".join(f"{f} {g!r} != {w!r}" for f, g, w in zip(fields, got, want, strict=True) if g != w)
        return None, f"signed header does not match: {diff}", True
    account = bound_account(valid, env.sender, previous_block, record.block_number)
    if account is None:
        return None, (f"signer {env.sender_peer_id} is not bound to any registered account (valid binding "
                      "signature) during the round"), False
    contributor.account = account
    try:
        body = msg.decode_contribution_body(env.payload)
    except msg.ProtocolError as exc:
        return None, f"not a contribution: {exc}", True
    contributor.applied = body.applied_hash.hex()
    contributor.binding = (body.contributor + body.binding).hex()
    return body.blob, "", False


def check_contributions(
    verdict: RoundVerdict,
    record: Any,
    sources: list,
    num_stages: int,
    valid: dict[str, list],
    previous_block: int,
    run: Any,
    document: dict | None,
) -> list[list[bytes]] | None:
    """Contributions root and envelopes of one round; return the payloads per stage if all verified."""
    commit = record.commit
    entries = _committed_entries(verdict, commit, sources, num_stages)
    if entries is None:
        return None
    verdict.contributors = [Contributor(s, r, p, h) for s, r, p, h in entries]
    problems = _shape_problems(entries, commit, num_stages, document)
    verdict.checks.append(Check("round shape", FAIL, "; ".join(problems)) if problems
                          else Check("round shape", OK))

    payloads: list[list[bytes]] = [[] for _ in range(num_stages)]
    missing = 0
    # Where a holder does not hold every closed envelope (the sliced exchange), one may be absent.
    partial_holders = document is not None and not traits_of(document).holds_all_envelopes
    for contributor in verdict.contributors:
        label = f"contribution s{contributor.stage} r{contributor.replica} {contributor.envelope[:12]}"
        copy = first_good_copy(
            sources, lambda src, c=contributor: src.envelope(commit.round, c.envelope), contributor.envelope
        )
        if copy.data is None:
            if copy.bad:
                verdict.checks.append(
                    Check(label, FAIL,
                          "archived bytes are not the committed envelope: " + "; ".join(copy.bad)))
            else:
                verdict.checks.append(Check(label, UNVERIFIABLE,
                                            "envelope bytes not held by any archive or peer"))
                missing += 1
            continue
        verdict.notes += [f"{label}: corrupt copy ignored ({b})" for b in copy.bad]
        blob, reason, absent_ok = _verified_payload(copy.data, contributor, record, run, valid,
                                                    previous_block)
        if blob is not None:
            verdict.checks.append(Check(label, OK))
            payloads[contributor.stage].append(blob)
        elif partial_holders and absent_ok:
            verdict.notes.append(f"{label}: {reason}; an absent input of the sliced exchange")
            verdict.checks.append(Check(label, OK, f"absent input ({reason})"))
            payloads[contributor.stage].append(b"")
        else:
            verdict.checks.append(Check(label, FAIL, reason))
    steps_range = _steps_range(document)
    if steps_range is not None and not missing:
        verdict.checks.append(_token_check(commit, payloads[num_stages - 1], steps_range, document))
    if any(c.status == FAIL for c in verdict.checks) or missing:
        return None
    return payloads


def _steps_range(document: dict | None) -> tuple[int, int] | None:
    """``(min_inner_steps, inner_steps)`` of a run document whose rounds are bounded by time, else None."""
    diloco = (document or {}).get("diloco", {})
    if not diloco.get("round_budget_s"):
        return None
    return diloco.get("min_inner_steps") or 1, diloco["inner_steps"]


def _token_check(commit: Any, last_payloads: list[bytes], steps_range: tuple[int, int],
                 document: dict) -> Check:
    """A time-bounded run's record counts the inner steps its last stage's contributions declared (in range;
    an absent input or a bad count 0: node.live.state.closesteps), in tokens: recomputed from the
    envelopes."""
    from training.slicebundle import counted_steps

    steps = [counted_steps(blob, steps_range) for blob in last_payloads]
    expected = sum(steps) * document["training"]["batch_size"] * document["model"]["block_size"]
    if commit.tokens != expected:
        return Check("tokens", FAIL,
                     f"the record says {commit.tokens} tokens, the last stage's contributions "
                                     f"declare {expected} ({sum(steps)} inner steps: {steps})")
    return Check("tokens", OK, f"{sum(steps)} declared inner steps ({steps})")
