"""The re-execution items of the audit: a sample of the recorded contributions rerun, and every
ejection's evidence judged (the reruns themselves: node/tools/audit_reexec.py)."""

from __future__ import annotations

from dataclasses import replace

from node import protocol as msg
from node.errors import DLX_ERRORS
from node.tools.audit_reexec import MAX_BLOB, ReexecAuditor, how_judged, peer_of, sample_contributions
from node.tools.audit_slicedproof import SLICED_PROOFS, SlicedProofAuditor
from node.tools.report import FAIL, OK, UNVERIFIABLE, Check
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected


def built_elsewhere_check(name: str, auditor: ReexecAuditor, round_index: int, replica: int,
                          stages: tuple[int, ...], reason: str) -> Check:
    """The item of a rerun that found ``stages`` of ``(round, replica)`` built on another result of round t-1
    than the record's (a forked member's round, bound by its ``applied_hash``): fine if the holders left those
    stages' contributions out of the round (the archives say so), else a finding.

    A split replica forks stage by stage (each stage's member applies its own close and is re-based by its own
    fork repair), so only the forked stages' contributions are left out; a partner stage that followed the
    record was aggregated as any. The rerun stops at the fork and does not judge that stage, so the item is
    then unverifiable, never ok (before, the whole replica had to be left out: the soak's round 13,
    docs/P2P.md, failed the audit)."""
    left_out = {(int(stage), str(hash_hex)) for stage, _replica, _peer, hash_hex, why, _detail
                in auditor.archives.excluded(round_index) if why == "other_result"}
    mine = {(int(e[0]), str(e[3])) for e in auditor.sealed.get(round_index, []) if int(e[1]) == replica}
    forked = {entry for entry in mine if entry[0] in stages}
    if not forked or not forked <= left_out:
        return Check(name, FAIL,
                     f"{reason}, and the archives do not show it left out of the round's aggregate",
                     round_index)
    aggregated = sorted(stage for stage, _hash in mine - left_out)
    if aggregated:
        return Check(name, UNVERIFIABLE,
                     f"not a rerun of the record: {reason}; every holder left it out of the "
                     f"round, and stage(s) {aggregated} of the replica, aggregated, are not "
                     "judged by a rerun that "
                     "stops at the fork", round_index)
    return Check(name, OK, f"not a rerun of the record: {reason}; every holder left it out of the round",
                 round_index)


def recorded_pairs(sealed: dict[int, list[list]], history) -> tuple[list[tuple[int, int]], list[int]]:
    """The (round, replica) pairs of ``sealed`` whose round the chain committed, and the sealed rounds it did
    not.

    The audit judges the history the chain records. A round the archives sealed but the chain never committed
    (the nodes stopped before its commit: the end of every run that is stopped rather than run to its last
    round) binds nothing, and its nodes may have sealed different closes of it: the archives' union of such a
    round is no one's close, so a rerun of the next round against it would find an honest contribution "built
    on another result" (the 25-minute soak of 2026-11-26 FAILED so, on rounds 26 and 27 of a chain that held
    0-24)."""
    committed = {c.commit.round for c in history.commits}
    pairs = sorted({(r, int(e[1])) for r, entries in sealed.items() if r in committed for e in entries})
    return pairs, sorted(r for r in sealed if r not in committed)


def rerun_source(report, history, replayer, archives, fetcher):
    """What the reruns read: the ``--archive`` directories, or without any, the run's peers through the
    audit's ``fetcher`` (a run link or --bootstrap: node/tools/audit_peer_archives.py); None: neither."""
    if archives:
        return list(archives)
    if fetcher is None:
        return None
    from node.tools.audit_peer_archives import PeerArchives

    return PeerArchives(fetcher, report, replayer, history.run.run_id)


