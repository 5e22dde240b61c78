"""Judging a close: valid, pending while its contributions travel, or refused with the reason
(the RoundCoordinator's)."""

from __future__ import annotations

import logging

from node import protocol as msg
from node.live.state.closesteps import steps_problem
from node.live.state.roundbook import Announced

logger = logging.getLogger(__name__)


#: Verdicts of :meth:`RoundCoordinator.judge` besides "valid" (None) and a reason string.
PENDING = "pending"


class CloseJudging:
    """How a coordinator judges a close (see the module docstring)."""

    # -- checking a close -----------------------------------------------------------------
    def judge(self, outer_round: int, stage: int, coordinator: str, close: msg.Close) -> str | None:
        """None if the close is valid, PENDING while its contributions are on their way, else the reason."""
        key = (outer_round, stage, coordinator)
        with self._lock:
            if key in self._invalid:
                return self._invalid[key]
        here = 0
        if coordinator in self.book.close_equivocators(outer_round, stage):
            reason = "its coordinator signed two different closes of the round (equivocation)"
        else:
            reason, here = self._problem(outer_round, stage, close, coordinator)
        if reason == PENDING:
            limit = self.stall_limit()
            now = self._clock()
            with self._lock:
                count, since = self._pending_since.get(key, (-1, now))
                if here > count:  # progress: the stall clock restarts
                    count, since = here, now
                self._pending_since[key] = (count, since)
            if now - since <= limit:
                return PENDING
            reason = (f"its entries could not be placed and fetched: {len(close.contributions) - count} of "
                      f"{len(close.contributions)} still missing after {limit:.0f}s without progress")
        if reason is not None:
            with self._lock:
                self._invalid[key] = reason
            logger.warning("round %d stage %d: close of %s ignored: %s", outer_round, stage, coordinator[-8:],
                           reason)
        return reason

    def close_standing(self, outer_round: int, stage: int, signer: str,
                       close: msg.Close) -> tuple[bool | None, str]:
        """Whether ``close``, signed by ``signer``, is a close the aggregators of (round, stage) went by: what
        a wrong-partial proof is judged against (node.slicedproof.judge_wrong_partial; any member could sign a
        made-up close that misnames an input and frame an honest aggregator). True when it names the set
        this node aggregated, or, where this node took no close of the round, when its signer may close
        the stage (a holder: :meth:`rotation`) and it is valid by :meth:`judge`'s entry rules (every entry
        placed and announced as named); False when it is another set, its signer no holder or it was refused;
        None when that cannot be told here (its entries not all here, the round forgotten)."""
        if signer not in self.rotation(outer_round, stage):
            return False, f"{signer[-8:]} holds no seat of stage {stage}: none of its closes counts"
        accepted = self.accepted(outer_round, stage)
        if accepted is not None:
            if [list(e) for e in accepted.contributions] == [list(e) for e in close.contributions]:
                return True, "the set this node aggregated"
            return False, "it names another set than the close this node aggregated"
        refused = self.invalid_closes(outer_round, stage).get(signer)
        if refused is not None:
            return False, f"its close was refused here: {refused}"
        reason, _here = self._problem(outer_round, stage, close, signer) if self.contributions.lazy \
            else (PENDING, 0)
        if reason is None:
            return True, "a holder's close whose every entry was announced as named"
        if reason == PENDING:
            return None, "its entries are not all placed and announced here as it names them"
        return False, f"it is no valid close: {reason}"

    def _problem(self, outer_round: int, stage: int, close: msg.Close, coordinator: str) -> tuple[str | None,
                                                                                                  int]:
        """(None, n) if valid, (PENDING, entries placed and here) while waiting, else (reason, 0)."""
        entries = [tuple(e) for e in close.contributions]
        replicas = {e[0] for e in entries}
        if len(replicas) < max(1, self.quorum):
            return f"{len(replicas)} replica(s), fewer than the quorum of {max(1, self.quorum)}", 0
        if entries != sorted(entries, key=lambda e: (e[0], e[1], e[2])):
            return "entries not in canonical (replica, peer, hash) order", 0
        if not (len(replicas) == len({e[1] for e in entries}) == len({e[2] for e in entries})
                == len(entries)):
            return "duplicate replica, peer or contribution", 0
        # What this node holds of the named envelopes checks the named step counts; a lazy pool (the sliced
        # exchange) holds only some, so there only the form is judged: a refusal on what some holders fetched
        # would split them (the audit checks the counts against every envelope).
        held = {} if self.contributions.lazy else self.contributions.have(outer_round, stage)
        wrong_steps = steps_problem(close, held, self.steps_range)
        if wrong_steps is not None:
            return wrong_steps, 0
        if self.contributions.lazy:
            return self._lazy_problem(outer_round, stage, entries)
        rejected = self.contributions.rejected(outer_round, stage)
        for _replica, peer_id, digest, _size in entries:
            if digest in rejected:
                return (f"names contribution {digest.hex()[:12]} of {peer_id[-8:]}, rejected: "
                        f"{rejected[digest][1]}"), 0
        here = 0
        for replica, peer_id, digest, size in entries:
            placed = self.membership.placements.get(peer_id)
            if placed is None or stage not in placed.stages or placed.replica != replica:
                continue  # its hello may not be here yet; judged again until the stall limit
            if not self.contributions.holds(outer_round, stage, replica, peer_id, digest):
                # Fetch what the close names (announces may have been missed), from its sender or
                # from the coordinator, which held it to close; a wrong header is not counted as
                # here, so the close stays pending and then fails.
                self.contributions.fetch(outer_round, stage, Announced(peer_id, replica, digest, size),
                                         also_from=coordinator)
                continue
            here += 1
        if here < len(entries):
            return PENDING, here
        return None, here

    def _lazy_problem(self, outer_round: int, stage: int, entries: list[tuple]) -> tuple[str | None, int]:
        """:meth:`_problem`'s entry checks in the sliced exchange, which fetches no envelope to judge a close.

        An entry counts once its peer is placed on that stage and replica and signed an announce of
        that envelope for (round, stage) (docs/PROTOCOL.md, "Sliced exchange"): a coordinator cannot
        name what a member did not announce. Whether the envelope is a usable contribution is decided
        by the slice aggregators alike (an unusable one is an absent input), not here: only some nodes
        fetch it, so a refusal on what they found would split the holders.
        """
        here = 0
        for replica, peer_id, digest, _size in entries:
            placed = self.membership.placements.get(peer_id)
            if placed is None or stage not in placed.stages or placed.replica != replica:
                continue
            if self.book.was_announced(outer_round, stage, peer_id, digest):
                here += 1
        return (PENDING if here < len(entries) else None), here
