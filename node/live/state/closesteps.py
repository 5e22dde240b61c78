"""The declared inner steps a time-bounded run's close names (issue 44, docs/DILOCOX.md section 13).

In a run whose rounds are bounded by time (``diloco.round_budget_s``) every contribution declares the inner
steps its replica trained (in its codec blob, or in its slice reference in the sliced exchange). The
coordinator, which holds every envelope it closes with, names each one's count in the close
(:attr:`node.protocol.Close.steps`: inside the run's range, else 0); every holder that holds an envelope
checks the count against it (:meth:`node.live.exchange.coordination.RoundCoordinator.judge`), and every member
derives the record's ``tokens`` from the last stage's close alone (:func:`record_tokens`), so members that
hold no envelope of that stage (another stage of a split replica, a holder of the sliced exchange) sign
the same record. The audit recomputes it from the envelopes (node/tools/audit_rounds.py).
"""

from __future__ import annotations

from node import protocol as msg
from p2p.envelope import decode_envelope
from p2p.errors import EnvelopeRejected
from training.slicebundle import counted_steps


def envelope_steps(envelope: bytes, steps_range: tuple[int, int]) -> int:
    """:func:`training.slicebundle.counted_steps` of a contribution envelope (0 if it is none)."""
    try:
        blob = msg.decode_contribution_body(decode_envelope(envelope, len(envelope)).payload).blob
    except (EnvelopeRejected, msg.ProtocolError, ValueError):
        return 0
    return counted_steps(blob, steps_range)


def close_steps(entries: list[list], held: dict[bytes, bytes],
                steps_range: tuple[int, int] | None) -> list[int]:
    """The ``steps`` of a close of ``entries`` (the coordinator holds every envelope); [] in a fixed-H run."""
    if steps_range is None:
        return []
    return [envelope_steps(held[entry[2]], steps_range) for entry in entries]


def steps_problem(close: msg.Close, held: dict[bytes, bytes], steps_range: tuple[int, int] | None) -> str \
        | None:
    """Why ``close``'s declared steps are wrong, None if nothing here shows it: a fixed-H run's close names
    none; a time-bounded run's names one per entry, each the count of the envelope where it is ``held``."""
    if steps_range is None:
        return "it names declared steps in a fixed-H run" if close.steps else None
    if len(close.steps) != len(close.contributions):
        return (f"it names {len(close.steps)} declared step counts for "
                f"{len(close.contributions)} contributions")
    for entry, steps in zip(close.contributions, close.steps):
        envelope = held.get(entry[2])
        if envelope is not None and envelope_steps(envelope, steps_range) != steps:
            return (f"it names {steps} inner steps for contribution {entry[2].hex()[:12]}, which declares "
                    f"{envelope_steps(envelope, steps_range)}")
    return None


def record_tokens(last_close: msg.Close, inner_steps: int, tokens_per_step: int, budgeted: bool) -> int:
    """The record's ``tokens``: the inner steps the last stage's closed contributions trained, in tokens (H
    per contribution with fixed H; in a time-bounded run the counts its close names, what they declared)."""
    if budgeted:
        return sum(last_close.steps) * tokens_per_step
    return inner_steps * len({entry[0] for entry in last_close.contributions}) * tokens_per_step
