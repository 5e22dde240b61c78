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
from node.tools.evidence import first_good_copy
from node.tools.report import FAIL, OK, UNVERIFIABLE, Check, Contributor, RoundVerdict

logger = logging.getLogger(__name__)

MAX_COMBINATIONS = 64  # distinct per-stage contribution lists tried against one contributions root
CONTRIBUTION_KIND = "contribution"  # node.protocol.CONTRIBUTION (not imported: keeps this module light)
MAX_ENVELOPE_BYTES = 2 << 30


def _candidate_sets(
    sources: list, round_index: int, num_stages: int
) -> tuple[list[list[tuple[int, int, str, str]]], list[int]]:
    """Full canonical contribution lists to try (one distinct per-stage list per stage, combined), and the
    stages no source lists (then the evidence is incomplete and nothing is tried)."""
    per_stage: dict[int, list[tuple]] = {s: [] for s in range(num_stages)}
    for source in sources:
        try:
            lists = source.round_lists(round_index)
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
    from ledger.checks import bound_account
    from p2p.envelope import decode_envelope
    from p2p.errors import EnvelopeRejected

    commit = record.commit
    candidates, unlisted = _candidate_sets(sources, commit.round, num_stages)
    if unlisted:
        what = (
            "this round's contributions"
            if len(unlisted) == num_stages
            else f"stage(s) {unlisted} of this round"
        )
        verdict.checks.append(Check("contributions root", UNVERIFIABLE, f"no archive or peer lists {what}"))
        return None
    entries = next((c for c in candidates if _contribution_root(c) == commit.contributions_root), None)
    if entries is None:
        got = _contribution_root(candidates[0]).hex()
        verdict.checks.append(
            Check(
                "contributions root",
                FAIL,
                f"Merkle root of the archived contributions is "
                f"{got}, chain says {commit.contributions_root.hex()}",
            )
        )
        return None
    verdict.checks.append(Check("contributions root", OK))
    verdict.contributors = [Contributor(s, r, p, h) for s, r, p, h in entries]

    # Structure: every stage aggregated something, one contribution per replica per stage.
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
    if document is not None:
        last_replicas = {r for s, r, _p, _h in entries if s == num_stages - 1}
        per_replica = (
            document["diloco"]["inner_steps"]
            * document["training"]["batch_size"]
            * document["model"]["block_size"]
        )
        if commit.tokens != per_replica * len(last_replicas):
            problems.append(f"tokens {commit.tokens} != {per_replica} x {len(last_replicas)} replicas")
    verdict.checks.append(
        Check("round shape", FAIL, "; ".join(problems)) if problems else Check("round shape", OK)
    )

    payloads: list[list[bytes]] = [[] for _ in range(num_stages)]
    missing = 0
    # In the sliced exchange a holder does not fetch the closed envelopes: one that is no contribution is
    # an absent input for its aggregators (node.live.sliced.usable_reference), and so for the replay.
    sliced = document is not None and document.get("diloco", {}).get("exchange") == "sliced"

    def absent(label: str, contributor, reason: str) -> None:
        verdict.notes.append(f"{label}: {reason}; an absent input of the sliced exchange")
        verdict.checks.append(Check(label, OK, f"absent input ({reason})"))
        payloads[contributor.stage].append(b"")

    for contributor in verdict.contributors:
        label = f"contribution s{contributor.stage} r{contributor.replica} {contributor.envelope[:12]}"
        copy = first_good_copy(
            sources, lambda src, c=contributor: src.envelope(commit.round, c.envelope), contributor.envelope
        )
        if copy.data is None:
            if copy.bad:
                verdict.checks.append(
                    Check(
                        label, FAIL, "archived bytes are not the committed envelope: " + "; ".join(copy.bad)
                    )
                )
            else:
                verdict.checks.append(
                    Check(label, UNVERIFIABLE, "envelope bytes not held by any archive or peer")
                )
                missing += 1
            continue
        verdict.notes += [f"{label}: corrupt copy ignored ({b})" for b in copy.bad]
        try:
            env = decode_envelope(copy.data, MAX_ENVELOPE_BYTES)
        except EnvelopeRejected as exc:
            if sliced:
                absent(label, contributor, f"envelope rejected: {exc}")
            else:
                verdict.checks.append(Check(label, FAIL, f"envelope rejected: {exc}"))
            continue
        got = (env.kind, env.run_id, env.round, env.stage, env.replica, env.sender_peer_id)
        want = (
            CONTRIBUTION_KIND,
            run.run_id,
            commit.round,
            contributor.stage,
            contributor.replica,
            contributor.peer_id,
        )
        if got != want:
            fields = ("kind", "run", "round", "stage", "replica", "signer")
            diff = ", ".join(f"{f} {g!r} != {w!r}" for f, g, w in zip(fields, got, want) if g != w)
            if sliced:
                absent(label, contributor, f"signed header does not match: {diff}")
            else:
                verdict.checks.append(Check(label, FAIL, f"signed header does not match: {diff}"))
            continue
        account = bound_account(valid, env.sender, previous_block, record.block_number)
        if account is None:
            verdict.checks.append(
                Check(
                    label,
                    FAIL,
                    f"signer {env.sender_peer_id} is not bound to any registered "
                    "account (valid binding signature) during the round",
                )
            )
            continue
        contributor.account = account
        try:
            body = msg.decode_contribution_body(env.payload)
        except msg.ProtocolError as exc:
            if sliced:
                absent(label, contributor, f"not a contribution: {exc}")
            else:
                verdict.checks.append(Check(label, FAIL, f"not a contribution: {exc}"))
            continue
        verdict.checks.append(Check(label, OK))
        payloads[contributor.stage].append(body.blob)
    if any(c.status == FAIL for c in verdict.checks) or missing:
        return None
    return payloads