def reexec_checks(report, history, replayer, archives, count: int, progress=None, fetcher=None,
                  processes: int = 1, reader=None) -> None:
    """Append the re-execution checks to ``report.general`` (module docstring), count the reruns by how they
    were judged in ``report.reexecuted``; ``progress(done, total, what)`` after each rerun. Without
    ``archives``, the reruns read the run's peers through ``fetcher`` (:func:`rerun_source`). Every
    contribution found wrong or not rerun becomes a case lead (``report.case_leads``, with its challenge
    command where the archives' factors name it: node/tools/audit_cases.py; ``reader`` the chain)."""
    from node.tools.audit_cases import case_leads
    asked = "all" if count < 0 else count
    source = rerun_source(report, history, replayer, archives, fetcher)
    report.reexecution = {"asked": asked, "recorded": 0, "sampled": 0, "rerun": 0, "why_not": "",
                          "from": "archives" if archives else "peers" if source is not None else "nothing"}
    if replayer is None:
        report.reexecution["why_not"] = "the run document is not available"
        report.general.append(Check("re-execution", UNVERIFIABLE, f"asked to rerun {asked} contribution(s), "
                                    "reran 0: the run document is not available"))
        return
    auditor = ReexecAuditor(replayer, source or [], history.run.run_id, history.run.max_rounds, history,
                            processes=processes)
    guilty = [a for a in history.accusations if a.guilty]
    guilty_accounts = {a.accused.lower() for a in guilty}
    account_of = _peer_accounts(history)
    pairs, unrecorded = recorded_pairs(auditor.sealed, history)
    if unrecorded:
        report.notes.append(
            f"re-execution: round(s) {', '.join(map(str, unrecorded))} sealed in the archives but not "
            "committed on chain (the run stopped before their commit, or the chain never took them) "
            "are not judged: no record binds their contributions")
    sample = sample_contributions(pairs, history.head_hash, count)
    report.reexecution.update(recorded=len(pairs), sampled=len(sample))
    report.reexecuted = judged = {}  # how each sampled contribution was judged -> how many
    pending = []
    if progress is not None:
        progress(0, len(sample), "")
    for done, (round_index, replica) in enumerate(sample, 1):
        unparsed = None
        try:
            result, reason, distance = auditor.check(round_index, replica)
        except (*DLX_ERRORS, EnvelopeRejected, ValueError, OSError) as exc:
            result, reason, distance, unparsed = None, "", None, f"inputs do not parse: {exc}"
        how = "not rerun" if result is None else how_judged(result)
        judged[how] = judged.get(how, 0) + 1
        if progress is not None:
            progress(done, len(sample), f"round {round_index} replica {replica}")
        check = _rerun_check(auditor, (round_index, replica), (result, reason, distance, unparsed),
                             account_of, guilty_accounts)
        report.general.append(check)
        lead = _pending(check, (round_index, replica), result)
        if lead is not None:
            pending.append(lead)
    report.case_leads = case_leads(pending, auditor.sealed, archives or [], reader, history.run.run_id)
    _account_for_the_rest(report, report.reexecution["from"], asked, len(pairs), len(sample))
    proofs = SlicedProofAuditor(auditor.cfg, history.run.run_id, auditor.archives, auditor.sealed, account_of)
    report.general.extend(ejection_check(accusation, auditor, proofs, account_of) for accusation in guilty)


def _rerun_check(auditor, pair: tuple[int, int], outcome: tuple, account_of: dict,
                 guilty_accounts: set) -> Check:
    """The item of one rerun of (round, replica): ``outcome`` is (result, reason, distance, unparsed)."""
    round_index, replica = pair
    result, reason, distance, unparsed = outcome
    name = f"re-execution of round {round_index} replica {replica}"
    if unparsed is not None:
        return Check(name, FAIL, unparsed, round_index)
    if result is None:
        return Check(name, UNVERIFIABLE, reason, round_index)
    if result.verdict == "other_result":
        return built_elsewhere_check(name, auditor, round_index, replica, result.failed_stages, reason)
    if result.honest:
        return Check(name, OK, f"reproduced ({result.verdict}, distance {distance:.3g}; "
                     f"judged {how_judged(result)})", round_index)
    if result.undecided:
        return Check(name, UNVERIFIABLE, f"undecided (judged {how_judged(result)}: {reason})", round_index)
    envs = auditor._envelopes(round_index, replica) or []
    account = account_of.get(envs[0].sender_peer_id, "") if envs else ""
    caught = account.lower() in guilty_accounts
    return Check(name, OK if caught else FAIL,
                 f"does not reproduce ({result.verdict}: {reason}; judged {how_judged(result)})"
                 + ("; its member was found guilty on chain" if caught else "; the run did not catch it"),
                 round_index)


def _pending(check: Check, pair: tuple[int, int], result):
    """The case lead of a rerun's item (node/tools/audit_cases.py), None for a contribution that reproduced:
    wrong where the rerun did not reproduce it (a member caught on chain included: its round still lists
    it), not rerun where the item is unverifiable; the stages the rerun blames, else all of the replica's."""
    from node.tools.audit_cases import NOT_RERUN, WRONG, Pending

    wrong = check.status == FAIL or check.reason.startswith("does not reproduce")
    if not wrong and check.status != UNVERIFIABLE:
        return None
    stages = tuple(getattr(result, "failed_stages", ()) or ()) if wrong else ()
    return Pending(pair[0], pair[1], WRONG if wrong else NOT_RERUN, check.reason, stages)


def _account_for_the_rest(report, source: str, asked, recorded: int, sampled: int) -> None:
    """How many of the ``asked`` reruns were done and why not the rest (issue 80): in ``report.reexecution``
    and, when nothing was rerun, an unverifiable item (a ``--reexecute`` that reruns nothing is not
    PASSED). ``source``: "archives", "peers" or "nothing" (what the reruns read)."""
    rules = ("exact", "emulated", "tolerance")
    rerun = sum(report.reexecuted.get(rule, 0) for rule in rules)
    report.reexecution["rerun"] = rerun
    why = ""
    if not recorded:
        why = {"archives": "no archive holds the run's sealed rounds and their contributions",
               "peers": "no committed round's contributions came from the run's peers verified against "
                        "the chain (see the rounds' contributions root items); pass --archive DIR (a "
                        "member's data directory, or a copy of its archive)",
               "nothing": "no --archive, run link or --bootstrap was given: nothing holds the contributions "
                          "a rerun needs"}[source]
    elif isinstance(asked, int) and sampled < asked:
        where = "the archives record" if source == "archives" else "the run's peers served"
        why = f"{where} {recorded} contribution(s) of committed rounds, fewer than asked"
    if sampled > rerun:
        not_rerun = report.reexecuted.get("not rerun", 0)
        why = "; ".join(w for w in (why, f"{sampled - rerun} sampled not rerun ({not_rerun} without their "
                                          "inputs, the rest undecided or unparsable: see their items)") if w)
    report.reexecution["why_not"] = why
    if not rerun:
        why = why or "none sampled"
        report.general.append(Check("re-execution", UNVERIFIABLE,
                                    f"asked to rerun {asked} contribution(s), reran 0: {why}"))


