"""How far the chain alone lets a round be trusted (``dlx-node pull`` and ``audit``): :func:`round_standing`.

Split from :mod:`node.tools.pull`, which re-exports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from node.errors import (
    RoundBeyondMax,
    RoundDisputed,
    RoundNotLinked,
    RoundNotTrusted,
    RoundPending,
    RoundUnattested,
)

#: How a round became invalid, by its outcome in ``RunHistory.dispute_outcomes``.
_HOW = {"overturned": "overturned by a verdict of the round's members",
        "proven wrong": "proven wrong on chain by a fraud proof (AggregationProver)"}

def last_final_round(rounds: list[int], is_final: Callable[[int], bool]) -> int:
    """The highest of the committed ``rounds`` (ascending) that the chain calls final (``is_final``: the
    contract's ``isFinal``), -1 for none. ``isFinal`` of a round needs every earlier round's proof window
    closed, so it holds for a prefix of the rounds: a binary search reads it ``log2(rounds)`` times."""
    low, high = 0, len(rounds)  # rounds[:low] final, rounds[high:] not
    while low < high:
        middle = (low + high) // 2
        if is_final(rounds[middle]):
            low = middle + 1
        else:
            high = middle
    return rounds[low - 1] if low else -1


def chain_finality(client: Any, run_id: int) -> Callable[[int], bool]:
    """``is_final`` for :func:`round_standing` read from the chain (``TrainingLedger.isFinal`` now)."""
    return lambda round_index: bool(client.is_final(run_id, round_index))


def last_final_on_chain(client: Any, history: Any) -> int:
    """The highest committed round of ``history`` the chain calls final now (-1: none), for ``audit`` and
    the explorer (issue 79: final is the contract's ``isFinal``, never a count of blocks)."""
    return last_final_round(maybe_final(history), chain_finality(client, history.run.run_id))


def maybe_final(history: Any) -> list[int]:
    """The committed rounds whose dispute window had closed when ``history`` was read (ascending): no other
    can be final (``isFinal`` needs at least that), so only these are asked of the chain."""
    now = getattr(history, "block_number", 0)
    return [record.commit.round for record in history.commits
            if not now or record.block_number + history.run.dispute_blocks <= now]


def round_standing(history: Any, chain_id: int, ledger_address: str,
                   cleared: dict[int, str] | None = None,
                   final_only: bool = False,
                   is_final: Callable[[int], bool] | None = None) -> dict[int, RoundNotTrusted | None]:
    """For every committed round of ``history``: None if the chain gives no reason to distrust it, else the
    error (not raised) of the first check it fails, in this order: within ``maxRounds``, hash chain link,
    attested by the quorum of counted members, not overturned (nor after an overturned round), neither it nor
    an earlier round under an unsettled dispute (its weights descend from every earlier round), and, with
    ``final_only``, final: what the chain says (``is_final``, the contract's ``isFinal``: the round's and
    every earlier round's proof window closed, its disputes and availability challenges settled, issue 79);
    without ``is_final`` (a judge of a history alone) its dispute window closed at the block the history was
    read at.

    A dispute is settled when a verdict upheld the round, when its case lapsed (an expireDispute, or its
    deadline, ``accusation_blocks`` after the first dispute, passed without a verdict), or when a replay from
    archives cleared it (``cleared``: round -> how).

    Pure: it judges a :class:`ledger.eventrecords.RunHistory` (as :mod:`ledger.checks` does) and reads
    nothing.
    """
    cleared = dict(cleared or {})
    from ledger.checks import check_attesters, check_hash_chain

    run = history.run
    links = check_hash_chain(history, chain_id, ledger_address).links
    attested = check_attesters(history)
    outcomes = getattr(history, "dispute_outcomes", {}) or {}
    now = getattr(history, "block_number", 0)
    disputes: dict[int, list] = {}
    for dispute in history.disputes:
        disputes.setdefault(dispute.round, []).append(dispute)
    for round_index, filed in disputes.items():
        outcome = outcomes.get(round_index)
        deadline = min(d.block_number for d in filed) + run.accusation_blocks
        if outcome in ("upheld", "lapsed"):
            cleared.setdefault(round_index, f"settled: {outcome}")
        elif outcome is None and now and now >= deadline:
            cleared.setdefault(round_index, f"settled: no verdict by block {deadline}, the record stands")
    overturned = min((r for r, o in outcomes.items() if o in ("overturned", "proven wrong")), default=None)
    last_final = None
    if final_only and is_final is not None:
        last_final = last_final_round(maybe_final(history), is_final)
    standing: dict[int, RoundNotTrusted | None] = {}
    for record, link, attesters in zip(history.commits, links, attested):
        round_index = record.commit.round
        where = f"round {round_index} of run {run.run_id}"
        problem: RoundNotTrusted | None = None
        window_end = record.block_number + run.dispute_blocks
        if run.max_rounds and round_index >= run.max_rounds:
            problem = RoundBeyondMax(
                f"{where} is past the run's last round {run.max_rounds - 1} (maxRounds {run.max_rounds})"
            )
        elif not link.ok:
            problem = RoundNotLinked(f"{where} does not link into the run's hash chain: {link.reason}")
        elif not attesters.ok:
            problem = RoundUnattested(
                f"{where} is not attested by the quorum of counted members: {attesters.reason}"
            )
        elif overturned is not None and round_index >= overturned:
            problem = RoundDisputed(
                f"{where} is invalid: round {overturned} was {_HOW[outcomes[overturned]]} "
                "and the run halted; "
                "pull an earlier round"
            )
        elif round_index in disputes and round_index not in cleared:
            who = ", ".join(f"{d.disputer} (block {d.block_number})" for d in disputes[round_index])
            problem = RoundDisputed(
                f"{where} is disputed: {who} put a differing signed record on chain and "
                "no verdict settled it "
                "yet; run 'dlx-node audit' to see which record replays, or pull with --archive to replay it"
            )
        elif any(d < round_index and d not in cleared for d in disputes):
            upstream = min(d for d in disputes if d < round_index and d not in cleared)
            problem = RoundDisputed(
                f"{where} descends from disputed round {upstream}; pull with --archive to replay round "
                f"{upstream}, or pull --round {upstream - 1} or earlier"
            )
        elif final_only and last_final is not None and round_index > last_final:
            problem = RoundPending(
                f"{where} is not final on chain (isFinal is false: its proof window, a dispute or an "
                f"availability challenge of it or of an earlier round is still open; at least until block "
                f"{window_end}); pull --pending takes it anyway"
            )
        elif final_only and last_final is None and now < window_end:
            problem = RoundPending(
                f"{where} is not final: it can be disputed until block {window_end} (now "
                f"{now}); pull --pending "
                "takes it anyway"
            )
        standing[round_index] = problem
    return standing


