"""What a contribution binds of the round before it, and the holders' rule on it.

With the overlap (and "lookahead"/"eager") round t's training applies round t-1's
result before its encode, so its contribution depends on that result; it binds
the stage hash it applied (``ContributionBody.applied_hash``). A member whose round
t-1 forked from the record trained round t on its own result: honest, but its
contribution does not rerun from its start state with the record's round t-1, so
the holders leave it out of the aggregate (never accused). docs/PROTOCOL.md, "When
a node's weights leave the record". Used by the live node (the exchange's apply,
the fork repair) and the audit's replay alike.
"""

from __future__ import annotations

from node import protocol as msg
from training.config import DilocoConfig
from training.robust import OTHER_RESULT
from training.schedule import applies_before_encode


def other_result_exclusions(diloco_cfg: DilocoConfig, outer_round: int, applied_hashes: list[bytes],
                            held_hash: bytes) -> dict[int, tuple[str, str]]:
    """The closed contributions of ``outer_round`` (canonical order) built on another result of round t-1
    than ``held_hash``, the stage hash of round t-1 this holder applies round t on: index -> (reason, detail).

    Their training applied round t-1 mid-round (:func:`training.schedule.applies_before_encode`) and
    binds its hash (``ContributionBody.applied_hash``); one that binds another (a member whose round
    t-1 forked from the record) is left out of the aggregate, not accused: it is honest, but it does
    not rerun from its start state with the record's round t-1 (docs/PROTOCOL.md, "When a node's weights
    leave the record"). A round that applies nothing before its encode binds :data:`node.protocol.NO_APPLY`.
    Called where round t-1 is final here (the apply, after any re-base), so every honest holder compares
    with the record's hash and leaves out the same ones.
    """
    expected = held_hash if applies_before_encode(diloco_cfg, outer_round) else msg.NO_APPLY
    return {index: (OTHER_RESULT, f"built on another result of round {outer_round - 1} (it applied "
                                  f"{bound.hex()[:12]}, the round's result here is {expected.hex()[:12]})")
            for index, bound in enumerate(applied_hashes) if bound != expected}