def ejection_check(accusation, auditor: ReexecAuditor, proofs: SlicedProofAuditor,
                   account_of: dict[str, str]) -> Check:
    """The item of one guilty verdict: does the evidence the chain names hold (a rerun, or a signed proof)?"""
    name = f"ejection of {accusation.accused} (evidence {accusation.evidence_hash.hex()[:16]})"
    data = auditor.archives.blob(accusation.evidence_hash.hex())
    if data is None:
        refused = auditor.archives.refused(accusation.evidence_hash.hex())
        return Check(name, UNVERIFIABLE, "the evidence is not in the archives" + (
            f" (refused: {', '.join(refused)} does not hash to the chain's evidence hash)" if refused
            else ""))
    try:
        env = decode_envelope(data, MAX_BLOB)
        evidence = msg.decode_payload(msg.EVIDENCE, env.payload)
        if evidence.verdict in SLICED_PROOFS:  # a signed proof, not a contribution's rerun
            return proofs.check(name, accusation, env, evidence)
        envs = [decode_envelope(c, MAX_BLOB) for c in evidence.contributions]
        # A split replica's stages are signed by different members: the accused must have signed one.
        signed = [account_of.get(e.sender_peer_id, "").lower() == accusation.accused.lower() for e in envs]
        if "0x" + evidence.accused.hex() != accusation.accused.lower() or env.kind != msg.EVIDENCE or not any(
                signed) or len({e.replica for e in envs}) != 1 or envs[0].replica != evidence.replica:
            raise ValueError("the evidence does not name contributions of one replica signed by the accused")
        envs, next_envs = split_chain_evidence(envs, auditor.cfg.pipeline.num_stages, env.round)
        result, reason, _distance = auditor.check(env.round, evidence.replica, envs)
        broken = None
        if result is not None and result.honest and next_envs:
            broken, reason, stages = auditor.chain_broken(env.round, result, next_envs)
            broken = broken and _blames(next_envs, stages, accusation.accused, account_of)
        elif result is not None and not result.honest and not _blames(envs, result.failed_stages,
                                                                      accusation.accused, account_of):
            # The replica's rerun fails in a stage the accused did not sign: its own stages reproduce.
            result = replace(result, verdict="exact",
                             reason=f"the accused's stages reproduce; {result.reason}")
    except (*DLX_ERRORS, EnvelopeRejected, ValueError, OSError) as exc:
        return Check(name, FAIL, f"evidence does not hold: {exc}")
    if result is None or result.undecided or (next_envs and result.honest and broken is None):
        return Check(name, UNVERIFIABLE, reason, env.round)
    if next_envs and result.honest:
        return Check(name, OK if broken else FAIL, f"the start state of round {env.round + 1} "
                     + (f"does not follow ({reason})" if broken
                        else f"follows ({reason}): an honest member was ejected"), env.round)
    return Check(name, FAIL if result.honest else OK, f"the contribution of round {env.round} "
                 + ("reproduces: an honest member was ejected" if result.honest
                    else f"does not reproduce ({reason})"), env.round)


def _blames(envs: list, failed_stages, accused: str, account_of: dict[str, str]) -> bool:
    """Whether the accused signed one of the failing stages (every stage if the failure names none)."""
    return any(account_of.get(envs[stage].sender_peer_id, "").lower() == accused.lower()
               for stage in (failed_stages or range(len(envs))))


def split_chain_evidence(envs: list, stages: int, round_index: int) -> tuple[list, list]:
    """An accusation's envelopes as (round t's, round t+1's): one per stage of round t in stage order,
    then either nothing (a contribution that does not reproduce) or one per stage of round t+1 (a broken
    chain). Anything else raises ValueError."""
    this, following = envs[:stages], envs[stages:]
    if [(e.round, e.stage) for e in this] != [(round_index, s) for s in range(stages)]:
        raise ValueError(f"the evidence does not hold round {round_index}'s envelope of every stage in order")
    if following and [(e.round, e.stage) for e in following] != [(round_index + 1, s) for s in range(stages)]:
        raise ValueError(f"the evidence's envelopes after round {round_index}'s are not round "
                         f"{round_index + 1}'s of every stage in order")
    return this, following


def _peer_accounts(history) -> dict[str, str]:
    """Peer id -> account of every seat the run ever had (a seat binds the member's node key)."""
    peers = ((peer_of(membership.node_key), membership.account) for membership in history.memberships)
    return {peer: account for peer, account in peers if peer is not None}
